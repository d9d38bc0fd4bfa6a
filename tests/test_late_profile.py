"""bench/value/late_profile.py: the rank statistics (hand-worked), and the whole script on SmolLM2 after a 2-step
QLoRA run (slow)."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import load_bench

ROOT = Path(__file__).resolve().parents[1]


def test_ranks_and_spearman_by_hand():
    lp = load_bench("late_profile")
    assert lp.ranks([0.3, 0.1, 0.2]) == [3.0, 1.0, 2.0]
    assert lp.ranks([1.0, 2.0, 1.0, 3.0]) == [1.5, 3.0, 1.5, 4.0]  # ties share their mean rank
    assert lp.spearman([1, 2, 3, 4], [10, 20, 30, 40]) == pytest.approx(1.0)
    assert lp.spearman([1, 2, 3, 4], [4, 3, 2, 1]) == pytest.approx(-1.0)
    # d = rank differences (0, 0, 1, -1): 1 - 6 * 2 / (4 * 15) = 0.8 (no ties)
    assert lp.spearman([1, 2, 3, 4], [1, 2, 4, 3]) == pytest.approx(0.8)


@pytest.mark.slow
def test_late_profile_on_a_trained_smollm2_adapter(tmp_path, smollm2_dir):
    root = tmp_path / "bench"
    env_cmd = [sys.executable, str(ROOT / "bench" / "value" / "qlora_budget.py")]
    subprocess.run([*env_cmd, "profile", "--out", str(root), "--batches", "1"], check=True, capture_output=True)
    # the whole run path as the runner starts it: its own interpreter in another folder, so nothing the test session
    # imported helps it find recipes/finetune.py (a refactor once left qlora_budget's build importing the recipes'
    # loader before anything put it on the path, and every run of a plan failed while the unit tests stayed green)
    run = subprocess.run([*env_cmd, "run", "--method", "nf4", "--seed", "0", "--steps", "2", "--eval-problems", "4",
                          "--out", str(root / "nf4" / "seed0"), "--save-adapter", str(root / "adapter")],
                         capture_output=True, text=True, cwd=tmp_path)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((root / "nf4" / "seed0" / "result.json").read_text())
    assert result["steps"] == 2 and len(result["train_losses"]) == 2
    assert all(math.isfinite(x) for x in result["train_losses"])
    served, merged = result["heldout_loss_served"], result["heldout_loss_merged"]
    assert math.isfinite(served) and math.isfinite(merged) and served != merged  # two bases: NF4, then BF16
    assert result["memory_over_nf4"] == 0 and result["served_weight_bytes"] == result["nf4_weight_bytes"]
    assert result["peak_rss_bytes"] > result["trained_model_bytes"] > result["nf4_weight_bytes"]
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "value" / "late_profile.py"), "--root", str(root), "--adapter",
                           str(root / "adapter"), "--out", str(tmp_path / "late"), "--batches", "1",
                           "--eval-problems", "4", "--write-profile"], check=True, capture_output=True, text=True)
    record = json.loads((tmp_path / "late" / "late_profile.json").read_text())
    rows = record["rows"]
    table = json.loads((root / "nf4" / "seed0" / "result.json").read_text())
    # all-NF4 and all-BF16 with the trained adapter are the run's own served and merged losses
    assert rows["all NF4"]["heldout_loss"] == pytest.approx(table["heldout_loss_served"], abs=1e-5)
    assert rows["all BF16"]["heldout_loss"] == pytest.approx(table["heldout_loss_merged"], abs=1e-5)
    assert rows["all NF4"]["gap_closed"] == 0 and rows["all BF16"]["gap_closed"] == pytest.approx(1.0)
    init = json.loads((root / "profile.json").read_text())
    late = [u["score"] for u in record["late_scores"]]
    assert [u["name"] for u in record["late_scores"]] == [u["name"] for u in init["units"]]
    assert late != [u["score"] for u in init["units"]]  # the trained adapter moved the profile
    assert -1 <= record["spearman"] <= 1 and 0 < rows["late plan"]["units"] < 210
    # each plan is the product's planner over its own profile (greedy by score per byte, 10 % of the BF16 bytes)
    from gnmr_hf.planning import greedy_select

    ub = [u["bytes"] for u in init["units"]]
    names = [u["name"] for u in init["units"]]
    for label, scores in (("init plan", [u["score"] for u in init["units"]]), ("late plan", late)):
        assert record["sets"][label] == [names[i] for i in greedy_select(scores, ub, sum(ub) * 10 // 100)]
    assert "| late plan |" in proc.stdout
    # --write-profile: the trained-point scores in profile.json's layout, which qlora_budget's late-op plans read
    written = json.loads((root / "profile_late.json").read_text())
    assert [u["name"] for u in written["units"]] == names and [u["score"] for u in written["units"]] == late
    assert [u["bytes"] for u in written["units"]] == ub
    qb = load_bench("qlora_budget")
    assert qb.parse_method("late-op-10") == ("late-op", 10)
    assert [names[i] for i in qb.static_set("late-op", 10, ub, late, 0)] == record["sets"]["late plan"]
