"""bench/value/qlora_budget.py: method sets, equal-bytes accounting, plan order, resume and report arithmetic,
on fake runs with values worked out by hand."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_bench

qb = load_bench("qlora_budget")


def test_greedy_fill_skips_what_does_not_fit():
    # bytes 10, 1, 1, 5 and 6 bytes, in order 0..3: 0 does not fit, 1 and 2 do (2 bytes), 3 would make 7
    assert qb.greedy_fill([0, 1, 2, 3], [10, 1, 1, 5], 6) == [1, 2]
    assert qb.greedy_fill([3, 0, 1, 2], [10, 1, 1, 5], 6) == [1, 3]
    assert qb.greedy_fill([0, 1], [10, 1], 0) == []


def test_profiled_sets_are_the_products_plan():
    # 2 layers x 7 ops; bytes: attention ops 1, MLP ops 4 (total 2 * (4 + 12) = 32)
    ub = [1, 1, 1, 1, 4, 4, 4] * 2
    scores = [0.0] * 14
    scores[2], scores[9], scores[6], scores[13] = 0.5, 0.3, 1.0, -1.0  # v0: 0.5/B, v1... ; down0: 0.25/B
    scores[1] = 0.5  # k0 ties v0 per byte: lower index first
    # per byte: k0 0.5, v0 0.5, o1 0.3, down0 0.25; down1 (-1) never
    # 10 % of 32 bytes = 3: k0, v0, o1 (1 byte each)
    assert qb.static_set("prof-op", 10, ub, scores, seed=0) == [1, 2, 9]
    # 25 %: 8 bytes: k0, v0, o1 (3), down0 (4 -> 7)
    assert qb.static_set("prof-op", 25, ub, scores, seed=0) == [1, 2, 6, 9]
    # hybrid plans 3/4 of the budget: 25 % -> 6 bytes: k0, v0, o1 (down0 would make 7)
    assert qb.static_set("hybrid", 25, ub, scores, seed=0) == [1, 2, 9]
    # by layer: layer 0 scores 2.0 over 16 bytes, layer 1 scores -0.7: only layer 0, and only from 50 %
    assert qb.static_set("prof-layer", 50, ub, scores, seed=0) == list(range(7))
    assert qb.static_set("prof-layer", 25, ub, scores, seed=0) == []


def test_edge_and_random_sets_respect_the_bytes():
    ub = [2] * 7 * 4  # 4 layers of 14 bytes; total 56
    assert qb.static_set("edge", 50, ub, None, seed=0) == list(range(7)) + list(range(21, 28))  # layers 0, 3
    assert qb.static_set("edge", 25, ub, None, seed=0) == list(range(7))  # 14 bytes: layer 0 only
    a = qb.static_set("rand-op", 10, ub, None, seed=0)
    assert sum(ub[u] for u in a) <= 5 and len(a) == 2  # 10 % of 56 = 5 bytes: two 2-byte units
    assert a == qb.static_set("rand-op", 10, ub, None, seed=0) != qb.static_set("rand-op", 10, ub, None, seed=1)


def test_random_bytes_policy_redraws_within_the_budget_and_resumes():
    torch = pytest.importorskip("torch")
    ub = [1, 2, 3, 4, 5]
    p = qb.RandomBytesPolicy(5, ub, budget=6, seed=3)
    masks = [p.initial_mask()] + [p.step(torch.ones(5)) for _ in range(6)]
    for m in masks:
        assert sum(ub[u] for u in m.nonzero().flatten().tolist()) <= 6
    assert len({tuple(m.tolist()) for m in masks}) > 1  # drawn again
    q = qb.RandomBytesPolicy(5, ub, budget=6, seed=3)
    q.load_state_dict(json.loads(json.dumps(p.state_dict())))
    assert q.step(torch.ones(5)).tolist() == p.step(torch.ones(5)).tolist()
    with pytest.raises(ValueError, match="seed"):
        qb.RandomBytesPolicy(5, ub, budget=6, seed=4).load_state_dict(p.state_dict())


def test_parse_method_and_unknown_methods():
    assert qb.parse_method("prof-op-10") == ("prof-op", 10)
    assert qb.parse_method("loftq+prof-op-10") == ("loftq+prof-op", 10)
    assert qb.parse_method("bf16") == ("bf16", 100) and qb.parse_method("nf4") == ("nf4", 0)
    for bad in ("prof-10", "prof-op-100", "prof-op-x", "gnmr"):
        with pytest.raises(SystemExit, match="unknown method"):
            qb.parse_method(bad)
    assert all(qb.parse_method(m) for m in qb.METHODS)


def test_plan_is_tier_by_tier_over_seeds():
    runs = qb.plan_runs([0, 1], ("bf16", "nf4", "prof-op-5", "edge-10"))
    assert runs == [("bf16", 0), ("nf4", 0), ("bf16", 1), ("nf4", 1), ("prof-op-5", 0), ("prof-op-5", 1),
                    ("edge-10", 0), ("edge-10", 1)]
    assert qb.needs_profile("hybrid-10") and qb.needs_profile("loftq+prof-op-10") and not qb.needs_profile("rand-op-10")


def _result(root, method, seed, served, merged, served_bytes=0, total=100):
    d = root / method / f"seed{seed}"
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({
        "method": method, "seed": seed, "steps": 3, "eval_problems": 4, "total_bf16_bytes": total,
        "served_set_bytes": served_bytes, "mean_active_bytes": served_bytes, "peak_active_bytes": served_bytes,
        "heldout_loss_served": served, "heldout_loss_merged": merged, "step_s_median": 1.0}))


def test_gap_closed_per_route_and_report(tmp_path):
    for seed, shift in ((0, 0.0), (1, 0.1)):
        _result(tmp_path, "bf16", seed, 1.0 + shift, 1.0 + shift, 100)
        _result(tmp_path, "nf4", seed, 2.0 + shift, 1.6 + shift)  # QLoRA: 2.0 served, 1.6 merged
        _result(tmp_path, "prof-op-10", seed, 1.5 + shift, 1.3 + shift, 10)
    runs = qb.collect(tmp_path)
    # served: (2 - 1.5) / (2 - 1) = 0.5; merged: (1.6 - 1.3) / (1.6 - 1) = 0.5 (both seeds)
    assert qb.gap_closed(runs, "prof-op-10", "served") == pytest.approx([0.5, 0.5])
    assert qb.gap_closed(runs, "prof-op-10", "merged") == pytest.approx([0.5, 0.5])
    assert qb.gap_closed(runs, "nf4", "served") == [0.0, 0.0]
    assert qb.gap_closed(runs, "bf16", "merged") == [1.0, 1.0]
    text = qb.report(type("A", (), {"out": str(tmp_path), "plot": None})())
    row = next(line for line in text.splitlines() if line.startswith("| prof-op-10 "))
    assert "| 0.100 |" in row and "0.50 [0.50, 0.50]" in row


def test_a_missing_reference_seed_is_left_out(tmp_path):
    _result(tmp_path, "bf16", 0, 1.0, 1.0, 100)
    _result(tmp_path, "nf4", 0, 2.0, 2.0)
    _result(tmp_path, "rand-op-10", 0, 1.9, 1.8, 10)
    _result(tmp_path, "rand-op-10", 1, 1.0, 1.0, 10)  # no seed-1 references: not scored
    assert qb.gap_closed(qb.collect(tmp_path), "rand-op-10", "served") == pytest.approx([0.1])


def test_served_route_keeps_the_fixed_part_only():
    assert qb.served_units("prof-op", [1, 2]) == [1, 2] and qb.served_units("hybrid", [3]) == [3]
    assert qb.served_units("bf16", [0, 1]) == [0, 1] and qb.served_units("nf4", []) == []
    for kind in ("gnmr-op", "gnmr-layer", "rand-step"):
        assert qb.served_units(kind, [5]) == []


def test_oracle_set_fills_the_bytes_by_gap_per_byte():
    ub = [1, 2, 4, 1]
    # gap per byte: 0.2, 0.45, 0.25, 0.1 -> order 1, 2, 0, 3; budget 3 bytes: 1 (2 bytes), 2 does not fit, 0 (3)
    assert qb.oracle_set([0.2, 0.9, 1.0, 0.1], ub, 3) == [0, 1]
    # a zero gap is never in the oracle set, even with bytes to spare
    assert qb.oracle_set([0.0, 0.9, 0.0, 0.0], ub, 8) == [1]
    # ties per byte: the lower index first
    assert qb.oracle_set([0.5, 1.0, 0.0, 0.5], ub, 1) == [0]


def test_oracle_scores_by_hand():
    ub, gaps = [1, 2, 4, 1], [0.2, 0.9, 1.0, 0.1]  # total 2.2; oracle at 3 bytes: {0, 1}, 1.1 of the gap
    s = qb.oracle_scores(gaps, [1, 3], ub, 3)
    assert s["precision"] == 0.5 and s["recall"] == 0.5
    assert s["bytes_recall"] == pytest.approx(2 / 3)  # unit 1's 2 bytes of the oracle's 3
    assert s["captured"] == pytest.approx(1.0 / 2.2) and s["oracle_captured"] == pytest.approx(1.1 / 2.2)
    empty = qb.oracle_scores(gaps, [], ub, 3)
    assert empty["precision"] != empty["precision"] and empty["recall"] == 0.0  # NaN: nothing chosen


def test_oracle_table_on_a_fake_run():
    # 1 layer x 7 ops, 1 byte each (total 7; 30 % = 2 bytes); three measured steps
    ub = [1] * 7
    rows = [{"step": 1, "gaps": [0, 0, 3, 2, 0, 0, 1], "active": []},
            {"step": 3, "gaps": [0, 0, 3, 2, 0, 0, 1], "active": [2, 3]},
            {"step": 5, "gaps": [5, 0, 0, 0, 0, 0, 5], "active": [2, 3]}]
    result = {"method": "gnmr-op-30", "budget_pct": 30, "unit_bytes": ub, "oracle_rows": rows}
    scores = [0, 0, 0, 0, 0, 0.5, 1.0]  # the plan: ops 6 and 5
    table = {r["trigger"]: r for r in qb.oracle_table(result, scores)}
    # as run: step 1 nothing (recall 0), step 3 the oracle set {2, 3} (1), step 5 neither of {0, 6} (0)
    run = table["gnmr-op-30 (as run)"]
    assert run["steps"] == 3 and run["recall"] == pytest.approx(1 / 3)
    assert run["captured"] == pytest.approx((0 + 5 / 6 + 0) / 3)
    assert run["precision"] == pytest.approx(0.5)  # NaN at step 1 left out: mean of 1 and 0
    plan = table["profile plan (prof-op-30)"]  # {5, 6}: the oracle holds 6 only at step 5 ({0, 6})
    assert plan["recall"] == pytest.approx((0 + 0 + 0.5) / 3)
    prev = table["previous measured step's oracle"]  # steps 3 and 5, with steps 1 and 3's oracle {2, 3}
    assert prev["steps"] == 2 and prev["recall"] == pytest.approx(0.5)
    rand = table["random operators (mean of 20 fixed sets)"]
    assert rand["steps"] == 3 * 20 and 0 <= rand["recall"] <= 1
    assert all(r["oracle_captured"] == pytest.approx((5 / 6 + 5 / 6 + 1) / 3) for r in table.values() if r["steps"] == 3)


def test_plan_ends_with_the_oracle_run_in_its_own_folder(tmp_path):
    assert qb._run_dir(tmp_path, "oracle:gnmr-op-10", 0) == tmp_path / "oracle" / "gnmr-op-10" / "seed0"
    assert qb._run_dir(tmp_path, "prof-op-10", 1) == tmp_path / "prof-op-10" / "seed1"
    assert not qb.needs_profile("oracle:gnmr-op-10")
    # the oracle run is not a table row: collect() reads <method>/seed*/ only
    d = qb.oracle_dir(tmp_path)
    d.mkdir(parents=True)
    (d / "result.json").write_text(json.dumps({"method": "gnmr-op-10", "seed": 0}))
    assert qb.collect(tmp_path) == {}


def test_bundled_routes():
    from gnmr_hf.planning import skip_modules

    assert qb.bundled_routes("bf16", []) == {"merged": ("bf16", None)}
    assert qb.bundled_routes("nf4", []) == {"served": ("nf4", None), "merged": ("bf16", None)}
    mods = ["model.layers.3.self_attn.v_proj"]
    routes = qb.bundled_routes("prof-op", mods)
    assert routes["served"] == ("nf4", skip_modules(mods)) and "lm_head" in routes["served"][1]
    assert routes["served"][1][-1] == mods[0]


def test_bundled_table_rows_and_the_check_against_the_table_run(tmp_path):
    _result(tmp_path, "prof-op-10", 0, 1.5, 1.3, 10)
    run = tmp_path / "bundled" / "prof-op-10" / "seed0"
    run.mkdir(parents=True)
    (run / "result.json").write_text(json.dumps({"method": "prof-op-10", "seed": 0, "heldout_loss_served": 1.5,
                                                 "heldout_loss_merged": 1.3002}))
    for route, em, ppl in (("served", 0.125, 40.0), ("merged", None, 35.5)):
        (run / f"eval_{route}.json").write_text(json.dumps({"summary": {"gsm8k_em": em, "wikitext_word_ppl": ppl}}))
    rows = qb.bundled_table(tmp_path)
    assert rows == ["| prof-op-10 | merged | - | 35.50 | 1.3002 | 2.0e-04 |",
                    "| prof-op-10 | served | 12.5 | 40.00 | 1.5000 | 2.0e-04 |"]


# ------------------------------------------------------------------------------ data-free baselines

def _names(num_layers):
    ops = ["self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj"]
    return [f"layers.{b}.{op}" for b in range(num_layers) for op in ops]


def test_the_heuristic_keeps_early_down_projections_then_every_v_projection():
    names = _names(4)  # unit 7 * b + 2 is layer b's v_proj, 7 * b + 6 its down_proj
    assert qb.heuristic_order(names) == [6, 13, 2, 9, 16, 23, 20, 27]
    # every unit 10 bytes, down_proj 40: a budget of 100 buys the two early down_proj (80) and two v_proj
    ub = [40 if n.endswith("down_proj") else 10 for n in names]
    assert qb.static_set("heur-op", 100 * 100 // sum(ub), ub, None, 0, names) == [2, 6, 9, 13]
    with pytest.raises(ValueError, match="names"):
        qb.static_set("heur-op", 10, ub, None, 0)


def test_the_data_free_rankings_fill_the_bytes_by_score_per_byte():
    # four linears: weight error 8, 6, 1, 0.5 over 4, 1, 1, 1 bytes -> per byte 2, 6, 1, 0.5
    ub, werr = [4, 1, 1, 1], [8.0, 6.0, 1.0, 0.5]
    # 3 of 7 bytes (pct 42 -> 2 bytes): unit 1 (6 per byte), then unit 2 (1 per byte); unit 0 does not fit
    assert qb.static_set("werr-op", 42, ub, werr, 0) == [1, 2]
    assert qb.static_set("out-op", 100 * 6 // 7, ub, werr, 0) == [0, 1]  # 5 bytes: unit 1, then unit 0 (4 bytes)
    assert qb.needs_dataless("werr-op-10") and qb.needs_dataless("out-op-5") and not qb.needs_dataless("heur-op-10")
    assert not qb.needs_profile("werr-op-10") and not qb.needs_dataless("prof-op-10")


def test_plan_runs_keeps_methods_no_tier_names():
    runs = qb.plan_runs([0], ("werr-op-25", "nf4", "werr-op-10"))
    assert runs == [("nf4", 0), ("werr-op-10", 0), ("werr-op-25", 0)]


def _planned_jobs(tmp_path, monkeypatch, methods: str) -> dict:
    """The jobs ``plan`` hands the runner for ``methods`` (seed 0), by key, without running them."""
    seen = {}
    monkeypatch.setattr(qb.runner, "run_plan", lambda jobs: seen.update(jobs=jobs))
    args = qb.main.__globals__["argparse"].Namespace(
        seeds="0", methods=methods, oracle_every=0, out=str(tmp_path), workers=1, worker=None,
        profile_batches=2, steps=3, eval_problems=4, eval_every=0)
    qb.plan(args)
    return {j.key: j for j in seen["jobs"]}


def test_the_data_free_methods_wait_for_their_own_profile(tmp_path, monkeypatch):
    jobs = _planned_jobs(tmp_path, monkeypatch, "nf4,werr-op-10,prof-op-10")
    assert jobs[("werr-op-10", 0)].needs == ("profile-dataless",) and jobs[("prof-op-10", 0)].needs == ("profile",)
    assert jobs[("nf4", 0)].needs == ()
    assert "--dataless" in jobs["profile-dataless"].cmd and jobs["profile-dataless"].done == tmp_path / "profile_dataless.json"


def _ladder_profile(root, nf4_model_bytes=1000):
    """Three linears A, B, C with hand-picked gains and prices (bytes over NF4) per rung."""
    units = [("model.layers.0.self_attn.v_proj", {"int8": 3.0, "bf16": 4.0}),
             ("model.layers.0.mlp.down_proj", {"int8": 1.0, "bf16": 6.0}),
             ("model.layers.1.self_attn.v_proj", {"int8": 2.1, "bf16": 2.5})]
    prof = {"nf4_model_bytes": nf4_model_bytes, "rungs": ["int8", "bf16"],
            "units": [{"name": n, "numel": 64, "rows": 8, "gains": g, "prices": {"int8": 30, "bf16": 90}}
                      for n, g in units]}
    (root / "profile_ladder.json").write_text(json.dumps(prof))
    return prof


def test_the_ladder_methods_plan_under_memory_over_nf4(tmp_path):
    prof = _ladder_profile(tmp_path)
    A, B, C = (u["name"] for u in prof["units"])
    assert qb.parse_method("lad-10") == ("lad", 10) and qb.parse_method("lad-int8-25") == ("lad-int8", 25)
    assert qb.parse_method("lad-bf16-5") == ("lad-bf16", 5)
    with pytest.raises(SystemExit, match="unknown method"):
        qb.parse_method("lad-fp8-10")
    # 10 % of a 1000-byte NF4 model: 100 bytes. INT8 only: gain per byte A 0.1, C 0.07, B 0.033; all three
    # fit (90 bytes). BF16 only: B 0.067 first (90 bytes), then nothing fits.
    assert qb.ladder_plan("lad-int8", 10, prof) == {A: "int8", B: "int8", C: "int8"}
    assert qb.ladder_plan("lad-bf16", 10, prof) == {B: "bf16"}
    # both rungs: A's INT8 (0.1), C's INT8 (0.07), then B's BF16 (0.067; its INT8 point lies under the hull)
    # would make 150 bytes, A's upgrade to BF16 (1/60 a byte) 120: the plan stops at A and C on INT8
    assert qb.ladder_plan("lad", 10, prof) == {A: "int8", C: "int8"}
    # at 25 % (250 bytes): A and C on INT8 (60), B on BF16 (150), A's upgrade (+60, 210); C's (+60) would
    # make 270
    assert qb.ladder_plan("lad", 25, prof) == {A: "bf16", B: "bf16", C: "int8"}
    assert qb.ladder_plan("lad", 1, prof) == {}  # 10 bytes buy no rung
    # lad-fill: the same knapsack, its unspent bytes on upgrades; here C's (+60) does not fit in what is left
    assert qb.parse_method("lad-fill-25") == ("lad-fill", 25)
    assert qb.ladder_plan("lad-fill", 25, prof) == qb.ladder_plan("lad", 25, prof)
    # tied INT8 / BF16 gains (A 3, B 1, C 2.5): the knapsack buys the three INT8 rungs (90 bytes) and no
    # upgrade; fill upgrades A then C (+60 each, 210), B's would make 270 > 250
    for u, g in zip(prof["units"], (3.0, 1.0, 2.5)):
        u["gains"] = {"int8": g, "bf16": g}
    assert qb.ladder_plan("lad", 25, prof) == {A: "int8", B: "int8", C: "int8"}
    assert qb.ladder_plan("lad-fill", 25, prof) == {A: "bf16", B: "int8", C: "bf16"}


def test_served_weight_bytes_count_int8_rungs_at_their_own_bytes():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = LlamaConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2)
    with torch.device("meta"):
        model = LlamaForCausalLM(cfg)
    names = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    units = [(f"base_model.model.{n}", None) for n in names]  # as PEFT names them
    v, down = names.index("model.layers.0.self_attn.v_proj"), names.index("model.layers.1.mlp.down_proj")
    w = qb.served_weight_bytes(model, units, [v, down],
                               {"model.layers.0.self_attn.v_proj": "int8", "model.layers.1.mlp.down_proj": "bf16"})
    # v_proj 32 x 64 = 2048 weights: INT8 2048 + 4 * 32 row scales = 2176 bytes, NF4 1024 + 4 * 32 absmax + 64
    # (code table) = 1216, so +960; down_proj 64 x 128 = 8192: BF16 16384, NF4 4096 + 512 + 64 = 4672, +11712
    assert w["served_weight_bytes"] - w["nf4_weight_bytes"] == 960 + 11712
    assert w["memory_over_nf4"] == pytest.approx(12672 / w["nf4_weight_bytes"])
    bf16_only = qb.served_weight_bytes(model, units, [v, down])
    assert bf16_only["served_weight_bytes"] - w["served_weight_bytes"] == (4096 - 1216) - 960


def test_the_ladder_runs_wait_for_the_ladder_profile(tmp_path, monkeypatch):
    jobs = _planned_jobs(tmp_path, monkeypatch, "lad-10,lad-int8-10,nf4")
    assert set(jobs) == {"profile-ladder", ("lad-10", 0), ("lad-int8-10", 0), ("nf4", 0)}
    assert jobs[("lad-10", 0)].needs == ("profile-ladder",) and jobs[("nf4", 0)].needs == ()
    assert "--ladder" in jobs["profile-ladder"].cmd and jobs["profile-ladder"].done == tmp_path / "profile_ladder.json"
    assert [m for m, _ in qb.plan_runs([0], qb.LADDER_METHODS)][:3] == ["lad-10", "lad-int8-10", "lad-bf16-10"]


def test_the_ladder_table_prices_every_row_in_memory_over_nf4(tmp_path):
    prof = _ladder_profile(tmp_path)
    _result(tmp_path, "bf16", 0, 1.0, 1.0, 100)
    _result(tmp_path, "nf4", 0, 2.0, 1.6)
    _result(tmp_path, "lad-10", 0, 1.4, 1.3, 0)
    r = json.loads((tmp_path / "lad-10" / "seed0" / "result.json").read_text())
    r.update(memory_over_nf4=0.098, int8_linears=2, bf16_linears=0, served_set_size=2, peak_rss_bytes=3 * 2**30)
    (tmp_path / "lad-10" / "seed0" / "result.json").write_text(json.dumps(r))
    # an older BF16 plan without the field: priced from profile_ladder.json (two linears at 90 bytes over NF4)
    _result(tmp_path, "prof-op-10", 0, 1.5, 1.45, 10)
    r = json.loads((tmp_path / "prof-op-10" / "seed0" / "result.json").read_text())
    r.update(kind="prof-op", planned=[u["name"].removeprefix("model.") for u in prof["units"][:2]], served_set_size=2)
    (tmp_path / "prof-op-10" / "seed0" / "result.json").write_text(json.dumps(r))
    rows = qb.ladder_table(tmp_path, qb.collect(tmp_path))
    lad = next(x for x in rows if x.startswith("| lad-10 "))
    # served (2 - 1.4) / (2 - 1) = 0.6, merged (1.6 - 1.3) / (1.6 - 1) = 0.5
    assert "| 2 / 0 | +9.8 % | 3.00 | 0.60 | 0.50 |" in lad
    plan_row = next(x for x in rows if x.startswith("| prof-op-10 "))
    assert "| 0 / 2 | +18.0 % | - | 0.50 | 0.25 |" in plan_row
    text = qb.report(type("A", (), {"out": str(tmp_path), "plot": None, "plot_ladder": str(tmp_path / "l.png")})())
    assert "Precision ladder at equal memory" in text and (tmp_path / "l.png").stat().st_size > 10_000
    # the first table carries the same price beside its BF16-byte share: recorded, priced, or "-" without either

    def first_table(text):  # method -> cells of the first table's rows (its eleven columns)
        return {row.split(" | ")[0].removeprefix("| "): row.split(" | ") for row in text.splitlines()
                if row.startswith("| ") and row.count(" | ") == 10}

    first = first_table(text)
    assert first["lad-10"][3] == "+9.8 %" and first["prof-op-10"][3] == "+18.0 %" and first["nf4"][3] == "+0.0 %"
    (tmp_path / "profile_ladder.json").unlink()
    first = first_table(qb.report(type("A", (), {"out": str(tmp_path), "plot": None, "plot_ladder": None})()))
    assert first["lad-10"][3] == "+9.8 %" and first["prof-op-10"][3] == "-"
    assert qb.ladder_table(tmp_path / "none", {}) == []


def test_a_folder_keeps_the_setting_it_was_started_with(tmp_path):
    assert qb.claim_setting(tmp_path / "a", None, None) == qb.DEFAULT_SETTING  # written on first use
    assert qb.read_setting(tmp_path / "a") == {"model": "smollm2-135m", "task": "generated"}
    assert qb.claim_setting(tmp_path / "b", "gemma3-270m", "pydocs") == {"model": "gemma3-270m", "task": "pydocs"}
    assert qb.claim_setting(tmp_path / "b", None, None)["model"] == "gemma3-270m"  # resumed: kept
    with pytest.raises(SystemExit, match="holds gemma3-270m on pydocs: asked for task generated"):
        qb.claim_setting(tmp_path / "b", "gemma3-270m", "generated")
    # a folder of results from before setting.json (the committed one) is the default setting
    _result(tmp_path / "c", "nf4", 0, 2.0, 2.0)
    with pytest.raises(SystemExit, match="holds smollm2-135m on generated: asked for model gemma3-270m"):
        qb.claim_setting(tmp_path / "c", "gemma3-270m", None)
    with pytest.raises(SystemExit, match="unknown model"):
        qb.check_setting({"model": "llama", "task": "generated"})
    assert qb.recipe_of({"model": "gemma3-270m"}).is_file() and qb.recipe_of({"model": "gemma3-270m"}, "gnmr-nf4").is_file()


def test_the_text_held_out_loss_is_the_models_own_mean_token_loss(tiny_llama_dir):
    """Blocks of the text task: the loss on every token, token-weighted over batches; a full block's mean
    equals what transformers computes with labels = input_ids."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32)
    g = torch.Generator().manual_seed(2)
    held = [{"input_ids": r, "attention_mask": [1] * 9, "labels": list(r)}
            for r in torch.randint(0, 128, (5, 9), generator=g).tolist()]
    got = qb.heldout_loss(model, None, held, None, batch_size=2)
    ids = torch.tensor([r["input_ids"] for r in held])
    with torch.no_grad():
        want = float(model(input_ids=ids, labels=ids).loss)  # 5 blocks x 8 targets at once
    assert got == pytest.approx(want, rel=1e-5)
    other = held[:4] + [{**held[4], "input_ids": [7] * 9, "labels": [7] * 9}]
    assert qb.heldout_loss(model, None, other, None, batch_size=2) != got  # the last, lone block is counted


