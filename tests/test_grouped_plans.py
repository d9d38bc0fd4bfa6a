"""Grouped plans (``plan(..., groups="vllm")``, ``choose_rungs(..., groups=...)``, ``gnmr-hf profile --groups``, the
recipes' ``profile.groups``): whole serving groups bought together, never split, within budget; a group's price
and gain the sums of its members' (worked out by hand on a one-layer LLaMA); ``groups=None`` today's plan; a
grouped request on a plan file made free refused in one line."""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gnmr_hf.planning import SensitivityProfile, UnitScore, plan  # noqa: E402
from gnmr_hf.planning.groups import ServingLayoutError, serving_groups, split_groups  # noqa: E402
from gnmr_hf.planning.ladder import LadderUnit, choose_rungs, choose_rungs_exact, plan_gain  # noqa: E402
from gnmr_hf.planning.planner import (  # noqa: E402
    format_grouping_table,
    paired_plans,
    plan_groups,
    require_groups,
    serving_layout,
    unit_purchases,
)
from tests.test_serving_groups import ARCHS, _linears, _meta_model  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "recipes" / "smollm2-135m"


def _profile(names: list[str], scores: list[float], sizes: list[int], arch: str | None) -> SensitivityProfile:
    units = [UnitScore(index=i, name=n.removeprefix("model."), modules=[n], bytes=b, layer=None, op=n.rsplit(".", 1)[-1],
                       scores={"first_order": s}) for i, (n, s, b) in enumerate(zip(names, scores, sizes))]
    return SensitivityProfile(units=units, criteria=["first_order"], losses={"low": 2.0, "high": 1.0}, costs={},
                              batches=1, tokens=10, keep_modules=["lm_head"], meta={"model": arch} if arch else {})


# ------------------------------------------------------------------------------ every tiny architecture


@pytest.mark.parametrize("arch", sorted(ARCHS))
def test_a_grouped_plan_never_splits_a_group_and_stays_within_budget(arch):
    model = _meta_model(arch)
    names = _linears(model)  # found independently of the package: every nn.Linear under model.layers
    groups = serving_groups(model)
    class_name = type(model).__name__
    split_free = 0
    for seed in range(8):
        rng = random.Random(seed)
        scores = [rng.uniform(-1, 3) for _ in names]
        sizes = [rng.randint(1, 9) * 64 for _ in names]
        prof = _profile(names, scores, sizes, class_name)
        for fraction in (0.1, 0.25, 0.5):
            p = plan(prof, budget_fraction=fraction, groups="vllm")  # the layout from the profile's architecture
            assert p.groups == "vllm" and p.to_dict()["groups"] == "vllm"
            assert p.modules and split_groups(p.modules, groups) == []
            assert p.bytes == sum(sizes[i] for i in p.indices) <= p.budget_bytes == int(fraction * sum(sizes))
            assert p.modules == [names[i] for i in p.indices]
            # the model's own layout is the one the profile's architecture gives (meta model: only its classes)
            assert serving_layout("vllm", model=model, profile=prof) == serving_layout("vllm", profile=prof) == groups
            free = plan(prof, budget_fraction=fraction)
            assert free.groups is None and free.bytes <= free.budget_bytes
            split_free += bool(split_groups(free.modules, groups))
        # the ladder: one rung per group, within the budget
        units = [LadderUnit(n, 100, 4, gains={"int8": rng.uniform(-1, 2), "bf16": rng.uniform(-1, 3)},
                            prices={"int8": rng.randint(1, 4), "bf16": rng.randint(5, 12)}) for n in names]
        budget = sum(u.prices["bf16"] for u in units) // 4
        chosen = choose_rungs(units, budget, groups=groups)
        assert chosen and split_groups(chosen, groups) == []
        assert all(n in names for n in chosen) and plan_gain(units, chosen)[1] <= budget
        filled = choose_rungs(units, budget, fill=True, groups=groups)
        assert split_groups(filled, groups) == [] and plan_gain(units, filled)[1] <= budget
        for rungs in (("int8",), ("bf16",)):
            one = choose_rungs(units, budget, rungs, groups=groups)
            assert set(one.values()) <= set(rungs) and split_groups(one, groups) == []
    if arch != "phi3":  # Phi3's linears are its groups: nothing to split
        assert split_free > 0  # the free plans do split groups: the constraint was exercised


