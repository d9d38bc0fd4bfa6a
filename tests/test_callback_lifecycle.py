"""GNMRCallback's life cycle around a run (issue 17): the mask outside training (after train() returns or
raises, during the Trainer's evaluation), a crashed run whose callback is then removed, two callbacks on
one Trainer, resuming with another effective batch or other policy settings, a model that was never
prepared with prepare_dual_path, another library's wrapper on accelerator.clip_grad_norm_, and one
train -> evaluate -> resume run on a 4-bit (NF4) dual-path model.

Tiny 2-layer random LLaMA, real Trainer, real PEFT, real bitsandbytes (INT8; NF4 for the last test).
References are plain Trainer runs and uninterrupted runs.
"""

from __future__ import annotations

import functools
import json
import math
import os
import warnings

import pytest
import torch

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import Trainer, TrainerCallback  # noqa: E402

import gnmr_hf  # noqa: E402
from gnmr_hf.core.controller import GNMRConfig, GNMRController  # noqa: E402
from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_callback import (  # noqa: E402
    LINEARS,
    SWITCHY,
    build,
    dataset,
    layer_modules,
    one_thread,
    read_trace,
    targs,
    trainable,
)
from tests.test_callback_faults import ScalerTrainer, raise_at_forward  # noqa: E402

# every step on the recovery path (the full-recovery warm-up never ends in these runs): the mask that
# could outlive a step is never empty
ALWAYS = {"max_active": 2, "full_recovery_steps": 1000}


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.fixture(scope="module")
def tiny2(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny2"), num_layers=2)


def low_cost(model) -> bool:
    return gnmr_hf.active_units(model) == [] and gnmr_hf.recovery_device_bytes(model) == 0


class MaskRecorder(TrainerCallback):
    """The units the model runs on the recovery path at each step begin and at each evaluation batch."""

    def __init__(self):
        self.steps, self.evals = [], []

    def on_step_begin(self, args, state, control, model=None, **kw):
        self.steps.append((state.global_step + 1, gnmr_hf.active_units(model)))

    def on_prediction_step(self, args, state, control, **kw):
        self.evals.append((state.global_step, gnmr_hf.active_units(self.model)))


# ---------------------------------------------------------------------------------------------------------
# 17.1: the mask outside training
# ---------------------------------------------------------------------------------------------------------


def test_mask_is_low_cost_after_train_returns(tiny2, tmp_path):
    model = build(tiny2)
    cb = GNMRCallback(ALWAYS)
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=3), train_dataset=dataset(), callbacks=[cb])
    trainer.train()
    trace = read_trace(tmp_path)
    assert [r["active"] for r in trace] == [[0, 1]] * 3  # the last decision is the recovery path ...
    assert cb.active == [0, 1]  # ... and the callback still reports it (it is the checkpointed decision)
    assert low_cost(model)  # but the model is back on the low-cost path, no recovery bytes held


def test_mask_is_low_cost_after_train_raises(tiny2, tmp_path):
    model = raise_at_forward(build(tiny2), 3, ValueError("bad batch"))
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=6), train_dataset=dataset(),
                      callbacks=[GNMRCallback(ALWAYS)])
    with pytest.raises(ValueError, match="bad batch"):
        trainer.train()
    assert [r["active"] for r in read_trace(tmp_path)] == [[0, 1]] * 2  # step 3 ran on the recovery path
    assert low_cost(model)
    # the Trainer's clip call is accelerate's own again (the class's method, no instance attribute left)
    assert "clip_grad_norm_" not in vars(trainer.accelerator)


