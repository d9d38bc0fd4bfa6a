"""Operator units (``units="linears"``): every linear inside the decoder layers is its own unit."""

from __future__ import annotations

import pytest
import torch

import gnmr_hf
from gnmr_hf.units import find_linear_units, resolve_units, short_name
from tests.test_dual_path import LINEARS, NUM_LAYERS, load, wrap

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ORDER = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]  # LLaMA's module order


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_linears_in_module_order_plain_and_under_peft(tiny_llama_dir):
    model = load(tiny_llama_dir, False)
    units = resolve_units(model, "linears")
    assert [short_name(n) for n, _ in units] == [
        f"layers.{i}.{'self_attn' if j < 4 else 'mlp'}.{op}" for i in range(NUM_LAYERS) for j, op in enumerate(ORDER)]
    assert all(isinstance(m, torch.nn.Linear) for _, m in units)
    pm = wrap(model)
    wrapped = find_linear_units(pm)
    # under PEFT the unit is the LoRA wrapper: its trainable parameters are exactly its own lora_A/lora_B
    assert [short_name(n) for n, _ in wrapped] == [short_name(n) for n, _ in units]
    for name, unit in wrapped:
        trainable = [n for n, p in unit.named_parameters() if p.requires_grad]
        assert sorted(trainable) == ["lora_A.default.weight", "lora_B.default.weight"], name
    assert wrapped[0][0] == "base_model.model.model.layers.0.self_attn.q_proj"


def test_unknown_grain_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match=r"unknown grain 'linear'.*'layers', 'linears'"):
        resolve_units(load(tiny_llama_dir, False), "linear")


@pytest.mark.parametrize("low", ["int8", "nf4"])
def test_prepare_with_linears_records_the_grain(tiny_llama_dir, ids, low):
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low), tiny_llama_dir, units="linears",
                                          dtype=torch.float32))
    n = NUM_LAYERS * len(LINEARS)
    assert gnmr_hf.recoverable_units(dual) == [True] * n  # units=None now means the linears
    assert gnmr_hf.recoverable_units(dual, "layers") == [True] * NUM_LAYERS
    low_logits = dual(ids).logits.detach()
    v1 = 1 * len(ORDER) + ORDER.index("v_proj")  # layers.1.self_attn.v_proj
    gnmr_hf.set_active_units(dual, [v1])
    assert gnmr_hf.active_units(dual) == [v1]
    assert gnmr_hf.active_units(dual, "layers") == [1]  # layer 1 holds a promoted module
    promoted = [m for m in gnmr_hf.backends.base.dual_path_modules(dual) if m.recovery]
    assert len(promoted) == 1 and promoted[0].recovery_key == "model.layers.1.self_attn.v_proj.weight"
    # the bytes of exactly that one weight (FP32-kept here)
    assert gnmr_hf.recovery_device_bytes(dual) == 4 * promoted[0].in_features * promoted[0].out_features
    mixed = dual(ids).logits.detach()
    assert (mixed - low_logits).abs().max() > 0
    gnmr_hf.set_active_units(dual, [])
    assert torch.equal(dual(ids).logits.detach(), low_logits)
    # prepared again with the default grain: the decoder layers again
    gnmr_hf.prepare_dual_path(dual, tiny_llama_dir, dtype=torch.float32)
    assert len(gnmr_hf.recoverable_units(dual)) == NUM_LAYERS
