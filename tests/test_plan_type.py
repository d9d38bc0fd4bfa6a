"""Issue 59, step 1 and its feed into step 2: :class:`gnmr_hf.planning.Plan`, one type for every plan.

``Plan.load`` reads every profile.json this project has written (the ones committed under bench/results, and
each of today's four writers: ``gnmr-hf profile`` BF16 and ``--low int4``, the planned recipe, the ladder
recipe), ``Plan.save`` round-trips, the stock skip list and the bitsandbytes config come from it; a recipe's
``--profile.plan P`` trains with P's rungs as saved, runs no profile pass and refuses in one line a plan of
another model, low format, group size or layout. Tiny models (2 layers, hidden 64) throughout.
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import sys
from pathlib import Path

import pytest
import torch

from gnmr_hf.planning import Plan, PlanError
from tests.conftest import make_tiny_llama
from tests.test_profile_faults_r3 import WORDS, tiny_tokenizer

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402

SMOL = ROOT / "recipes" / "smollm2-135m"
COMMITTED = sorted(ROOT.glob("bench/results/**/profile.json"))


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("plan_type") / "model", num_layers=2, hidden=64)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """The same architecture and shapes, other weights: only the identity tells them apart."""
    path = make_tiny_llama(tmp_path_factory.mktemp("plan_type_other") / "model", num_layers=2, hidden=64, seed=1)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    r = random.Random(0)
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(4)))
    return path


def _profile(*argv):
    from gnmr_hf.planning.cli import main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = main([str(a) for a in argv])
    assert rc == 0, err.getvalue()
    return out.getvalue()


def _base(model_dir, docs, out):
    return ["--model", model_dir, "--data", docs, "--max-seq-len", 16, "--batch-size", 2, "--batches", 2, "--quiet",
            "--no-plot", "--output", out]


@pytest.fixture(scope="module")
def cli_nf4(model_dir, docs, tmp_path_factory):
    """``gnmr-hf profile --low nf4 --budget +15%nf4``: the BF16-only plan and (its ladder table's row at +15 %, a
    budget of the user's that is none of the table's own points) the ladder plan."""
    out = tmp_path_factory.mktemp("cli") / "nf4"
    _profile(*_base(model_dir, docs, out), "--low", "nf4", "--budget", "+15%nf4")
    return out


@pytest.fixture(scope="module")
def cli_int4(model_dir, docs, tmp_path_factory):
    pytest.importorskip("compressed_tensors")
    out = tmp_path_factory.mktemp("cli") / "int4"
    _profile(*_base(model_dir, docs, out), "--low", "int4", "--group-size", 64, "--budget", "+10%int4")
    return out


def _recipe(out, *argv, ladder=False):
    return finetune.validate(finetune.load_config([
        "--config", str(SMOL / ("planned-ladder-nf4.yaml" if ladder else "planned-nf4.yaml")), "--output_dir", str(out),
        "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true", *argv]))


def _data():
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": [1] * 12, "labels": ids}
            for ids in torch.randint(0, 100, (8, 12), generator=g).tolist()]


def _planned(model_dir, recipe):
    from transformers import AutoTokenizer

    model = finetune.load_model(recipe, str(model_dir))
    policy, record = finetune.planned_policy(recipe, model, _data(), AutoTokenizer.from_pretrained(model_dir),
                                             str(model_dir))
    return model, policy, record


@pytest.fixture(scope="module")
def recipe_bf16(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "bf16"
    _planned(model_dir, _recipe(out, "--profile.budget", "+25%nf4"))
    return out


@pytest.fixture(scope="module")
def recipe_ladder(model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("recipe") / "ladder"
    _planned(model_dir, _recipe(out, "--profile.budget", "+25%nf4", ladder=True))
    return out


# ------------------------------------------------------------------------------------------- Plan.load


@pytest.mark.parametrize("path", COMMITTED, ids=[p.parent.name for p in COMMITTED])
def test_every_committed_profile_json_loads(path):
    assert COMMITTED, "no profile.json under bench/results"
    plan = Plan.load(path)
    again = Plan.load(path.parent)  # a folder means DIR/profile.json
    assert plan == again and plan.source == path
    # the committed ones are profiles without a plan (the bench planned in memory): no rungs, said so
    assert not plan.planned and plan.rungs == {}
    assert plan.chosen_by["batches"] == json.loads(path.read_text())["batches"]
    with pytest.raises(PlanError, match="is a profile without a plan"):
        plan.require_planned()


def test_the_profile_written_before_the_planning_package_loads():
    fixture = ROOT / "tests" / "data" / "profile_format1.json"
    raw = json.loads(fixture.read_text())
    plan = Plan.load(fixture)
    assert plan.planned and list(plan.rungs) == raw["plan"]["modules"]
    assert plan.skip_modules() == raw["skip_modules"]


def test_the_cli_bf16_schema(cli_nf4, model_dir):
    raw = json.loads((cli_nf4 / "profile.json").read_text())
    plan = Plan.load(cli_nf4)
    assert (plan.low, plan.group_size, plan.groups, plan.rung_set, plan.budget) == ("nf4", None, None, ("bf16",),
                                                                                      "+15%nf4")
    assert set(plan.rungs.values()) == {"bf16"} and list(plan.rungs) == raw["plan"]["modules"]
    assert plan.skip_modules() == raw["skip_modules"]  # the stock skip list, derived
    cfg = plan.bnb_config(compute_dtype=torch.float32)
    assert cfg.load_in_4bit and cfg.bnb_4bit_quant_type == "nf4" and cfg.llm_int8_skip_modules == raw["skip_modules"]
    assert plan.model_identity == raw["meta"]["model_identity"]
    assert plan.chosen_by["criterion"] == raw["criterion"] and plan.chosen_by["batches"] == 2
    assert plan.chosen_by["writer"] == "gnmr-hf profile"
    # its ladder plan: the ladder table's row at the file's own budget (+15 %, added to the table's points)
    ladder = Plan.load(cli_nf4, rung_set=("int8", "bf16"))
    row = next(r for r in raw["ladder"]["rows"] if r["memory_over_low"] == pytest.approx(0.15)
               and r["rungs"] == "int8+bf16")
    assert ladder.rung_set == ("int8", "bf16") and ladder.rungs == row["rung_of"] and ladder.rungs
    assert ladder.price_bytes == row["price_bytes"] <= ladder.budget_bytes == row["budget_bytes"]


def test_the_cli_int4_schema(cli_int4):
    raw = json.loads((cli_int4 / "profile.json").read_text())
    plan = Plan.load(cli_int4 / "profile.json")
    assert (plan.low, plan.group_size, plan.groups, plan.rung_set) == ("int4", 64, raw["groups"], ("int8", "bf16"))
    assert plan.rungs == raw["rungs"] and plan.budget_bytes == raw["budget_bytes"]
    assert plan.price_bytes == raw["price_bytes"] and plan.model_identity == raw["model_identity"]
    assert "int4" in plan.describe() and "group 64" in plan.describe()
    for derived in (plan.skip_modules, plan.bnb_config):
        with pytest.raises(PlanError, match="compressed-tensors INT4 export"):
            derived()


def test_the_planned_recipe_schema(recipe_bf16):
    raw = json.loads((recipe_bf16 / "profile.json").read_text())
    plan = Plan.load(recipe_bf16)
    assert plan.rung_set == ("bf16",) and list(plan.rungs) == raw["plan"]["modules"] and plan.rungs
    assert plan.skip_modules() == raw["skip_modules"]
    assert (plan.budget, plan.budget_bytes, plan.price_bytes) == ("+25%nf4", raw["plan"]["budget_bytes"],
                                                                  raw["plan"]["price_over_nf4_bytes"])
    assert plan.chosen_by["writer"] == "a planned recipe" and plan.chosen_by["policy"] == "static"


def test_the_ladder_recipe_schema(recipe_ladder):
    raw = json.loads((recipe_ladder / "profile.json").read_text())
    plan = Plan.load(recipe_ladder)
    assert plan.rungs == raw["rungs"] and plan.rung_set == ("int8", "bf16") and plan.low == "nf4"
    assert plan.model_identity == raw["model_identity"] and plan.price_bytes == raw["plan"]["price_over_nf4_bytes"]
    if "int8" in plan.rungs.values():
        with pytest.raises(PlanError, match="on INT8"):
            plan.skip_modules()


def test_save_and_load_round_trip(cli_nf4, recipe_ladder, cli_int4, tmp_path):
    for i, plan in enumerate([Plan.load(cli_nf4), Plan.load(cli_nf4, rung_set=("int8", "bf16")),
                              Plan.load(recipe_ladder), Plan.load(cli_int4)]):
        path = plan.save(tmp_path / f"{i}.json", note="extra keys are kept and ignored")
        again = Plan.load(path)
        assert again == plan and json.loads(path.read_text())["schema_version"] == 1
    folder = tmp_path / "folder"
    folder.mkdir()
    assert Plan.load(Plan.load(cli_nf4).save(folder)) == Plan.load(cli_nf4)  # a folder: DIR/profile.json


def test_load_refusals_are_one_plan_error_line(tmp_path):
    cases = {
        "missing": (tmp_path / "nope.json", "no such plan file"),
        "folder": (tmp_path, "a folder without profile.json"),
    }
    (tmp_path / "text.json").write_text("not json")
    cases["text"] = (tmp_path / "text.json", "not JSON")
    (tmp_path / "rung.json").write_text(json.dumps({"rungs": {"model.layers.0.mlp.up_proj": "fp8"}}))
    cases["rung"] = (tmp_path / "rung.json", "unknown rung")
    (tmp_path / "v.json").write_text(json.dumps({"schema_version": 9, "kind": "gnmr_hf.plan", "low": "nf4",
                                                 "rungs": {}}))
    cases["version"] = (tmp_path / "v.json", "schema_version 9")
    (tmp_path / "p.json").write_text(json.dumps({"units": [], "losses": {}}))
    cases["profile"] = (tmp_path / "p.json", r"neither a ladder plan \(no 'rungs'\) nor a profile")
    for name, (path, message) in cases.items():
        with pytest.raises(PlanError, match=message) as e:
            Plan.load(path)
        assert "\n" not in str(e.value), name


# ------------------------------------------------------------------------- step 1 feeds step 2: --profile.plan


def _count_profile_passes(monkeypatch):
    """Every profile pass a plan can be made with (the BF16 planner's sensitivity profile, the ladder's rung gains,
    the INT4 ladder's), counted where make_plan calls them."""
    import gnmr_hf
    from gnmr_hf.planning import int4, ladder, profiler, rung_criteria

    calls = []

    def counted(name, real):
        def wrapper(*a, **k):
            calls.append(name)
            return real(*a, **k)
        return wrapper

    real = profiler.profile_sensitivity
    monkeypatch.setattr(gnmr_hf, "profile_sensitivity", counted("profile_sensitivity", real))
    monkeypatch.setattr(profiler, "profile_sensitivity", counted("profile_sensitivity", real))
    monkeypatch.setattr(ladder, "rung_gains", counted("rung_gains", ladder.rung_gains))
    monkeypatch.setattr(int4, "ct_rung_gains", counted("ct_rung_gains", int4.ct_rung_gains))
    monkeypatch.setattr(rung_criteria, "criterion_rung_gains",
                        counted("criterion_rung_gains", rung_criteria.criterion_rung_gains))
    return calls


def test_profile_then_the_ladder_recipe_with_profile_plan(cli_nf4, model_dir, tmp_path, monkeypatch):
    from gnmr_hf.backends.recovery import Int8RecoveryWeight, RecoveryWeight
    from gnmr_hf.planning.passes import _units

    calls = _count_profile_passes(monkeypatch)
    out = tmp_path / "ladder"
    # planned-ladder-nf4.yaml's own budget (in the file) is not the plan's: the plan is used as saved
    model, policy, record = _planned(model_dir, _recipe(out, "--profile.plan", str(cli_nf4), ladder=True))
    assert calls == []  # no profile pass at all
    saved = Plan.load(cli_nf4, rung_set=("int8", "bf16"))
    assert record["rungs"] == saved.rungs and saved.rungs
    assert Plan.load(out).rungs == saved.rungs  # the run's profile.json: the same plan, rung for rung
    assert json.loads((out / "profile.json").read_text())["rungs"] == saved.rungs  # load_planned's schema
    # the training model: each planned linear on its rung, the planned set on at every step
    by_name = {n: m._gnmr_source for u in _units(model, "linears") for n, m in zip(u.modules, u.dual)}
    assert all(isinstance(by_name[n], Int8RecoveryWeight if r == "int8" else RecoveryWeight)
               for n, r in saved.rungs.items())
    assert sorted(policy.units) == record["indices"] and len(record["indices"]) == len(saved.rungs)
    assert record["price_over_nf4_bytes"] == saved.price_bytes  # the plan's price, in the one currency


@pytest.mark.parametrize("ladder", [True, False], ids=["ladder", "bf16"])
def test_gnmr_hf_profile_then_a_trained_run_with_profile_plan(cli_nf4, model_dir, tmp_path, monkeypatch, ladder):
    """``gnmr-hf profile --output P`` (the fixture), then the recipe run in-process with ``--profile.plan P``: one
    step trained, no profile pass, and the run's plan is P's rung for rung."""
    calls = _count_profile_passes(monkeypatch)
    out = tmp_path / "run"
    record = finetune.run(_recipe(out, "--profile.plan", str(cli_nf4), "--model", str(model_dir), "--max_steps", "1",
                                  "--max_train_examples", "16", ladder=ladder))
    assert calls == []
    assert record["status"] == "complete" and record["global_step"] == 1
    want = Plan.load(cli_nf4, rung_set=("int8", "bf16") if ladder else None)
    assert want.rungs and Plan.load(out, rung_set=want.rung_set).rungs == want.rungs
    planned = record["profile"]["plan"]
    assert planned["rungs"] == want.rungs and planned["plan_file"] == str(cli_nf4 / "profile.json")
    assert planned["profile_seconds"] == 0.0 and planned["ranks_agreed"] == 1


def test_profile_then_the_planned_recipe_with_profile_plan(cli_nf4, model_dir, tmp_path, monkeypatch):
    calls = _count_profile_passes(monkeypatch)
    _planned(model_dir, _recipe(tmp_path / "control", "--profile.budget", "+25%nf4"))
    assert calls == ["profile_sensitivity"]  # the counter sees a recipe's profile pass
    calls.clear()
    out = tmp_path / "bf16"
    _, policy, record = _planned(model_dir, _recipe(out, "--profile.plan", str(cli_nf4 / "profile.json")))
    assert calls == []
    saved = Plan.load(cli_nf4)
    assert record["modules"] == list(saved.rungs) and record["skip_modules"] == saved.skip_modules()
    run_plan = Plan.load(out)
    assert run_plan.rungs == saved.rungs and run_plan.skip_modules() == saved.skip_modules()
    assert sorted(policy.units) == record["indices"]


def _refused(recipe, model_dir, monkeypatch, message):
    """The recipe run in-process up to the plan check: refused in one line, the model never loaded."""
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the plan was checked")

    monkeypatch.setattr(finetune, "load_model", no_load)
    with pytest.raises(finetune.RecipeError, match=message) as e:
        finetune.run(recipe)
    assert "\n" not in str(e.value)
    assert not (Path(recipe.training.output_dir) / "profile.json").exists()
    return str(e.value)


_RUN = ["--max_steps", "1", "--max_train_examples", "8"]


def test_a_plan_of_another_model_is_refused_before_training(cli_nf4, other_dir, tmp_path, monkeypatch):
    recipe = _recipe(tmp_path / "o", "--profile.plan", str(cli_nf4), "--model", str(other_dir), *_RUN, ladder=True)
    _refused(recipe, other_dir, monkeypatch, r"profile\.plan: .*profile\.json was made for another model than .*: "
                                             r"its weights' fingerprint")


def test_a_plan_of_another_low_format_or_group_size_is_refused(cli_int4, cli_nf4, model_dir, tmp_path, monkeypatch):
    # an INT4 (group 64) plan given to an NF4 run
    recipe = _recipe(tmp_path / "a", "--profile.plan", str(cli_int4), "--model", str(model_dir), *_RUN, ladder=True)
    _refused(recipe, model_dir, monkeypatch, r"is an? int8\+bf16 ladder plan over int4 \(group 64\), .*this run trains "
                                             r"over nf4 .*gnmr-hf profile --model .* --low nf4")
    # an NF4 plan given to an INT8-base run (precision gnmr)
    recipe = finetune.validate(finetune.load_config([
        "--config", str(SMOL / "gnmr.yaml"), "--profile.plan", str(cli_nf4), "--model", str(model_dir),
        "--output_dir", str(tmp_path / "b"), *_RUN]))
    _refused(recipe, model_dir, monkeypatch, r"plan over nf4, free; this run trains over int8 \(precision gnmr\)")


def test_a_plan_of_another_layout_is_refused_with_the_command_that_fits(cli_nf4, recipe_ladder, model_dir, tmp_path,
                                                                          monkeypatch):
    # a BF16-only plan (no ladder table in it) given to the ladder recipe: the profile command that writes one
    bf16_only = Plan.load(cli_nf4).save(tmp_path / "bf16.json")
    recipe = _recipe(tmp_path / "a", "--profile.plan", str(bf16_only), "--model", str(model_dir), *_RUN, ladder=True)
    line = _refused(recipe, model_dir, monkeypatch, r"is a BF16-only plan over nf4, free, not a plan over \[int8, bf16\]")
    assert "gnmr-hf profile --model" in line and "--low nf4 --budget +15%nf4 --output DIR writes the ladder plan" in line
    # a ladder plan given to the BF16-only recipe
    recipe = _recipe(tmp_path / "b", "--profile.plan", str(recipe_ladder), "--model", str(model_dir), *_RUN)
    _refused(recipe, model_dir, monkeypatch, r"ladder plan .*not a plan over \[bf16\].*profile\.rungs int8,bf16")
    # a free plan given to a grouped run
    recipe = _recipe(tmp_path / "c", "--profile.plan", str(cli_nf4), "--profile.groups", "vllm", "--model",
                     str(model_dir), *_RUN)
    _refused(recipe, model_dir, monkeypatch, r"was planned free, not with profile\.groups vllm: gnmr-hf profile .* "
                                             r"--groups vllm")


def test_profile_plan_parse_refusals():
    with pytest.raises(finetune.RecipeError, match=r"profile\.plan .* needs profile\.policy static, got hybrid"):
        finetune.load_config(["--config", str(SMOL / "hybrid-nf4.yaml"), "--profile.plan", "prof"])
    with pytest.raises(finetune.RecipeError, match=r"profile\.budget \(set on the command line\) has no effect with "
                                                   r"profile\.plan"):
        finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.plan", "prof",
                              "--profile.budget", "+5%nf4"])
    r = finetune.load_config(["--config", str(SMOL / "planned-ladder-nf4.yaml"), "--profile.plan", "prof"])
    assert r.profile.plan == "prof" and r.profile.enabled