# --------------------------------------------------------------------------------- worked out by hand

ONE_LAYER = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
             "model.layers.0.mlp.down_proj"]


def test_the_grouped_price_and_gain_are_the_members_sums_by_hand():
    groups = serving_groups("LlamaForCausalLM", ONE_LAYER)
    #         q   k   v    o  gate up down
    scores = [3, 1, -1, 1, 4, 2, 5]
    sizes = [2, 1, 1, 2, 4, 4, 4]
    prof = _profile(ONE_LAYER, scores, sizes, "LlamaForCausalLM")
    buys, names = unit_purchases(prof, groups)
    assert buys == [[0, 1, 2], [3], [4, 5], [6]]
    assert names == ["serving group model.layers.0.self_attn.qkv_proj", "serving group model.layers.0.self_attn.o_proj",
                     "serving group model.layers.0.mlp.gate_up_proj", "serving group model.layers.0.mlp.down_proj"]
    # purchases: qkv 3 in 4 B (0.75 a byte), o 1 in 2 (0.5), gate_up 6 in 8 (0.75), down 5 in 4 (1.25); budget 8:
    # down (4 B), then qkv (0.75, before gate_up by order; 8 B in all); gate_up and o no longer fit
    p = plan(prof, 8, groups="vllm")
    assert p.indices == [0, 1, 2, 6] and p.bytes == 8 and p.predicted_gain == 8 and p.predicted_gap_closed == 8
    # free: q 1.5, down 1.25, k 1.0, gate 1.0 (k first by index), o 0.5, up 0.5, v never; q, down, k = 7 B; gate
    # (4 B) and o (2 B) do not fit: q and k kept without v, the qkv group split
    free = plan(prof, 8)
    assert free.indices == [0, 1, 6] and free.bytes == 7 and free.predicted_gain == 9
    assert [g.name for g in split_groups(free.modules, groups)] == ["model.layers.0.self_attn.qkv_proj"]
    # a budget below the smallest purchase (o_proj, 2 B) buys nothing: refused naming it
    with pytest.raises(ValueError, match=r"budget 1 B .* buys no unit: the smallest unit \(serving group "
                                         r"model\.layers\.0\.self_attn\.o_proj\) is 2 B"):
        plan(prof, 1, groups="vllm")
    # the ladder: per group, INT8 and BF16 gains and prices summed over the members
    units = [LadderUnit(ONE_LAYER[0], 10, 2, {"int8": 1, "bf16": 2}, {"int8": 1, "bf16": 4}),
             LadderUnit(ONE_LAYER[1], 10, 2, {"int8": 1, "bf16": 2}, {"int8": 1, "bf16": 4}),
             LadderUnit(ONE_LAYER[2], 10, 2, {"int8": 1, "bf16": 2}, {"int8": 1, "bf16": 4}),
             LadderUnit(ONE_LAYER[3], 10, 2, {"int8": 0.5, "bf16": 0.6}, {"int8": 1, "bf16": 4}),
             LadderUnit(ONE_LAYER[4], 10, 2, {"int8": 2, "bf16": 3}, {"int8": 2, "bf16": 6}),
             LadderUnit(ONE_LAYER[5], 10, 2, {"int8": 2, "bf16": 3}, {"int8": 2, "bf16": 6}),
             LadderUnit(ONE_LAYER[6], 10, 2, {"int8": 3, "bf16": 3.5}, {"int8": 2, "bf16": 8})]
    # groups' steps by gain per byte: down INT8 1.5 (2 B), qkv INT8 3/3 = 1.0, gate_up INT8 4/4 = 1.0 (9 B in all),
    # o INT8 0.5 (1 B: over 9), qkv BF16 upgrade (6-3)/(12-3) = 0.33 (over), ...
    chosen = choose_rungs(units, 9, groups=groups)
    assert chosen == {ONE_LAYER[0]: "int8", ONE_LAYER[1]: "int8", ONE_LAYER[2]: "int8", ONE_LAYER[4]: "int8",
                      ONE_LAYER[5]: "int8", ONE_LAYER[6]: "int8"}
    assert plan_gain(units, chosen) == (10, 9)
    # the exhaustive optimum over whole groups is the same (every group on one rung: 3 ** 4 choices, read off)
    best = max((c for c in _group_choices(units, groups) if plan_gain(units, c)[1] <= 9),
               key=lambda c: plan_gain(units, c)[0])
    assert plan_gain(units, best)[0] == 10
    # free, the same budget buys BF16 on q (2 per 4 B is below 1.0) ... the greedy picks: down INT8, q/k/v INT8 one
    # by one (1.0 a byte), gate/up INT8 (1.0): the same 9 B; with 8 B the free plan splits gate/up, the grouped not
    assert split_groups(choose_rungs(units, 8), groups)
    assert split_groups(choose_rungs(units, 8, groups=groups), groups) == []
    assert choose_rungs_exact(units, 9) and plan_gain(units, choose_rungs_exact(units, 9))[0] >= 10


