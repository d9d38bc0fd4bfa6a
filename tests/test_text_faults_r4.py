"""The text task never reads bad data silently (issue 52, item 6): a file that is not UTF-8 is refused in one
line naming it and the byte offset; a held-out split with no block is refused before training; binary files
and hidden paths are skipped and counted, and the counts reach run.json."""

from __future__ import annotations

import json
import sys
import warnings
from pathlib import Path

import pytest

from gnmr_hf.offline import text_data

ROOT = Path(__file__).resolve().parents[1]
WORDS = ["<unk>", "<eos>", "a", "b", "c", "d", "e", "f"]


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _write(folder: Path, texts: dict[str, str | bytes]) -> None:
    for name, text in texts.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(text if isinstance(text, bytes) else text.encode("utf-8"))


LATIN1 = "a b c caf\u00e9 d e r\u00e9sum\u00e9 f".encode("latin-1")  # é is 0xe9 in Latin-1, not valid UTF-8 alone
PNG = b"\x89PNG\r\n\x1a\n\x00\x00\x00\rIHDR" + bytes(64)  # a NUL in its first bytes


# ---------------------------------------------------------------- not UTF-8
def test_a_latin1_file_is_refused_naming_file_and_offset(tmp_path, word_tokenizer):
    _write(tmp_path, {"1.txt": "a b c d", "2.txt": LATIN1, "3.txt": "e f a b"})
    offset = LATIN1.index(b"\xe9")
    assert offset == 9 and LATIN1[offset] == 0xE9
    with pytest.raises(ValueError) as e:
        text_data.text_task(tmp_path, word_tokenizer, block_size=2, heldout_every=0)
    msg = str(e.value)
    assert "\n" not in msg and str(tmp_path / "2.txt") in msg
    assert f"byte 0xe9 at offset {offset}" in msg and "not UTF-8" in msg
    # the same bytes read as the old code did: replacement characters, no error (what this refusal prevents)
    assert "\ufffd" in (tmp_path / "2.txt").read_text(encoding="utf-8", errors="replace")


def test_valid_utf8_with_accents_is_read_unchanged(tmp_path):
    (tmp_path / "u.txt").write_text("caf\u00e9 r\u00e9sum\u00e9", encoding="utf-8")
    assert text_data.read_text_file(tmp_path / "u.txt") == "caf\u00e9 r\u00e9sum\u00e9"


def test_the_recipe_refuses_it_in_one_line(tmp_path, word_tokenizer):
    from gnmr_hf.recipe import RecipeError, ScriptArguments, text_dataset

    corpus = tmp_path / "docs"
    _write(corpus, {f"p{i:02d}.txt": "a b c d e f " * 4 for i in range(21)})
    _write(corpus, {"p07.txt": LATIN1})
    with pytest.raises(RecipeError) as e:
        text_dataset(ScriptArguments(dataset=f"text:{corpus}", max_seq_len=4), word_tokenizer)
    assert "\n" not in str(e.value) and "p07.txt is not UTF-8: byte 0xe9 at offset 9" in str(e.value)


def test_profile_text_data_refuses_it_in_one_line(tmp_path, word_tokenizer, capsys):
    from gnmr_hf.planning import cli
    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", num_layers=1, hidden=32)
    word_tokenizer.save_pretrained(model)
    _write(tmp_path, {"latin1.txt": LATIN1})
    code = cli.main(["--model", str(model), "--data", str(tmp_path / "latin1.txt"), "--output", str(tmp_path / "p")])
    errors = [line for line in capsys.readouterr().err.splitlines() if "gnmr-hf profile" in line]
    assert code == 2 and len(errors) == 1
    assert "latin1.txt is not UTF-8: byte 0xe9 at offset 9" in errors[0]


def test_the_stress_recipe_refuses_it(tmp_path, word_tokenizer):
    sys.path.insert(0, str(ROOT / "recipes" / "stress"))
    import pretrain

    _write(tmp_path, {"latin1.txt": LATIN1})
    (tmp_path / "cache").mkdir()
    with pytest.raises(ValueError, match="latin1.txt is not UTF-8: byte 0xe9 at offset 9"):
        pretrain.tokenize_files(word_tokenizer, [tmp_path / "latin1.txt"], tmp_path / "cache", "train")
    assert not list((tmp_path / "cache").iterdir())  # nothing cached from the refused file


# ---------------------------------------------------------------- a held-out split with no block
@pytest.mark.parametrize("held", ["", "a"])  # empty files; files shorter than one block
def test_a_held_out_split_without_a_block_is_refused(tmp_path, word_tokenizer, held):
    # files 2 and 4 are held out (every 2nd): each holds len(held) words + EOS, 2 or 4 tokens in all
    _write(tmp_path, {"1.txt": "a b c d e f", "2.txt": held, "3.txt": "f e d c b a", "4.txt": held})
    n_held = 2 * (len(held.split()) + 1)
    with pytest.raises(ValueError) as e:
        text_data.text_task(tmp_path, word_tokenizer, block_size=5, heldout_every=2)
    msg = str(e.value)
    assert "\n" not in msg and "2 held-out file(s)" in msg and "2.txt, 4.txt" in msg
    assert f"hold {n_held} tokens with their EOS, less than one block of 5" in msg
    # one block's worth of held-out tokens is enough: nothing refused, one held-out block
    _write(tmp_path, {"4.txt": "a b c d"})
    train, held_blocks, summary = text_data.text_task(tmp_path, word_tokenizer, block_size=5, heldout_every=2)
    assert summary["heldout_blocks"] == len(held_blocks) == 1 and summary["heldout_files"] == 2


