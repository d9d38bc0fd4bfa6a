"""The one run loop of the resumable benches (bench/value/nf4_bench.py, bench/value/qlora_budget.py).

A bench describes its plan as a list of :class:`Job` (a key, a run folder, the command that fills it, the
file whose existence means "done", and the keys it waits for); :func:`run_plan` runs them:

- **claim**: a job's folder is taken with an exclusive ``flock`` on its ``run.lock``, so several
  workers (``--workers N``, :func:`fan_out`) or a second session never run the same job; the kernel drops
  a dead owner's lock, so its job is free again;
- **subprocess**: each job runs in its own process with one torch thread (``OMP_NUM_THREADS=1``, as the
  benches' figures are measured) and its output *appended* to ``run folder/log.txt``, so a retried job
  keeps the log of the attempt that failed;
- **resume**: a job whose ``done`` file exists is never run again, so a killed plan continues where it
  stopped when started again;
- **failed set**: a job that exits non-zero is not retried in this plan (the line printed names its log);
  the jobs waiting for it are dropped with it, and the plan ends with the list of both;
- **light results**: a job that succeeded leaves its per-step trace gzip-compressed (``gnmr_trace.jsonl.gz``)
  and its log too when it is over ``LOG_KEPT_RAW`` bytes (``log.txt.gz``, a later attempt's log appended as a
  further member); the readers open either copy (``gnmr_hf.reporting.stored.open_text``). A failed job's log
  stays plain text. Logs stay out of git (``.gitignore``): the figures a report reads are in ``result.json``.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import time
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from gnmr_hf.reporting.stored import compress

ENV = {"OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
TRACE = "gnmr_trace.jsonl"  # gnmr_hf.trainer.trace.TRACE_NAME (not imported: that module loads torch)
LOG_KEPT_RAW = 200_000  # a landed run's log over this many bytes is kept compressed
_HELD: dict[Path, int] = {}  # run.lock -> the descriptor holding its flock (claim to release)


@dataclass(frozen=True)
class Job:
    key: Hashable  # e.g. (method, seed)
    run_dir: Path  # holds run.lock and log.txt while and after it runs
    cmd: list[str]
    done: Path  # the job is finished when this file exists (usually run_dir / "result.json")
    needs: tuple[Hashable, ...] = ()  # keys of jobs whose `done` must exist first
    label: str = ""

    @property
    def name(self) -> str:
        return self.label or " ".join(str(k) for k in (self.key if isinstance(self.key, tuple) else (self.key,)))


@dataclass
class Outcome:
    failed: list[Hashable] = field(default_factory=list)
    blocked: list[Hashable] = field(default_factory=list)  # waited for a failed job


def claim(run_dir: Path) -> bool:
    """Take ``run_dir`` (created if missing) for this process: True when an exclusive ``flock`` on its
    ``run.lock`` is now ours (held until :func:`release`), False while another process (or another claim in
    this one) holds it. The kernel drops the lock when its owner dies, so a killed worker's job is free at
    once; the pid written in the file is for people, never read. (A lock *file* whose creation and pid were
    two steps let a worker that read it in between take an empty file for a dead owner's, so two workers ran
    one job in one folder.)"""
    path = run_dir / "run.lock"
    run_dir.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_CREAT | os.O_RDWR, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            return False
        try:
            current = os.fstat(fd).st_ino == os.stat(path).st_ino
        except FileNotFoundError:
            current = False
        if current:
            break
        os.close(fd)  # released and removed between our open and our lock: take the file now at the path
    os.ftruncate(fd, 0)
    os.write(fd, str(os.getpid()).encode())
    _HELD[path] = fd
    return True


def release(run_dir: Path) -> None:
    """Give up :func:`claim`'s lock on ``run_dir``: the file is removed while still held, then closed."""
    path = run_dir / "run.lock"
    fd = _HELD.pop(path, None)
    path.unlink(missing_ok=True)
    if fd is not None:
        os.close(fd)


def land(run_dir: Path) -> None:
    """Keep a finished run light: its trace compressed, and its log when over ``LOG_KEPT_RAW`` bytes or when an
    earlier landing compressed one (the attempt's log joins it, so a landed run has one copy of its log:
    ``open_text`` refuses to guess how a ``log.txt`` beside a ``log.txt.gz`` joins)."""
    compress(run_dir / TRACE)
    log = run_dir / "log.txt"
    if log.is_file() and (log.stat().st_size > LOG_KEPT_RAW or log.with_name(log.name + ".gz").is_file()):
        compress(log, append=True)


def run_claimed(run_dir: Path, cmd: Sequence[str], what: str) -> bool:
    """Run ``cmd`` (one torch thread) with its output appended to ``run_dir/log.txt``, :func:`land` it when it
    succeeded, then release the lock the caller :func:`claim`-ed; False, with a line naming the log, when it
    exited non-zero."""
    with open(run_dir / "log.txt", "a") as log:
        rc = subprocess.call(list(cmd), stdout=log, stderr=subprocess.STDOUT, env={**os.environ, **ENV})
    if rc == 0:
        land(run_dir)
    release(run_dir)
    if rc != 0:
        print(f"  {what} failed (rc {rc}); see {run_dir / 'log.txt'}", flush=True)
    return rc == 0


def fan_out(workers: int, argv: Sequence[str] | None = None) -> None:
    """Start ``workers`` copies of this script (``sys.argv`` plus ``--worker i``) and exit with the worst
    return code; each copy runs :func:`run_plan` over the same plan, the locks keeping them apart."""
    argv = list(sys.argv if argv is None else argv)
    procs = [subprocess.Popen([sys.executable, *argv, "--worker", str(w)]) for w in range(workers)]
    sys.exit(max(p.wait() for p in procs))


def run_plan(jobs: Sequence[Job], *, poll_s: float = 20.0,
             run: Callable[[Path, Sequence[str], str], bool] = run_claimed) -> Outcome:
    """Run every job of ``jobs`` whose ``done`` file is missing, in list order as their ``needs`` allow,
    one at a time in this process; returns (and prints) what failed and what it blocked."""
    by_key = {j.key: j for j in jobs}
    unknown = [(j.key, n) for j in jobs for n in j.needs if n not in by_key]
    if unknown:
        raise ValueError(f"jobs wait for keys not in the plan: {unknown}")
    out = Outcome()
    while True:
        bad = set(out.failed) | set(out.blocked)
        pending = [j for j in jobs if not j.done.is_file() and j.key not in bad]
        newly_blocked = [j.key for j in pending if any(n in bad for n in j.needs)]
        if newly_blocked:
            out.blocked += newly_blocked
            continue
        if not pending:
            break
        ready = [j for j in pending if all(by_key[n].done.is_file() for n in j.needs)]
        took = False
        for job in ready:
            if not claim(job.run_dir):
                continue  # another worker holds it
            took = True
            if job.done.is_file():  # finished by another worker between the listing and the claim
                release(job.run_dir)
                break
            print(f"[{time.strftime('%H:%M:%S')}] {len(jobs) - len(pending)}/{len(jobs)} done; running {job.name}",
                  flush=True)
            if not run(job.run_dir, job.cmd, job.name):
                out.failed.append(job.key)
            break
        if not took:
            time.sleep(poll_s)  # another worker holds what is ready, or what the rest waits for
    note = "; ".join(f"{what}: {keys}" for what, keys in (("failed", out.failed), ("blocked by them", out.blocked))
                     if keys)
    print("plan complete" + (f"; {note}" if note else ""), flush=True)
    return out
