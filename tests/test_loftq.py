"""LoftQ on a CPU (gnmr_hf.loftq): PEFT's own LoftQ with one line changed."""

from __future__ import annotations

import difflib

import pytest
import torch

from tests.test_dual_path import LINEARS, load, logits

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from gnmr_hf import loftq  # noqa: E402


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _qlora(path, rank=4, alpha=None):
    model = load(path, "nf4")  # FP32 compute, bitsandbytes' reference layout
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=LINEARS)  # default scaling 1
    return peft.get_peft_model(model, cfg)


def test_the_patch_changes_exactly_the_compute_device_line():
    original, patched = loftq.patched_source()
    changed = [ln for ln in difflib.ndiff(original.splitlines(), patched.splitlines()) if ln[:2] in ("- ", "+ ")]
    assert [ln[2:].strip() for ln in changed] == [loftq.CUDA_LINE, loftq.CPU_LINE]


def test_stock_peft_loftq_needs_an_accelerator(tiny_llama_dir):
    if torch.cuda.is_available():
        pytest.skip("an accelerator is present")
    from peft import replace_lora_weights_loftq

    with pytest.raises((RuntimeError, AssertionError), match="(?i)cuda|nvidia|torch not compiled"):
        replace_lora_weights_loftq(_qlora(tiny_llama_dir), model_path=str(tiny_llama_dir))


def test_loftq_init_is_the_svd_of_the_quantisation_residual(tiny_llama_dir):
    from safetensors import safe_open

    model = loftq.replace_lora_weights_loftq(_qlora(tiny_llama_dir, rank=4), tiny_llama_dir)
    layer = model.base_model.model.model.layers[2].mlp.down_proj
    with safe_open(str(tiny_llama_dir / "model.safetensors"), framework="pt") as f:
        w = f.get_tensor("model.layers.2.mlp.down_proj.weight").float()
    residual = w - bnb.functional.dequantize_4bit(layer.base_layer.weight.data, layer.base_layer.weight.quant_state)
    u, s, vh = torch.linalg.svd(residual, full_matrices=False)  # by hand: B = U sqrt(S), A = sqrt(S) Vh, rank 4
    b_want, a_want = u[:, :4] * s[:4].sqrt(), s[:4].sqrt()[:, None] * vh[:4]
    a, b = layer.lora_A["default"].weight, layer.lora_B["default"].weight
    torch.testing.assert_close(b @ a, b_want @ a_want, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.abs(), a_want.abs(), rtol=1e-3, atol=1e-5)  # singular vectors up to sign
    assert (b @ a).abs().max() > 1e-3  # the correction is not zero


def test_loftq_adapter_brings_the_4bit_model_closer_to_bf16(tiny_llama_dir, ids):
    reference = logits(load(tiny_llama_dir, False), ids)
    plain = _qlora(tiny_llama_dir, rank=8)  # B = 0: the 4-bit model itself
    plain_err = (logits(plain, ids) - reference).pow(2).mean()
    from peft.utils import loftq_utils

    stock = loftq_utils._loftq_init_new
    init = loftq.replace_lora_weights_loftq(_qlora(tiny_llama_dir, rank=8), tiny_llama_dir)
    loftq_err = (logits(init, ids) - reference).pow(2).mean()
    assert loftq_err < 0.8 * plain_err, (float(loftq_err), float(plain_err))
    assert loftq_utils._loftq_init_new is stock  # PEFT's module is its own again afterwards


@pytest.mark.parametrize("account", [True, False])
def test_scaling_is_accounted_for(tiny_llama_dir, account):
    plain = loftq.replace_lora_weights_loftq(_qlora(tiny_llama_dir, rank=4), tiny_llama_dir)
    scaled = loftq.replace_lora_weights_loftq(_qlora(tiny_llama_dir, rank=4, alpha=8), tiny_llama_dir,
                                                 account_for_scaling=account)

    def delta(m):  # what the adapter adds to the weight: scaling * B A
        layer = m.base_model.model.model.layers[1].self_attn.v_proj
        return layer.scaling["default"] * layer.lora_B["default"].weight @ layer.lora_A["default"].weight

    want = delta(plain) if account else 2 * delta(plain)  # scaling 2 without the correction
    torch.testing.assert_close(delta(scaled), want, rtol=1e-4, atol=1e-6)


@pytest.mark.parametrize("name", ["model.layers.1.self_attn.v_proj",  # the stock name (a plan's modules)
                                  "base_model.model.model.layers.1.self_attn.v_proj",  # PEFT's, resolve_units'
                                  "layers.1.self_attn.v_proj"])  # the short unit name
