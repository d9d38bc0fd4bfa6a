"""The INT8 rung of the dual path (``prepare_dual_path(..., rungs={name: "int8"})``): a unit's path is one of
low (NF4), INT8 (the checkpoint weight quantised row-wise by bitsandbytes) or BF16. Checked against stock
bitsandbytes ``Linear8bitLt`` (a real ``load_in_8bit`` model), ``load_planned``, exact bytes, refusals and a
real Trainer run under a planned policy."""

from __future__ import annotations

import json

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import gnmr_hf  # noqa: E402
from gnmr_hf.planning import ladder  # noqa: E402
from gnmr_hf.units import find_linear_units, short_name  # noqa: E402
from tests.test_dual_path import load, logits  # noqa: E402
from tests.test_ladder import RUNGS, _stock  # noqa: E402

V = "model.layers.0.self_attn.v_proj"


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(11))


def _dual(path, rungs):
    return gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears",
                                     dtype=torch.float32, rungs=rungs)


def _unit_index(model, full_name):
    names = [short_name(n) for n, _ in find_linear_units(model)]
    return names.index(full_name.removeprefix("model."))


def test_the_int8_rung_computes_what_a_stock_load_in_8bit_layer_computes(tiny_llama_dir):
    dual = _dual(tiny_llama_dir, {V: "int8"})
    m = dict(dual.named_modules())[V]
    stock8 = dict(_stock(tiny_llama_dir, "int8").named_modules())[V]  # transformers' own load_in_8bit
    assert type(stock8) is bnb.nn.Linear8bitLt
    x = torch.randn(2, 5, 64, generator=torch.Generator().manual_seed(3))
    low = m(x)
    m.set_recovery(True)
    got = m(x)
    assert torch.equal(got, stock8(x))
    assert not torch.equal(got, low)  # it left the NF4 path
    # and it is not the BF16 rung: the same layer with its checkpoint weight in FP32
    w = dict(load(tiny_llama_dir, None).named_modules())[V].weight.float()
    assert not torch.equal(got, x @ w.T)
    assert (got - x @ w.T).abs().max() < (low - x @ w.T).abs().max()  # INT8 is nearer BF16 than NF4 is
    assert "rung=int8" in repr(m)


def test_gradients_reach_the_input_as_through_stock_linear8bitlt(tiny_llama_dir):
    dual = _dual(tiny_llama_dir, {V: "int8"})
    m = dict(dual.named_modules())[V]
    m.set_recovery(True)
    stock8 = dict(_stock(tiny_llama_dir, "int8").named_modules())[V]
    x1 = torch.randn(3, 64, generator=torch.Generator().manual_seed(5), requires_grad=True)
    x2 = x1.detach().clone().requires_grad_(True)
    g = torch.randn(3, 32, generator=torch.Generator().manual_seed(6))
    (m(x1) * g).sum().backward()
    (stock8(x2) * g).sum().backward()
    assert x1.grad is not None and torch.count_nonzero(x1.grad) > 0
    assert torch.equal(x1.grad, x2.grad)


def test_load_planned_equals_the_dual_path_with_the_same_rungs_active(tiny_llama_dir, ids, bnb_cpu):
    from gnmr_hf.backends.bnb_4bit import keep_reference_layout

    mixed = ladder.load_planned(tiny_llama_dir, RUNGS, dtype=torch.float32)
    keep_reference_layout(mixed)
    dual = _dual(tiny_llama_dir, RUNGS)
    low_logits = logits(dual, ids)
    gnmr_hf.set_active_units(dual, [_unit_index(dual, n) for n in RUNGS])
    assert torch.equal(logits(mixed.eval(), ids), logits(dual, ids))
    assert not torch.equal(low_logits, logits(dual, ids))


