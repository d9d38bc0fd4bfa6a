"""Results that stay light: no file over 1 MB is tracked under bench/results/ (the checker is shown to catch
one first), and the trace readers read a trace kept compressed (``gnmr_trace.jsonl.gz``) exactly as the raw
one: gnmr_hf.reporting.stored, plots.read_trace and the heat map, bench/runner.py compressing a landed run."""

from __future__ import annotations

import gzip
import json
import math
import os
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gnmr_hf.reporting.plots import plot_gnmr_heatmap, read_trace
from gnmr_hf.reporting.stored import compress, exists, open_text, stored
from gnmr_hf.trainer.trace import TRACE_NAME, TraceWriter
from tests.conftest import load_bench

ROOT = Path(__file__).resolve().parents[1]
LIMIT = 1_000_000  # bytes: "over 1 MB"

# gzip -9 of the 240-step traces of bench/results/qlora_length (210 linears x 240 steps of float64 norms,
# GNMR, delta and risk): gzip takes 3.4-3.9 MB down to 1.37-1.40 MB and no further (xz -9e: 1.21 MB). Kept, by
# exact size, so none of them grows and no other file joins them; nothing reads them (the report reads
# result.json), so they may go.
KNOWN_OVER = {
    f"bench/results/qlora_length/{run}/gnmr_trace.jsonl.gz": size for run, size in {
        "bf16/seed0": 1396671, "bf16/seed1": 1395252, "bf16/seed2": 1394544,
        "loftq+prof-op-10/seed0": 1378319, "loftq+prof-op-10/seed1": 1378795, "loftq+prof-op-10/seed2": 1377760,
        "loftq/seed0": 1373215, "loftq/seed1": 1373790, "loftq/seed2": 1374161,
        "nf4/seed0": 1374108, "nf4/seed1": 1374008, "nf4/seed2": 1373274,
        "prof-op-10/seed0": 1378982, "prof-op-10/seed1": 1378850, "prof-op-10/seed2": 1377385,
        "rand-op-10/seed1": 1376512, "rand-op-10/seed2": 1376375,
    }.items()
}


def tracked_sizes(repo: Path, under: str) -> dict[str, int]:
    """``{path: bytes}`` of every file git tracks (in the index) under ``under`` of ``repo``: the sizes of
    the blobs a commit holds, whatever the working tree has."""
    listing = subprocess.run(["git", "ls-files", "-s", "-z", "--", under], cwd=repo, capture_output=True,
                             check=True).stdout.decode().split("\0")
    entries = [line.split("\t", 1) for line in listing if line]
    shas = [meta.split()[1] for meta, _ in entries]
    sizes = subprocess.run(["git", "cat-file", "--batch-check=%(objectsize)"], cwd=repo, check=True,
                           input="\n".join(shas) + "\n", capture_output=True, text=True).stdout.split()
    return {path: int(size) for (_, path), size in zip(entries, sizes)}


def too_large(sizes: dict[str, int], known: dict[str, int], limit: int = LIMIT) -> list[str]:
    """The files over ``limit`` bytes that are not in ``known`` at their exact size, one line each."""
    return [f"{path}: {size} bytes" + (f" (known at {known[path]})" if path in known else "")
            for path, size in sorted(sizes.items()) if size > limit and known.get(path) != size]


def _git(repo: Path, *args: str) -> None:
    subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=repo, check=True,
                   capture_output=True)


