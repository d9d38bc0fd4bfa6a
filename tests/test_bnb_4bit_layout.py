"""bitsandbytes' CPU inference repacking of 4-bit weights, and why a dual-path layer never repacks.

On a CPU with AVX512-BF16, bitsandbytes 0.50's ``Linear4bit`` repacks its weight at the first eval-mode
forward under ``no_grad`` (BF16 block scales, a BF16 kernel), and the inverse that ``state_dict()`` runs
leaves the block scales transposed when they are not double-quantised. Before the fix, an evaluation
followed by a checkpoint save changed a 4-bit dual-path model's low-cost path for the rest of training,
and the 4-bit equality tests of test_dual_path.py failed or passed depending on their order.
"""

from __future__ import annotations

import pytest
import torch

import gnmr_hf
from tests.test_dual_path import LINEARS, load, wrap

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from gnmr_hf.backends.bnb_4bit import is_repacked, keep_reference_layout  # noqa: E402

HAS_REPACKING = bool(bnb.functional.has_avx512bf16())
needs_repacking_cpu = pytest.mark.skipif(not HAS_REPACKING, reason="bitsandbytes repacks 4-bit weights only on "
                                         "CPUs with AVX512-BF16")


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


def _stock_4bit(path, quant="nf4", double_quant=False):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=quant, bnb_4bit_use_double_quant=double_quant,
                             bnb_4bit_compute_dtype=torch.float32)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=cfg)


def _linear4bit(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _train_mode_logits(model, ids):
    model.train()
    with torch.no_grad():  # train mode: bitsandbytes never repacks here
        return model(ids).logits.clone()


@pytest.mark.parametrize("quant, double_quant", [("nf4", False), ("nf4", True), ("fp4", False)])
def test_4bit_eval_and_checkpoint_leave_the_low_path_unchanged(tiny_llama_dir, ids, quant, double_quant):
    """An evaluation (eval mode, no_grad) and a checkpoint save (state_dict) in the middle of training leave
    the 4-bit dual-path model computing exactly what it computed before, in both modes."""
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, quant, double_quant=double_quant), tiny_llama_dir,
                                          dtype=torch.float32))
    before = _train_mode_logits(dual, ids)
    dual.eval()
    with torch.no_grad():
        evaluated = dual(ids).logits
    dual.state_dict()
    peft.get_peft_model_state_dict(dual)
    after = _train_mode_logits(dual, ids)
    assert not any(is_repacked(m) for m in _linear4bit(dual))
    assert torch.equal(evaluated, before)  # evaluation computes what training computes
    assert torch.equal(after, before)
    gnmr_hf.set_active_units(dual, [1])
    assert not torch.equal(_train_mode_logits(dual, ids), before)  # the comparison can see a change


@needs_repacking_cpu
def test_stock_bitsandbytes_repacking_corrupts_the_weight_at_state_dict(tiny_llama_dir, ids):
    """What the dual path avoids (a canary: if bitsandbytes fixes its inverse, this fails and the
    module docstring of gnmr_hf.backends.bnb_4bit should be revisited)."""
    model = _stock_4bit(tiny_llama_dir)
    before = _train_mode_logits(model, ids)
    model.eval()
    with torch.no_grad():
        model(ids)
    assert all(is_repacked(m) for m in _linear4bit(model))
    model.state_dict()
    assert not any(is_repacked(m) for m in _linear4bit(model))
    assert (_train_mode_logits(model, ids) - before).abs().max() > 1e-3


@needs_repacking_cpu
def test_prepare_dual_path_refuses_a_repacked_layer(tiny_llama_dir, ids):
    model = _stock_4bit(tiny_llama_dir).eval()
    with torch.no_grad():
        model(ids)
    with pytest.raises(ValueError, match=r"model\.layers\.0\.self_attn\.q_proj: .*repacked.*right after from_pretrained"):
        gnmr_hf.prepare_dual_path(model, tiny_llama_dir)
    # every check runs before any layer is converted
    assert not any(isinstance(m, gnmr_hf.backends.base.DualPathModule) for m in model.modules())
    with pytest.raises(ValueError, match="repacked"):
        keep_reference_layout(model)


def test_keep_reference_layout_on_a_stock_model(tiny_llama_dir, ids):
    model = _stock_4bit(tiny_llama_dir)
    n = keep_reference_layout(model)
    assert n == len(_linear4bit(model)) == 4 * len(LINEARS)
    before = _train_mode_logits(model, ids)
    model.eval()
    with torch.no_grad():
        evaluated = model(ids).logits
    model.state_dict()
    assert not any(is_repacked(m) for m in _linear4bit(model))
    assert torch.equal(evaluated, before) and torch.equal(_train_mode_logits(model, ids), before)


def test_order_of_the_4bit_equality_checks_does_not_matter(tiny_llama_dir, ids):
    """The sequence that made main's CI red: a stock-equality check in eval mode, a state_dict read (PEFT's
    adapter copy), then the hybrid comparison, on one prepared model."""
    dual = wrap(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), tiny_llama_dir, dtype=torch.float32))
    dual.eval()
    with torch.no_grad():
        first = dual(ids).logits
    peft.get_peft_model_state_dict(dual)
    with torch.no_grad():
        assert torch.equal(dual(ids).logits, first)
