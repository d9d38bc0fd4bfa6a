"""Faults of round 5, items 7-9: stored run files (X beside X.gz, an interrupted compress(append=True), a
truncated .gz), degenerate sparse-training settings, and plan/profile JSON readers (a list given to
load_planned, a key named twice in a profile.json)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
from torch import nn

from gnmr_hf.reporting import stored as stored_mod
from gnmr_hf.reporting.stored import StoredFileError, compress, open_text

# ------------------------------------------------------------------------------- 7. stored results


def _read(path, **kw) -> str:
    with open_text(path, **kw) as f:
        return f.read()


def test_x_beside_x_gz_is_refused_unless_the_caller_says_how_they_join(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("attempt 1\n")
    compress(log, append=True)
    log.write_text("attempt 2\n")  # a later attempt's log, not compressed (yet)
    with pytest.raises(StoredFileError) as e:
        _read(log)
    assert str(log) in str(e.value) and str(log) + ".gz" in str(e.value) and "appended=" in str(e.value)
    assert _read(log, appended=True) == "attempt 1\nattempt 2\n"  # a log: the .gz's text, then the raw one's
    assert _read(log, appended=False) == "attempt 2\n"  # written anew: the raw copy alone
    compress(log, append=True)  # settled on disk: one copy, both attempts
    assert not log.exists() and _read(log) == "attempt 1\nattempt 2\n"


def _crash_once(monkeypatch, target: str, when):
    """Make the first call of ``target`` (``os.replace`` or ``Path.unlink``) for which ``when(args)`` holds raise,
    as a process killed at that point would stop."""
    real = {"os.replace": os.replace, "Path.unlink": Path.unlink}[target]
    fired = []

    def fake(*args, **kwargs):
        if not fired and when(args):
            fired.append(args)
            raise KeyboardInterrupt("killed")
        return real(*args, **kwargs)

    if target == "os.replace":
        monkeypatch.setattr(stored_mod.os, "replace", fake)
    else:
        monkeypatch.setattr(Path, "unlink", fake)
    return fired


@pytest.mark.parametrize("earlier", [False, True], ids=["first-compress", "onto-an-earlier-gz"])
def test_an_append_killed_between_its_replace_and_unlink_and_run_again_keeps_the_text_once(tmp_path, monkeypatch,
                                                                                        earlier):
    log = tmp_path / "log.txt"
    expected = ""
    if earlier:
        log.write_text("attempt 1\n")
        compress(log, append=True)
        expected = "attempt 1\n"
    log.write_text("attempt 2\n")
    fired = _crash_once(monkeypatch, "Path.unlink", lambda a: a[0] == log)
    with pytest.raises(KeyboardInterrupt):
        compress(log, append=True)
    assert fired and log.exists() and log.with_name("log.txt.gz").exists()  # the crash state
    monkeypatch.undo()
    assert _read(log) == expected + "attempt 2\n"  # read meanwhile: once
    compress(log, append=True)  # the run again (bench/runner.land)
    assert not log.exists() and _read(log) == expected + "attempt 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt.gz"]  # no journal or temporary left


def test_an_append_killed_after_its_replace_then_written_to_appends_only_the_new_text(tmp_path, monkeypatch):
    log = tmp_path / "log.txt"
    log.write_text("attempt 1\n")
    _crash_once(monkeypatch, "Path.unlink", lambda a: a[0] == log)
    with pytest.raises(KeyboardInterrupt):
        compress(log, append=True)
    monkeypatch.undo()
    with open(log, "a") as f:  # a retried run appends to the raw log it finds
        f.write("attempt 2\n")
    assert _read(log) == "attempt 1\nattempt 2\n"
    compress(log, append=True)
    assert _read(log) == "attempt 1\nattempt 2\n"


def test_an_append_killed_before_its_replace_is_redone_whole(tmp_path, monkeypatch):
    log = tmp_path / "log.txt"
    log.write_text("attempt 1\n")
    compress(log, append=True)
    log.write_text("attempt 2\n")
    _crash_once(monkeypatch, "os.replace", lambda a: Path(a[1]).name == "log.txt.gz")
    with pytest.raises(KeyboardInterrupt):
        compress(log, append=True)
    monkeypatch.undo()
    assert _read(log, appended=True) == "attempt 1\nattempt 2\n"  # the journal is stale: nothing landed
    compress(log, append=True)
    assert _read(log) == "attempt 1\nattempt 2\n"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["log.txt.gz"]


def test_a_truncated_gz_names_the_file_and_what_to_do(tmp_path):
    trace = tmp_path / "gnmr_trace.jsonl"
    trace.write_text("".join(json.dumps({"step": i, "loss": 1.0 / (i + 1)}) + "\n" for i in range(2000)))
    gz = compress(trace)
    gz.write_bytes(gz.read_bytes()[: gz.stat().st_size // 2])
    for read in (lambda f: f.read(), lambda f: list(f), lambda f: [f.readline() for _ in range(5000)]):
        with pytest.raises(StoredFileError) as e:
            with open_text(trace) as f:
                read(f)
        assert str(gz) in str(e.value) and "cut short" in str(e.value) and "Restore it" in str(e.value)
    trace.write_text("{}\n")  # and through the merged read
    with pytest.raises(StoredFileError, match="cut short"):
        _read(trace, appended=True)


def test_the_runner_lands_a_short_log_onto_a_compressed_one_so_one_copy_is_left(tmp_path):
    from tests.conftest import load_bench

    runner = load_bench("runner")
    log = tmp_path / "log.txt"
    log.write_text("attempt 1\n" * (runner.LOG_KEPT_RAW // 10 + 1))  # long: compressed when landed
    runner.land(tmp_path)
    assert not log.exists()
    log.write_text("attempt 2\n")  # a rerun of the landed job (its done file removed), short
    runner.land(tmp_path)
    assert not log.exists() and _read(log).endswith("attempt 1\nattempt 2\n")


# ------------------------------------------------------------------------------- 8. sparse settings


def test_a_density_that_keeps_no_block_is_refused_and_the_linear_stays_plain():
    from gnmr_hf.sparse import SparseLinear

    lin = nn.Linear(32, 16)
    with pytest.raises(ValueError, match=r"density=1e-06 keeps no block .* 1/512"):
        SparseLinear.convert(lin, 1e-6)
    assert type(lin) is nn.Linear and lin.weight.shape == (16, 32)
    with pytest.raises(ValueError, match="density=1e-06"):
        SparseLinear(32, 16, density=1e-6)


def test_a_density_the_blocks_round_far_off_warns_with_the_density_obtained():
    from gnmr_hf.sparse import SparseLinear

    with pytest.warns(UserWarning, match=r"density=0.1 on a 8x32 linear .* 1 blocks: density 0.125 obtained"):
        layer = SparseLinear(32, 8, density=0.1, block_size=32)  # a block as wide as the row
    assert layer.density == 0.125
    import warnings

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert SparseLinear(32, 16, density=0.1).density == 51 / 512  # within 10 %: silent


def test_update_topology_refuses_a_drop_fraction_outside_0_1():
    from gnmr_hf.sparse import SparseLinear

    layer = SparseLinear(32, 16, density=0.25, generator=torch.Generator().manual_seed(0))
    before = layer.index.clone()
    for bad in (-0.5, 1.5, float("nan")):
        with pytest.raises(ValueError, match="drop_fraction"):
            layer.update_topology(bad)
    assert torch.equal(layer.index, before)


@pytest.mark.parametrize("kwargs, name", [({"eps": -1}, "eps"), ({"weight_decay": -0.1}, "weight_decay")])
def test_sparse_adamw_refuses_a_negative_eps_or_weight_decay(kwargs, name):
    from gnmr_hf.sparse import SparseAdamW, SparseLinear

    layer = SparseLinear(32, 16, density=0.25)
    with pytest.raises(ValueError, match=name):
        SparseAdamW(layer.parameters(), layers=[layer], **kwargs)


# ------------------------------------------------------------------------------- 9. plan readers


def test_load_planned_given_a_list_of_names_says_what_it_takes(tmp_path):
    from gnmr_hf.planning.ladder import load_planned

    with pytest.raises(TypeError, match=r"takes a mapping of linear names to rungs .* got a list of 1 names"):
        load_planned(tmp_path, ["model.layers.0.self_attn.v_proj"])


DUPLICATED = '{"skip_modules": ["lm_head"], "rungs": {"model.layers.0.mlp.up_proj": "bf16"}, ' \
             '"rungs": {"model.layers.0.mlp.up_proj": "int8"}}'
NESTED = '{"rungs": {"model.layers.0.mlp.up_proj": "bf16", "model.layers.0.mlp.up_proj": "int8"}}'


def _readers(path: Path):
    from gnmr_hf.evaluation.evaluate import read_skip_modules
    from gnmr_hf.export import _read_plan
    from gnmr_hf.export_ct import read_rungs
    from gnmr_hf.planning.ladder import load_planned
    from gnmr_hf.planning.planner import require_groups
    from gnmr_hf.planning.results import SensitivityProfile

    return {
        "SensitivityProfile.from_json": lambda: SensitivityProfile.from_json(path),
        "load_planned": lambda: load_planned(path.parent, path),
        "load_planned (folder)": lambda: load_planned(path.parent, path.parent),
        "export._read_plan": lambda: _read_plan(path, ladder=True),
        "export_ct.read_rungs": lambda: read_rungs(path),
        "evaluate.read_skip_modules": lambda: read_skip_modules(str(path)),
        "planner.require_groups": lambda: require_groups(path, "vllm"),
    }


@pytest.mark.parametrize("text, key", [(DUPLICATED, "rungs"), (NESTED, "model.layers.0.mlp.up_proj")],
                         ids=["top-level", "nested"])
def test_every_plan_reader_refuses_a_key_named_twice(tmp_path, text, key):
    path = tmp_path / "profile.json"
    path.write_text(text)
    for name, read in _readers(path).items():
        with pytest.raises(Exception) as e:
            read()
        assert f"key {key!r} appears twice" in str(e.value) and str(path) in str(e.value), (name, e.value)


def test_strict_json_reads_what_json_reads():
    from gnmr_hf.strict_json import DuplicateKeyError, loads

    text = '{"a": [1, {"b": 2, "c": {"b": 3}}], "d": NaN}'
    assert json.dumps(loads(text)) == json.dumps(json.loads(text))
    with pytest.raises(DuplicateKeyError, match="x.json: key 'b' appears twice"):
        loads('{"a": {"b": 1, "b": 2}}', "x.json")
