"""GNMRCallback across crashes and checkpoints: a run killed with SIGKILL and resumed, a trace cut in
the middle of a line, and checkpoints whose GNMR state does not belong to the resuming run.

The reference for the killed run is the same script run without interruption, in its own process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import Trainer  # noqa: E402

from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402
from gnmr_hf.trainer.trace import TraceWriter  # noqa: E402
from tests.test_callback import SWITCHY, build, dataset, layer_modules, one_thread, read_trace, targs  # noqa: E402

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

WORKER = textwrap.dedent(
    """
    import os, signal, sys
    import torch
    from transformers import Trainer, TrainerCallback
    from gnmr_hf.trainer.callback import GNMRCallback
    from tests.test_callback import SWITCHY, build, dataset, targs

    model_dir, out, kill_at, resume = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4] == "resume"
    torch.set_num_threads(1)

    class Kill(TrainerCallback):
        def on_step_end(self, args, state, control, **kw):
            if state.global_step == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)  # no cleanup of any kind runs

    trainer = Trainer(model=build(model_dir), train_dataset=dataset(),
                      args=targs(out, max_steps=12, save_strategy="steps", save_steps=3, save_total_limit=2),
                      callbacks=[GNMRCallback(SWITCHY), Kill()])
    trainer.train(resume_from_checkpoint=True if resume else None)
    """
)


def run_worker(tmp_path, model_dir, out, kill_at: int, resume: bool) -> subprocess.CompletedProcess:
    script = tmp_path / "worker.py"
    script.write_text(WORKER, encoding="utf-8")
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO)
    cmd = [sys.executable, str(script), str(model_dir), str(out), str(kill_at), "resume" if resume else "fresh"]
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)


@pytest.mark.slow
def test_sigkill_then_resume_equals_uninterrupted(tiny_llama_dir, tmp_path):
    straight = run_worker(tmp_path, tiny_llama_dir, tmp_path / "straight", kill_at=-1, resume=False)
    assert straight.returncode == 0, straight.stderr[-3000:]
    reference = read_trace(tmp_path / "straight")
    assert [r["step"] for r in reference] == list(range(1, 13))
    assert len({tuple(r["active"]) for r in reference}) >= 3  # the decisions move: resuming wrong would show

    out = tmp_path / "killed"
    killed = run_worker(tmp_path, tiny_llama_dir, out, kill_at=8, resume=False)
    assert killed.returncode == -9, killed.stderr[-3000:]
    assert [r["step"] for r in read_trace(out)] == list(range(1, 9))  # lines 7, 8 are past checkpoint-6
    assert sorted(n for n in os.listdir(out) if n.startswith("checkpoint-")) == ["checkpoint-3", "checkpoint-6"]

    resumed = run_worker(tmp_path, tiny_llama_dir, out, kill_at=-1, resume=True)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(out / "gnmr_trace.jsonl", encoding="utf-8") as f:
        lines = f.read().splitlines()
    trace = [json.loads(line) for line in lines]  # every line valid JSON
    assert [r["step"] for r in trace] == list(range(1, 13))  # every step exactly once
    assert trace == reference  # the same norms and decisions as the uninterrupted run


def test_trace_cut_mid_line_is_dropped(tmp_path):
    path = str(tmp_path / "gnmr_trace.jsonl")
    with open(path, "w", encoding="utf-8") as f:
        f.write('{"step": 1, "active": []}\n{"step": 2, "active": [1]}\n{"step": 3, "act')
    writer = TraceWriter(path, resume_step=3)
    writer.write({"step": 4, "active": [0]})
    writer.close()
    with open(path, encoding="utf-8") as f:
        assert [json.loads(line)["step"] for line in f] == [1, 2, 4]


@pytest.fixture(scope="module")
def checkpoint_2(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("ckpt")
    with one_thread():
        Trainer(model=build(tiny_llama_dir), train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)],
                args=targs(out, max_steps=2, save_strategy="steps", save_steps=2)).train()
    return out


def resume_with(tiny_llama_dir, tmp_path, checkpoint, callback, restore_flag=False) -> Trainer:
    trainer = Trainer(model=build(tiny_llama_dir), train_dataset=dataset(), callbacks=[callback],
                      args=targs(tmp_path, max_steps=4, restore_callback_states_from_checkpoint=restore_flag))
    trainer.train(resume_from_checkpoint=str(checkpoint / "checkpoint-2"))
    return trainer


@pytest.mark.parametrize("restore_flag", [False, True])
def test_resume_refuses_other_units(checkpoint_2, tiny_llama_dir, tmp_path, restore_flag):
    three = lambda m: [(f"model.layers.{i}", layer) for i, layer in enumerate(layer_modules(m)[:3])]  # noqa: E731
    with one_thread(), pytest.raises(ValueError, match=r"state is for 4 units, this model has 3"):
        resume_with(tiny_llama_dir, tmp_path, checkpoint_2, GNMRCallback(SWITCHY, units=three), restore_flag)


def test_resume_refuses_other_config(checkpoint_2, tiny_llama_dir, tmp_path):
    other = dict(SWITCHY, alpha=1.2, window=4)
    with one_thread(), pytest.raises(ValueError, match=r"different GNMRConfig \(alpha: saved 1\.05 vs 1\.2; "
                                                        r"window: saved 3 vs 4\)"):
        resume_with(tiny_llama_dir, tmp_path, checkpoint_2, GNMRCallback(other))
    from gnmr_hf.core.policies import RandomPolicy

    with one_thread(), pytest.raises(ValueError, match="made with policy GNMRController, this run uses RandomPolicy"):
        resume_with(tiny_llama_dir, tmp_path, checkpoint_2, GNMRCallback(policy=RandomPolicy(4, max_active=1)))


def test_resume_same_config_continues(checkpoint_2, tiny_llama_dir, tmp_path):
    """The refusals above come from the differences: the same config resumes (the control case)."""
    with one_thread():
        trainer = resume_with(tiny_llama_dir, tmp_path, checkpoint_2, GNMRCallback(SWITCHY))
    assert trainer.state.global_step == 4
    assert [r["step"] for r in read_trace(tmp_path)] == [3, 4]