# The whole run path from a fresh interpreter in another folder (one NF4 QLoRA run on the real SmolLM2, scored on both
# routes) is checked by tests/test_late_profile.py::test_late_profile_on_a_trained_smollm2_adapter, whose run it is.


def test_the_ladder_plot_places_a_plan_at_what_it_spent_not_at_its_budget(tmp_path):
    """A knapsack stops short of its budget when no rung left has a positive gain (Gemma's INT8-only plans
    spend +7.2 % at a 10 % and a 25 % budget): the ladder plot draws each point at the recorded memory over NF4."""
    _result(tmp_path, "bf16", 0, 1.0, 1.0, 100)
    _result(tmp_path, "nf4", 0, 2.0, 1.6)
    for method, mem, served in (("lad-int8-10", 0.072, 1.4), ("lad-int8-25", 0.072, 1.3), ("lad-bf16-10", 0.099, 1.5)):
        _result(tmp_path, method, 0, served, 1.3)
        r = json.loads((tmp_path / method / "seed0" / "result.json").read_text())
        r["memory_over_nf4"] = mem
        (tmp_path / method / "seed0" / "result.json").write_text(json.dumps(r))
    calls = []

    class Ax:
        def errorbar(self, xs, ys, **kw):
            calls.append((list(xs), list(ys), kw["label"]))

    runs = qb.collect(tmp_path)
    spent = {m: 100 * json.loads((tmp_path / m / "seed0" / "result.json").read_text())["memory_over_nf4"]
             for m in ("lad-int8-10", "lad-int8-25", "lad-bf16-10")}
    qb._family_curve(Ax(), runs, "lad-int8", "served", "INT8 only", x_of=spent.get)
    qb._family_curve(Ax(), runs, "lad-int8", "served", "INT8 only")  # the first table's plot: the budget
    # served gap closed: (2 - 1.4) / (2 - 1) = 0.6 at 10 %, 0.7 at 25 %
    assert calls[0][0] == pytest.approx([7.2, 7.2]) and calls[0][1] == pytest.approx([0.6, 0.7])
    assert calls[1][0] == [10, 25]
    qb.plot_ladder(runs, str(tmp_path / "l.png"), tmp_path)
    assert (tmp_path / "l.png").stat().st_size > 10_000


