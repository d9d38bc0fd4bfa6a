"""The 4-bit (NF4 / FP4) dual-path layer on a tiny random LLaMA: real bitsandbytes, real PEFT, on CPU.

As for INT8 (tests/test_dual_path.py), the references are stock libraries: the FP32 model read from
the same BF16 checkpoint with stock PEFT for the recovery path, stock PEFT over a stock 4-bit load for
the low-cost path, and a hybrid of the two stock models for a mix.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

import gnmr_hf

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from gnmr_hf.backends.bnb_4bit import DualPathLinear4bit  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_LAYERS = 4
QUANT_TYPES = ["nf4", "fp4"]


def load(path, quant: str | None, dtype=torch.float32, double_quant=False, compute_dtype=None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if quant:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=compute_dtype or dtype,
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw).eval()


def wrap(model, seed=0, **kw):
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so LoRA really changes the output
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False, **kw)
    return peft.get_peft_model(model, cfg)


def copy_lora(dst, src):
    res = peft.set_peft_model_state_dict(dst, peft.get_peft_model_state_dict(src))
    assert not [k for k in res.unexpected_keys if "lora" in k]
    return dst


def layers(pm):
    return pm.base_model.model.model.layers


@torch.no_grad()
def logits(model, ids):
    out = model(ids).logits.float()
    assert torch.isfinite(out).all()
    return out


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module", params=QUANT_TYPES)
def fp32(request, tiny_llama_dir):
    """(quant type, dual-path model, stock FP32 reference, stock 4-bit reference), one set of LoRA weights."""
    quant = request.param
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, quant), tiny_llama_dir, dtype=torch.float32))
    ref_bf = copy_lora(wrap(load(tiny_llama_dir, None), seed=5), dual)
    ref_4bit = copy_lora(wrap(load(tiny_llama_dir, quant), seed=6), dual)
    return quant, dual, ref_bf, ref_4bit


def test_plain_get_peft_model_wraps_dual_path_with_stock_4bit_lora(fp32):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    quant, dual, _, _ = fp32
    for i, layer in enumerate(layers(dual)):
        for name, m in layer.named_modules():
            if name.split(".")[-1] in LINEARS:
                assert type(m) is LoraLinear4bit, name
                assert type(m.base_layer) is DualPathLinear4bit
                assert m.base_layer.recovery_key == f"model.layers.{i}.{name}.weight"
                assert m.base_layer.weight.quant_type == quant  # the quantised weight was kept
                assert m.base_layer.weight.dtype == torch.uint8
    assert gnmr_hf.recoverable_units(dual) == [True] * NUM_LAYERS
    assert gnmr_hf.active_units(dual) == []


def test_all_promoted_is_the_bf16_checkpoint_model(fp32, ids):
    _, dual, ref_bf, ref_4bit = fp32
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    try:
        got = logits(dual, ids)
        with dual.disable_adapter():
            got_base = logits(dual, ids)
    finally:
        gnmr_hf.set_active_units(dual, [])
    want = logits(ref_bf, ids)
    with ref_bf.disable_adapter():
        want_base = logits(ref_bf, ids)
    assert (want - want_base).abs().max() > 0.1  # LoRA changes the output
    assert (want - logits(ref_4bit, ids)).abs().max() > 1e-2  # 4-bit differs from BF16
    torch.testing.assert_close(got_base, want_base, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_none_promoted_is_stock_peft_over_stock_4bit(fp32, ids):
    _, dual, _, ref_4bit = fp32
    gnmr_hf.set_active_units(dual, [])
    assert torch.equal(logits(dual, ids), logits(ref_4bit, ids))


def test_mix_is_the_hybrid_of_the_stock_models(fp32, tiny_llama_dir, ids):
    quant, dual, ref_bf, ref_4bit = fp32
    promoted = [1, 2]
    hybrid = copy_lora(wrap(load(tiny_llama_dir, quant), seed=7), dual)
    bf_layers = copy_lora(wrap(load(tiny_llama_dir, None), seed=8), dual)
    for i in promoted:  # stock FP32 decoder layers (with their stock LoRA) inside a stock 4-bit model
        layers(hybrid)[i] = layers(bf_layers)[i]
    gnmr_hf.set_active_units(dual, promoted)
    try:
        assert gnmr_hf.active_units(dual) == promoted
        got = logits(dual, ids)
    finally:
        gnmr_hf.set_active_units(dual, [])
    torch.testing.assert_close(got, logits(hybrid, ids), rtol=0, atol=1e-5)
    assert (got - logits(ref_bf, ids)).abs().max() > 1e-2
    assert (got - logits(ref_4bit, ids)).abs().max() > 1e-2


def _lora_grads(pm):
    return {n: p.grad.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}


def _loss_backward(pm, ids):
    pm.zero_grad(set_to_none=True)
    out = pm(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def test_gradients_reach_lora_on_both_paths(fp32, ids):
    _, dual, ref_bf, ref_4bit = fp32
    trainable = [n for n, p in dual.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # base weights stay frozen
    before = layers(dual)[0].self_attn.q_proj.base_layer.weight.detach().clone()
    grads = {}
    for active, ref in ((list(range(NUM_LAYERS)), ref_bf), ([], ref_4bit)):
        gnmr_hf.set_active_units(dual, active)
        _loss_backward(dual, ids)
        got = grads[len(active)] = _lora_grads(dual)
        assert set(got) == set(trainable)
        for layer in range(NUM_LAYERS):  # every layer's LoRA gets a non-zero, finite gradient
            g = torch.cat([v.flatten() for n, v in got.items() if f"layers.{layer}." in n])
            assert torch.isfinite(g).all() and g.abs().sum() > 0
        _loss_backward(ref, ids)
        want = _lora_grads(ref)
        for n in trainable:
            torch.testing.assert_close(got[n], want[n], rtol=1e-4, atol=1e-6)
    # the two paths give different gradients (the check above compares two different things)
    assert any((grads[0][n] - grads[NUM_LAYERS][n]).abs().max() > 1e-4 for n in trainable)
    gnmr_hf.set_active_units(dual, [])
    for pm in (dual, ref_bf, ref_4bit):
        pm.zero_grad(set_to_none=True)
    assert torch.equal(layers(dual)[0].self_attn.q_proj.base_layer.weight, before)


def test_double_quant_and_bf16_compute(tiny_llama_dir, ids):
    """bnb_4bit_use_double_quant=True and BF16 compute (the QLoRA setting): none promoted is stock,
    all promoted is the BF16 model's base output exactly, and with LoRA to a few BF16 ulps (PEFT's
    bnb LoRA layer and its plain one round the LoRA output at different points)."""
    kw = {"dtype": torch.bfloat16, "double_quant": True}
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4", **kw), tiny_llama_dir))
    assert layers(dual)[0].mlp.up_proj.base_layer.weight.compress_statistics
    stock = copy_lora(wrap(load(tiny_llama_dir, "nf4", **kw), seed=2), dual)
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


# ---------------------------------------------------------------- storage and device-byte accounting


def layer_bf16_bytes(path, layer):
    """BF16 size of one decoder layer's linear weights, from the checkpoint header (independent)."""
    total = 0
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            if k.startswith(f"model.layers.{layer}.") and k.split(".")[-2] in LINEARS:
                n = 1
                for s in f.get_slice(k).get_shape():
                    n *= s
                total += 2 * n
    return total


