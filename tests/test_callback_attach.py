"""Where GNMRCallback sits in the Trainer: first in the callback list, so that reporting callbacks
(TensorBoard, W&B: added by ``report_to`` before user callbacks) see the ``gnmr/*`` keys; the explicit
``gnmr_hf.attach(trainer, ...)`` and the drop-in ``callbacks=[...]`` place it alike."""

from __future__ import annotations

import pytest

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import Trainer, TrainerCallback  # noqa: E402
from transformers.trainer_callback import DefaultFlowCallback  # noqa: E402

import gnmr_hf  # noqa: E402
from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402
from gnmr_hf.trainer.state import GNMRState  # noqa: E402
from tests.test_callback import MONITOR, SWITCHY, build, dataset, one_thread, read_trace, targs  # noqa: E402


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


class Reporter(TrainerCallback):
    """Stands for TensorBoardCallback: records what on_log hands it."""

    def __init__(self):
        self.seen = []

    def on_log(self, args, state, control, logs=None, **kw):
        self.seen.append(dict(logs))


def step_logs(reporter: Reporter) -> list[dict]:
    return [s for s in reporter.seen if "loss" in s]


@pytest.mark.slow
def test_attach_places_first_and_reporters_see_gnmr_keys(tiny_llama_dir, tmp_path):
    early = Reporter()
    trainer = Trainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=4), train_dataset=dataset(),
                      callbacks=[early])
    late = Reporter()
    trainer.add_callback(late)
    cb = gnmr_hf.attach(trainer, SWITCHY)
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is cb and isinstance(callbacks[1], DefaultFlowCallback)
    assert callbacks.index(early) < callbacks.index(late) < callbacks.index(cb.state_carrier)
    with pytest.raises(ValueError, match="already has a GNMRCallback"):
        gnmr_hf.attach(trainer, SWITCHY)
    trainer.train()
    trace = read_trace(tmp_path)
    for reporter in (early, late):
        logs = step_logs(reporter)
        assert [s["gnmr/active"] for s in logs] == [float(len(r["active"])) for r in trace]
        assert "gnmr/summary/promotion_ratio" in reporter.seen[-1]
    assert any(r["active"] for r in trace)  # the values reported are not all zero
    assert cb.active == trace[-1]["active"] and gnmr_hf.active_units(trainer.model) == []  # low-cost after train()


def test_drop_in_is_placed_first_at_init(tiny_llama_dir, tmp_path):
    reporter = Reporter()
    cb = GNMRCallback(MONITOR, trace=False)
    trainer = Trainer(model=build(tiny_llama_dir, "plain"), args=targs(tmp_path, max_steps=2),
                      train_dataset=dataset(), callbacks=[reporter, cb])
    callbacks = trainer.callback_handler.callbacks
    assert callbacks[0] is cb
    assert [c for c in callbacks if isinstance(c, GNMRState)] == [cb.state_carrier]
    # a callback inserted in front later is overtaken again at train begin
    front = Reporter()
    callbacks.insert(0, front)
    trainer.train()
    assert callbacks[0] is cb
    assert all("gnmr/over_gnmr" in s for s in step_logs(front)) and len(step_logs(front)) == 2


@pytest.mark.slow
def test_controller_state_is_reachable_after_attach(tiny_llama_dir, tmp_path):
    """attach returns the live callback: its controller is the one that ran."""
    trainer = Trainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=3), train_dataset=dataset())
    cb = gnmr_hf.attach(trainer, SWITCHY, trace=False)
    assert cb.controller is None
    trainer.train()
    assert cb.controller.t == 3
    assert cb.active == cb.controller.last_record["active"] and gnmr_hf.active_units(trainer.model) == []