def test_the_compressed_tensors_config_is_derived_from_the_plan(cli_int4, model_dir):
    from gnmr_hf.planning.groups import decoder_linears
    from gnmr_hf.planning.ladder import _meta_model

    plan = Plan.load(cli_int4)
    linears = decoder_linears(_meta_model(model_dir))
    cfg = plan.ct_config(linears)
    by_bits = {g.weights.num_bits: g for g in cfg.config_groups.values()}
    assert sorted(by_bits[4].targets) == sorted(n for n in linears if n not in plan.rungs)
    assert by_bits[4].weights.group_size == 64
    assert sorted(by_bits[8].targets) == sorted(n for n, r in plan.rungs.items() if r == "int8")
    assert sorted(cfg.ignore) == sorted(["lm_head"] + [n for n, r in plan.rungs.items() if r == "bf16"])
    with pytest.raises(PlanError, match="none of the given linears"):
        plan.ct_config(linears[:1])


def test_a_planned_run_on_an_int8_base_records_its_low(model_dir, tmp_path, monkeypatch):
    out = tmp_path / "int8"
    recipe = finetune.validate(finetune.load_config([
        "--config", str(SMOL / "gnmr.yaml"), "--profile.budget", "25%", "--output_dir", str(out),
        "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]))
    _planned(model_dir, recipe)
    plan = Plan.load(out)
    assert plan.low == "int8" and plan.rungs and plan.bnb_config().load_in_8bit
    # and it trains again as saved on an INT8 base, while an NF4 run refuses it
    again = finetune.validate(finetune.load_config([
        "--config", str(SMOL / "gnmr.yaml"), "--profile.plan", str(out), "--output_dir", str(tmp_path / "again"),
        "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]))
    calls = _count_profile_passes(monkeypatch)
    _, _, record = _planned(model_dir, again)
    assert calls == [] and record["rungs"] == plan.rungs and Plan.load(tmp_path / "again").low == "int8"
    with pytest.raises(finetune.RecipeError, match=r"plan over int8, free; this run trains over nf4"):
        finetune.check_saved_plan(_recipe(tmp_path / "nf4", "--profile.plan", str(out)), str(model_dir))


def test_the_bitsandbytes_export_reads_a_saved_plan(cli_nf4, recipe_ladder, tmp_path):
    from gnmr_hf import export

    saved = Plan.load(cli_nf4).save(tmp_path / "bf16.json")
    skips, _ = export._read_plan(saved)
    assert skips == Plan.load(cli_nf4).skip_modules() == json.loads((cli_nf4 / "profile.json").read_text())["skip_modules"]
    ladder = Plan.load(recipe_ladder)
    path = ladder.save(tmp_path / "ladder.json")
    assert export._read_plan(path, ladder=True)[0] == sorted(ladder.rungs)
    if "int8" in ladder.rungs.values():
        with pytest.raises(export.ExportError, match="on INT8 .*export it with --format compressed-tensors"):
            export._read_plan(path)