def test_evaluation_during_training_runs_on_the_low_cost_path(tiny2, tmp_path):
    eval_ds = dataset(8, seed=1)
    kw = dict(max_steps=4, eval_strategy="steps", eval_steps=2, per_device_eval_batch_size=4)
    results = {}
    for arm in ("low", "recovery"):
        model = build(tiny2)
        rec = MaskRecorder()
        rec.model = model
        trainer = Trainer(model=model, args=targs(tmp_path / arm, **kw), train_dataset=dataset(), eval_dataset=eval_ds,
                          callbacks=[GNMRCallback(ALWAYS, eval_on_recovery=arm == "recovery"), rec])
        trainer.train()
        # evaluations at steps 2 and 4, two batches each: on the low-cost path by default, on the training
        # mask with eval_on_recovery=True
        during = [] if arm == "low" else [0, 1]
        assert rec.evals == [(2, during), (2, during), (4, during), (4, during)]
        assert len([h for h in trainer.state.log_history if "eval_loss" in h]) == 2
        # training steps run the training mask, also right after an evaluation
        assert rec.steps == [(1, [0, 1]), (2, [0, 1]), (3, [0, 1]), (4, [0, 1])]
        assert low_cost(model)
        # evaluate() after training: the low-cost path in both arms
        results[arm] = trainer.evaluate()["eval_loss"]
        assert low_cost(model) and rec.evals[-1] == (4, [])
    assert results["low"] == results["recovery"]


def test_evaluation_inside_train_does_not_change_training(tiny2, tmp_path):
    """The training mask is put back after each evaluation: a switching run with evaluations every two
    steps takes the same decisions, from the same norms, as without evaluations."""
    traces = []
    for arm, extra in (("plain", {}), ("eval", dict(eval_strategy="steps", eval_steps=2))):
        trainer = Trainer(model=build(tiny2), args=targs(tmp_path / arm, max_steps=8, **extra), train_dataset=dataset(),
                          eval_dataset=dataset(8, seed=1), callbacks=[GNMRCallback(SWITCHY)])
        trainer.train()
        traces.append(read_trace(tmp_path / arm))
    assert traces[0] == traces[1]
    assert any(r["active"] for r in traces[0][:-1])  # evaluations did happen with units promoted


# ---------------------------------------------------------------------------------------------------------
# 17.2: a crash, then the callback removed
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_removed_callback_after_a_crash_trains_like_a_plain_trainer(tiny2, tmp_path):
    """Steps 1..3 run all on the low-cost path (SWITCHY promotes nothing before step 3's decision), the
    forward of step 4 raises with layers on the recovery path; without the callback the next train() must
    be a plain Trainer's."""
    adapters = {}
    for arm in ("plain", "gnmr"):
        model = raise_at_forward(build(tiny2), 4, ValueError("bad batch"))
        args = targs(tmp_path / arm, max_steps=6, max_grad_norm=0.05)
        callbacks = [GNMRCallback(SWITCHY)] if arm == "gnmr" else []
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
        with pytest.raises(ValueError, match="bad batch"):
            trainer.train()
        if arm == "gnmr":
            trace = read_trace(tmp_path / arm)
            assert [r["active"] for r in trace[:2]] == [[], []] and trace[2]["active"]  # the crash-time mask
            trainer.remove_callback(GNMRCallback)
            assert not any(isinstance(cb, GNMRCallback) for cb in trainer.callback_handler.callbacks)
        trainer.train()
        adapters[arm] = trainable(model)
        assert low_cost(model)
    assert all(torch.equal(adapters["plain"][k], adapters["gnmr"][k]) for k in adapters["plain"])


# ---------------------------------------------------------------------------------------------------------
# 17.3: one GNMRCallback per Trainer
# ---------------------------------------------------------------------------------------------------------


def test_two_callbacks_on_one_trainer_are_refused(tiny2, tmp_path):
    model = build(tiny2)
    c1 = GNMRCallback(SWITCHY, trace=False)
    c2 = GNMRCallback({"max_active": 1}, trace=False)
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=dataset(), callbacks=[c1, c2])
    with pytest.raises(ValueError, match=r"2 GNMRCallbacks.*max_active=2.*max_active=1|2 GNMRCallbacks.*max_active=1.*max_active=2"):
        trainer.train()
    assert trainer.state.global_step == 0 and low_cost(model)


# ---------------------------------------------------------------------------------------------------------
# 17.4: resume with another effective batch, or other policy settings
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def checkpoint_3(tiny2, tmp_path_factory):
    """SWITCHY trained to step 3 with 4 samples per optimizer step, checkpoint at step 3."""
    out = tmp_path_factory.mktemp("ckpt3")
    with one_thread():
        Trainer(model=build(tiny2), train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)],
                args=targs(out, max_steps=3, save_strategy="steps", save_steps=3)).train()
    return out / "checkpoint-3"


