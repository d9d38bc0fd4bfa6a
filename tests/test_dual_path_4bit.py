"""What is particular to the 4-bit (NF4 / FP4) low path. The checks shared with INT8 (all promoted =
the BF16 model, none promoted = stock PEFT over stock 4-bit, a mix, gradients on both paths, bytes per
storage mode, adapter round trip, merge and DoRA refused) run for every low path in
tests/test_dual_path.py."""

from __future__ import annotations

import pytest
import torch

import gnmr_hf
from tests.test_dual_path import NUM_LAYERS, copy_lora, layers, load, logits, wrap

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def test_double_quant_and_bf16_compute(tiny_llama_dir, ids):
    """bnb_4bit_use_double_quant=True and BF16 compute (the QLoRA setting): none promoted is stock,
    all promoted is the BF16 model's base output exactly, and with LoRA to a few BF16 ulps (PEFT's
    bnb LoRA layer and its plain one round the LoRA output at different points)."""
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4", torch.bfloat16, double_quant=True),
                                          tiny_llama_dir))
    assert layers(dual)[0].mlp.up_proj.base_layer.weight.compress_statistics  # double quantisation is on
    stock = copy_lora(wrap(load(tiny_llama_dir, "nf4", torch.bfloat16, double_quant=True), seed=2), dual)
    ref_bf = copy_lora(wrap(load(tiny_llama_dir, None, torch.bfloat16), seed=3), dual)
    assert torch.equal(logits(dual, ids), logits(stock, ids))
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    got = logits(dual, ids)
    with dual.disable_adapter():
        got_base = logits(dual, ids)
    want = logits(ref_bf, ids)
    with ref_bf.disable_adapter():
        want_base = logits(ref_bf, ids)
    assert torch.equal(got_base, want_base)
    assert (want - want_base).abs().max() > 0.05 and (want - logits(stock, ids)).abs().max() > 0.05
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 7)
    assert (got - want).abs().max() <= 4 * ulp


def test_dispatch_picks_the_backend_from_the_layers(tiny_llama_dir):
    from gnmr_hf.backends import bnb_4bit, bnb_int8
    from gnmr_hf.backends.dispatch import find_backend

    m4 = load(tiny_llama_dir, "fp4")
    assert find_backend(m4).module == "gnmr_hf.backends.bnb_4bit"
    assert find_backend(load(tiny_llama_dir, "int8")).module == "gnmr_hf.backends.bnb_int8"
    with pytest.raises(ValueError, match=r"no bitsandbytes Linear8bitLt .*\['Linear', 'Linear4bit'\]"):
        bnb_int8.prepare_dual_path(m4, tiny_llama_dir)
    with pytest.raises(ValueError, match=r"no bitsandbytes Linear4bit .*load_in_4bit=True"):
        bnb_4bit.prepare_dual_path(load(tiny_llama_dir, None), tiny_llama_dir)
