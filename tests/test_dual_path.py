"""The dual-path layers (INT8, NF4 and FP4 low paths) on a tiny random LLaMA: real bitsandbytes, real PEFT, on CPU.

The stock 4-bit references compute with bitsandbytes' reference de-quantise + matmul in eval mode as in
training (``keep_reference_layout``), as a dual-path layer always does; the tests at the end of the file
show why: on an AVX512-BF16 CPU bitsandbytes otherwise repacks the weight at the first eval-mode forward
and its unpacking (at ``state_dict()``) corrupts it, which made these comparisons depend on test order.

References are built independently with stock libraries: the BF16 (or FP32) model read from the same
checkpoint with stock PEFT for the recovery path, stock PEFT over a stock bnb INT8 / 4-bit load for the
low-cost path, and a hybrid of the two stock models for a mix. The tests on the ``fp32`` fixture run
for every low path; the FP4 ones are in the slow tier (the same code as NF4, another bnb code book). The exactness checks run in FP32 (the checkpoint's BF16
values upcast), where both of PEFT's LoRA layer classes add the LoRA output without an extra rounding;
the BF16 check allows for the one BF16 rounding in which PEFT's bnb and plain LoRA layers differ.
"""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import gnmr_hf
from tests.conftest import make_tiny_llama

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from gnmr_hf.backends.bnb_4bit import DualPathLinear4bit  # noqa: E402
from gnmr_hf.backends.bnb_int8 import DualPathLinear8bitLt  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_LAYERS = 4
LOW_PATHS = ["int8", "nf4", pytest.param("fp4", marks=pytest.mark.slow)]
DUAL_TYPES = {"int8": DualPathLinear8bitLt, "nf4": DualPathLinear4bit, "fp4": DualPathLinear4bit}