def _group_choices(units, groups):
    import itertools

    for combo in itertools.product(("low", "int8", "bf16"), repeat=len(groups)):
        yield {m: r for g, r in zip(groups, combo) if r != "low" for m in g.members}


def test_groups_none_is_todays_plan():
    names = _linears(_meta_model("llama"))
    rng = random.Random(3)
    scores = [rng.uniform(-1, 3) for _ in names]
    sizes = [rng.randint(1, 9) * 64 for _ in names]
    prof = _profile(names, scores, sizes, "LlamaForCausalLM")
    for fraction in (0.05, 0.1, 0.25, 0.6):
        budget = int(fraction * sum(sizes))
        # today's greedy, written out: by score per byte (ties to the lower index), each while it fits
        order = sorted((i for i in range(len(names)) if scores[i] > 0), key=lambda i: (-scores[i] / sizes[i], i))
        want, used = [], 0
        for i in order:
            if used + sizes[i] <= budget:
                want.append(i)
                used += sizes[i]
        default, none = plan(prof, budget_fraction=fraction), plan(prof, budget_fraction=fraction, groups=None)
        assert default.indices == none.indices == sorted(want)
        assert default.to_dict() == none.to_dict() and none.to_dict()["groups"] is None
        assert set(none.to_dict()) == {"criterion", "budget_bytes", "budget_fraction", "total_bytes", "bytes",
                                       "fraction", "indices", "names", "modules", "predicted_gain",
                                       "predicted_gap_closed", "gain_score", "measured", "skip_modules", "priced_in",
                                       "held_bytes", "groups"}
        grouped = plan(prof, budget_fraction=fraction, groups="vllm")
        assert grouped.budget_bytes == none.budget_bytes  # one budget, two ways to spend it
    choices = {tuple(plan(prof, budget_fraction=f, groups=g).indices) for f in (0.1, 0.25) for g in (None, "vllm")}
    assert len(choices) > 2  # the grouped plans differ from the free ones: the comparison above is not vacuous


def test_bad_groups_and_unknown_layouts_are_one_line_errors():
    names = _linears(_meta_model("llama"))
    prof = _profile(names, [1.0] * len(names), [64] * len(names), "LlamaForCausalLM")
    with pytest.raises(ValueError, match=r"groups='tgi': None \(a free plan, unit by unit\) or 'vllm'"):
        plan(prof, budget_fraction=0.1, groups="tgi")
    with pytest.raises(ValueError, match=r"reads the serving layout from the model's architecture: give the model"):
        plan(_profile(names, [1.0] * len(names), [64] * len(names), None), budget_fraction=0.1, groups="vllm")
    with pytest.raises(ServingLayoutError) as e:  # a profile of an architecture vLLM's layout is not known for
        plan(_profile(names, [1.0] * len(names), [64] * len(names), "GPTNeoXForCausalLM"), budget_fraction=0.1,
             groups="vllm")
    assert "\n" not in str(e.value) and str(e.value).startswith("GPTNeoXForCausalLM: no known vLLM fused layout")
    config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4)
    with torch.device("meta"):
        neox = transformers.GPTNeoXForCausalLM(config)
    with pytest.raises(ServingLayoutError, match=r"GPTNeoXForCausalLM: .*query_key_value x2"):
        serving_layout("vllm", model=neox)
    with pytest.raises(ValueError, match=r"takes the model's serving groups .*not 'vllm'"):
        choose_rungs([LadderUnit(names[0], 1, 1, {"int8": 1.0, "bf16": 1.0}, {"int8": 1, "bf16": 2})], 5,
                     groups="vllm")