def test_skip_keeps_the_named_pairs_and_only_those(tiny_llama_dir, name):
    torch.manual_seed(0)
    model = _qlora(tiny_llama_dir, rank=4)
    layers = model.base_model.model.model.layers

    def pair(m):
        return m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone()

    before = {n: pair(getattr(layers[i].self_attn, op)) for n, i, op in
              (("v1", 1, "v_proj"), ("k1", 1, "k_proj"), ("v3", 3, "v_proj"))}
    loftq.replace_lora_weights_loftq(model, tiny_llama_dir, skip=[name])
    a, b = pair(layers[1].self_attn.v_proj)
    assert torch.equal(a, before["v1"][0]) and torch.equal(b, before["v1"][1])  # kept: B still 0
    assert not torch.equal(pair(layers[1].self_attn.k_proj)[1], before["k1"][1])  # LoftQ'd
    # layers.3 does not match the name of layers.1, nor would layers.11 (a dot boundary)
    assert not torch.equal(pair(layers[3].self_attn.v_proj)[1], before["v3"][1])


def test_skip_keeps_the_pairs_bit_identical_under_the_recipes_scaling(tiny_llama_dir):
    # the recipes' LoRA: r 8, alpha 16 (scaling 2): a skipped pair must not be divided by sqrt(2)
    torch.manual_seed(0)
    model = _qlora(tiny_llama_dir, rank=8, alpha=16)
    layers = model.base_model.model.model.layers
    skipped = [layers[0].self_attn.v_proj, layers[2].mlp.down_proj]

    def pair(m):
        return m.lora_A["default"].weight.detach().clone(), m.lora_B["default"].weight.detach().clone()

    before = {id(m): pair(m) for m in model.modules() if isinstance(m, peft.tuners.lora.Linear4bit)}
    loftq.replace_lora_weights_loftq(model, tiny_llama_dir, skip=["model.layers.0.self_attn.v_proj",
                                                                  "model.layers.2.mlp.down_proj"])
    for m in skipped:
        a, b = pair(m)
        assert torch.equal(a, before[id(m)][0]) and torch.equal(b, before[id(m)][1])
    replaced = loftq.replaced_pairs(model, before)
    assert len(replaced) == len(before) - 2 and not any(m in replaced for m in skipped)
    # a replaced pair carries the residual with the scaling accounted for: A was divided by sqrt(2)
    m = layers[1].self_attn.q_proj
    assert m in replaced and not torch.equal(pair(m)[0], before[id(m)][0])


# issue 26 item 12: LoftQ on bad input refuses in one line before anything changes
def _lora_state(model):
    return {k: v.clone() for k, v in model.state_dict().items() if "lora_" in k}


def test_a_rank_above_a_linears_smaller_dimension_is_refused(tiny_llama_dir):
    model = _qlora(tiny_llama_dir, rank=48)  # k_proj / v_proj are 32 x 64 here (2 KV heads of 16)
    before = _lora_state(model)
    with pytest.raises(ValueError, match=r"rank r=48 is above the smaller dimension of .*k_proj \(32 x 64\)"):
        loftq.replace_lora_weights_loftq(model, tiny_llama_dir, progress=False)
    after = _lora_state(model)
    assert all(torch.equal(before[k], after[k]) for k in before)  # nothing changed


def test_a_model_without_lora_is_refused(tiny_llama_dir):
    with pytest.raises(ValueError, match="needs a PEFT model with LoRA on its 4-bit linears .*got LlamaForCausalLM"):
        loftq.replace_lora_weights_loftq(load(tiny_llama_dir, "nf4"), tiny_llama_dir, progress=False)
    bf16 = peft.get_peft_model(load(tiny_llama_dir, None), peft.LoraConfig(r=4, target_modules=LINEARS))
    with pytest.raises(ValueError, match="no LoRA adapter 'default' on a bitsandbytes 4-bit linear"):
        loftq.replace_lora_weights_loftq(bf16, tiny_llama_dir, progress=False)


def test_another_checkpoint_is_refused(tiny_llama_dir, tmp_path):
    from tests.conftest import make_tiny_llama

    other = make_tiny_llama(tmp_path / "other", seed=5)
    model = _qlora(tiny_llama_dir)
    with pytest.raises(ValueError, match=r"is not the checkpoint this model was quantised from: .*q_proj's 4-bit weight "
                                         r"differs from its weight there by 1\.\d+ of its norm"):
        loftq.replace_lora_weights_loftq(model, other, progress=False)
    with pytest.raises(ValueError, match="holds no .safetensors file"):
        loftq.replace_lora_weights_loftq(model, tmp_path, progress=False)


def test_loftq_shows_progress(tiny_llama_dir, capsys):
    model = _qlora(tiny_llama_dir)
    loftq.replace_lora_weights_loftq(model, tiny_llama_dir)
    err = capsys.readouterr().err
    assert "LoftQ" in err and "28/28" in err  # 4 layers x 7 linears