def load(path, quant: bool | str | None, dtype=torch.float32, double_quant: bool = False):
    """The checkpoint at ``path``: unquantised (``quant`` None/False), INT8 (True or ``"int8"``) or 4-bit
    (``"nf4"``/``"fp4"``, computing in ``dtype``)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {}
    if quant is True or quant == "int8":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    elif quant:
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double_quant,
            bnb_4bit_compute_dtype=dtype,
        )
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    if quant and quant not in (True, "int8"):
        # bitsandbytes' reference de-quantise + matmul in eval mode too, as a dual-path layer computes
        # (not its CPU inference repacking: see test_4bit_eval_and_checkpoint_leave_the_low_path_unchanged)
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        keep_reference_layout(model)
    return model.eval()


def lora_config(**kw):
    # init_lora_weights=False: B is random too, so LoRA really changes the output
    return peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False, **kw)


def wrap(model, seed=0, **kw):
    torch.manual_seed(seed)
    return peft.get_peft_model(model, lora_config(**kw))


def copy_lora(dst, src):
    sd = peft.get_peft_model_state_dict(src)
    res = peft.set_peft_model_state_dict(dst, sd)
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


@pytest.fixture(scope="module", params=LOW_PATHS)
def fp32(request, tiny_llama_dir):
    """Dual-path model (on the low path ``request.param``) and the stock references (FP32 model, the same
    low path), all computing in FP32 with one set of LoRA weights."""
    low = request.param
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low), tiny_llama_dir, dtype=torch.float32))
    dual.low_path = low  # for the tests' own bookkeeping
    ref_bf = copy_lora(wrap(load(tiny_llama_dir, False), seed=5), dual)
    ref_low = copy_lora(wrap(load(tiny_llama_dir, low), seed=6), dual)
    return dual, ref_bf, ref_low


def test_plain_get_peft_model_wraps_dual_path_with_stock_bnb_lora(fp32):
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit
    from peft.tuners.lora.bnb import Linear8bitLt as LoraLinear8bitLt

    dual, _, _ = fp32
    lora_type = LoraLinear8bitLt if dual.low_path == "int8" else LoraLinear4bit
    for i, layer in enumerate(layers(dual)):
        for name, m in layer.named_modules():
            if name.split(".")[-1] in LINEARS:
                assert type(m) is lora_type, name
                assert type(m.base_layer) is DUAL_TYPES[dual.low_path]
                assert m.base_layer.recovery_key == f"model.layers.{i}.{name}.weight"
                # the quantised weight was kept
                if dual.low_path == "int8":
                    assert m.base_layer.weight.dtype == torch.int8
                else:
                    assert m.base_layer.weight.dtype == torch.uint8
                    assert m.base_layer.weight.quant_type == dual.low_path
    assert gnmr_hf.recoverable_units(dual) == [True] * NUM_LAYERS
    assert gnmr_hf.active_units(dual) == []


def test_all_promoted_is_the_bf16_checkpoint_model(fp32, ids):
    dual, ref_bf, ref_low = fp32
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
    assert (want - logits(ref_low, ids)).abs().max() > 1e-3  # the low path differs from BF16
    torch.testing.assert_close(got_base, want_base, rtol=0, atol=1e-6)
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_none_promoted_is_stock_peft_over_the_stock_low_path(fp32, ids):
    dual, _, ref_low = fp32
    gnmr_hf.set_active_units(dual, [])
    assert torch.equal(logits(dual, ids), logits(ref_low, ids))


def test_mix_is_the_hybrid_of_the_stock_models(fp32, tiny_llama_dir, ids):
    dual, ref_bf, ref_low = fp32
    promoted = [0, 2]
    hybrid = copy_lora(wrap(load(tiny_llama_dir, dual.low_path), seed=7), dual)
    bf_layers = copy_lora(wrap(load(tiny_llama_dir, False), seed=8), dual)
    for i in promoted:  # stock BF16 decoder layers (with their stock LoRA) inside a stock low-path model
        layers(hybrid)[i] = layers(bf_layers)[i]
    gnmr_hf.set_active_units(dual, promoted)
    try:
        assert gnmr_hf.active_units(dual) == promoted
        got = logits(dual, ids)
    finally:
        gnmr_hf.set_active_units(dual, [])
    torch.testing.assert_close(got, logits(hybrid, ids), rtol=0, atol=1e-5)
    assert (got - logits(ref_bf, ids)).abs().max() > 1e-3
    assert (got - logits(ref_low, ids)).abs().max() > 1e-3


@pytest.mark.parametrize("low, double_quant", [("int8", False), ("nf4", True)])
def test_bf16_compute_all_promoted_matches_bf16_model(tiny_llama_dir, ids, low, double_quant):
    """The paper's setting, BF16 activations (for NF4, the QLoRA setting: BF16 compute and double
    quantisation). None promoted is the stock model. PEFT's bnb LoRA layers round their LoRA output to
    BF16 before the add where PEFT's plain LoRA layer adds in FP32, so end to end the logits agree to a
    few BF16 ulps; one layer agrees exactly with that rounding written out by hand."""
    quantised = [load(tiny_llama_dir, low, torch.bfloat16, double_quant=double_quant) for _ in range(2)]
    dual = wrap(gnmr_hf.prepare_dual_path(quantised[0], tiny_llama_dir))
    if double_quant:
        assert layers(dual)[0].mlp.up_proj.base_layer.weight.compress_statistics
    stock = copy_lora(wrap(quantised[1], seed=2), dual)
    ref_bf = copy_lora(wrap(load(tiny_llama_dir, False, torch.bfloat16), seed=3), dual)
    assert torch.equal(logits(dual, ids), logits(stock, ids))
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    got = logits(dual, ids)
    with dual.disable_adapter():
        got_base = logits(dual, ids)
    want = logits(ref_bf, ids)
    with ref_bf.disable_adapter():
        want_base = logits(ref_bf, ids)
    assert torch.equal(got_base, want_base)  # the base path itself is exact
    assert (want - want_base).abs().max() > 0.05 and (want - logits(stock, ids)).abs().max() > 0.01
    ulp = 2.0 ** (torch.floor(torch.log2(want.abs().max())) - 7)
    assert (got - want).abs().max() <= 4 * ulp

    layer = layers(dual)[1].mlp.down_proj
    x = torch.randn(3, 5, layer.in_features, generator=torch.Generator().manual_seed(2)).to(torch.bfloat16)
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.1.mlp.down_proj.weight")
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    by_hand = x @ w.T + ((x.float() @ a.T @ b.T) * layer.scaling["default"]).to(torch.bfloat16)
    with torch.no_grad():
        assert torch.equal(layer(x), by_hand)
    gnmr_hf.set_active_units(dual, [])
    with torch.no_grad():
        assert not torch.equal(layer(x), by_hand)


def _lora_grads(pm):
    return {n: p.grad.detach().clone() for n, p in pm.named_parameters() if p.requires_grad}


def _loss_backward(pm, ids):
    pm.zero_grad(set_to_none=True)
    out = pm(ids, labels=ids)
    out.loss.backward()
    return out.loss.detach()


def test_gradients_reach_lora_on_both_paths(fp32, ids):
    dual, ref_bf, ref_low = fp32
    trainable = [n for n, p in dual.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)  # base weights stay frozen
    low_before = layers(dual)[0].self_attn.q_proj.base_layer.weight.detach().clone()
    grads = {}
    for active, ref in ((list(range(NUM_LAYERS)), ref_bf), ([], ref_low)):
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
    # the two paths give different gradients, so the two comparisons above compare different things
    assert max((grads[0][n] - grads[NUM_LAYERS][n]).abs().max() for n in trainable) > 1e-4
    gnmr_hf.set_active_units(dual, [])
    dual.zero_grad(set_to_none=True)
    ref_bf.zero_grad(set_to_none=True)
    ref_low.zero_grad(set_to_none=True)
    assert torch.equal(layers(dual)[0].self_attn.q_proj.base_layer.weight, low_before)


def test_switching_leaves_lora_and_adamw_state_untouched(tiny_llama_dir, ids):
    pm = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, True), tiny_llama_dir, dtype=torch.float32))
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=1e-2)
    for active in ([], [1, 3]):
        gnmr_hf.set_active_units(pm, active)
        _loss_backward(pm, ids)
        opt.step()
    named = dict(pm.named_parameters())
    values = {n: p.detach().clone() for n, p in named.items()}
    state = {id(p): {k: v.clone() for k, v in opt.state[p].items()} for p in params}
    keys = list(pm.state_dict())
    for active in ([0], [0, 1, 2, 3], [2], []):
        gnmr_hf.set_active_units(pm, active)
        assert gnmr_hf.active_units(pm) == active
        assert [p for p in pm.parameters() if p.requires_grad] == params  # same tensor objects
        assert list(pm.state_dict()) == keys  # recovery weights never enter the state dict
        assert opt.param_groups[0]["params"] == params
        for n, p in pm.named_parameters():
            assert p is named[n] and torch.equal(p, values[n]), n
        for p in params:
            for k, v in opt.state[p].items():
                assert torch.equal(v, state[id(p)][k])
    assert any(s["exp_avg"].abs().sum() > 0 for s in opt.state.values())  # the state compared is real


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_gradient_checkpointing_gives_the_same_gradients(tiny_llama_dir, ids, use_reentrant):
    pms = []
    for gc in (False, True):
        pm = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, True), tiny_llama_dir, dtype=torch.float32))
        if gc:
            pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": use_reentrant})
            pm.enable_input_require_grads()
        pm.train()
        gnmr_hf.set_active_units(pm, [1, 2])
        pms.append(pm)
    assert pms[1].base_model.model.model.gradient_checkpointing
    loss = [_loss_backward(pm, ids) for pm in pms]
    assert torch.equal(loss[0], loss[1])
    g0, g1 = _lora_grads(pms[0]), _lora_grads(pms[1])
    assert g0.keys() == g1.keys()
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-5, atol=1e-7)
    assert any(g.abs().sum() > 0 for g in g0.values())


def test_switch_between_forward_and_backward_is_caught_by_nonreentrant_checkpointing(tiny_llama_dir, ids):
    from torch.utils.checkpoint import CheckpointError

    pm = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, True), tiny_llama_dir, dtype=torch.float32))
    pm.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    pm.enable_input_require_grads()
    pm.train()
    out = pm(ids, labels=ids)
    gnmr_hf.set_active_units(pm, [1])  # misuse: paths must only change between steps
    with pytest.raises(CheckpointError):
        out.loss.backward()


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


@pytest.mark.parametrize("low", LOW_PATHS)
def test_host_storage_counts_exactly_the_promoted_layers(tiny_llama_dir, low):
    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low, torch.bfloat16), tiny_llama_dir, storage="host")
    per_layer = [layer_bf16_bytes(tiny_llama_dir, i) for i in range(NUM_LAYERS)]
    # q, o: 64x64; k, v: 32x64 (2 KV heads of 16); gate, up, down: 128x64; BF16 = 2 bytes
    assert per_layer == [2 * (2 * 64 * 64 + 2 * 32 * 64 + 3 * 128 * 64)] * NUM_LAYERS
    assert gnmr_hf.recovery_device_bytes(model) == 0
    for active in ([1], [0, 3], [0, 1, 2, 3], [2], []):
        gnmr_hf.set_active_units(model, active)
        assert gnmr_hf.recovery_device_bytes(model) == sum(per_layer[i] for i in active)
    mods = [m for m in model.modules() if isinstance(m, DUAL_TYPES[low])]
    assert len(mods) == NUM_LAYERS * len(LINEARS)
    assert all(m._gnmr_weight is None for m in mods)  # the device copies were dropped


@pytest.mark.parametrize("low", LOW_PATHS)
def test_device_storage_is_constant(tiny_llama_dir, low):
    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low, torch.bfloat16), tiny_llama_dir, storage="device")
    total = sum(layer_bf16_bytes(tiny_llama_dir, i) for i in range(NUM_LAYERS))
    for active in ([], [1], [0, 1, 2, 3], []):
        gnmr_hf.set_active_units(model, active)
        assert gnmr_hf.recovery_device_bytes(model) == total


def test_disk_storage_reads_the_file_at_promotion(tiny_llama_dir, tmp_path, ids):
    ckpt = tmp_path / "ckpt"
    shutil.copytree(tiny_llama_dir, ckpt)
    disk = gnmr_hf.prepare_dual_path(load(ckpt, True, torch.bfloat16), ckpt, storage="disk")
    host = gnmr_hf.prepare_dual_path(load(ckpt, True, torch.bfloat16), ckpt, storage="host")
    # rewrite the checkpoint after prepare: "disk" must see the new values, "host" keeps its copy
    sd = load_file(str(ckpt / "model.safetensors"))
    key = "model.layers.1.self_attn.q_proj.weight"
    original = sd[key].clone()
    sd[key] = sd[key] * 2
    save_file(sd, str(ckpt / "model.safetensors"), metadata={"format": "pt"})
    for model in (disk, host):
        gnmr_hf.set_active_units(model, [1])
        assert gnmr_hf.recovery_device_bytes(model) == layer_bf16_bytes(ckpt, 1)
    assert torch.equal(disk.model.layers[1].self_attn.q_proj._gnmr_weight, original * 2)
    assert torch.equal(host.model.layers[1].self_attn.q_proj._gnmr_weight, original)
    assert not torch.equal(logits(disk, ids), logits(host, ids))
    for model in (disk, host):
        gnmr_hf.set_active_units(model, [])
        assert gnmr_hf.recovery_device_bytes(model) == 0
    assert disk.model.layers[1].self_attn.q_proj._gnmr_weight is None


# ---------------------------------------------------------------- name mapping: bias, prefixes, PEFT


def test_bias_and_other_checkpoint_prefixes(tmp_path, ids):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, attention_bias=True, mlp_bias=True)
    src = tmp_path / "bias"
    m = LlamaForCausalLM(cfg).to(torch.bfloat16)
    for p in m.parameters():  # biases are zero at init: make them matter
        torch.nn.init.normal_(p, std=0.05)
    m.save_pretrained(src)
    sd = load_file(str(src / "model.safetensors"))
    # the same tensors saved from the bare backbone ("layers.0...") and under an extra prefix
    bare = tmp_path / "bare.safetensors"
    save_file({k[len("model."):]: v for k, v in sd.items() if k.startswith("model.")}, str(bare))
    extra = tmp_path / "extra.safetensors"
    save_file({"base_model.model." + k: v for k, v in sd.items()}, str(extra))
    ref = load(src, False)
    want = logits(ref, ids)
    for source in (src, bare, extra):
        model = gnmr_hf.prepare_dual_path(load(src, True), source, dtype=torch.float32)
        low = logits(model, ids)
        gnmr_hf.set_active_units(model, [0, 1])
        assert torch.equal(logits(model, ids), want), source
        assert not torch.equal(low, want)  # the INT8 path differs, so the equality above means something
    assert model.model.layers[0].mlp.up_proj.bias is not None


def test_prepare_after_get_peft_model(fp32, tiny_llama_dir, ids):
    dual, _, ref_low = fp32
    late = copy_lora(wrap(load(tiny_llama_dir, dual.low_path), seed=9), dual)
    gnmr_hf.prepare_dual_path(late, tiny_llama_dir, dtype=torch.float32)
    q = layers(late)[2].self_attn.q_proj.base_layer
    assert isinstance(q, DUAL_TYPES[dual.low_path]) and q.recovery_key == "model.layers.2.self_attn.q_proj.weight"
    assert torch.equal(logits(late, ids), logits(ref_low, ids))
    gnmr_hf.set_active_units(late, range(NUM_LAYERS))
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    try:
        assert torch.equal(logits(late, ids), logits(dual, ids))
    finally:
        gnmr_hf.set_active_units(dual, [])


# ---------------------------------------------------------------- the adapter is a stock PEFT adapter


def test_adapter_round_trip_on_bf16_and_low_path_bases(fp32, tiny_llama_dir, tmp_path, ids):
    dual, _, ref_low = fp32
    gnmr_hf.set_active_units(dual, [0, 3])  # saving does not depend on the current paths
    dual.save_pretrained(tmp_path / "dual")
    ref_low.save_pretrained(tmp_path / "stock")
    a, b = (load_file(str(tmp_path / d / "adapter_model.safetensors")) for d in ("dual", "stock"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    cfg = json.loads((tmp_path / "dual" / "adapter_config.json").read_text())
    assert "gnmr" not in json.dumps(cfg).lower() and cfg["use_dora"] is False
    gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
    high = logits(dual, ids)
    gnmr_hf.set_active_units(dual, [])
    low = logits(dual, ids)
    on_bf16 = peft.PeftModel.from_pretrained(load(tiny_llama_dir, False), tmp_path / "dual")
    on_low = peft.PeftModel.from_pretrained(load(tiny_llama_dir, dual.low_path), tmp_path / "dual")
    assert not any(isinstance(m, DUAL_TYPES[dual.low_path]) for m in on_low.modules())
    torch.testing.assert_close(logits(on_bf16, ids), high, rtol=0, atol=1e-5)
    assert torch.equal(logits(on_low, ids), low)
    assert (high - low).abs().max() > 1e-3


# ---------------------------------------------------------------- merging and DoRA are refused


def test_merge_is_refused_and_the_advised_merge_works(fp32, tiny_llama_dir, tmp_path, ids):
    dual, _, _ = fp32
    gnmr_hf.set_active_units(dual, [2])
    before = logits(dual, ids)
    for merge in (dual.merge_adapter, dual.merge_and_unload, lambda: dual.merge_and_unload(safe_merge=True)):
        with pytest.warns(UserWarning), pytest.raises(ValueError, match=r"(?s)cannot be replaced.*merge_and_unload"
                                                      r".*PeftModel\.from_pretrained"):
            merge()
        assert not any(getattr(m, "merged_adapters", []) for m in dual.modules())
    assert isinstance(layers(dual)[2].mlp.up_proj.base_layer, DUAL_TYPES[dual.low_path])
    try:
        assert torch.equal(logits(dual, ids), before)  # nothing was changed by the refused merges
        gnmr_hf.set_active_units(dual, range(NUM_LAYERS))
        high = logits(dual, ids)
    finally:
        gnmr_hf.set_active_units(dual, [])
    # what the message advises: the adapter merged on a stock base is the all-promoted model
    dual.save_pretrained(tmp_path / "adapter")
    merged = peft.PeftModel.from_pretrained(load(tiny_llama_dir, False), tmp_path / "adapter").merge_and_unload()
    assert not any("lora" in n for n, _ in merged.named_modules())
    torch.testing.assert_close(logits(merged, ids), high, rtol=0, atol=1e-4)


@pytest.mark.parametrize("low", LOW_PATHS)
def test_dora_is_refused(tiny_llama_dir, low):
    torch.manual_seed(0)
    cfg = peft.LoraConfig(r=4, target_modules=LINEARS, use_dora=True)
    dora = peft.get_peft_model(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low), tiny_llama_dir), cfg)
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.q_proj: DoRA .*\(use_dora=False\)"):
        gnmr_hf.set_active_units(dora, [0])
    with pytest.raises(ValueError, match="DoRA"):
        gnmr_hf.recoverable_units(dora)  # what the callback calls when it sets up
    assert gnmr_hf.active_units(dora) == []
    late = peft.get_peft_model(load(tiny_llama_dir, low), cfg)  # PEFT first, then prepare
    with pytest.raises(ValueError, match="DoRA"):
        gnmr_hf.prepare_dual_path(late, tiny_llama_dir)
    assert not any(isinstance(m, DUAL_TYPES[low]) for m in late.modules())  # refused before converting


# ---------------------------------------------------------------- clear errors


def test_errors(tiny_llama_dir, tmp_path):
    dual = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, True), tiny_llama_dir)
    # every check runs before anything is changed, so one model serves for every bad call
    with pytest.raises(ValueError, match="storage must be one of"):
        gnmr_hf.prepare_dual_path(dual, tiny_llama_dir, storage="gpu")
    with pytest.raises(ValueError, match=r"found no layer.*\{'Linear': 29\}.*Supported: bitsandbytes\.Linear8bitLt"):
        gnmr_hf.prepare_dual_path(load(tiny_llama_dir, False), tiny_llama_dir)  # 4 x 7 projections + lm_head
    from gnmr_hf.backends import bnb_int8

    with pytest.raises(ValueError, match=r"no bitsandbytes Linear8bitLt .*\['Linear'\].*load_in_8bit=True"):
        bnb_int8.prepare_dual_path(load(tiny_llama_dir, False), tiny_llama_dir)
    with pytest.raises(ValueError, match="dtype must be a floating-point"):
        gnmr_hf.prepare_dual_path(dual, tiny_llama_dir, dtype=torch.int8)
    other = make_tiny_llama(tmp_path / "other", num_layers=NUM_LAYERS, hidden=32)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.self_attn\.q_proj\.weight'.*shape \[32, 32\]"):
        gnmr_hf.prepare_dual_path(dual, other)
    sd = load_file(str(tiny_llama_dir / "model.safetensors"))
    del sd["model.layers.2.mlp.up_proj.weight"]
    missing = tmp_path / "missing.safetensors"
    save_file(sd, str(missing))
    with pytest.raises(ValueError, match=r"no tensor for model\.layers\.2\.mlp\.up_proj\.weight"):
        gnmr_hf.prepare_dual_path(dual, missing)
    with pytest.raises(FileNotFoundError, match="does not exist"):
        gnmr_hf.prepare_dual_path(dual, tmp_path / "nowhere")
    with pytest.raises(FileNotFoundError, match="local Hugging Face cache"):
        gnmr_hf.prepare_dual_path(dual, "gnmr-hf-test/not-a-cached-model")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match="no .safetensors"):
        gnmr_hf.prepare_dual_path(dual, tmp_path / "empty")
    with pytest.raises(IndexError, match="out of range"):
        gnmr_hf.set_active_units(dual, [NUM_LAYERS])
    assert gnmr_hf.active_units(dual) == []


# ---------------------------------------------------------------- GPU (side-stream copies)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("storage", ["host", "disk", "device"])
@pytest.mark.parametrize("low", ["int8", "nf4"])
def test_gpu_promotion_copies_on_a_side_stream(tiny_llama_dir, ids, storage, low):
    dev = torch.device("cuda", torch.cuda.current_device())
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if low == "int8":
        quant = BitsAndBytesConfig(load_in_8bit=True)
    else:
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=low, bnb_4bit_compute_dtype=torch.bfloat16)
    model = AutoModelForCausalLM.from_pretrained(
        tiny_llama_dir, quantization_config=quant, dtype=torch.bfloat16, device_map={"": dev.index}
    ).eval()
    model = gnmr_hf.prepare_dual_path(model, tiny_llama_dir, storage=storage)
    assert isinstance(model.model.layers[0].self_attn.q_proj, DUAL_TYPES[low])
    ref = load(tiny_llama_dir, False, torch.bfloat16).to(dev)
    q = model.model.layers[0].self_attn.q_proj
    if storage == "host":
        assert q._gnmr_source.stored.is_pinned()
    before = torch.cuda.memory_allocated(dev)
    gnmr_hf.set_active_units(model, range(NUM_LAYERS))
    assert q._gnmr_weight.device == dev
    got = logits(model, ids.to(dev))
    torch.cuda.synchronize(dev)
    assert torch.equal(got, logits(ref, ids.to(dev)))
    promoted = gnmr_hf.recovery_device_bytes(model)
    assert promoted == sum(layer_bf16_bytes(tiny_llama_dir, i) for i in range(NUM_LAYERS))
    if storage != "device":
        assert torch.cuda.memory_allocated(dev) - before >= promoted
    gnmr_hf.set_active_units(model, [])
    torch.cuda.synchronize(dev)
    assert gnmr_hf.recovery_device_bytes(model) == (promoted if storage == "device" else 0)


def test_units_of_another_model_are_refused(tiny_llama_dir, ids):
    """Units resolved from one model, handed with another (the same checkpoint loaded twice), would switch
    the first model's layers and leave the second on the low path without a word: refused instead."""
    from gnmr_hf.units import resolve_units

    first = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), tiny_llama_dir, dtype=torch.float32)
    second = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), tiny_llama_dir, dtype=torch.float32)
    stale = resolve_units(first)
    low = logits(second, ids)
    for call in (lambda: gnmr_hf.set_active_units(second, range(NUM_LAYERS), stale),
                 lambda: gnmr_hf.active_units(second, stale)):
        with pytest.raises(ValueError, match=f"{NUM_LAYERS} of {NUM_LAYERS} units given .* not modules of this model"):
            call()
    assert gnmr_hf.active_units(first) == []  # the refused call switched nothing on the other model either
    own = resolve_units(second)
    gnmr_hf.set_active_units(second, range(NUM_LAYERS), own)
    assert gnmr_hf.active_units(second, own) == list(range(NUM_LAYERS))
    assert (logits(second, ids) - low).abs().max() > 1e-3  # its own units did switch it to BF16