def test_the_side_by_side_table_pairs_free_and_grouped():
    names = _linears(_meta_model("llama"))
    rng = random.Random(1)
    prof = _profile(names, [rng.uniform(0, 3) for _ in names], [rng.randint(1, 9) * 64 for _ in names],
                    "LlamaForCausalLM")
    free = [plan(prof, budget_fraction=f) for f in (0.1, 0.25)]
    f2, g2 = paired_plans(prof, free)
    assert f2 == free and [g.groups for g in g2] == ["vllm", "vllm"]
    assert [g.indices for g in g2] == [plan(prof, budget_fraction=f, groups="vllm").indices for f in (0.1, 0.25)]
    f3, g3 = paired_plans(prof, g2)  # from the grouped side: the free ones found again
    assert [p.indices for p in f3] == [p.indices for p in free] and g3 == g2
    for p, gap in zip([*free, *g2], (0.2, 0.3, 0.15, 0.31)):
        p.measured["profile"] = {"gap_closed": gap}
    table = format_grouping_table(free, g2, serving_groups("LlamaForCausalLM", names)).splitlines()
    assert table[0].startswith("| budget | plan | linears | split groups |") and len(table) == 6
    row = [c.strip() for c in table[3].split("|")[1:-1]]
    assert row[:3] == ["10 %", "grouped (vllm)", str(len(g2[0].modules))] and row[3] == "0" and row[-1] == "-0.050"
    assert [c.strip() for c in table[2].split("|")[1:-1]][3] == str(len(split_groups(free[0].modules,
                                                                                      serving_groups("LlamaForCausalLM",
                                                                                                     names))))


# -------------------------------------------------------------------------------- plan files


def test_a_grouped_request_on_a_plan_file_made_free_is_refused_in_one_line(tmp_path):
    names = _linears(_meta_model("llama"))
    prof = _profile(names, [float(i % 5) for i in range(len(names))], [64] * len(names), "LlamaForCausalLM")
    free, grouped = plan(prof, budget_fraction=0.25), plan(prof, budget_fraction=0.25, groups="vllm")
    prof.to_json(tmp_path / "free.json", plan=free.to_dict(), skip_modules=free.skip_modules())
    (tmp_path / "grouped").mkdir()
    prof.to_json(tmp_path / "grouped" / "profile.json", plan=grouped.to_dict(), skip_modules=grouped.skip_modules())
    assert plan_groups(json.loads((tmp_path / "free.json").read_text())) is None
    require_groups(tmp_path / "grouped", "vllm")  # the folder, as gnmr-hf profile --output writes it
    with pytest.raises(ValueError) as e:
        require_groups(tmp_path / "free.json", "vllm")
    msg = str(e.value)
    assert "\n" not in msg and msg == (f"{tmp_path / 'free.json'} was planned free (no groups recorded), not with "
                                       "groups='vllm': plan again with groups='vllm' (gnmr-hf profile --groups vllm, or "
                                       "profile.groups: vllm in a recipe)")
    # a file written before plans recorded groups, and a ladder plan file (its record under "plan")
    old = json.loads((tmp_path / "free.json").read_text())
    del old["plan"]["groups"]
    with pytest.raises(ValueError, match=r"was planned free"):
        require_groups(old, "vllm")
    ladder = {"rungs": {names[0]: "int8"}, "plan": {"rungs": {names[0]: "int8"}, "groups": "vllm"}}
    require_groups(ladder, "vllm")
    with pytest.raises(ValueError, match=r"not a readable plan file"):
        require_groups(tmp_path / "missing.json", "vllm")


