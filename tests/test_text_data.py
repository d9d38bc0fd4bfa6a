"""The text task: file discovery, the by-file held-out split, block building and the loss on every
token, hand-worked on a word-level tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gnmr_hf.offline import text_data

SAMPLE = Path(__file__).resolve().parents[1] / "recipes" / "stress" / "corpus_sample"


@pytest.fixture(scope="module")
def word_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "a", "b", "c", "d", "e", "f"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")


def _write(folder: Path, texts: dict[str, str]) -> None:
    for name, text in texts.items():
        p = folder / name
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(text)


def test_files_sorted_recursive_and_by_glob(tmp_path):
    _write(tmp_path, {"b.txt": "a", "a.rst": "b", "sub/c.md": "c", "skip.html": "d"})
    assert [p.relative_to(tmp_path).as_posix() for p in text_data.text_files(tmp_path)] == ["a.rst", "b.txt", "sub/c.md"]
    assert [p.name for p in text_data.text_files(str(tmp_path / "*.txt"))] == ["b.txt"]
    with pytest.raises(FileNotFoundError, match="matches no file"):
        text_data.text_files(str(tmp_path / "*.json"))
    with pytest.raises(FileNotFoundError, match="python3.11-doc"):
        text_data.text_files("/usr/share/doc/python3.11/html/_sources/nope")


def test_split_holds_out_every_nth_file_whole():
    files = [Path(f"f{i:02d}") for i in range(1, 46)]
    train, held = text_data.split_by_file(files, 20)
    assert held == [Path("f20"), Path("f40")]
    assert len(train) == 43 and not set(train) & set(held)
    assert text_data.split_by_file(files, 0) == (files, [])
    with pytest.raises(ValueError, match="heldout_every"):
        text_data.split_by_file(files, 1)


def test_blocks_by_hand(tmp_path, word_tokenizer):
    # tokens: a b c <eos> | d e <eos> | f a b c d <eos>  (ids 2 3 4 1 5 6 1 7 2 3 4 5 1)
    _write(tmp_path, {"1.txt": "a b c", "2.txt": "d e", "3.txt": "f a b c d"})
    ids = text_data.token_stream(text_data.text_files(tmp_path), word_tokenizer)
    assert ids == [2, 3, 4, 1, 5, 6, 1, 7, 2, 3, 4, 5, 1]
    rows = text_data.blocks(ids, 4)
    assert [r["input_ids"] for r in rows] == [[2, 3, 4, 1], [5, 6, 1, 7], [2, 3, 4, 5]]  # the last 1 dropped
    assert all(r["labels"] == r["input_ids"] and r["attention_mask"] == [1] * 4 for r in rows)


def test_text_task_keeps_held_out_files_apart(tmp_path, word_tokenizer):
    _write(tmp_path, {"1.txt": "a b c", "2.txt": "d e", "3.txt": "f a b c d", "4.txt": "e e e e e e e"})
    train, held, summary = text_data.text_task(tmp_path, word_tokenizer, block_size=3, heldout_every=2)
    # train = files 1, 3: a b c <eos> f a b c d <eos> (10 tokens, 3 blocks); held = 2, 4: 11 tokens, 3 blocks
    assert [r["input_ids"] for r in train] == [[2, 3, 4], [1, 7, 2], [3, 4, 5]]
    assert [r["input_ids"] for r in held] == [[5, 6, 1], [6, 6, 6], [6, 6, 6]]
    assert summary == {"source": str(tmp_path), "files": 4, "train_files": 2, "heldout_files": 2,
                       "train_tokens": 10, "heldout_tokens": 11, "block_size": 3, "train_blocks": 3,
                       "heldout_blocks": 3, "skipped_hidden": 0, "skipped_binary": 0}
    with pytest.raises(ValueError, match="less than one block of 50"):
        text_data.text_task(tmp_path, word_tokenizer, block_size=50, heldout_every=2)


def test_a_folder_too_small_to_hold_a_file_out_says_so(tmp_path, word_tokenizer):
    # 4 files, every 20th held out: none is (the Python tutorial alone, 17 files, is such a folder)
    _write(tmp_path, {"1.txt": "a b c", "2.txt": "d e", "3.txt": "f a b c d", "4.txt": "e e e e e e e"})
    with pytest.warns(UserWarning, match="4 file\\(s\\), fewer than heldout_every=20, so no file is held out"):
        train, held, summary = text_data.text_task(tmp_path, word_tokenizer, block_size=3)
    assert held == [] and summary["heldout_files"] == 0 and len(train) == 7  # all 21 tokens train
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        text_data.text_task(tmp_path, word_tokenizer, block_size=3, heldout_every=0)  # asked for no split: silent


def test_the_loss_covers_every_token(word_tokenizer):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=8, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=2)).eval()
    row = text_data.blocks([2, 3, 4, 1, 5, 6], 6)[0]
    ids, labels = torch.tensor([row["input_ids"]]), torch.tensor([row["labels"]])
    with torch.no_grad():
        out = model(input_ids=ids, labels=labels)
        logp = torch.log_softmax(out.logits[0].float(), -1)
    # every position t predicts token t+1: 5 terms, none masked
    by_hand = -sum(logp[t, row["input_ids"][t + 1]] for t in range(5)) / 5
    assert torch.allclose(out.loss, by_hand, atol=1e-6)
    # a masked prompt (the QA task's rule) would give a different value: the comparison can fail
    masked = labels.clone()
    masked[0, :3] = -100
    with torch.no_grad():
        assert not torch.allclose(model(input_ids=ids, labels=masked).loss, by_hand)


def test_the_shipped_sample_with_a_real_tokenizer():
    pytest.importorskip("tokenizers")
    files = text_data.text_files(SAMPLE)
    assert len(files) == 5
    train, held = text_data.split_by_file(files, 2)
    assert [f.name for f in held] == [files[1].name, files[3].name]


# the recipes' dataset: text:PATH
def _tiny_with_tokenizer(tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    from tests.conftest import make_tiny_llama

    path = make_tiny_llama(tmp_path / "tiny", num_layers=2, seed=4, hidden=32, vocab_size=len(AutoTokenizer.from_pretrained(smollm2_dir)))
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return path


def _corpus(folder, n=21):
    folder.mkdir()
    for i in range(n):  # file 20 is held out
        (folder / f"page{i:02d}.rst.txt").write_text(f"Page {i}. " + "The quick brown fox jumps over the dog. " * 12)
    return folder


def test_a_recipe_trains_on_plain_text(tmp_path, smollm2_dir):
    import json
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import finetune

    model = _tiny_with_tokenizer(tmp_path, smollm2_dir)
    corpus = _corpus(tmp_path / "docs")
    out = tmp_path / "run"
    recipe = finetune.load_config(["--config", str(Path(finetune.__file__).parent / "smollm2-135m" / "bf16.yaml"),
                                   "--model", str(model), "--dataset", f"text:{corpus}", "--max_seq_len", "32",
                                   "--output_dir", str(out), "--max_steps", "2", "--per_device_train_batch_size", "2",
                                   "--compute_dtype", "float32", "--disable_tqdm", "true", "--save_strategy", "no",
                                   "--report_to", "none", "--use_cpu", "true"])
    record = finetune.run(recipe)
    assert record["status"] == "complete" and record["global_step"] == 2
    text = record["text_data"]
    assert (text["files"], text["train_files"], text["heldout_files"]) == (21, 20, 1)
    assert text["block_size"] == 32 and record["num_train_examples"] == text["train_blocks"] > 2
    assert json.loads((out / "run.json").read_text())["text_data"] == text


def test_a_text_dataset_that_is_missing_is_one_line(tmp_path, smollm2_dir):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "recipes"))
    import finetune
    from transformers import AutoTokenizer

    script = finetune.ScriptArguments(dataset=f"text:{tmp_path / 'nothing'}")
    with pytest.raises(finetune.RecipeError, match=r"dataset text:.*nothing: .* is neither a folder"):
        finetune.text_dataset(script, AutoTokenizer.from_pretrained(smollm2_dir))