def test_no_held_out_split_asked_for_is_not_refused(tmp_path, word_tokenizer):
    _write(tmp_path, {"1.txt": "a b c d e f", "2.txt": ""})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        train, held, summary = text_data.text_task(tmp_path, word_tokenizer, block_size=5, heldout_every=0)
    assert held == [] and summary["heldout_files"] == 0 and len(train) == 1


# ---------------------------------------------------------------- binary files and hidden paths
def _mixed(folder: Path) -> None:
    _write(folder, {
        "a.txt": "a b c",
        "sub/b.md": "d e",
        ".ipynb_checkpoints/a-checkpoint.txt": "f f f f f f",   # hidden folder
        ".notes.txt": "f f f f",                                # hidden file
        "sub/.git/c.md": "f f",                                 # hidden folder below a visible one
        "image.txt": PNG,                                       # binary, with a text suffix
        "late_nul.txt": "a " * 600 + "\x00",                    # a NUL after the first KiB: text (the rule's limit)
    })


def test_a_folder_skips_and_counts_hidden_and_binary_files(tmp_path, word_tokenizer):
    _mixed(tmp_path)
    files = text_data.text_files(tmp_path)
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a.txt", "late_nul.txt", "sub/b.md"]
    assert text_data.scan_text_files(tmp_path) == (files, {"skipped_hidden": 3, "skipped_binary": 1})
    (tmp_path / "late_nul.txt").unlink()
    train, _, summary = text_data.text_task(tmp_path, word_tokenizer, block_size=2, heldout_every=0)
    # a b c <eos> d e <eos>: only the two visible text files' tokens
    assert [r["input_ids"] for r in train] == [[2, 3], [4, 1], [5, 6]]
    assert (summary["files"], summary["train_tokens"]) == (2, 7)
    assert (summary["skipped_hidden"], summary["skipped_binary"]) == (3, 1)


def test_a_glob_skips_and_counts_them_too(tmp_path):
    _mixed(tmp_path)
    _write(tmp_path, {"logo.png": PNG})
    files = text_data.text_files(str(tmp_path / "**" / "*"))
    assert [p.relative_to(tmp_path).as_posix() for p in files] == ["a.txt", "late_nul.txt", "sub/b.md"]
    files, skipped = text_data.scan_text_files(str(tmp_path / "**" / "*"))
    assert skipped["skipped_binary"] == 2  # image.txt, logo.png
    if sys.version_info >= (3, 11):  # glob's include_hidden: the hidden matches are seen, so counted
        assert skipped["skipped_hidden"] == 3
    # a hidden folder named in the glob's fixed part is what the user asked for
    files, skipped = text_data.scan_text_files(str(tmp_path / ".ipynb_checkpoints" / "*.txt"))
    assert [p.name for p in files] == ["a-checkpoint.txt"] and skipped == {"skipped_hidden": 0, "skipped_binary": 0}


def test_nothing_left_says_what_was_skipped(tmp_path):
    _write(tmp_path, {".hidden/x.txt": "a", "bin.txt": PNG})
    with pytest.raises(FileNotFoundError, match=r"no .* files under .* \(1 hidden and 1 binary file\(s\) skipped\)"):
        text_data.text_files(tmp_path)
    with pytest.raises(FileNotFoundError, match="bin.txt is a binary file"):
        text_data.text_files(tmp_path / "bin.txt")


def test_run_json_records_the_skipped_files(tmp_path, word_tokenizer):
    """The recipe writes text_task's summary to run.json: the skipped counts are there."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    from tests.conftest import make_tiny_llama

    model = make_tiny_llama(tmp_path / "tiny", num_layers=1, hidden=32, vocab_size=len(WORDS))
    word_tokenizer.save_pretrained(model)
    corpus = tmp_path / "docs"
    _write(corpus, {f"p{i:02d}.txt": "a b c d e f " * 6 for i in range(21)})
    _write(corpus, {".ipynb_checkpoints/p00-checkpoint.txt": "a b", "figure.txt": PNG})
    out = tmp_path / "run"
    recipe = finetune.load_config(["--config", str(ROOT / "recipes" / "smollm2-135m" / "bf16.yaml"),
                                   "--model", str(model), "--dataset", f"text:{corpus}", "--max_seq_len", "8",
                                   "--output_dir", str(out), "--max_steps", "1", "--per_device_train_batch_size", "2",
                                   "--compute_dtype", "float32", "--disable_tqdm", "true", "--save_strategy", "no",
                                   "--report_to", "none", "--use_cpu", "true"])
    record = finetune.run(recipe)
    text = json.loads((out / "run.json").read_text())["text_data"]
    assert text == record["text_data"]
    assert (text["files"], text["train_files"], text["heldout_files"]) == (21, 20, 1)
    assert (text["skipped_hidden"], text["skipped_binary"]) == (1, 1)