def test_bytes_of_an_int8_rung_are_what_linear8bitlt_stores(tiny_llama_dir):
    from gnmr_hf.trainer.lifecycle import unit_bytes

    dual = _dual(tiny_llama_dir, {V: "int8", "model.layers.1.mlp.down_proj": "bf16"})
    units = find_linear_units(dual)
    ub = unit_bytes(units)
    stock8 = dict(_stock(tiny_llama_dir, "int8").named_modules())[V]
    held = stock8.weight.numel() * 1 + stock8.weight.SCB.numel() * 4
    assert held == 32 * 64 + 32 * 4  # v_proj: 32 rows of 64 int8 weights, one FP32 scale a row
    assert ub[_unit_index(dual, V)] == held
    assert ub[_unit_index(dual, "model.layers.1.mlp.down_proj")] == 64 * 128 * 4  # FP32 recovery dtype here
    m = dict(dual.named_modules())[V]
    assert m.recovery_device_bytes() == held  # resident, promoted or not
    # the planner's price of the rung over NF4 uses the same storage: NF4 holds 2 weights a byte, one FP32
    # absmax per block of 64 and its 16-entry FP32 code table
    price = ladder.rung_prices(32 * 64, 32)["int8"]
    assert price == held - (32 * 64 // 2 + 32 * 64 // 64 * 4 + 16 * 4)


def test_bad_rungs_are_refused_before_anything_changes(tiny_llama_dir):
    model = load(tiny_llama_dir, "nf4")
    with pytest.raises(ValueError, match=r"unknown rung\(s\) \{'model.layers.0.self_attn.v_proj': 'fp8'\}"):
        gnmr_hf.prepare_dual_path(model, recovery_source=tiny_llama_dir, units="linears", rungs={V: "fp8"})
    with pytest.raises(ValueError, match="not quantised linears inside the units, e.g. 'model.layers.9.mlp.up_proj'"):
        gnmr_hf.prepare_dual_path(model, recovery_source=tiny_llama_dir, units="linears",
                                  rungs={"model.layers.9.mlp.up_proj": "int8"})
    assert not any(hasattr(m, "_gnmr_source") for m in model.modules())  # nothing was converted


def test_a_trainer_run_on_planned_int8_and_bf16_rungs(tiny_llama_dir, ids, tmp_path):
    import datasets
    from transformers import Trainer, TrainingArguments

    model = _dual(tiny_llama_dir, RUNGS)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                                       task_type="CAUSAL_LM"))
    model.train()
    n = len(find_linear_units(model))
    planned = sorted(_unit_index(model, name) for name in RUNGS)
    callback = gnmr_hf.GNMRCallback(policy=gnmr_hf.StaticPolicy(n, planned))
    rows = [{"input_ids": r, "labels": r} for r in ids.tolist()] * 3
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none",
                             logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True)
    lora_b = {k: v.detach().clone() for k, v in model.named_parameters() if "lora_B" in k}
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    moved = [k for k, v in model.named_parameters() if "lora_B" in k and not torch.equal(v, lora_b[k])]
    assert any("layers.0.self_attn.v_proj" in k for k in moved)  # the adapter over the INT8 rung trained
    trace = [json.loads(line) for line in (tmp_path / "gnmr_trace.jsonl").read_text().splitlines()]
    assert all(sorted(t["active"]) == planned for t in trace)


def test_a_promoted_int8_rung_adds_no_module_and_no_state_dict_key(tiny_llama_dir):
    """The rung's Linear8bitLt is a plain attribute of the layer: promoted or not, the model's modules and
    state_dict are the same, and preparing the model again (every rung back on BF16) sees only the layers."""
    dual = _dual(tiny_llama_dir, {V: "int8"})
    keys, mods = set(dual.state_dict()), {n for n, _ in dual.named_modules()}
    i = _unit_index(dual, V)
    gnmr_hf.set_active_units(dual, [i])
    m = dict(dual.named_modules())[V]
    assert m.recovery and isinstance(m._gnmr_weight, bnb.nn.Linear8bitLt)  # promoted, on the INT8 rung
    assert set(dual.state_dict()) == keys
    assert {n for n, _ in dual.named_modules()} == mods
    x = torch.randn(2, 64, generator=torch.Generator().manual_seed(8))
    on_int8 = m(x)
    gnmr_hf.prepare_dual_path(dual, recovery_source=tiny_llama_dir, units="linears", dtype=torch.float32)
    assert "rung=bf16" in repr(m) and not m.recovery
    m.set_recovery(True)
    w = dict(load(tiny_llama_dir, None).named_modules())[V].weight.float()
    assert torch.allclose(m(x), x @ w.T, atol=1e-5) and not torch.equal(m(x), on_int8)
