"""The saved-activation quantisation backend (paper Appendix E.1/E.4)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from gnmr_hf.backends.act_quant import (
    PROJECTIONS,
    ActQuantLinear,
    dequantize_tokenwise,
    prepare_act_quant,
    quantize_tokenwise,
    saved_activation_bytes,
    set_full_precision,
)
from gnmr_hf.backends.base import DualPathModule, active_units, recoverable_units, set_active_units


@pytest.mark.parametrize("bits, qmax", [(4, 7), (8, 127)])
def test_round_trip_error_bound_by_hand(bits, qmax):
    # row 0: absmax 7 -> scale 7/qmax; row 1: absmax 0.5 -> scale 0.5/qmax
    x = torch.tensor([[7.0, -3.2, 0.4, 1.75, -7.0], [0.5, 0.01, -0.26, 0.0, 0.125]])
    q, scale = quantize_tokenwise(x, bits)
    assert q.dtype == torch.int8 and scale.shape == (2, 1)
    torch.testing.assert_close(scale, torch.tensor([[7.0 / qmax], [0.5 / qmax]]))
    assert q.abs().max().item() == qmax  # the absmax maps onto the largest level
    err = (x - dequantize_tokenwise(q, scale, torch.float32)).abs()
    assert torch.all(err <= scale / 2 + 1e-7)
    # a value worked out by hand: at 4 bits row 0 has scale 1, so -3.2 -> -3 (error 0.2) and 1.75 -> 2
    if bits == 4:
        assert q[0].tolist() == [7, -3, 0, 2, -7]
        assert q[1].tolist() == [7, 0, -4, 0, 2]  # 0.125 * 14 = 1.75 -> 2; -0.26 * 14 = -3.64 -> -4
    assert err.max() > 0  # it really rounded something


def test_random_error_bound_and_8bit_tighter():
    torch.manual_seed(0)
    x = torch.randn(64, 96) * torch.logspace(-2, 2, 64).unsqueeze(1)
    errs = {}
    for bits, qmax in ((4, 7), (8, 127)):
        q, scale = quantize_tokenwise(x, bits)
        err = (x - dequantize_tokenwise(q, scale, torch.float32)).abs()
        bound = x.abs().amax(-1, keepdim=True) / qmax / 2
        assert torch.all(err <= bound * (1 + 1e-6))
        errs[bits] = err.mean().item()
    assert errs[8] < errs[4] / 10


def test_scales_are_tokenwise():
    torch.manual_seed(1)
    x = torch.randn(4, 32)
    q, s = quantize_tokenwise(x, 4)
    y = x.clone()
    y[2, 5] = 1000.0  # an outlier in one token
    q2, s2 = quantize_tokenwise(y, 4)
    keep = [0, 1, 3]
    assert torch.equal(q[keep], q2[keep]) and torch.equal(s[keep], s2[keep])
    assert s2[2] > 100 * s[2]  # only the outlier's own row got the coarse scale
    err_other = (x[keep] - dequantize_tokenwise(q2[keep], s2[keep], torch.float32)).abs().max()
    assert err_other <= s[keep].max() / 2 + 1e-7


def test_zero_row_is_exact():
    q, s = quantize_tokenwise(torch.zeros(2, 8), 4)
    assert torch.all(q == 0) and torch.all(s == 0)
    assert torch.all(torch.isfinite(dequantize_tokenwise(q, s, torch.float32)))


def _grads(module, x, g):
    module.zero_grad()
    x = x.clone().requires_grad_(True)
    y = module(x)
    y.backward(g)
    return y.detach(), module.weight.grad.clone(), module.bias.grad.clone(), x.grad.clone()


def test_forward_identical_only_weight_grad_changes():
    torch.manual_seed(0)
    lin = nn.Linear(48, 24)
    x = torch.randn(3, 10, 48) * torch.linspace(0.1, 5, 48)  # uneven channels, like real activations
    g = torch.randn(3, 10, 24)
    y_ref, gw_ref, gb_ref, gx_ref = _grads(lin, x, g)
    aq = ActQuantLinear.from_linear(lin, low_bits=4, high_bits=8)
    assert aq.weight is lin.weight and isinstance(aq, DualPathModule)
    diffs = {}
    for recovery, bits in ((False, 4), (True, 8)):
        aq.set_recovery(recovery)
        assert aq.bits == bits
        y, gw, gb, gx = _grads(aq, x, g)
        assert torch.equal(y, y_ref)  # the forward is untouched
        torch.testing.assert_close(gx, gx_ref, rtol=1e-5, atol=1e-6)  # grad_x needs W, not x
        torch.testing.assert_close(gb, gb_ref, rtol=1e-5, atol=1e-6)
        diffs[bits] = (gw - gw_ref).abs().max().item()
        assert diffs[bits] > 0 and torch.all(torch.isfinite(gw))
        # grad_W is exactly g^T @ dequantised(x)
        q, s = quantize_tokenwise(x, bits)
        expected = g.reshape(-1, 24).t() @ dequantize_tokenwise(q, s, torch.float32).reshape(-1, 48)
        torch.testing.assert_close(gw, expected, rtol=1e-5, atol=1e-5)
    assert diffs[8] < diffs[4] / 5
    aq.low_bits = None  # no quantisation: bit-for-bit the exact gradient
    aq.set_recovery(False)
    _, gw, _, _ = _grads(aq, x, g)
    assert torch.equal(gw, gw_ref)


def test_bf16_and_packing_memory():
    torch.manual_seed(0)
    lin = nn.Linear(64, 32).to(torch.bfloat16)
    aq = ActQuantLinear.from_linear(lin, low_bits=4, high_bits=8)
    x = torch.randn(2, 16, 64, dtype=torch.bfloat16)
    sizes = {}
    for rec in (False, True):
        aq.set_recovery(rec)
        y = aq(x)
        y.float().sum().backward()
        assert aq.weight.grad.dtype == torch.bfloat16 and torch.all(torch.isfinite(aq.weight.grad))
        sizes[rec] = aq.last_saved_bytes
    tokens = 32
    assert sizes[False] == tokens * 64 // 2 + tokens * 4  # two 4-bit values per byte + fp32 scale per token
    assert sizes[True] == tokens * 64 + tokens * 4
    aq.full_precision = True
    aq(x).float().sum().backward()
    assert aq.last_saved_bytes == tokens * 64 * 2  # bf16 activation as is


def _tiny_llama(layers=2):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


def test_prepare_units_order_and_scope():
    model = _tiny_llama(2)
    ref = _tiny_llama(2)
    units = prepare_act_quant(model)
    assert len(units) == 14
    assert [n.rsplit(".", 1)[-1] for n, _ in units] == list(PROJECTIONS) * 2
    assert units[0][0] == "model.layers.0.self_attn.q_proj" and units[13][0] == "model.layers.1.mlp.down_proj"
    assert all(isinstance(m, ActQuantLinear) for _, m in units)
    # embeddings, norms and the head stay outside
    assert not isinstance(model.lm_head, ActQuantLinear)
    assert sum(isinstance(m, ActQuantLinear) for m in model.modules()) == 14
    assert recoverable_units(model, units) == [True] * 14
    # the backend-agnostic control API flips exactly the chosen operators
    set_active_units(model, [1, 12], units)
    assert active_units(model, units) == [1, 12]
    assert [m.bits for _, m in units][:3] == [4, 8, 4]
    # layer units for the same model
    assert [n for n, _ in prepare_act_quant(model, units="layers")] == ["model.layers.0", "model.layers.1"]
    # same outputs as the unconverted model, different gradients
    ids = torch.randint(0, 64, (2, 16))
    out = model(input_ids=ids, labels=ids)
    out_ref = ref(input_ids=ids, labels=ids)
    assert torch.equal(out.logits, out_ref.logits)
    out.loss.backward()
    out_ref.loss.backward()
    w, w_ref = model.model.layers[0].mlp.down_proj.weight.grad, ref.model.layers[0].mlp.down_proj.weight.grad
    assert not torch.equal(w, w_ref)
    torch.testing.assert_close(w, w_ref, rtol=0.5, atol=0.5 * w_ref.abs().max().item())
    torch.testing.assert_close(model.model.embed_tokens.weight.grad, ref.model.embed_tokens.weight.grad,
                               rtol=0.2, atol=1e-3)
    assert saved_activation_bytes(model) > 0
    set_full_precision(model, True)
    model.zero_grad()
    ref.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    ref(input_ids=ids, labels=ids).loss.backward()
    assert torch.equal(model.model.layers[1].self_attn.q_proj.weight.grad, ref.model.layers[1].self_attn.q_proj.weight.grad)


def test_bad_bits():
    with pytest.raises(ValueError, match="low_bits"):
        ActQuantLinear(4, 4, low_bits=9)
    with pytest.raises(ValueError, match="units"):
        prepare_act_quant(_tiny_llama(1), units="blocks")


def test_peft_model_quantises_the_saved_input_of_lora_a():
    """On a LoRA model the trainable gradient is LoRA's: lora_A's weight gradient is computed from the
    quantised projection input (4 bits visibly further from the exact one than 8), lora_B's and the
    forward are the stock ones, and the adapter is unchanged."""
    peft = pytest.importorskip("peft")

    def lora_model():
        torch.manual_seed(3)
        cfg = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                              init_lora_weights=False)
        return peft.get_peft_model(_tiny_llama(2), cfg)

    model, ref = lora_model(), lora_model()
    keys = list(peft.get_peft_model_state_dict(model))
    units = prepare_act_quant(model)
    assert [n for n, _ in units] == [f"base_model.model.model.layers.{i}.{p}" for i in (0, 1)
                                     for p in ("self_attn.q_proj", "self_attn.v_proj", "mlp.down_proj")]
    q = model.base_model.model.model.layers[0].self_attn.q_proj
    assert units[0][1] is q and isinstance(q.lora_A["default"], ActQuantLinear)
    assert type(q.base_layer) is nn.Linear  # the frozen base layer keeps its exact forward
    assert type(model.base_model.model.model.layers[0].self_attn.k_proj) is nn.Linear  # no trainable weight
    assert list(peft.get_peft_model_state_dict(model)) == keys
    assert prepare_act_quant(model) == units  # a second call finds the same units

    ids = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    ref.zero_grad()
    out_ref = ref(input_ids=ids, labels=ids)
    out_ref.loss.backward()
    exact = {n: p.grad.clone() for n, p in ref.named_parameters() if p.requires_grad}
    err = {}
    for bits, active in ((4, []), (8, list(range(len(units))))):
        set_active_units(model, active, units)
        assert active_units(model, units) == active and q.lora_A["default"].bits == bits
        model.zero_grad()
        out = model(input_ids=ids, labels=ids)
        assert torch.equal(out.logits, out_ref.logits)  # the forward is untouched
        out.loss.backward()
        grads = {n: p.grad for n, p in model.named_parameters() if p.requires_grad}
        assert grads.keys() == exact.keys() and all(torch.isfinite(g).all() for g in grads.values())
        a_err = [(grads[n] - exact[n]).norm() / exact[n].norm() for n in exact if "lora_A" in n]
        # lora_B of the last layer sees exact activations and an exact upstream gradient
        last_b = "base_model.model.model.layers.1.mlp.down_proj.lora_B.default.weight"
        torch.testing.assert_close(grads[last_b], exact[last_b], rtol=1e-5, atol=1e-7)
        err[bits] = max(a_err).item()
        assert min(a_err) > 0  # every lora_A gradient changed
    assert err[4] > 0.02 and err[8] < err[4] / 5
    assert saved_activation_bytes(model) > 0
