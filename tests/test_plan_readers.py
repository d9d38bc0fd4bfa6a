"""Plan is the only reader of a plan file: the exports' readers, load_planned's and SensitivityProfile.from_json give
the rungs Plan.load gives, on a committed gnmr-hf profile file and a ladder recipe's plan; a folder means
its profile.json for each of them; an INT4 plan is refused by every bitsandbytes reader in Plan's words."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from gnmr_hf.export import ExportError, read_plan
from gnmr_hf.export_ct import read_rungs
from gnmr_hf.planning.groups import INT4_PROFILE
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.results import SensitivityProfile

ROOT = Path(__file__).resolve().parents[1]
PROFILE = ROOT / "tests" / "data" / "profile_format1.json"  # gnmr-hf profile's file, format 1
#: a ladder recipe's profile.json (its rungs, its plan record; units and losses left out)
LADDER = {"rungs": {"model.layers.0.mlp.down_proj": "int8", "model.layers.1.self_attn.v_proj": "bf16"},
          "plan": {"rung_counts": {"int8": 1, "bf16": 1}, "budget": "+10%nf4", "policy": "static"}}


@pytest.fixture
def folders(tmp_path):
    (tmp_path / "bf16").mkdir()
    shutil.copy(PROFILE, tmp_path / "bf16" / "profile.json")
    (tmp_path / "ladder").mkdir()
    (tmp_path / "ladder" / "profile.json").write_text(json.dumps(LADDER))
    return tmp_path


def test_the_readers_give_plan_loads_rungs(folders):
    raw = json.loads(PROFILE.read_text())
    plan = Plan.load(folders / "bf16")
    assert plan.rungs == {n: "bf16" for n in raw["skip_modules"] if n != "lm_head"} and plan.keep_modules == ["lm_head"]
    assert read_plan(folders / "bf16") == (raw["skip_modules"], raw)  # the stock skip list, as the file wrote it
    assert read_rungs(folders / "bf16")[0] == plan.rungs
    prof = SensitivityProfile.from_json(folders / "bf16")  # a folder too, its plan part from Plan
    assert prof.plan == plan and len(prof.units) == len(raw["units"])

    ladder = Plan.load(folders / "ladder")
    rungs = LADDER["rungs"]
    assert ladder.rungs == rungs and ladder.rung_set == ("int8", "bf16") and ladder.budget == "+10%nf4"
    assert read_rungs(folders / "ladder")[0] == rungs
    assert read_plan(folders / "ladder", ladder=True)[0] == sorted(rungs)  # --merge: the names only
    with pytest.raises(ExportError, match=r"precision-ladder plan with \d+ INT8 linears .*--format compressed-tensors"):
        read_plan(folders / "ladder")


def test_an_int4_plan_is_refused_by_the_bitsandbytes_readers_in_plan_words(tmp_path):
    from gnmr_hf.planning.ladder import load_planned

    path = Plan(rungs={"model.layers.0.mlp.down_proj": "int8"}, low="int4", group_size=64,
                rung_set=("int8", "bf16")).save(tmp_path / "profile.json")
    plan = Plan.load(path)
    assert plan.is_int4 and plan.on("int8") == ["model.layers.0.mlp.down_proj"]
    with pytest.raises(ExportError, match=f"was {INT4_PROFILE}"):
        read_plan(path)
    with pytest.raises(PlanError, match=f"was {INT4_PROFILE} \\(load_planned loads bitsandbytes low paths\\)"):
        load_planned(tmp_path, path)
    assert read_rungs(path)[0] == plan.rungs  # the compressed-tensors export takes it


def test_a_hand_built_skip_list_and_a_missing_file(tmp_path):
    path = tmp_path / "skips.json"
    path.write_text(json.dumps({"skip_modules": ["lm_head", "model.layers.1.mlp.up_proj"]}))
    plan = Plan.load(path)
    assert plan.rungs == {"model.layers.1.mlp.up_proj": "bf16"} and plan.skip_modules()[0] == "lm_head"
    assert plan.chosen_by["writer"] == "hand-built"
    with pytest.raises(ExportError, match="no such profile.json: .*a folder without profile.json"):
        read_rungs(tmp_path)
    with pytest.raises(ExportError, match="no such profile.json: .*no such plan file"):
        read_plan(tmp_path / "nope.json")