# ------------------------------------------------------------------------------------- the CLI


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    from tests.conftest import make_tiny_llama
    from tests.test_profile_faults_r3 import tiny_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_groups"))
    tiny_tokenizer().save_pretrained(path)
    return path


def test_gnmr_hf_profile_groups_reaches_the_planner(tiny_with_tokenizer, tmp_path, capsys):
    pytest.importorskip("bitsandbytes")
    from gnmr_hf.planning.cli import main

    base = ["--model", str(tiny_with_tokenizer), "--batch-size", "2", "--budget", "25%", "--heldout-batches", "1",
            "--no-ladder", "--no-plot", "--quiet"]
    assert main(base + ["--output", str(tmp_path / "g"), "--groups", "vllm"]) == 0
    out = capsys.readouterr().out
    saved = json.loads((tmp_path / "g" / "profile.json").read_text())
    groups = serving_groups("LlamaForCausalLM", [m for u in saved["units"] for m in u["modules"]])
    assert saved["plan"]["groups"] == "vllm" and all(p["groups"] == "vllm" for p in saved["price"])
    kept = [s for s in saved["skip_modules"] if s != "lm_head"]
    assert kept and split_groups(kept, groups) == []
    # the written plan is make_plan's grouped plan of the written profile, at the same budget (bytes over NF4)
    prof = SensitivityProfile.from_json(tmp_path / "g" / "profile.json")
    assert saved["plan"]["indices"] == _served_plan(prof, saved["plan"]["budget_bytes"], "vllm")
    # the side-by-side table: a free and a grouped row per budget, in-sample and held-out, with the difference
    head = next(i for i, ln in enumerate(out.splitlines()) if ln.startswith("| budget | plan |"))
    rows = [ln for ln in out.splitlines()[head + 2:] if ln.startswith("|")]
    assert [r.split("|")[2].strip() for r in rows] == ["free", "grouped (vllm)"] * (len(rows) // 2) and rows
    assert "gap closed (profile, in-sample)" in out.splitlines()[head] and "grouped - free (heldout)" in out
    assert [p["kind"] for p in saved["grouping"]["plans"]] == ["free", "grouped"] * (len(rows) // 2)
    assert all("heldout" in p["measured"] for p in saved["grouping"]["plans"])
    # without --groups: the free plan written, the grouped one still printed beside it
    assert main(base + ["--output", str(tmp_path / "f")]) == 0
    out = capsys.readouterr().out
    free = json.loads((tmp_path / "f" / "profile.json").read_text())
    assert free["plan"]["groups"] is None and "grouped (vllm)" in out
    assert free["plan"]["indices"] == _served_plan(SensitivityProfile.from_json(tmp_path / "f" / "profile.json"),
                                                   free["plan"]["budget_bytes"])
    assert free["plan"]["indices"] != saved["plan"]["indices"]  # the flag changed the plan
    # a value the flag does not know: one line, exit code 2
    with pytest.raises(SystemExit) as e:
        main(base + ["--output", str(tmp_path / "x"), "--groups", "tgi"])
    assert e.value.code == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "--groups: invalid choice: 'tgi'" in err[0]


# ----------------------------------------------------------------------------------- the recipes


def _finetune():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    return finetune


@pytest.mark.parametrize("argv, want", [([], None), (["--profile.groups", "vllm"], "vllm"),
                                        (["--profile.groups", "null"], None)])
def test_the_recipe_key_parses(argv, want):
    finetune = _finetune()
    r = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), *argv]))
    assert r.profile.groups == want and r.profile.to_dict()["groups"] == want
    lad = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml"), *argv]))
    assert lad.profile.groups == want and lad.profile.ladder


