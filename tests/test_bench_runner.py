"""bench/runner.py: the one run loop of the resumable benches (claim, subprocess, log, resume, failed set)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from tests.conftest import load_bench

runner = load_bench("runner")

# a job: appends its name to a shared journal, records the environment it saw, writes its done file;
# it fails when its name is listed in FAIL (a file), which a test can change between plans
JOB = textwrap.dedent("""
    import json, os, sys, time
    name, done, journal, fail = sys.argv[1:5]
    time.sleep(float(os.environ.get("JOB_SLEEP", "0")))
    with open(journal, "a") as f:
        f.write(name + "\\n")
    print("attempt of", name)
    if name in open(fail).read().split():
        sys.exit(3)
    open(done, "w").write(json.dumps({"omp": os.environ.get("OMP_NUM_THREADS")}))
""")


def _jobs(tmp: Path, spec: list[tuple[str, tuple[str, ...]]]) -> list:
    script = tmp / "job.py"
    script.write_text(JOB)
    (tmp / "fail").touch()
    jobs = []
    for name, needs in spec:
        run_dir = tmp / name
        cmd = [sys.executable, str(script), name, str(run_dir / "result.json"), str(tmp / "journal"),
               str(tmp / "fail")]
        jobs.append(runner.Job(name, run_dir, cmd, run_dir / "result.json", needs=needs))
    return jobs


def _journal(tmp: Path) -> list[str]:
    return (tmp / "journal").read_text().split() if (tmp / "journal").is_file() else []


def test_jobs_run_in_order_of_their_needs_with_one_thread_and_a_log_each(tmp_path):
    # "b" is listed first but waits for "a"
    jobs = _jobs(tmp_path, [("b", ("a",)), ("a", ()), ("c", ())])
    out = runner.run_plan(jobs, poll_s=0.01)
    assert out.failed == [] and out.blocked == []
    assert _journal(tmp_path) == ["a", "b", "c"]
    for name in "abc":
        assert json.loads((tmp_path / name / "result.json").read_text()) == {"omp": "1"}
        assert (tmp_path / name / "log.txt").read_text() == f"attempt of {name}\n"
        assert not (tmp_path / name / "run.lock").exists()  # released


def test_a_second_plan_resumes_and_a_failure_blocks_only_what_waits_for_it(tmp_path, capsys):
    jobs = _jobs(tmp_path, [("a", ()), ("b", ("a",)), ("c", ()), ("d", ("b",))])
    (tmp_path / "fail").write_text("a")
    out = runner.run_plan(jobs, poll_s=0.01)
    assert out.failed == ["a"] and sorted(out.blocked) == ["b", "d"]
    assert _journal(tmp_path) == ["a", "c"]  # failed once, not retried in the same plan
    printed = capsys.readouterr().out
    assert "a failed (rc 3)" in printed and str(tmp_path / "a" / "log.txt") in printed
    assert "plan complete; failed: ['a']; blocked by them: " in printed

    (tmp_path / "fail").write_text("")  # fixed: the next plan runs what is missing, nothing twice
    out = runner.run_plan(jobs, poll_s=0.01)
    assert out.failed == [] and out.blocked == []
    assert _journal(tmp_path) == ["a", "c", "a", "b", "d"]
    assert (tmp_path / "a" / "log.txt").read_text() == "attempt of a\nattempt of a\n"  # appended, not replaced


def test_a_job_held_by_a_live_process_is_left_to_it(tmp_path):
    jobs = _jobs(tmp_path, [("a", ()), ("b", ())])
    assert runner.claim(tmp_path / "a")  # this process holds "a" and never runs it

    def finish_a_later(run_dir, cmd, what):  # while "b" runs, the holder of "a" finishes it
        ok = runner.run_claimed(run_dir, cmd, what)
        (tmp_path / "a" / "result.json").write_text("{}")
        return ok

    out = runner.run_plan(jobs, poll_s=0.01, run=finish_a_later)
    assert out.failed == [] and _journal(tmp_path) == ["b"]


def test_a_dead_owners_lock_is_reclaimed(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    (tmp_path / "a").mkdir()
    (tmp_path / "a" / "run.lock").write_text(str(dead.pid))
    out = runner.run_plan(_jobs(tmp_path, [("a", ())]), poll_s=0.01)
    assert out.failed == [] and _journal(tmp_path) == ["a"]


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_two_workers_over_one_plan_run_every_job_once(tmp_path):
    jobs = _jobs(tmp_path, [(n, ()) for n in "abcdef"] + [("g", ("a", "f"))])
    worker = tmp_path / "worker.py"
    worker.write_text(textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(Path(runner.__file__).parent)!r})
        import runner
        jobs = [runner.Job(n, runner.Path(d), c, runner.Path(f), tuple(w)) for n, d, c, f, w in {[
            (j.key, str(j.run_dir), j.cmd, str(j.done), list(j.needs)) for j in jobs]!r}]
        runner.run_plan(jobs, poll_s=0.05)
    """))
    env = {**os.environ, "JOB_SLEEP": "0.3"}
    procs = [subprocess.Popen([sys.executable, str(worker)], env=env, stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    outs = [p.communicate(timeout=120)[0] for p in procs]
    assert all(p.returncode == 0 for p in procs)
    assert sorted(_journal(tmp_path)) == list("abcdefg")  # each once
    assert all("running" in o for o in outs)  # both took work
    assert _journal(tmp_path)[-1] == "g"


@pytest.mark.slow  # subprocesses: the slow tier
@pytest.mark.parametrize("stale", [False, True], ids=["fresh folders", "dead owners' lock files"])
def test_two_processes_claiming_the_same_folders_at_once_never_both_win(tmp_path, stale):
    """Two workers that start a plan together race for the same folders (a resumed plan: for lock files a
    killed worker left). The former pid-in-a-file lock let a reader take a half-created (empty) lock for a
    dead owner's and remove it, so both ran one job in one folder."""
    folders = [tmp_path / f"d{i}" for i in range(400)]
    if stale:
        dead = subprocess.Popen([sys.executable, "-c", "pass"])
        dead.wait()
        for d in folders:
            d.mkdir()
            (d / "run.lock").write_text(str(dead.pid))
    script = tmp_path / "claimer.py"
    script.write_text(textwrap.dedent(f"""
        import sys, time
        sys.path.insert(0, {str(Path(runner.__file__).parent)!r})
        import runner
        from pathlib import Path
        go = Path(sys.argv[1])
        while not go.exists():
            time.sleep(0.001)
        won = [str(i) for i in range({len(folders)}) if runner.claim(Path({str(tmp_path)!r}) / f"d{{i}}")]
        print(" ".join(won), flush=True)
        while not Path(sys.argv[2]).exists():  # alive, holding its locks, until both have claimed
            time.sleep(0.01)
    """))
    go = tmp_path / "go"
    end = tmp_path / "end"
    procs = [subprocess.Popen([sys.executable, str(script), str(go), str(end)], stdout=subprocess.PIPE, text=True)
             for _ in range(2)]
    time.sleep(1.0)  # both started and waiting
    go.touch()
    won = [set(p.stdout.readline().split()) for p in procs]  # a worker's exit frees its locks: read first
    end.touch()
    assert all(p.wait(timeout=60) == 0 for p in procs)
    assert won[0].isdisjoint(won[1]), f"{len(won[0] & won[1])} folders claimed by both"
    assert won[0] | won[1] == {str(i) for i in range(len(folders))}  # every folder taken once


def test_a_need_outside_the_plan_is_refused(tmp_path):
    with pytest.raises(ValueError, match="not in the plan"):
        runner.run_plan(_jobs(tmp_path, [("a", ("zz",))]))
