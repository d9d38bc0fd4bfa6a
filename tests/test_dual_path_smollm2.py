"""The dual path on the real SmolLM2-135M-Instruct checkpoint (30 decoder layers), key checks only, for
each low path (INT8, NF4, FP4) against stock transformers + PEFT + bitsandbytes."""

from __future__ import annotations

import pytest
import torch
from safetensors import safe_open

import gnmr_hf

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

pytestmark = pytest.mark.slow

TARGETS = ["q_proj", "v_proj", "down_proj"]


def _load(path, low: str | None):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if low == "int8":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    elif low:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=low, bnb_4bit_compute_dtype=torch.float32
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kw)
    if low and low != "int8":  # the reference kernel in eval mode too, as the dual path (see test_dual_path.py)
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        keep_reference_layout(model)
    return model.eval()


def _wrap(model, seed):
    torch.manual_seed(seed)
    cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=TARGETS, init_lora_weights=False)
    return peft.get_peft_model(model, cfg)


@torch.no_grad()
def _logits(model, ids):
    out = model(ids).logits
    assert torch.isfinite(out).all()
    return out


@pytest.mark.parametrize("low_path", ["int8", "nf4", "fp4"])
def test_smollm2_paths_match_stock_models(smollm2_dir, low_path):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ids = tok(["The capital of France is", "Two plus two is"], return_tensors="pt",
              padding=True)["input_ids"]
    # loading INT8 on CPU is slow (about 30 s here), so one quantised model serves as the stock reference
    # first and is then prepared in place: this also covers prepare_dual_path after get_peft_model.
    # FP32 activations: the checkpoint's BF16 values upcast, so PEFT's two LoRA layer classes agree exactly
    dual = _wrap(_load(smollm2_dir, low_path), seed=0)
    stock_low = _logits(dual, ids)
    sd = peft.get_peft_model_state_dict(dual)
    gnmr_hf.prepare_dual_path(dual, smollm2_dir, storage="host", dtype=torch.float32)
    n_layers = len(gnmr_hf.find_decoder_layers(dual))
    assert n_layers == 30 and gnmr_hf.recoverable_units(dual) == [True] * 30
    low = _logits(dual, ids)
    assert torch.equal(low, stock_low)

    ref_bf = _wrap(_load(smollm2_dir, None), seed=2)
    peft.set_peft_model_state_dict(ref_bf, sd)
    want = _logits(ref_bf, ids)
    gnmr_hf.set_active_units(dual, range(n_layers))
    high = _logits(dual, ids)
    torch.testing.assert_close(high, want, rtol=1e-5, atol=1e-4)
    assert (low - want).abs().max() > 1e-2  # the low path really differs on this model
    with ref_bf.disable_adapter():
        assert (want - _logits(ref_bf, ids)).abs().max() > 1e-2  # and LoRA really changes the output
    del ref_bf

    # device bytes: exactly the FP32-kept checkpoint tensors of the promoted layers (from the header)
    gnmr_hf.set_active_units(dual, [4, 17])
    expected = 0
    with safe_open(str(smollm2_dir / "model.safetensors"), framework="pt") as f:
        for k in f.keys():
            parts = k.split(".")
            if k.startswith(("model.layers.4.", "model.layers.17.")) and parts[-2].endswith("_proj"):
                shape = f.get_slice(k).get_shape()
                expected += 4 * shape[0] * shape[1]
    assert expected > 0 and gnmr_hf.recovery_device_bytes(dual) == expected

    # gradients reach LoRA on both paths (layers 4 and 17 recovered, the rest on the low path), and the mix differs
    dual.train()
    out = dual(ids, labels=ids)
    out.loss.backward()
    mix = out.logits.detach()
    assert (mix - low).abs().max() > 1e-3 and (mix - high).abs().max() > 1e-3
    for i in (4, 5, 17, 29):
        g = dual.base_model.model.model.layers[i].self_attn.q_proj.lora_B["default"].weight.grad
        assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    gnmr_hf.set_active_units(dual, [])
    assert gnmr_hf.recovery_device_bytes(dual) == 0

    # again with BF16 weights read from disk at promotion: one layer's BF16 size, by hand
    gnmr_hf.prepare_dual_path(dual, smollm2_dir, storage="disk")
    gnmr_hf.set_active_units(dual, [0])
    # q, o: 576x576; k, v: 192x576 (3 KV heads of 64); gate, up, down: 1536x576; BF16 = 2 bytes
    assert gnmr_hf.recovery_device_bytes(dual) == 2 * (2 * 576 * 576 + 2 * 192 * 576 + 3 * 1536 * 576)
    with pytest.raises(ValueError, match="merge_and_unload"), pytest.warns(UserWarning):
        dual.merge_adapter()
    gnmr_hf.set_active_units(dual, [])
    assert gnmr_hf.recovery_device_bytes(dual) == 0
