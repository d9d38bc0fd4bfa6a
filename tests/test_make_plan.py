"""make_plan, the one planner (issue 59, items 2 and 3): every plan in one currency (bytes over the all-low model as
served), chosen greedily by gain per byte; the same batches and budget through ``gnmr-hf profile``'s code path and
through the recipe's give the same plan (BF16-only, the ladder, INT4; free and grouped).

Tiny random LLaMAs (4 layers of 7 linears): every test here runs in seconds."""

from __future__ import annotations

import argparse
import itertools
import random
import sys
from pathlib import Path

import pytest
import torch

from gnmr_hf.planning import Plan, PlanError, make_plan
from gnmr_hf.planning.ladder import LadderUnit
from gnmr_hf.planning.make import PlanGains, PlanPrices, plan_budget

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "recipes" / "smollm2-135m"


# ------------------------------------------------------------------------------- the greedy, without a model


def _instance(gains: dict[str, dict[str, float]], prices: dict[str, dict[str, int]], low_bytes: int = 10_000):
    names = list(gains)
    rungs = tuple(r for r in ("int8", "bf16") if any(r in p for p in prices.values()))
    pp = PlanPrices(names, dict.fromkeys(names, (1, 1)), prices, "nf4", low_bytes, rungs)
    units = [LadderUnit(n, 1, 1, gains=dict(gains[n]), prices=dict(prices[n])) for n in names]
    return pp, PlanGains(units, "first_order", 1, 10)


def _greedy_by_hand(gains: dict[str, float], prices: dict[str, int], budget: int) -> set[str]:
    """The BF16-only rule written out independently: positive gains by gain per byte, highest first (ties to the
    earlier linear), each taken while it fits."""
    order = sorted((n for n in gains if gains[n] > 0), key=lambda n: (-gains[n] / prices[n], list(gains).index(n)))
    chosen, used = set(), 0
    for n in order:
        if used + prices[n] <= budget:
            chosen.add(n)
            used += prices[n]
    return chosen


def test_a_bf16_plan_worked_out_by_hand():
    # gain per byte: a 0.010, b 0.008, c 0.0125, d negative (never bought), e 0.005
    gains = {"a": 1.0, "b": 0.8, "c": 0.5, "d": -1.0, "e": 0.25}
    prices = {"a": 100, "b": 100, "c": 40, "d": 10, "e": 50}
    pp, pg = _instance({n: {"bf16": g} for n, g in gains.items()}, {n: {"bf16": p} for n, p in prices.items()})
    # 150 B: c (40) then a (100) fit, b (100) does not, e (50) does not either (190): {a, c}
    plan = make_plan(None, [], 150, ("bf16",), prices=pp, gains=pg)
    assert isinstance(plan, Plan) and plan.rungs == {"a": "bf16", "c": "bf16"}
    assert (plan.budget_bytes, plan.price_bytes, plan.chosen_by["predicted_gain"]) == (150, 140, 1.5)
    # 200 B: c, a, then e (190); b never fits after a
    assert set(make_plan(None, [], 200, ("bf16",), prices=pp, gains=pg).rungs) == {"a", "c", "e"}
    # a share budget is of what every linear on its dearest rung adds (300 B here): 50 % = 150 B
    assert make_plan(None, [], "50%", ("bf16",), prices=pp, gains=pg).rungs == plan.rungs
    # memory over the low model: +1.5 % of 10,000 B = 150 B
    assert make_plan(None, [], "+1.5%nf4", ("bf16",), prices=pp, gains=pg).budget_bytes == 150


def test_make_plan_is_the_greedy_on_random_instances():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 7)
        gains = {f"l{i}": rng.uniform(-0.5, 1.0) for i in range(n)}
        prices = {f"l{i}": rng.randint(1, 60) for i in range(n)}
        pp, pg = _instance({k: {"bf16": g} for k, g in gains.items()}, {k: {"bf16": p} for k, p in prices.items()})
        budget = rng.randint(min(prices.values()), sum(prices.values()))
        plan = make_plan(None, [], budget, ("bf16",), prices=pp, gains=pg)
        assert set(plan.rungs) == _greedy_by_hand(gains, prices, budget)
        assert plan.price_bytes == sum(prices[k] for k in plan.rungs) <= budget


