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
    assert serve_bench.main(_args(setup, out, work, "--adapter", str(adapter), "--tag", "ft")) == 0
    name = model_dir.name  # the rows file is named by the model folder
    doc = json.loads((out / f"{name}+ft.json").read_text())
    assert doc["setting"]["adapter"] == str(adapter.resolve())
    assert set(doc["rows"]) == {"bf16", "w4a16", "planned", "random-0"}
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
    assert "adapter" not in base["setting"]
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