@pytest.mark.parametrize("quant", QUANT_TYPES)
@pytest.mark.parametrize("storage", ["host", "device", "disk"])
def test_bytes_exact_per_storage_mode(tiny_llama_dir, quant, storage):
    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, quant, torch.bfloat16), tiny_llama_dir, storage=storage)
    per_layer = [layer_bf16_bytes(tiny_llama_dir, i) for i in range(NUM_LAYERS)]
    # q, o: 64x64; k, v: 32x64 (2 KV heads of 16); gate, up, down: 128x64; BF16 = 2 bytes
    assert per_layer == [2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)] * NUM_LAYERS
    for active in ([], [1], [0, 3], [0, 1, 2, 3], [2], []):
        gnmr_hf.set_active_units(model, active)
        want = sum(per_layer) if storage == "device" else sum(per_layer[i] for i in active)
        assert gnmr_hf.recovery_device_bytes(model) == want, active
    mods = [m for m in model.modules() if isinstance(m, DualPathLinear4bit)]
    assert len(mods) == NUM_LAYERS * len(LINEARS)
    assert all(m._gnmr_weight is None for m in mods)  # demoted: the device copies were dropped


# ---------------------------------------------------------------- the adapter is a stock PEFT adapter


def test_adapter_round_trip_on_bf16_and_4bit_bases(fp32, tiny_llama_dir, tmp_path, ids):
    quant, dual, _, ref_4bit = fp32
    gnmr_hf.set_active_units(dual, [0, 3])  # saving does not depend on the current paths
    dual.save_pretrained(tmp_path / "dual")
    ref_4bit.save_pretrained(tmp_path / "stock")
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("dual", "stock"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert "gnmr" not in (tmp_path / "dual" / "adapter_config.json").read_text().lower()
    assert json.loads((tmp_path / "dual" / "adapter_config.json").read_text())["use_dora"] is False
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    high = logits(dual, ids)
    gnmr_hf.set_active_units(dual, [])
    low = logits(dual, ids)
    on_bf16 = peft.PeftModel.from_pretrained(load(tiny_llama_dir, None), tmp_path / "dual")
    on_4bit = peft.PeftModel.from_pretrained(load(tiny_llama_dir, quant), tmp_path / "dual")
    assert not any(isinstance(m, DualPathLinear4bit) for m in on_4bit.modules())
    torch.testing.assert_close(logits(on_bf16, ids), high, rtol=0, atol=1e-5)
    assert torch.equal(logits(on_4bit, ids), low)
    assert (high - low).abs().max() > 1e-2


# ---------------------------------------------------------------- merging and DoRA are refused


def test_merge_is_refused_and_the_advised_merge_works(fp32, tiny_llama_dir, tmp_path, ids):
    _, dual, _, _ = fp32
    gnmr_hf.set_active_units(dual, [1])
    before = logits(dual, ids)
    for merge in (dual.merge_adapter, dual.merge_and_unload, lambda: dual.merge_and_unload(safe_merge=True)):
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"(?s)cannot be replaced.*merge_and_unload"
                                                      r".*PeftModel\.from_pretrained"):
            merge()
        assert not any(getattr(m, "merged_adapters", []) for m in dual.modules())
    assert isinstance(layers(dual)[1].self_attn.q_proj.base_layer, DualPathLinear4bit)
    assert torch.equal(logits(dual, ids), before)  # nothing was changed by the refused merges
    # what the message advises: the adapter merged on a stock BF16 base is the all-promoted model
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    high = logits(dual, ids)
    gnmr_hf.set_active_units(dual, [])
    dual.save_pretrained(tmp_path / "adapter")
    merged = peft.PeftModel.from_pretrained(load(tiny_llama_dir, None), tmp_path / "adapter").merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_modules())
    torch.testing.assert_close(logits(merged, ids), high, rtol=0, atol=1e-4)