def _with_curve(root, method, seed, points, peak=None):
    """Add a length curve ({step: (served, merged)}) and a training peak to a fake run."""
    path = root / method / f"seed{seed}" / "result.json"
    r = json.loads(path.read_text())
    r["curve"] = [{"step": k, "heldout_loss_served": v[0], "heldout_loss_merged": v[1]} for k, v in points.items()]
    if peak is not None:
        r["peak_rss_bytes"] = peak
    path.write_text(json.dumps(r))


def test_the_length_curve_scores_each_step_against_the_same_steps_references(tmp_path):
    for seed in (0, 1):
        _result(tmp_path, "bf16", seed, 1.0, 1.0, 100)
        _result(tmp_path, "nf4", seed, 1.5, 1.8)
        _result(tmp_path, "prof-op-10", seed, 1.2, 1.6, 10)
    # step 30: bf16 2.0, nf4 3.0 served / 4.0 merged; step 60: bf16 1.0, nf4 1.5 / 1.8 (the run's end)
    for seed in (0, 1):
        _with_curve(tmp_path, "bf16", seed, {30: (2.0, 2.0), 60: (1.0, 1.0)}, peak=4 * 2**30)
        _with_curve(tmp_path, "nf4", seed, {30: (3.0, 4.0), 60: (1.5, 1.8)}, peak=3 * 2**30)
    _with_curve(tmp_path, "prof-op-10", 0, {30: (2.5, 3.0), 60: (1.2, 1.6)}, peak=3 * 2**30 + 2**29)
    _with_curve(tmp_path, "prof-op-10", 1, {30: (2.2, 3.5), 60: (1.2, 1.6), 90: (1.0, 1.0)})  # 90: no references
    runs = qb.collect(tmp_path)
    served, merged = qb.curve_gap_closed(runs, "prof-op-10", "served"), qb.curve_gap_closed(runs, "prof-op-10", "merged")
    # served at 30: (3 - 2.5) / (3 - 2) = 0.5 and (3 - 2.2) / 1 = 0.8; at 60: (1.5 - 1.2) / 0.5 = 0.6 (both)
    assert list(served) == [30, 60] and served[30] == pytest.approx([0.5, 0.8]) and served[60] == pytest.approx([0.6, 0.6])
    # merged at 30: (4 - 3) / (4 - 2) = 0.5 and 0.25; at 60: (1.8 - 1.6) / 0.8 = 0.25: the end point is the table's
    assert merged[30] == pytest.approx([0.5, 0.25]) and merged[60] == pytest.approx(qb.gap_closed(runs, "prof-op-10", "merged"))
    assert qb.curve_gap_closed(runs, "rand-op-10", "served") == {}
    text = qb.report(type("A", (), {"out": str(tmp_path), "plot": None, "plot_ladder": None,
                                    "plot_length": str(tmp_path / "len.png")})())
    row = next(x for x in text.splitlines() if x.startswith("| prof-op-10 | served |"))
    assert row == "| prof-op-10 | served | 0.65 [0.50, 0.80] | 0.60 [0.60, 0.60] |"
    assert "| bf16 | held-out loss | 2.0000 [2.0000, 2.0000] | 1.0000 [1.0000, 1.0000] |" in text
    assert not any(x.startswith("| nf4 | served |") for x in text.splitlines())  # 0 by definition: no row
    # the training peak column: the largest peak of the method's runs, "-" where none recorded one
    first = {x.split(" | ")[0]: x.split(" | ") for x in text.splitlines() if x.count(" | ") == 10}
    assert first["| prof-op-10"][5] == "3.50" and first["| bf16"][5] == "4.00"
    assert qb._peak_gib([{"heldout_loss_served": 1.0}]) == "-"
    assert (tmp_path / "len.png").stat().st_size > 10_000
    (tmp_path / "bf16" / "seed0" / "result.json").unlink()
    (tmp_path / "bf16" / "seed1" / "result.json").unlink()
    assert qb.curve_table(qb.collect(tmp_path)) == []


