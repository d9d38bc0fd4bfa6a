"""A criterion in the registry serves BF16-only, ladder and INT4 plans alike (issue 59, item 3): make_plan runs a
registered criterion once per rung, the rung's weight standing in for the high path
(gnmr_hf/planning/rung_criteria.py).

Tiny random LLaMA (4 layers of 7 linears), FP32 compute: the by-hand losses below are the model's own forward
with one linear's output replaced by the rung's (bitsandbytes' Linear8bitLt over the checkpoint weight, the
weight itself, the compressed-tensors quantisers for INT4)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.nn import functional as F

from gnmr_hf.planning import PlanError, make_plan, rung_criteria
from gnmr_hf.planning import criteria as criteria_mod
from gnmr_hf.planning.ladder import choose_rungs

LINEARS = ("model.layers.1.self_attn.v_proj", "model.layers.3.mlp.down_proj")


def _batches(n: int = 2, seq: int = 12, bs: int = 2):
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, 120, (n * bs, seq), generator=g)
    return [{"input_ids": ids[i:i + bs], "attention_mask": torch.ones_like(ids[i:i + bs]), "labels": ids[i:i + bs]}
            for i in range(0, n * bs, bs)]


def _ckpt(path) -> dict[str, torch.Tensor]:
    return load_file(str(Path(path) / "model.safetensors"))


def _loss(model, batches, name: str | None = None, output=None) -> float:
    """The batches' mean loss (equal token counts: the token-weighted mean), with ``name``'s output replaced by
    ``output(x)`` when given."""
    handle = None
    if name is not None:
        handle = dict(model.named_modules())[name].register_forward_hook(lambda m, i, o: output(i[0]).to(o.dtype))
    try:
        with torch.no_grad():
            return sum(float(model(**b).loss) for b in batches) / len(batches)
    finally:
        if handle is not None:
            handle.remove()


@pytest.fixture(scope="module")
def nf4_model(tiny_llama_dir):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.profile_run import load_dual

    args = argparse.Namespace(low="nf4", storage="host")
    return load_dual(args, Path(tiny_llama_dir), torch.float32).eval()


@pytest.fixture(scope="module")
def bf16_model(tiny_llama_dir):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()


def _spy(monkeypatch) -> dict:
    """Keep what criterion_rung_gains returned to make_plan."""
    seen = {}
    real = rung_criteria.criterion_rung_gains

    def spy(*a, **k):
        seen["units"], _ = out = real(*a, **k)
        return out

    monkeypatch.setattr(rung_criteria, "criterion_rung_gains", spy)
    return seen


def _check_plan(plan, units, budget):
    assert plan.chosen_by["criterion"] == "loss" and plan.rungs
    assert plan.rungs == choose_rungs(units, plan.budget_bytes, ("int8", "bf16"))
    by = {u.name: u for u in units}
    assert plan.chosen_by["predicted_gain"] == pytest.approx(sum(by[n].gains[r] for n, r in plan.rungs.items()))


def test_loss_on_the_ladder_over_nf4_is_each_linear_alone_on_its_rung(nf4_model, tiny_llama_dir, monkeypatch):
    import bitsandbytes as bnb

    batches, seen = _batches(), _spy(monkeypatch)
    before = _loss(nf4_model, batches)
    plan = make_plan(nf4_model, batches, "+20%nf4", ("int8", "bf16"), criterion="loss", model_path=tiny_llama_dir)
    units = seen["units"]
    _check_plan(plan, units, "+20%nf4")
    assert _loss(nf4_model, batches) == before  # the model's recovery paths are its own again
    ckpt, by = _ckpt(tiny_llama_dir), {u.name: u for u in units}
    for name in LINEARS:
        w = ckpt[f"{name}.weight"]
        int8 = bnb.nn.Linear8bitLt(w.shape[1], w.shape[0], bias=False, has_fp16_weights=False, threshold=6.0)
        int8.weight = bnb.nn.Int8Params(w.to(torch.float16), requires_grad=False, has_fp16_weights=False)
        int8.eval()
        want = {"int8": before - _loss(nf4_model, batches, name, lambda x, int8=int8: int8(x)),
                "bf16": before - _loss(nf4_model, batches, name, lambda x, w=w: F.linear(x, w.float()))}
        assert want["int8"] != 0 and want["bf16"] != 0 and want["int8"] != want["bf16"]
        for rung in ("int8", "bf16"):
            assert by[name].gains[rung] == pytest.approx(want[rung], rel=1e-3, abs=1e-6), (name, rung)


def test_loss_on_the_ladder_over_int4_is_each_linear_alone_on_its_rung(bf16_model, tiny_llama_dir, monkeypatch):
    from gnmr_hf.planning.groups import decoder_linears
    from gnmr_hf.planning.int4 import int4_fake_quant, int8_fake_quant

    batches, seen = _batches(), _spy(monkeypatch)
    original = {n: p.detach().clone() for n, p in bf16_model.named_parameters()}
    plan = make_plan(bf16_model, batches, "+20%int4", ("int8", "bf16"), criterion="loss", low="int4", group_size=32)
    units = seen["units"]
    _check_plan(plan, units, "+20%int4")
    assert plan.low == "int4" and plan.group_size == 32
    # the model is as it was: its weights and plain linears
    assert all(torch.equal(p, original[n]) for n, p in bf16_model.named_parameters())
    modules = dict(bf16_model.named_modules())
    assert all(type(modules[n]) is torch.nn.Linear for n in decoder_linears(bf16_model))
    # by hand: every decoder linear on W4A16 (the export's quantiser on its BF16 weight), then one on its rung
    bf16 = {n: modules[n].weight.detach().to(torch.bfloat16) for n in decoder_linears(bf16_model)}
    try:
        with torch.no_grad():
            for n, w in bf16.items():
                modules[n].weight.copy_(int4_fake_quant(w, 32).float())
        low = _loss(bf16_model, batches)
        by = {u.name: u for u in units}
        for name in LINEARS:
            want = {r: low - _loss(bf16_model, batches, name, lambda x, w=w: F.linear(x, w.float()))
                    for r, w in (("int8", int8_fake_quant(bf16[name])), ("bf16", bf16[name]))}
            assert want["int8"] != 0 and want["int8"] != want["bf16"]
            for rung in ("int8", "bf16"):
                assert by[name].gains[rung] == pytest.approx(want[rung], rel=1e-3, abs=1e-6), (name, rung)
    finally:
        with torch.no_grad():
            for n, p in bf16_model.named_parameters():
                p.copy_(original[n])


def _prefer(target: str, seen: list):
    """A toy criterion: the output distance between the high and the low path on a fixed probe, for ``target``
    only (every other linear scores 0)."""
    from gnmr_hf.planning.passes import _high_output

    def run(model, units, batches, weights, progress, seen_low):
        scores = []
        for u in units:
            if target not in u.modules:
                scores.append(0.0)
                continue
            (m,) = u.dual
            x = torch.randn(3, m.in_features, generator=torch.Generator().manual_seed(0))
            with torch.no_grad():
                scores.append(float((_high_output(m, x) - m.forward(x)).norm()))
        seen.append(scores)
        return {"prefer": scores}, {"forwards": 0, "backwards": 0}
    return run


@pytest.mark.parametrize("target", LINEARS)
def test_a_toy_criterion_registered_here_chooses_every_kind_of_plan(nf4_model, bf16_model, tiny_llama_dir,
                                                                     monkeypatch, target):
    seen: list = []
    monkeypatch.setitem(criteria_mod.REGISTRY, "prefer", (_prefer(target, seen), ("prefer",)))
    batches = _batches(1)
    plans = {
        "ladder": make_plan(nf4_model, batches, "+20%nf4", ("int8", "bf16"), criterion="prefer",
                            model_path=tiny_llama_dir),
        "int4": make_plan(bf16_model, batches, "+20%int4", ("int8", "bf16"), criterion="prefer", low="int4",
                          group_size=32),
        "bf16": make_plan(nf4_model, batches, "+20%nf4", ("bf16",), criterion="prefer", model_path=tiny_llama_dir),
    }
    for kind, plan in plans.items():
        assert plan.chosen_by["criterion"] == "prefer" and set(plan.rungs) == {target}, kind
    # the ladder's and INT4's passes ran once per rung, each with that rung on the high path: the scores differ
    assert len(seen) == 5
    (i,) = {s.index(max(s)) for s in seen}
    assert seen[0][i] > 0 and seen[0][i] != seen[1][i] and seen[2][i] != seen[3][i] and seen[4][i] == seen[1][i]


def test_an_unknown_criterion_is_one_line_naming_the_registered_ones(monkeypatch):
    monkeypatch.setitem(criteria_mod.REGISTRY, "toy", (lambda *a: "never run", ("toy",)))
    for rungs in (("bf16",), ("int8", "bf16")):
        with pytest.raises(PlanError) as e:
            make_plan(None, [], "+10%nf4", rungs, criterion="nope")  # refused before the model is looked at
        assert str(e.value) == "unknown criterion 'nope': one of loss, first_order, output, lora_grad, weight_error, toy"
    # plan_gains refuses it too (a caller taking the steps one by one)
    from gnmr_hf.planning.make import PlanPrices, plan_gains

    pp = PlanPrices(["a"], {"a": (1, 1)}, {"a": {"int8": 1, "bf16": 2}}, "nf4", 10, ("int8", "bf16"))
    with pytest.raises(PlanError, match=r"^unknown criterion 'nope': one of loss, .*, toy$"):
        plan_gains(None, [], pp, "nope")


def test_a_score_name_chooses_by_that_score_and_the_bf16_rung_is_the_bf16_profiles(nf4_model, tiny_llama_dir,
                                                                                    monkeypatch):
    from gnmr_hf import active_units, set_active_units
    from gnmr_hf.planning.profiler import profile_sensitivity

    batches, seen = _batches(1), _spy(monkeypatch)
    set_active_units(nf4_model, [5], units="linears")  # a unit on its recovery path stays there
    try:
        ladder = make_plan(nf4_model, batches, "+20%nf4", ("int8", "bf16"), criterion="output_rel",
                           model_path=tiny_llama_dir)
        assert active_units(nf4_model, "linears") == [5]
    finally:
        set_active_units(nf4_model, [], units="linears")
    bf16_only = make_plan(nf4_model, batches, "+20%nf4", ("bf16",), criterion="output_rel", model_path=tiny_llama_dir)
    assert ladder.chosen_by["criterion"] == bf16_only.chosen_by["criterion"] == "output_rel"
    prof = profile_sensitivity(nf4_model, batches, criteria=("output",))
    want = dict(zip([u.modules[0] for u in prof.units], prof.scores("output_rel")))
    got = {u.name: u.gains for u in seen["units"]}
    assert set(got) == set(want) and all(want[n] > 0 for n in want)
    assert all(got[n]["bf16"] == pytest.approx(want[n], rel=1e-6) for n in want)
    assert any(got[n]["int8"] != pytest.approx(got[n]["bf16"], rel=1e-3) for n in want)  # the INT8 rung stood in
