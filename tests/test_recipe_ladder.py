"""The recipes' precision ladder (``profile.rungs: [int8, bf16]``): parse and refusals (fast), the plan on a tiny
LLaMA checked against the real library (a stock load, ``choose_rungs``, ``load_planned``'s footprint), the
serving refusals of ``gnmr-hf export`` / ``eval --skip-modules``, and a 3-step SmolLM2 run (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402

SMOL = ROOT / "recipes" / "smollm2-135m"
GEMMA = ROOT / "recipes" / "gemma3-270m"


def test_the_ladder_recipes_parse():
    for folder in (SMOL, GEMMA):
        r = finetune.validate(finetune.load_config(["--config", str(folder / "planned-ladder-nf4.yaml")]))
        assert r.script.precision == "gnmr-nf4" and r.profile.enabled
        assert (r.profile.budget, r.profile.rungs, r.profile.policy, r.profile.ladder) == \
            ("+10%nf4", ("int8", "bf16"), "static", True)
    assert finetune.load_config(["--config", str(GEMMA / "planned-ladder-nf4.yaml")]).script.model == "gemma3-270m"
    # the BF16-only plan is the default, and the command line reaches the key (any order, cheapest first)
    plain = finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml")])
    assert plain.profile.rungs == ("bf16",) and not plain.profile.ladder
    cli = finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.budget", "+5%nf4",
                                "--profile.rungs", "bf16,int8"])
    assert cli.profile.rungs == ("int8", "bf16") and cli.profile.given["rungs"] == "on the command line"
    int8_only = finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml"), "--profile.rungs", "int8"])
    assert int8_only.profile.rungs == ("int8",) and int8_only.profile.ladder
    assert finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml")]).profile.to_dict()["rungs"] == \
        ("int8", "bf16")


@pytest.mark.parametrize("argv, message", [
    (["--profile.rungs", "fp8"], r"profile\.rungs must be a non-empty list of distinct rungs from int8, bf16 .*'fp8'"),
    (["--profile.rungs", "int8,int8"], r"profile\.rungs must be .*distinct"),
    (["--profile.rungs", ""], r"profile\.rungs must be a non-empty list"),
    (["--profile.budget", "10%"], r"profile\.rungs \[int8, bf16\] plans under memory over the NF4 model: write "
                                  r"profile\.budget as \+N%nf4 .*not '10%'"),
    (["--profile.policy", "hybrid"], r"profile\.rungs \[int8, bf16\] needs profile\.policy static .*got hybrid"),
    (["--profile.criterion", "nope"], r"profile\.criterion must be one of .*'nope'"),
])
def test_bad_ladder_settings_are_one_line_errors(argv, message):
    with pytest.raises(finetune.RecipeError, match=message) as e:
        finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml"), *argv])
    assert "\n" not in str(e.value)


def test_policy_gnmr_is_the_papers_controller_one_line_away_from_the_ladder_too():
    ladder = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml"),
                                                     "--profile.policy", "gnmr", "--output_dir", "x"]))
    paper = finetune.validate(finetune.load_config(["--config", str(SMOL / "gnmr-nf4.yaml"), "--output_dir", "x"]))
    assert not ladder.profile.enabled and ladder.script == paper.script
    assert ladder.gnmr.to_dict() == paper.gnmr.to_dict() and ladder.training.to_dict() == paper.training.to_dict()
    # rungs given beside policy gnmr by the user is refused, as every other profile key is
    with pytest.raises(finetune.RecipeError, match=r"profile\.rungs \(set on the command line\) has no effect with "
                                                   r"profile\.policy gnmr"):
        finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.policy", "gnmr",
                                                "--profile.rungs", "int8,bf16"]))


def _batches(n: int = 4, bs: int = 2, seq: int = 12):
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": [1] * seq, "labels": ids}
            for ids in torch.randint(0, 128, (n * bs, seq), generator=g).tolist()]


def _ladder(tiny_llama_dir, smollm2_dir, out, budget="+25%nf4", rungs="int8,bf16", dtype="float32"):
    from transformers import AutoTokenizer

    recipe = finetune.validate(finetune.load_config([
        "--config", str(SMOL / "planned-ladder-nf4.yaml"), "--profile.budget", budget, "--profile.rungs", rungs,
        "--output_dir", str(out), "--compute_dtype", dtype, "--per_device_train_batch_size", "2",
        "--disable_tqdm", "true"]))
    model = finetune.load_model(recipe, str(tiny_llama_dir))
    policy, record = finetune.planned_policy(recipe, model, _batches(), AutoTokenizer.from_pretrained(smollm2_dir),
                                             str(tiny_llama_dir))
    return model, policy, record


def _stock(path, rungs=None):
    import torch

    from gnmr_hf.planning.ladder import load_planned

    return load_planned(path, rungs or {}, "nf4", dtype=torch.bfloat16)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_the_recipes_ladder_is_the_libraries_plan_and_its_price_is_what_a_stock_load_holds(
        tiny_llama_dir, smollm2_dir, tmp_path, dtype):
    import bitsandbytes as bnb
    import torch

    import gnmr_hf
    from gnmr_hf.backends.recovery import Int8RecoveryWeight, RecoveryWeight
    from gnmr_hf.memory import model_bytes
    from gnmr_hf.planning.ladder import _stock_low, choose_rungs, rung_gains

    model, policy, record = _ladder(tiny_llama_dir, smollm2_dir, tmp_path / dtype, dtype=dtype)
    rungs = record["rungs"]
    assert set(rungs.values()) == {"int8", "bf16"}  # both rungs bought (7 INT8, 3 BF16 of the 28 linears)
    # the same plan from the library's own steps on a stock load, with the budget worked out from a stock
    # NF4 load's footprint (get_memory_footprint plus the quant states)
    stock_bytes = model_bytes(_stock(tiny_llama_dir))["total"]
    assert record["memory_budget"]["low_model_bytes"] == stock_bytes
    budget = int(0.25 * stock_bytes)
    assert record["budget_bytes"] == budget
    data = _batches()  # the recipe profiles profile.batches (2) batches of 2, in order
    batches = [{k: torch.tensor([row[k] for row in data[i * 2:(i + 1) * 2]]) for k in data[0]} for i in range(2)]
    stock = _stock_low(tiny_llama_dir, "nf4", getattr(torch, dtype))
    units = rung_gains(stock, tiny_llama_dir, batches)
    assert choose_rungs(units, budget) == rungs
    # what is served: a stock load of the plan holds exactly the plan's price over the NF4 model
    served = model_bytes(_stock(tiny_llama_dir, rungs))["total"]
    assert served - stock_bytes == record["over_low_bytes"] <= budget
    assert record["memory_over_nf4"] == pytest.approx((served - stock_bytes) / stock_bytes)
    loaded = gnmr_hf.load_planned(tiny_llama_dir, tmp_path / dtype / "profile.json", dtype=torch.bfloat16)
    mods = dict(loaded.named_modules())
    assert sorted(n for n, m in mods.items() if isinstance(m, bnb.nn.Linear8bitLt)) == \
        sorted(n for n, r in rungs.items() if r == "int8")
    # the training model: each planned linear's recovery path on its rung, the planned set active at every step
    by_name = {}
    for u in gnmr_hf.planning.passes._units(model, "linears"):
        for name, m in zip(u.modules, u.dual):
            by_name[name] = m._gnmr_source
    assert all(isinstance(by_name[n], Int8RecoveryWeight if r == "int8" else RecoveryWeight) for n, r in rungs.items())
    assert all(type(src) is RecoveryWeight for n, src in by_name.items() if n not in rungs)
    assert len(record["indices"]) == len(rungs) and sorted(policy.units) == record["indices"]
    gnmr_hf.set_active_units(model, record["indices"])
    assert gnmr_hf.recovery_device_bytes(model) == record["held_bytes"] == policy.set_bytes > 0
    saved = json.loads((tmp_path / dtype / "profile.json").read_text())
    assert saved["rungs"] == rungs and len(saved["units"]) == 28


def test_an_int8_only_ladder_plans_no_bf16(tiny_llama_dir, smollm2_dir, tmp_path):
    _, _, record = _ladder(tiny_llama_dir, smollm2_dir, tmp_path, budget="+10%nf4", rungs="int8")
    assert set(record["rungs"].values()) == {"int8"} and record["skip_modules"] == []
    assert record["rung_counts"] == {"int8": len(record["rungs"])}


def test_export_and_eval_refuse_a_ladder_plan_in_one_line(tmp_path):
    from gnmr_hf.evaluation.evaluate import EvalError, read_skip_modules
    from gnmr_hf.export import ExportError, _read_plan

    path = tmp_path / "profile.json"
    path.write_text(json.dumps({"rungs": {"model.layers.0.mlp.down_proj": "int8",
                                          "model.layers.1.self_attn.v_proj": "bf16"}}))
    with pytest.raises(ExportError, match=r"precision-ladder plan with 1 INT8 linears \(e\.g\. model\.layers\.0\.mlp"
                                          r"\.down_proj\): bitsandbytes' format holds one low precision per checkpoint"
                                          r".*--format compressed-tensors.*gnmr_hf\.load_planned") as e:
        _read_plan(path)
    assert "\n" not in str(e.value)
    with pytest.raises(EvalError, match=r"--skip-modules .*precision-ladder plan with 1 INT8 linears .*load_planned"):
        read_skip_modules(str(path))


def test_load_planned_takes_a_device_map(tiny_llama_dir):
    import torch

    from gnmr_hf.planning.ladder import load_planned

    rungs = {"model.layers.0.mlp.down_proj": "int8", "model.layers.1.self_attn.v_proj": "bf16"}
    model = load_planned(tiny_llama_dir, rungs, dtype=torch.bfloat16, device_map={"": "cpu"})
    mods = dict(model.named_modules())
    assert type(mods["model.layers.0.mlp.down_proj"]).__name__ == "Linear8bitLt"
    assert type(mods["model.layers.1.self_attn.v_proj"]) is torch.nn.Linear
    assert mods["model.layers.0.mlp.down_proj"].weight.device.type == "cpu"


@pytest.mark.slow
def test_the_ladder_recipe_three_steps(tmp_path, smollm2_dir):
    import bitsandbytes as bnb
    import torch

    import gnmr_hf
    from tests.test_recipes_e2e import _launch, _trace

    out = tmp_path / "planned-ladder-nf4"
    proc = _launch("cpu.yaml", "planned-ladder-nf4", out)
    assert "the precision ladder at +10%nf4" in proc.stdout
    record = json.loads((out / "run.json").read_text())
    assert record["status"] == "complete" and record["global_step"] == 3
    plan = record["profile"]["plan"]
    assert record["profile"]["rungs"] == ["int8", "bf16"]
    assert plan["rung_counts"]["int8"] > 0 and 0 < plan["memory_over_nf4"] <= 0.10
    lines = _trace(out)
    assert [x["step"] for x in lines] == [1, 2, 3]
    assert all(sorted(x["active"]) == sorted(plan["indices"]) for x in lines)  # fixed rungs at every step
    saved = json.loads((out / "profile.json").read_text())
    assert saved["rungs"] == plan["rungs"] and len(saved["units"]) == 210
    served = gnmr_hf.load_planned(smollm2_dir, out / "profile.json", dtype=torch.float32)
    mods = dict(served.named_modules())
    assert sum(isinstance(m, bnb.nn.Linear8bitLt) for m in mods.values()) == plan["rung_counts"]["int8"]