def test_the_ladder_takes_an_upgrade_only_after_the_step_below_it():
    # x: INT8 buys 0.6 for 30 B (0.02 a byte), the BF16 upgrade 0.3 more for 70 B more (0.0043 a byte);
    # y: INT8 0.2 for 30 B (0.0067), the upgrade 0.2 for 70 B (0.0029)
    gains = {"x": {"int8": 0.6, "bf16": 0.9}, "y": {"int8": 0.2, "bf16": 0.4}}
    prices = {"x": {"int8": 30, "bf16": 100}, "y": {"int8": 30, "bf16": 100}}
    pp, pg = _instance(gains, prices)
    # 60 B and 100 B: both on INT8 (x's upgrade, 70 B more, does not fit beside them)
    for budget in (60, 100):
        assert make_plan(None, [], budget, ("int8", "bf16"), prices=pp, gains=pg).rungs == {"x": "int8", "y": "int8"}
    # 130 B: then x's upgrade, the best step left
    assert make_plan(None, [], 130, ("int8", "bf16"), prices=pp, gains=pg).rungs == {"x": "bf16", "y": "int8"}
    # 200 B: every step
    assert make_plan(None, [], 200, ("int8", "bf16"), prices=pp, gains=pg).rungs == {"x": "bf16", "y": "bf16"}
    # never above the exhaustive optimum, never over the budget
    for budget in range(30, 201, 10):
        plan = make_plan(None, [], budget, ("int8", "bf16"), prices=pp, gains=pg)
        best = max(sum(gains[k][r] for k, r in zip(gains, c) if r != "low")
                   for c in itertools.product(("low", "int8", "bf16"), repeat=2)
                   if sum(prices[k][r] for k, r in zip(gains, c) if r != "low") <= budget)
        assert plan.chosen_by["predicted_gain"] <= best + 1e-12 and plan.price_bytes <= budget


def test_a_budget_that_buys_nothing_or_exceeds_the_total_is_one_line():
    pp, pg = _instance({"a": {"bf16": 1.0}, "b": {"bf16": 1.0}}, {"a": {"bf16": 40}, "b": {"bf16": 60}})
    with pytest.raises(PlanError, match=r"budget 39 = 39 B over the NF4 model buys no unit: the cheapest is a"):
        make_plan(None, [], 39, ("bf16",), prices=pp, gains=pg)
    with pytest.raises(PlanError, match=r"exceeds what there is to keep: all 2 linears"):
        plan_budget(101, pp)
    assert plan_budget("100%", pp, share=0.5) == 50  # a hybrid run's static part


# ---------------------------------------------------------------- the CLI's path and the recipe's: one plan


def _finetune():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    return finetune


def _batches(n: int = 2, seq: int = 12, bs: int = 2):
    g = torch.Generator().manual_seed(0)
    ids = torch.randint(3, 120, (n * bs, seq), generator=g)
    return [{"input_ids": ids[i:i + bs], "attention_mask": torch.ones_like(ids[i:i + bs]), "labels": ids[i:i + bs]}
            for i in range(0, n * bs, bs)]