def test_the_checker_catches_a_file_over_1_mb_added_under_bench_results(tmp_path):
    repo = tmp_path / "repo"
    (repo / "bench" / "results" / "run").mkdir(parents=True)
    _git(repo, "init", "-q")
    big = repo / "bench" / "results" / "run" / "gnmr_trace.jsonl"
    big.write_bytes(os.urandom(LIMIT + 1))
    (repo / "bench" / "results" / "run" / "edge.bin").write_bytes(os.urandom(LIMIT))  # exactly 1 MB: allowed
    (repo / "outside.bin").write_bytes(os.urandom(2 * LIMIT))  # not under bench/results
    _git(repo, "add", "-f", ".")
    sizes = tracked_sizes(repo, "bench/results")
    assert sizes == {"bench/results/run/gnmr_trace.jsonl": LIMIT + 1, "bench/results/run/edge.bin": LIMIT}
    assert too_large(sizes, {}) == [f"bench/results/run/gnmr_trace.jsonl: {LIMIT + 1} bytes"]
    # a known file passes at its size, and fails once it grows
    assert too_large(sizes, {"bench/results/run/gnmr_trace.jsonl": LIMIT + 1}) == []
    assert too_large(sizes, {"bench/results/run/gnmr_trace.jsonl": LIMIT}) == [
        f"bench/results/run/gnmr_trace.jsonl: {LIMIT + 1} bytes (known at {LIMIT})"]
    # compressed, it is a small .gz the checker passes (random bytes would not shrink: a real trace's text)
    big.write_text("".join(json.dumps({"step": i, "norms": [0.5] * 50}) + "\n" for i in range(4000)))
    assert big.stat().st_size > LIMIT
    compress(big)
    _git(repo, "add", "-A", "bench/results")
    assert too_large(tracked_sizes(repo, "bench/results"), {}) == []


def test_no_file_over_1_mb_is_tracked_under_bench_results():
    if not (ROOT / ".git").exists() or shutil.which("git") is None:
        pytest.skip("not a git checkout")
    sizes = tracked_sizes(ROOT, "bench/results")
    assert len(sizes) > 100  # the tree's results were listed
    assert too_large(sizes, KNOWN_OVER) == []


def _records(n: int) -> list[dict]:
    """Trace lines as the callback writes them, non-finite values included."""
    return [{"step": s, "norms": [0.1 * s, float("inf") if s == 2 else 0.3], "gnmr": [1.0, float("nan")],
             "active": [0] if s % 2 else [], "promoted": [], "warmup": s == 1} for s in range(1, n + 1)]


def _same(a: list[dict], b: list[dict]) -> bool:
    """Equal records, NaN equal to NaN (json writes both the same)."""
    return json.dumps(a, sort_keys=True) == json.dumps(b, sort_keys=True)


def test_read_trace_reads_the_compressed_copy_equal_to_the_raw_trace(tmp_path):
    path = tmp_path / TRACE_NAME
    writer = TraceWriter(str(path))
    for r in _records(40):
        writer.write(r)
    writer.close()
    raw = read_trace(path)
    assert len(raw) == 40 and math.isinf(raw[1]["norms"][1]) and math.isnan(raw[0]["gnmr"][1])
    raw_bytes = path.read_bytes()

    gz = compress(path)
    assert gz == tmp_path / (TRACE_NAME + ".gz") and not path.exists() and gz.stat().st_size < len(raw_bytes)
    assert gzip.decompress(gz.read_bytes()) == raw_bytes
    assert stored(path) == gz and exists(path)
    assert _same(read_trace(path), raw)  # asked by its raw name, read from the .gz
    assert _same(read_trace(gz), raw)  # or by the .gz itself
    # what `gzip -9n` made (the tree's compressed traces) reads the same
    path.write_bytes(raw_bytes)
    gz.unlink()
    subprocess.run(["gzip", "-9n", str(path)], check=True)
    assert not path.exists() and _same(read_trace(path), raw)
    # ours has no name and no time in its header (flags 0, mtime 0), so the same text gives the same bytes
    path.write_bytes(raw_bytes)
    compress(path)
    header = gz.read_bytes()[:10]
    assert header[:3] == b"\x1f\x8b\x08" and header[3] == 0 and header[4:8] == b"\0\0\0\0"
    assert _same(read_trace(path), raw)


def test_a_missing_trace_names_the_raw_file_and_a_raw_copy_wins_over_a_stale_gz(tmp_path):
    path = tmp_path / TRACE_NAME
    with pytest.raises(FileNotFoundError, match=TRACE_NAME):
        read_trace(path)
    assert not exists(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(3)))
    compress(path)
    path.write_text("".join(json.dumps(r) + "\n" for r in _records(5)))  # a newer raw trace beside the .gz
    assert len(read_trace(path)) == 5