def resume(tiny2, out, checkpoint, callback, **kw) -> Trainer:
    trainer = Trainer(model=build(tiny2), train_dataset=dataset(), callbacks=[callback],
                      args=targs(out, **{"max_steps": 6, **kw}))
    trainer.train(resume_from_checkpoint=str(checkpoint))
    return trainer


def gnmr_warnings(record) -> list[str]:
    return [str(w.message) for w in record if "GNMRCallback" in str(w.message)]


def test_checkpoint_records_the_effective_batch(checkpoint_3):
    with open(checkpoint_3 / "trainer_state.json", encoding="utf-8") as f:
        saved = json.load(f)["stateful_callbacks"]["GNMRState"]["attributes"]["saved"]
    assert saved["effective_batch"] == 4


def test_resume_with_the_same_effective_batch_continues(tiny2, checkpoint_3, tmp_path):
    """2 x 2 accumulation is the same effective batch as 4 x 1: the statistics continue, no warning."""
    cb = GNMRCallback(SWITCHY)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resume(tiny2, tmp_path, checkpoint_3, cb, per_device_train_batch_size=2, gradient_accumulation_steps=2)
    assert gnmr_warnings(record) == []
    assert cb.controller.t == 6


def test_resume_with_another_effective_batch_restarts_the_statistics(tiny2, checkpoint_3, tmp_path):
    cb = GNMRCallback(SWITCHY)
    rec = MaskRecorder()
    trainer = Trainer(model=build(tiny2), train_dataset=dataset(), callbacks=[cb, rec],
                      args=targs(tmp_path, max_steps=6, per_device_train_batch_size=2))
    with pytest.warns(UserWarning, match=r"effective batch of 4 .* this run uses 2.*restart"):
        trainer.train(resume_from_checkpoint=str(checkpoint_3))
    assert cb.controller.t == 3  # a fresh controller: steps 4, 5, 6 only
    assert rec.steps[0] == (4, [])  # nothing carried over onto the recovery path
    trace = read_trace(tmp_path)
    assert [r["step"] for r in trace] == [4, 5, 6]
    assert [r["controller_step"] for r in trace] == [1, 2, 3]
    fresh = GNMRController(2, GNMRConfig(**SWITCHY))
    for r in trace:
        assert r["active"] == fresh.step(torch.tensor(r["norms"], dtype=torch.float64)).nonzero().flatten().tolist()
    # the next checkpoint of the restarted run records the new batch
    assert cb.state_carrier.state()["attributes"]["saved"]["effective_batch"] == 2


def test_resume_with_another_effective_batch_refused_in_strict_mode(tiny2, checkpoint_3, tmp_path):
    with pytest.raises(ValueError, match=r"effective batch of 4 .* this run uses 8.*strict_resume"):
        resume(tiny2, tmp_path, checkpoint_3, GNMRCallback(SWITCHY, strict_resume=True), gradient_accumulation_steps=2)


def test_resume_from_a_checkpoint_without_the_effective_batch(tiny2, checkpoint_3, tmp_path):
    """A checkpoint written before the field existed resumes, the batch unknown: exactly, without a warning."""
    import shutil

    old = tmp_path / "old" / "checkpoint-3"
    shutil.copytree(checkpoint_3, old)
    path = old / "trainer_state.json"
    state = json.loads(path.read_text(encoding="utf-8"))
    del state["stateful_callbacks"]["GNMRState"]["attributes"]["saved"]["effective_batch"]
    path.write_text(json.dumps(state), encoding="utf-8")
    cb = GNMRCallback(SWITCHY)
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        resume(tiny2, tmp_path / "run", old, cb, per_device_train_batch_size=2)
    assert gnmr_warnings(record) == []
    assert cb.controller.t == 6  # the saved statistics were loaded


