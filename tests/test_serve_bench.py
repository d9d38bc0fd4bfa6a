"""bench/value/serve_bench.py's fine-tune route (``--adapter``): the rows of a LoRA adapter merged into the BF16
weights, on a tiny LLaMA and a small text folder (the real runs: bench/results/serve, docs/results.md)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import load_bench

pytest.importorskip("compressed_tensors")
peft = pytest.importorskip("peft")
serve_bench = load_bench("serve_bench")


@pytest.fixture(scope="module")
def setup(tmp_path_factory, tiny_tok):
    """A tiny LLaMA over SmolLM2's tokenizer, a LoRA adapter on it with B drawn at random (so merging moves the
    weights), and 40 short text files (every 20th held out)."""
    from transformers import AutoModelForCausalLM

    root = tmp_path_factory.mktemp("serve")
    model_dir = tiny_tok
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj", "down_proj"]))
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for n, prm in lora.named_parameters():
            if "lora_B" in n:
                prm.copy_(torch.randn(prm.shape, generator=g) * 0.5)
    lora.save_pretrained(root / "adapter")
    text = root / "text"
    text.mkdir()
    words = "def class return import while for in if else print value list dict the a of to and".split()
    for i in range(40):
        rng = torch.Generator().manual_seed(i)
        body = " ".join(words[int(j)] for j in torch.randint(0, len(words), (700,), generator=rng))
        (text / f"doc{i:02d}.txt").write_text(body + "\n")
    return model_dir, root / "adapter", text


def _args(setup, out, work, *extra):
    model_dir, _, text = setup
    return ["--model", str(model_dir), "--group-size", "32", "--seeds", "0", "--profile-blocks", "2",
            "--heldout-blocks", "2", "--out", str(out), "--work", str(work), "--source", str(text), *extra]


def test_the_adapter_route_scores_the_merged_fine_tune(setup, tmp_path):
    model_dir, adapter, text = setup
    out, work = tmp_path / "out", tmp_path / "work"
    # a bare --seeds: no random rows (the fine-tune runs of bench/results/serve)
    assert serve_bench.main(_args(setup, out, work, "--adapter", str(adapter), "--tag", "ft", "--seeds")) == 0
    name = model_dir.name  # the rows file is named by the model folder
    doc = json.loads((out / f"{name}+ft.json").read_text())
    assert doc["setting"]["adapter"] == str(adapter.resolve()) and doc["setting"]["seeds"] == []
    assert set(doc["rows"]) == {"bf16", "w4a16", "planned"}
    # the bf16 row is the adapter merged into the BF16 weights (as the export merges it), scored independently here
    from transformers import AutoTokenizer

    from gnmr_hf.export_ct import _merged_bf16
    from gnmr_hf.offline.text_data import text_task

    _, held, _ = text_task(text, AutoTokenizer.from_pretrained(model_dir), serve_bench.BLOCK)
    blocks = serve_bench.spaced(held, 2)
    merged = _merged_bf16(model_dir, adapter).to(torch.float32)
    assert doc["rows"]["bf16"]["loss"] == pytest.approx(serve_bench.heldout_loss(merged, blocks, 2), rel=1e-6)
    # the base model's rows differ: the merge moved the weights
    assert serve_bench.main(_args(setup, out, work)) == 0
    base = json.loads((out / f"{name}.json").read_text())
    assert "adapter" not in base["setting"] and set(base["rows"]) == {"bf16", "w4a16", "planned", "random-0"}
    assert base["rows"]["bf16"]["loss"] != doc["rows"]["bf16"]["loss"]
    assert base["rows"]["w4a16"]["loss"] != doc["rows"]["w4a16"]["loss"]
    table = (out / "serve.md").read_text()
    assert f"## {name}+ft " in table and "merged into the BF16 weights first" in table and f"## {name} " in table


def test_adapter_and_tag_go_together(setup, tmp_path, capsys):
    _, adapter, _ = setup
    for extra in (["--adapter", str(adapter)], ["--tag", "x"], ["--adapter", str(tmp_path), "--tag", "x"]):
        with pytest.raises(SystemExit) as e:
            serve_bench.main(_args(setup, tmp_path / "o", tmp_path / "w", *extra))
        assert e.value.code == 2
    err = capsys.readouterr().err
    assert "--adapter and --tag go together" in err and "not a PEFT adapter folder" in err


def _rows_file(out, model, tag, losses):
    setting = {"model": model, "group_size": 64, "over": 0.1, "heldout_blocks": 2, "block": 256, "profile_blocks": 2}
    if tag:
        setting.update(tag=tag, adapter=f"/runs/{tag}/adapter")
    rows = {k: {"loss": v, "tensor_bytes": 100, "bytes_on_disk": 100, "schemes": {"W4A16": 1}} for k, v in losses.items()}
    name = model + (f"+{tag}" if tag else "")
    (out / f"{name}.json").write_text(json.dumps({"setting": setting, "rows": rows, "command": "python x",
                                                  "uniform_w4a16_tensor_bytes": 100, "data": {"heldout_tokens_scored": 9}}))


def test_the_fine_tune_section_compares_each_seed_with_the_nf4_fine_tune_of_that_seed(tmp_path):
    _rows_file(tmp_path, "m", None, {"bf16": 2.0, "w4a16": 3.0, "planned": 2.5})  # the base: not a fine-tune
    _rows_file(tmp_path, "m", "nf4-seed0", {"bf16": 2.0, "w4a16": 3.0, "planned": 2.4})
    _rows_file(tmp_path, "m", "nf4-seed1", {"bf16": 2.2, "w4a16": 3.2, "planned": 2.8})
    _rows_file(tmp_path, "m", "lad-grp-10-seed0", {"bf16": 1.9, "w4a16": 2.9, "planned": 2.3})
    _rows_file(tmp_path, "m", "lad-grp-10-seed1", {"bf16": 2.0, "w4a16": 3.0, "planned": 2.6})
    _rows_file(tmp_path, "m", "lad-grp-10-seed2", {"bf16": 2.0, "w4a16": 3.0, "planned": 2.5})  # no nf4 seed 2
    _rows_file(tmp_path, "m", "ft", {"bf16": 1.0, "w4a16": 1.5, "planned": 1.2})  # not <method>-seed<S>: left out
    assert list(serve_bench.finetune_rows(tmp_path)) == [("m", "nf4"), ("m", "lad-grp-10")]  # NF4 QLoRA first
    lines = serve_bench.finetune_table(tmp_path)
    # nf4: planned 2.4 / 2.8, gap closed (3.0 - 2.4) / 1.0 = 0.6 and (3.2 - 2.8) / 1.0 = 0.4
    assert "| m nf4 | 2 | 2.1000 [2.0000, 2.2000] | 3.1000 [3.0000, 3.2000] | 2.6000 [2.4000, 2.8000] | " \
           "0.500 [0.400, 0.600] |" in lines
    # lad-grp-10: 3 seeds, planned 2.3 / 2.6 / 2.5 (median 2.5); gaps 0.6 / 0.4 / 0.5
    assert "| m lad-grp-10 | 3 | 2.0000 [1.9000, 2.0000] | 3.0000 [2.9000, 3.0000] | 2.5000 [2.3000, 2.6000] | " \
           "0.500 [0.400, 0.600] |" in lines
    # against nf4 of the same seed (0 and 1 only): planned - w4a16 = 2.3 - 3.0, 2.6 - 3.2; planned - planned =
    # 2.3 - 2.4, 2.6 - 2.8
    assert "| m | lad-grp-10 | 0, 1 | -0.6500 [-0.7000, -0.6000] | -0.1500 [-0.2000, -0.1000] |" in lines
    assert not any(line.startswith("| m ft") for line in lines)
    serve_bench.write_table(tmp_path)
    assert "## Fine-tunes served" in (tmp_path / "serve.md").read_text()