def test_bad_recipe_groups_are_one_line_errors(tmp_path):
    finetune = _finetune()
    with pytest.raises(finetune.RecipeError, match=r"profile\.groups must be vllm .* or null \(a free plan\), got 'tgi'"):
        finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.groups", "tgi"])
    cfg = tmp_path / "r.yaml"
    cfg.write_text(f"include: {SMOL / 'planned-nf4.yaml'}\nprofile:\n  groups: [vllm]\n")
    with pytest.raises(finetune.RecipeError, match=r"profile\.groups must be vllm"):
        finetune.load_config(["--config", str(cfg)])
    with pytest.raises(finetune.RecipeError, match=r"profile\.groups \(set on the command line\) has no effect with "
                                                   r"profile\.policy gnmr"):
        finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.policy", "gnmr",
                                                "--profile.groups", "vllm"]))


def _rows(n: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": [1] * seq, "labels": ids}
            for ids in torch.randint(3, 120, (n, seq), generator=g).tolist()]


@pytest.mark.parametrize("ladder", [False, True])
def test_the_recipe_key_reaches_the_planner(tiny_with_tokenizer, tmp_path, ladder):
    pytest.importorskip("bitsandbytes")
    from transformers import AutoTokenizer

    finetune = _finetune()
    recipe_file = SMOL / ("planned-ladder-nf4.yaml" if ladder else "planned-nf4.yaml")
    records = {}
    for groups in ("null", "vllm"):
        out = tmp_path / groups
        recipe = finetune.validate(finetune.load_config([
            "--config", str(recipe_file), "--profile.budget", "+25%nf4", "--profile.groups", groups,
            "--output_dir", str(out), "--compute_dtype", "float32", "--per_device_train_batch_size", "2",
            "--disable_tqdm", "true"]))
        model = finetune.load_model(recipe, str(tiny_with_tokenizer))
        _, record = finetune.planned_policy(recipe, model, _rows(), AutoTokenizer.from_pretrained(tiny_with_tokenizer),
                                            str(tiny_with_tokenizer))
        records[groups] = (record, json.loads((out / "profile.json").read_text()))
    layout = serving_groups("LlamaForCausalLM", [n for n, m in _linears_of(tiny_with_tokenizer)])
    for groups, (record, saved) in records.items():
        kept = record["rungs"] if ladder else record["modules"]
        assert record["groups"] == (None if groups == "null" else "vllm") == plan_groups(saved)
        assert record["price_over_nf4_bytes"] <= record["budget_bytes"]
        if groups == "vllm":
            assert kept and split_groups(kept, layout) == []
            require_groups(tmp_path / groups, "vllm")
        else:
            with pytest.raises(ValueError, match="was planned free"):
                require_groups(tmp_path / groups, "vllm")
    free, grouped = records["null"][0], records["vllm"][0]
    assert (free["rungs"] if ladder else free["modules"]) != (grouped["rungs"] if ladder else grouped["modules"])
    if not ladder:  # the BF16 plan: make_plan's grouped plan of the written profile at the recorded budget
        prof = SensitivityProfile.from_json(tmp_path / "vllm" / "profile.json")
        assert _served_plan(prof, grouped["plan_budget_bytes"], "vllm") == grouped["indices"]


def _served_plan(prof, budget: int, groups=None) -> list[int]:
    """The unit indices make_plan chooses from a written profile: greedy by first-order score per byte served over
    NF4 (each linear's BF16 weight less its NF4 weight and quant state), whole serving groups with ``groups``."""
    from gnmr_hf.planning.budget import rung_price
    from gnmr_hf.planning.ladder import LadderUnit, choose_rungs

    units = [LadderUnit(u.modules[0], u.bytes // 2, 1, gains={"bf16": u.scores["first_order"]},
                        prices={"bf16": rung_price(u.bytes // 2, 1, "bf16", "nf4")}) for u in prof.units]
    layout = serving_groups("LlamaForCausalLM", [u.name for u in units]) if groups else None
    chosen = choose_rungs(units, budget, ("bf16",), groups=layout)
    return [i for i, u in enumerate(prof.units) if u.modules[0] in chosen]


def _linears_of(path):
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(path))
    return [(n, m) for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