def policy_checkpoint(tiny2, out, factory):
    Trainer(model=build(tiny2), train_dataset=dataset(), callbacks=[GNMRCallback(policy=factory)],
            args=targs(out, max_steps=2, save_strategy="steps", save_steps=2)).train()
    return out / "checkpoint-2"


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_resume_refuses_other_policy_settings(tiny2, tmp_path):
    from gnmr_hf.core.policies import RandomBudgetPolicy, RandomPolicy, StaticSensitivityPolicy

    ckpt = policy_checkpoint(tiny2, tmp_path / "random", functools.partial(RandomPolicy, max_active=1, seed=0))
    with pytest.raises(ValueError, match=r"RandomPolicy settings.*max_active: saved 1 vs 2; seed: saved 0 vs 1"):
        resume(tiny2, tmp_path / "r1", ckpt, GNMRCallback(policy=functools.partial(RandomPolicy, max_active=2, seed=1)))
    with pytest.raises(ValueError, match=r"seed: saved 0 vs 3"):
        resume(tiny2, tmp_path / "r2", ckpt, GNMRCallback(policy=functools.partial(RandomPolicy, max_active=1, seed=3)))
    # the control case: the same settings resume
    resume(tiny2, tmp_path / "r3", ckpt, GNMRCallback(policy=functools.partial(RandomPolicy, max_active=1, seed=0)))

    ckpt = policy_checkpoint(tiny2, tmp_path / "budget",
                             functools.partial(RandomBudgetPolicy, mean_active=0.5, max_active=2, seed=0))
    with pytest.raises(ValueError, match=r"mean_active: saved 0\.5 vs 1\.5"):
        resume(tiny2, tmp_path / "b1", ckpt,
               GNMRCallback(policy=functools.partial(RandomBudgetPolicy, mean_active=1.5, max_active=2, seed=0)))

    ckpt = policy_checkpoint(tiny2, tmp_path / "adapt",
                             functools.partial(StaticSensitivityPolicy, max_active=2, warmup_steps=1, fraction=0.5))
    with pytest.raises(ValueError, match=r"fraction: saved 0\.5 vs 1\.0"):
        resume(tiny2, tmp_path / "a1", ckpt,
               GNMRCallback(policy=functools.partial(StaticSensitivityPolicy, max_active=2, warmup_steps=1, fraction=1.0)))


# ---------------------------------------------------------------------------------------------------------
# 17.5: a model never prepared with prepare_dual_path
# ---------------------------------------------------------------------------------------------------------


def test_forgotten_prepare_dual_path_is_refused(tiny2, tmp_path):
    model = build(tiny2, "plain")
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=dataset(),
                      callbacks=[GNMRCallback({"max_active": 2})])
    with pytest.raises(ValueError, match=r"max_active=2.*no dual-path.*gnmr_hf\.prepare_dual_path.*max_active=0"):
        trainer.train()
    assert trainer.state.global_step == 0
    # a deliberate monitor says so, and runs
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=2), train_dataset=dataset(),
                      callbacks=[GNMRCallback({"max_active": 0})])
    trainer.train()
    assert len(read_trace(tmp_path)) == 2


# ---------------------------------------------------------------------------------------------------------
# 17.6: another library's wrapper on accelerator.clip_grad_norm_
# ---------------------------------------------------------------------------------------------------------


class CountingClip:
    """Another library's wrapper on ``accelerator.clip_grad_norm_``: counts its calls and records each
    decoder layer's gradient norm as it receives the gradients (before clipping)."""

    def __init__(self, trainer):
        self.trainer = trainer
        self.inner = trainer.accelerator.clip_grad_norm_
        self.calls = 0
        self.unit_norms = []
        trainer.accelerator.clip_grad_norm_ = self

    def __call__(self, parameters, max_norm, norm_type=2):
        self.calls += 1
        self.unit_norms.append([
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in layer.parameters()
                                                  if p.requires_grad])).item()
            for layer in layer_modules(self.trainer.model)
        ])
        return self.inner(parameters, max_norm, norm_type=norm_type)