def _with_train_losses(root, method, seed, losses):
    path = root / method / f"seed{seed}" / "result.json"
    r = json.loads(path.read_text())
    path.write_text(json.dumps({**r, "train_losses": losses}))


def test_the_training_loss_gap_is_closed_window_by_window_against_each_seeds_references(tmp_path):
    # 60 steps = two windows of 30; per window the mean losses: bf16 2.0 then 1.0, nf4 3.0 then 2.0
    ref = {"bf16": [2.0] * 30 + [1.0] * 30, "nf4": [3.0] * 30 + [2.0] * 30}
    for seed in (0, 1):
        for m in ("bf16", "nf4", "prof-op-10"):
            _result(tmp_path, m, seed, 1.5, 1.5)
        for m, losses in ref.items():
            _with_train_losses(tmp_path, m, seed, losses)
    # seed 0: window 1 mean 2.5 (alternating 2.0 / 3.0) -> 0.5; window 2 all 1.8 -> (2 - 1.8) / 1 = 0.2
    _with_train_losses(tmp_path, "prof-op-10", 0, [2.0, 3.0] * 15 + [1.8] * 30)
    # seed 1: window 1 2.2 -> 0.8; its window 2 cut short (45 steps): left out, not scored on a part
    _with_train_losses(tmp_path, "prof-op-10", 1, [2.2] * 45)
    runs = qb.collect(tmp_path)
    at = qb.train_window_gap_closed(runs, "prof-op-10")
    assert list(at) == [(1, 30), (31, 60)]
    assert at[(1, 30)] == pytest.approx([0.5, 0.8]) and at[(31, 60)] == pytest.approx([0.2])
    assert qb.train_window_table(runs) == ["| method | steps 1-30 | steps 31-60 |", "|---|---|---|",
                                           "| prof-op-10 | 0.65 [0.50, 0.80] | 0.20 |"]  # one seed: no range
    text = qb.report(type("A", (), {"out": str(tmp_path), "plot": None})())
    assert "| prof-op-10 | 0.65 [0.50, 0.80] | 0.20 |" in text
    # one window only (a 30-step folder): no table
    assert qb.train_window_table(runs, width=60) == []