def test_appended_members_read_as_one_text(tmp_path):
    log = tmp_path / "log.txt"
    log.write_text("attempt 1\n")
    compress(log, append=True)
    log.write_text("attempt 2\n")
    compress(log, append=True)
    with open_text(log) as f:
        assert f.read() == "attempt 1\nattempt 2\n"
    log.write_text("only this\n")
    compress(log)  # not appended: replaced
    with open_text(log) as f:
        assert f.read() == "only this\n"


def test_the_heat_map_of_a_compressed_trace_is_the_raw_ones(tmp_path):
    path = tmp_path / TRACE_NAME
    records = [{"step": s, "gnmr": [1.0 + 0.1 * ((s * u) % 7) for u in range(4)], "active": [s % 4]}
               for s in range(1, 13)]
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    plot_gnmr_heatmap(path, tmp_path / "raw.png", title="t")
    compress(path)
    plot_gnmr_heatmap(path, tmp_path / "gz.png", title="t")
    assert (tmp_path / "raw.png").read_bytes() == (tmp_path / "gz.png").read_bytes()


# a bench job: writes a trace and a long log, then its done file; it fails when told to
JOB = textwrap.dedent("""
    import json, sys
    run_dir, log_lines, fail = sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1"
    with open(run_dir + "/gnmr_trace.jsonl", "w") as f:
        for s in range(1, 31):
            f.write(json.dumps({"step": s, "norms": [s / 7, s / 9]}) + "\\n")
    for i in range(log_lines):
        print("line", i, "of the run's log " + "x" * 60)
    if fail:
        sys.exit(3)
    open(run_dir + "/result.json", "w").write("{}")
""")


def test_the_runner_leaves_a_landed_runs_trace_and_long_log_compressed(tmp_path):
    runner = load_bench("runner")
    script = tmp_path / "job.py"
    script.write_text(JOB)
    jobs = []
    for name, lines, fail in (("long", 4000, "0"), ("short", 3, "0"), ("failed", 4000, "1")):
        run_dir = tmp_path / name
        jobs.append(runner.Job(name, run_dir, [sys.executable, str(script), str(run_dir), str(lines), fail],
                               run_dir / "result.json"))
    out = runner.run_plan(jobs, poll_s=0.01)
    assert out.failed == ["failed"]
    expected = [{"step": s, "norms": [s / 7, s / 9]} for s in range(1, 31)]

    long = tmp_path / "long"
    assert not (long / TRACE_NAME).exists() and (long / (TRACE_NAME + ".gz")).is_file()
    assert read_trace(long / TRACE_NAME) == expected
    assert not (long / "log.txt").exists()  # over LOG_KEPT_RAW bytes: compressed
    with open_text(long / "log.txt") as f:
        text = f.read()
    assert len(text) > runner.LOG_KEPT_RAW and text.splitlines()[-1].startswith("line 3999 ")

    short = tmp_path / "short"
    assert (short / (TRACE_NAME + ".gz")).is_file() and read_trace(short / TRACE_NAME) == expected
    assert (short / "log.txt").read_text().count("\n") == 3  # a short log stays plain

    failed = tmp_path / "failed"  # a failed run is left as it is, to be read
    assert (failed / TRACE_NAME).is_file() and (failed / "log.txt").stat().st_size > runner.LOG_KEPT_RAW
    assert not (failed / (TRACE_NAME + ".gz")).exists() and not (failed / "log.txt.gz").exists()


@pytest.mark.parametrize("run", ["qlora_smollm2_pydocs_90/nf4/seed0", "late_profile_smollm2_pydocs/nf4-run",
                                 "qlora_length/bf16/seed0"])
def test_the_trees_compressed_traces_read_as_their_runs_steps(run):
    folder = ROOT / "bench" / "results" / run
    if not (folder / (TRACE_NAME + ".gz")).is_file():
        pytest.skip(f"{folder} holds no compressed trace")
    result = json.loads((folder / "result.json").read_text())
    trace = read_trace(folder / TRACE_NAME)
    assert [r["step"] for r in trace] == list(range(1, result["steps"] + 1))