def test_dora_is_refused(tiny_llama_dir):
    from gnmr_hf.backends import bnb_4bit

    dora = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), tiny_llama_dir), use_dora=True)
    with pytest.raises(ValueError, match=r"q_proj: DoRA .* is not supported over a dual-path layer"):
        gnmr_hf.set_active_units(dora, [0])
    with pytest.raises(ValueError, match="DoRA"):
        gnmr_hf.recoverable_units(dora)  # what the callback calls when it sets up
    assert gnmr_hf.active_units(dora) == []
    late = wrap(load(tiny_llama_dir, "nf4"), use_dora=True)  # PEFT first, then prepare
    with pytest.raises(ValueError, match="DoRA"):
        bnb_4bit.prepare_dual_path(late, tiny_llama_dir)
    assert not any(isinstance(m, DualPathLinear4bit) for m in late.modules())  # refused before converting


def test_dispatch_picks_the_backend_from_the_layers(tiny_llama_dir):
    from gnmr_hf.backends import bnb_int8
    from gnmr_hf.backends.dispatch import find_backend

    m4 = load(tiny_llama_dir, "nf4")
    assert find_backend(m4).module == "gnmr_hf.backends.bnb_4bit"
    with pytest.raises(ValueError, match="not loaded in 8-bit .it is 4-bit"):
        bnb_int8.prepare_dual_path(m4, tiny_llama_dir)
    from gnmr_hf.backends import bnb_4bit

    with pytest.raises(ValueError, match="not loaded in 4-bit"):
        bnb_4bit.prepare_dual_path(load(tiny_llama_dir, None), tiny_llama_dir)