def _recipe(finetune, out, budget, groups, ladder=False):
    return finetune.validate(finetune.load_config([
        "--config", str(SMOL / ("planned-ladder-nf4.yaml" if ladder else "planned-nf4.yaml")),
        "--profile.budget", budget, "--profile.groups", groups, "--output_dir", str(out),
        "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]))


def test_profile_and_recipe_choose_the_same_bf16_plan(tiny_llama_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.groups import split_groups
    from gnmr_hf.planning.profile_run import _Plans, _priced, load_dual
    from gnmr_hf.planning.profiler import profile_sensitivity
    from gnmr_hf.recipe_plan import bf16_policy

    finetune = _finetune()
    batches, budget = _batches(), "+20%nf4"
    # gnmr-hf profile's own path: its load, prices, profile and plans (profile_run), on the same batches
    args = argparse.Namespace(low="nf4", budget=budget, groups=None, storage="host")
    cli_model = load_dual(args, Path(tiny_llama_dir), torch.float32)
    prices, served, layout, _ = _priced(args, cli_model, Path(tiny_llama_dir))
    prof = profile_sensitivity(cli_model, batches, criteria=("first_order",))
    plans = _Plans(args, cli_model, Path(tiny_llama_dir), prof, "first_order", prices, batches, [])
    model = None
    chosen = {}
    for groups in ("null", "vllm"):
        recipe = _recipe(finetune, tmp_path / groups, budget, groups)
        model = model or finetune.load_model(recipe, str(tiny_llama_dir))  # a BF16 plan leaves the model as it is
        _, record = bf16_policy(recipe, model, batches, str(tiny_llama_dir))
        plan, _ = plans.make(served, None if groups == "null" else groups, budget)
        assert plan.rungs and sorted(plan.rungs) == sorted(record["modules"]), groups
        assert (plan.budget_bytes, plan.price_bytes) == (record["budget_bytes"], record["price_over_nf4_bytes"])
        assert plan.groups == record["groups"] == (None if groups == "null" else groups)
        chosen[groups] = plan.rungs
    # the grouped plan never splits a serving group, and differs from the free one
    assert split_groups(chosen["vllm"], layout) == [] and chosen["vllm"] != chosen["null"]


def test_profile_and_recipe_choose_the_same_ladder_plan(tiny_llama_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.ladder import ladder_table
    from gnmr_hf.recipe_plan import ladder_policy

    finetune = _finetune()
    batches = _batches()
    recipe = _recipe(finetune, tmp_path / "run", "+20%nf4", "null", ladder=True)
    model = finetune.load_model(recipe, str(tiny_llama_dir))
    _, record = ladder_policy(recipe, model, batches, str(tiny_llama_dir))
    # gnmr-hf profile's ladder plan: its ladder table's row at the budget (what Plan.load reads from its file)
    table = ladder_table(tiny_llama_dir, batches, "nf4", dtype=torch.float32, points=(0.20,),
                         rung_sets=(("int8", "bf16"),))
    (row,) = table["rows"]
    assert record["rungs"] and row["rung_of"] == record["rungs"]
    assert row["budget_bytes"] == record["budget_bytes"] and row["price_bytes"] == record["price_over_nf4_bytes"]
    assert set(record["rungs"].values()) == {"int8", "bf16"}  # both rungs bought: the ladder, not a BF16 plan


def test_the_grouped_ladder_is_make_plans_whole_groups(tiny_llama_dir, tmp_path):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.groups import split_groups
    from gnmr_hf.planning.make import layout_of, plan_gains, plan_prices
    from gnmr_hf.recipe_plan import ladder_policy

    finetune = _finetune()
    batches = _batches()
    recipe = _recipe(finetune, tmp_path / "run", "+20%nf4", "vllm", ladder=True)
    model = finetune.load_model(recipe, str(tiny_llama_dir))
    prices = plan_prices(model, ("int8", "bf16"), "nf4", tiny_llama_dir)
    gains = plan_gains(model, batches, prices, model_path=tiny_llama_dir, dtype=torch.float32)
    layout = layout_of(model, "vllm", prices)
    free = make_plan(model, batches, "+20%nf4", ("int8", "bf16"), None, prices=prices, gains=gains)
    grouped = make_plan(model, batches, "+20%nf4", ("int8", "bf16"), "vllm", prices=prices, gains=gains)
    _, record = ladder_policy(recipe, model, batches, str(tiny_llama_dir))
    assert record["rungs"] == grouped.rungs and split_groups(grouped.rungs, layout) == []
    assert grouped.rungs != free.rungs and split_groups(free.rungs, layout)  # the constraint changed the plan


@pytest.mark.parametrize("groups", ["none", "vllm"])
def test_profile_int4_writes_make_plans_plan(tiny_llama_dir, tmp_path, groups):
    from transformers import AutoModelForCausalLM

    from gnmr_hf.planning.groups import split_groups
    from gnmr_hf.planning.make import layout_of, plan_prices
    from gnmr_hf.planning.profile_int4 import run_int4

    batches = _batches()
    args = argparse.Namespace(group_size=32, groups=groups, budget="+10%int4", quiet=True, model="tiny", argv=[])
    assert run_int4(args, Path(tiny_llama_dir), batches, [], torch.float32, tmp_path, 0.0) == 0
    written = Plan.load(tmp_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32).eval()
    want = make_plan(model, batches, "+10%int4", ("int8", "bf16"), None if groups == "none" else "vllm",
                     low="int4", group_size=32)
    assert (written.low, written.group_size, written.groups) == ("int4", 32, want.groups)
    assert written.rungs and written.rungs == want.rungs and written.price_bytes == want.price_bytes
    if groups == "vllm":
        assert split_groups(written.rungs, layout_of(model, "vllm", plan_prices(model, ("int8", "bf16"), "int4",
                                                                                 group_size=32))) == []


# ------------------------------------------------ behaviour kept: the published budgets choose the same linears


def _removed_planner_budget(scores, sizes, prices, budget):
    """The recipes' former rule (``planner_budget``, removed with make_plan): the largest BF16-bytes budget whose
    greedy set by score per BF16 byte costs at most ``budget`` served."""
    from gnmr_hf.planning.planner import greedy_select

    b = min(sum(sizes), int(budget * max(s / p for s, p in zip(sizes, prices))))
    while b > 0:
        chosen = greedy_select(scores, sizes, b)
        if sum(prices[i] for i in chosen) <= budget:
            return b
        b = sum(sizes[i] for i in chosen) - 1
    return 0


@pytest.mark.slow  # the real models' configs (a GGUF conversion on a fresh machine), as tests/conftest.py says
@pytest.mark.parametrize("alias, profile", [("smollm2-135m-instruct", "qlora_budget"),
                                            ("smollm2-135m-instruct", "qlora_smollm2_pydocs"),
                                            ("gemma3-270m", "qlora_gemma_pydocs")])
def test_the_published_budgets_choose_what_the_former_rules_chose(alias, profile):
    """On the committed first-order profiles of the real models (bench/results), make_plan's greedy in the served
    currency chooses the linears both former BF16-bytes rules chose: the recipes' (the largest BF16 budget whose
    set fits) and gnmr-hf profile's (the served budget times the smallest BF16 bytes per served byte)."""
    import json

    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.planning.budget import _meta_model, over_low_prices, rung_price, served_budget
    from gnmr_hf.planning.planner import greedy_select

    try:
        model_path = resolve_model(alias)
    except FileNotFoundError as e:
        pytest.skip(f"{alias} is not converted here: {e}")
    data = json.loads((ROOT / "bench" / "results" / profile / "profile.json").read_text())
    names = ["model." + u["name"] for u in data["units"]]
    scores, sizes = [u["score"] for u in data["units"]], [u["bytes"] for u in data["units"]]
    mods = dict(_meta_model(model_path).named_modules())
    rows = [mods[n].weight.shape[0] for n in names]
    prices = [rung_price(s // 2, r, "bf16", "nf4") for s, r in zip(sizes, rows)]
    low_bytes = over_low_prices(model_path, names, "nf4")["low_model_bytes"]
    pp = PlanPrices(names, {n: (r, s // 2 // r) for n, r, s in zip(names, rows, sizes)},
                    {n: {"bf16": p} for n, p in zip(names, prices)}, "nf4", low_bytes, ("bf16",))
    pg = PlanGains([LadderUnit(n, s // 2, r, gains={"bf16": g}, prices={"bf16": p})
                    for n, s, r, g, p in zip(names, sizes, rows, scores, prices)], "first_order", 2, 0)
    for text in ("10%", "+5%nf4", "+10%nf4", "+25%nf4"):
        budget = served_budget(text, low_bytes, sum(prices))
        new = {names.index(n) for n in make_plan(None, [], text, ("bf16",), prices=pp, gains=pg).rungs}
        recipe = set(greedy_select(scores, sizes, _removed_planner_budget(scores, sizes, prices, budget)))
        # gnmr-hf profile's former rule: a share of the BF16 bytes, or the served budget times the smallest ratio
        cli = set(greedy_select(scores, sizes, int(0.10 * sum(sizes)) if text == "10%"
                                else int(budget * min(s / p for s, p in zip(sizes, prices)))))
        assert new and new == recipe == cli, text
