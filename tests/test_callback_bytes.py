"""GNMRCallback with operator units and a byte budget: a real Trainer, real PEFT over bitsandbytes INT8."""

from __future__ import annotations

import json

import pytest
import torch

import gnmr_hf

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import Trainer  # noqa: E402

from tests.test_callback import LINEARS, NUM_LAYERS, SWITCHY, ActiveRecorder, dataset, read_trace, targs  # noqa: E402

# recovery weights kept in BF16 (2 bytes): per layer q, k, v, o, gate, up, down of the tiny LLaMA
# (hidden 64, 2 KV heads of 16, intermediate 128)
OP_BYTES = [2 * 64 * 64, 2 * 32 * 64, 2 * 32 * 64, 2 * 64 * 64, 2 * 128 * 64, 2 * 128 * 64, 2 * 64 * 128]


def _linears_model(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32,
                                                 quantization_config=BitsAndBytesConfig(load_in_8bit=True))
    model = gnmr_hf.prepare_dual_path(model, recovery_source=path, units="linears")
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS,
                                                      init_lora_weights=False))


def test_operator_units_under_a_byte_budget(tiny_llama_dir, tmp_path):
    model = _linears_model(tiny_llama_dir)
    budget = 3 * 2 * 64 * 64  # three q/o projections' worth
    cb = gnmr_hf.GNMRCallback(dict(SWITCHY, max_active=28, max_active_bytes=budget))
    recorder = ActiveRecorder()
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=8), train_dataset=dataset(),
                      callbacks=[recorder, cb])
    trainer.train()
    assert cb.unit_bytes() == OP_BYTES * NUM_LAYERS
    lines = read_trace(tmp_path)
    summary = json.loads((tmp_path / "gnmr_summary.json").read_text())
    assert summary["units"][:8] == [f"layers.0.self_attn.{op}" for op in LINEARS[:4]] + \
        [f"layers.0.mlp.{op}" for op in LINEARS[4:]] + ["layers.1.self_attn.q_proj"]
    assert summary["unit_bytes"] == OP_BYTES * NUM_LAYERS
    assert summary["summary"]["peak_active_bytes"] <= budget
    assert any(line["active"] for line in lines)  # something was promoted
    for line, applied in zip(lines, recorder.active):
        assert line["budget_bytes"] == budget
        assert line["active_bytes"] == sum(OP_BYTES[u % 7] for u in line["active"]) <= budget
        assert applied == line["active"]  # what the model ran is what the controller chose
    assert any(line["hit_bytes"] for line in lines)  # the budget bound at some step
    assert gnmr_hf.active_units(model) == [] and gnmr_hf.recovery_device_bytes(model) == 0  # after train()


def test_units_string_argument(tiny_llama_dir, tmp_path):
    with pytest.raises(TypeError, match=r"one of \('layers', 'linears'\).*'linear'"):
        gnmr_hf.GNMRCallback(units="linear")
    model = _linears_model(tiny_llama_dir)
    # the recorded grain is the linears; units="layers" asks for the decoder layers explicitly
    cb = gnmr_hf.GNMRCallback(dict(SWITCHY, max_active=1), units="layers")
    Trainer(model=model, args=targs(tmp_path, max_steps=3), train_dataset=dataset(), callbacks=[cb]).train()
    summary = json.loads((tmp_path / "gnmr_summary.json").read_text())
    assert summary["units"] == [f"layers.{i}" for i in range(NUM_LAYERS)]
    assert all(len(x["norms"]) == NUM_LAYERS for x in read_trace(tmp_path))