@pytest.mark.parametrize("max_norm", [0.05, 0.0])
def test_foreign_clip_wrapper_is_kept(tiny2, tmp_path, max_norm):
    results = {}
    for arm in ("plain", "gnmr"):
        model = build(tiny2, "plain")
        callbacks = [GNMRCallback({"max_active": 0})] if arm == "gnmr" else []
        trainer = Trainer(model=model, args=targs(tmp_path / arm, max_steps=4, max_grad_norm=max_norm),
                          train_dataset=dataset(), callbacks=callbacks)
        wrapper = CountingClip(trainer)
        with warnings.catch_warnings(record=True) as record:
            warnings.simplefilter("always")
            trainer.train()
        assert wrapper.calls == 4  # once per optimizer step, in both arms
        assert trainer.accelerator.clip_grad_norm_ is wrapper  # left in place
        grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        results[arm] = (trainable(model), wrapper, gnmr_warnings(record), grad_norms)
    (plain, _, _, plain_norms), (gnmr, wrapper, warned, gnmr_norms) = results["plain"], results["gnmr"]
    assert all(torch.equal(plain[k], gnmr[k]) for k in plain)  # monitor-only: bit-identical
    assert gnmr_norms == plain_norms
    assert len(warned) == 1 and "clip_grad_norm_" in warned[0] and "separate" in warned[0]
    trace = read_trace(tmp_path / "gnmr")
    for r, ref in zip(trace, wrapper.unit_norms, strict=True):
        assert r["norms"] == pytest.approx(ref, rel=1e-6)  # the pre-clip norms
    if max_norm:
        assert min(math.sqrt(sum(x * x for x in r["norms"])) for r in trace) > 2 * max_norm  # clipping acted


def test_foreign_clip_wrapper_with_a_loss_scaler(tiny2, tmp_path):
    """The separate pass reads gradients still multiplied by the fp16 loss scale (the wrapper's inner
    accelerate clip unscales them): it divides the scale out, and an overflow step is still skipped. The
    run equals the one whose clip call the callback answers itself."""
    traces = []
    for arm in ("fused", "wrapped"):
        trainer = ScalerTrainer(model=build(tiny2), args=targs(tmp_path / arm, max_steps=8, max_grad_norm=1.0),
                                train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)])
        trainer.overflow_at = (4,)
        if arm == "wrapped":
            wrapper = CountingClip(trainer)
        trainer.train()
        traces.append(read_trace(tmp_path / arm))
    assert wrapper.calls == 8
    assert [r["step"] for r in traces[1] if r.get("skipped")] == [4]
    assert traces[1] == traces[0]
    assert any(r["active"] for r in traces[0])


# ---------------------------------------------------------------------------------------------------------
# 17.7: end to end on NF4: train -> evaluate -> resume
# ---------------------------------------------------------------------------------------------------------


def build_nf4(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=quant)
    model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
    torch.manual_seed(0)
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False))


def test_nf4_train_evaluate_resume(tiny2, tmp_path):
    model = build_nf4(tiny2)
    rec = MaskRecorder()
    rec.model = model
    cb = GNMRCallback(SWITCHY)
    trainer = Trainer(model=model, train_dataset=dataset(), eval_dataset=dataset(8, seed=1), callbacks=[cb, rec],
                      args=targs(tmp_path, max_steps=8, save_strategy="steps", save_steps=4))
    trainer.train()
    straight = read_trace(tmp_path)
    assert [r["step"] for r in straight] == list(range(1, 9))
    assert len({tuple(r["active"]) for r in straight}) >= 2  # the decisions move
    # each step ran the previous step's decision; outside the steps, the low-cost path
    assert [m for _, m in rec.steps] == [[]] + [r["active"] for r in straight[:-1]]
    assert low_cost(model)
    metrics = trainer.evaluate()
    assert math.isfinite(metrics["eval_loss"]) and rec.evals and all(m == [] for _, m in rec.evals)
    assert low_cost(model)

    rec.steps = []
    with warnings.catch_warnings(record=True) as record:
        warnings.simplefilter("always")
        trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-4"))
    assert gnmr_warnings(record) == []  # in particular, the clip call is taken over as in the first run
    resumed = read_trace(tmp_path)
    assert [r["active"] for r in resumed] == [r["active"] for r in straight]
    assert resumed == straight
    assert [m for _, m in rec.steps] == [r["active"] for r in straight[3:-1]]
    assert low_cost(model)
    assert cb.controller.t == 8
    assert os.path.exists(tmp_path / "checkpoint-8")
