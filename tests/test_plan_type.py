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