def test_a_late_plan_without_its_profile_is_refused_in_one_line(tmp_path):
    root = tmp_path / "bench"
    root.mkdir()
    with pytest.raises(SystemExit, match=r"late-op-10 needs .*profile_late\.json \(late-op: run bench/value/late_profile\.py "
                                         r"--write-profile first\)"):
        qb.main(["run", "--method", "late-op-10", "--seed", "0", "--out", str(root / "late-op-10" / "seed0"),
                 "--steps", "1"])


def test_the_grouped_ladder_buys_whole_serving_groups(tmp_path):
    """lad-grp-M: one rung per vLLM group (q/k/v, gate/up), priced and valued as its members' sums, worked
    out by hand here; the free ladder at the same budget splits the groups."""
    layer = "model.layers.0"
    names = [f"{layer}.self_attn.{x}_proj" for x in "qkvo"] + [f"{layer}.mlp.{x}_proj" for x in ("gate", "up", "down")]
    # per linear: int8 costs 30 bytes, bf16 90; gains chosen so that the free plan takes v_proj and up_proj alone
    gains = {"q": 0.1, "k": 0.1, "v": 6.0, "o": 0.5, "gate": 0.2, "up": 4.0, "down": 0.3}
    prof = {"nf4_model_bytes": 1000, "rungs": ["int8", "bf16"],
            "units": [{"name": n, "numel": 64, "rows": 8, "gains": {"int8": gains[n.split(".")[-1][:-5]],
                                                                  "bf16": gains[n.split(".")[-1][:-5]]},
                       "prices": {"int8": 30, "bf16": 90}} for n in names]}
    assert qb.parse_method("lad-grp-10") == ("lad-grp", 10) and "lad-grp-10" in qb.METHODS
    free = qb.ladder_plan("lad", 10, prof)  # 100 bytes: v (6/30) then up (4/30) on INT8, then o (0.5/30)
    assert free == {names[2]: "int8", names[5]: "int8", names[3]: "int8"}
    # grouped, 100 bytes: qkv on INT8 costs 90 for 6.2 (0.069 a byte), gate_up 60 for 4.2 (0.07), o 30 for 0.5,
    # down 30 for 0.3: gate_up first (60), then qkv does not fit (150), o (90), then down would make 120
    grouped = qb.ladder_plan("lad-grp", 10, prof, "LlamaForCausalLM")
    assert grouped == {names[4]: "int8", names[5]: "int8", names[3]: "int8"}
    # 25 % (250 bytes): gate_up (60), qkv (150), o (180), down (210); no upgrade of 60+ bytes fits in 40
    assert qb.ladder_plan("lad-grp", 25, prof, "LlamaForCausalLM") == {n: "int8" for n in names}
    with pytest.raises(ValueError, match="architecture"):
        qb.ladder_plan("lad-grp", 10, prof)


def test_the_grouped_ladder_reads_the_architecture_from_the_settings_model(smollm2_dir):
    assert qb.architecture(qb.check_setting(dict(qb.DEFAULT_SETTING))) == "LlamaForCausalLM"


def test_plan_save_adapters_gives_every_run_its_adapter_folder(tmp_path, monkeypatch):
    seen = []
    monkeypatch.setattr(qb.runner, "run_plan", seen.extend)
    argv = ["plan", "--out", str(tmp_path), "--methods", "nf4,lad-grp-10", "--seeds", "0,1", "--oracle-every", "0"]
    qb.main(argv)
    runs = [j for j in seen if isinstance(j.key, tuple)]
    assert len(runs) == 4 and not any("--save-adapter" in j.cmd for j in runs)  # off by default
    seen.clear()
    qb.main(argv + ["--save-adapters"])
    runs = [j for j in seen if isinstance(j.key, tuple)]
    assert len(runs) == 4
    for job in runs:
        method, seed = job.key
        assert job.cmd[job.cmd.index("--save-adapter") + 1] == str(tmp_path / method / f"seed{seed}" / "adapter")
