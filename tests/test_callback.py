"""GNMRCallback inside a real transformers Trainer on CPU: tiny random LLaMA, real bitsandbytes INT8,
real PEFT LoRA, the real GNMRController.

References are computed independently: a fresh GNMRController fed the trace's norms, per-unit norms
taken with ``torch.linalg.vector_norm`` inside an overridden ``Trainer._clip_grad_norm`` (i.e. before the
Trainer clips), plain Trainer runs without the callback, and an uninterrupted run for resume.
"""

from __future__ import annotations

import contextlib
import functools
import json
import math
import os
import subprocess
import sys

import pytest
import torch

import gnmr_hf

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

from datasets import Dataset  # noqa: E402
from transformers import Trainer, TrainerCallback, TrainingArguments  # noqa: E402

from gnmr_hf.core.controller import GNMRConfig, GNMRController  # noqa: E402
from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402

LINEARS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
NUM_LAYERS = 4
# thresholds low enough that ordinary step-to-step noise makes units switch
SWITCHY = {"max_active": 2, "lock_steps": 1, "alpha": 1.05, "alpha_init": None, "beta": 1.05, "window": 3}
# the same statistics as a deliberate monitor (a model without dual-path layers refuses max_active > 0)
MONITOR = dict(SWITCHY, max_active=0)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@contextlib.contextmanager
def one_thread():
    # the tiny model is dominated by thread start-up and contention on a shared 2-core machine
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(n)


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def dataset(n: int = 64, seq: int = 16, seed: int = 0) -> Dataset:
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (n, seq), generator=g).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def build(path, kind: str = "dual", seed: int = 0):
    """``dual``: INT8 base with BF16 recovery paths + LoRA; ``plain``: FP32 base + LoRA (no dual path)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if kind == "dual":
        model = AutoModelForCausalLM.from_pretrained(
            path, dtype=torch.float32, quantization_config=BitsAndBytesConfig(load_in_8bit=True)
        )
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
    else:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    torch.manual_seed(seed)
    # init_lora_weights=False: B is random too, so every LoRA matrix gets a gradient from step 1
    return peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS, init_lora_weights=False))


def targs(out, **kw) -> TrainingArguments:
    base = dict(
        output_dir=str(out), max_steps=10, per_device_train_batch_size=4, learning_rate=1e-2,
        lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1, save_strategy="no",
        disable_tqdm=True, seed=0, max_grad_norm=1.0,
    )
    base.update(kw)
    return TrainingArguments(**base)


def read_trace(out) -> list[dict]:
    with open(os.path.join(out, "gnmr_trace.jsonl"), encoding="utf-8") as f:
        return [json.loads(line) for line in f]


def trainable(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}


def layer_modules(model):
    return model.base_model.model.model.layers


class ActiveRecorder(TrainerCallback):
    """After each optimizer step: which layers the model itself reports on the recovery path."""

    def __init__(self):
        self.active = []
        self.at_first_step = None

    def on_step_begin(self, args, state, control, model=None, **kw):
        if self.at_first_step is None:
            self.at_first_step = gnmr_hf.active_units(model)

    def on_optimizer_step(self, args, state, control, model=None, **kw):
        self.active.append(gnmr_hf.active_units(model))


def same_floats(a, b) -> bool:
    return all((math.isnan(x) and math.isnan(y)) or x == y for x, y in zip(a, b, strict=True))


# ---------------------------------------------------------------------------------------------------------
# dual path: decisions, actuation, logs
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def switching_run(tiny_llama_dir, tmp_path_factory):
    with one_thread():
        return _switching_run(tiny_llama_dir, tmp_path_factory)


def _switching_run(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("switch")
    model = build(tiny_llama_dir)
    gnmr_hf.set_active_units(model, [0, 1])  # left over from earlier use: train begin must reset it
    rec = ActiveRecorder()
    cb = GNMRCallback(SWITCHY)
    trainer = Trainer(model=model, args=targs(out, max_steps=24), train_dataset=dataset(), callbacks=[cb, rec])
    trainer.train()
    return {"out": out, "trainer": trainer, "cb": cb, "rec": rec, "trace": read_trace(out)}


@pytest.mark.slow
def test_trace_matches_controller_and_model(switching_run, tiny_llama_dir):
    trace, rec, trainer = switching_run["trace"], switching_run["rec"], switching_run["trainer"]
    assert [r["step"] for r in trace] == list(range(1, 25))

    ctrl = GNMRController(NUM_LAYERS, GNMRConfig(**SWITCHY))
    for r in trace:
        mask = ctrl.step(torch.tensor(r["norms"], dtype=torch.float64))
        expect = ctrl.last_record
        assert r["active"] == mask.nonzero().flatten().tolist() == expect["active"]
        assert same_floats(r["gnmr"], expect["gnmr"]) and same_floats(r["delta"], expect["delta"])
        assert r["promoted"] == expect["promoted"] and r["over_gnmr"] == expect["over_gnmr"]
        assert len(r["active"]) <= SWITCHY["max_active"]
        assert all(math.isfinite(x) and x > 0 for x in r["norms"])

    # the layers the model reports on BF16 after each step are the trace's decision for the next step
    assert rec.active == [r["active"] for r in trace]
    # ... and the initial mask (step 1 all INT8) was applied at train begin
    assert rec.at_first_step == [] and ctrl.initial_mask().sum() == 0

    # non-trivial activity: several different active sets, promotions and demotions
    assert len({tuple(r["active"]) for r in trace}) >= 3
    summary = ctrl.summary()
    assert summary["promotions"] >= 3 and summary["demotions"] >= 2

    # recovery bytes = BF16 bytes of the active layers' linear weights, counted from the checkpoint
    from safetensors import safe_open

    with safe_open(os.path.join(tiny_llama_dir, "model.safetensors"), "pt") as f:
        per_layer = [
            sum(f.get_slice(k).get_shape()[0] * f.get_slice(k).get_shape()[1] * 2 for k in f.keys()
                if k.startswith(f"model.layers.{b}.") and k.endswith("proj.weight"))
            for b in range(NUM_LAYERS)
        ]
    for r in trace:
        assert r["recovery_bytes"] == sum(per_layer[b] for b in r["active"])

    # Trainer logs carry gnmr/* (logging_steps=1: the step's own values) and the summary at the end
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["gnmr/active"] for h in logs] == [float(len(r["active"])) for r in trace]
    assert [h["gnmr/recovery_bytes"] for h in logs] == [float(r["recovery_bytes"]) for r in trace]
    assert [h["gnmr/over_delta"] for h in logs] == [float(r["over_delta"]) for r in trace]
    final = trainer.state.log_history[-1]
    assert final["gnmr/summary/promotion_ratio"] == pytest.approx(summary["promotion_ratio"])
    assert final["gnmr/summary/switches"] == summary["switches"]
    with open(os.path.join(switching_run["out"], "gnmr_summary.json"), encoding="utf-8") as f:
        assert json.load(f)["summary"] == json.loads(json.dumps(summary))
    assert trainer.args.max_grad_norm == 1.0


def test_logs_reach_reporting_callbacks(tiny_llama_dir, tmp_path):
    """A callback standing for TensorBoard/W&B (placed before GNMR, like report_to's) sees gnmr/*."""

    class Reporter(TrainerCallback):
        def __init__(self):
            self.seen = []

        def on_log(self, args, state, control, logs=None, **kw):
            self.seen.append(dict(logs))

    reporter = Reporter()
    trainer = Trainer(model=build(tiny_llama_dir, "plain"), args=targs(tmp_path, max_steps=3),
                      train_dataset=dataset(), callbacks=[reporter, GNMRCallback(MONITOR, trace=False)])
    trainer.train()
    step_logs = [s for s in reporter.seen if "loss" in s]
    assert len(step_logs) == 3 and all("gnmr/over_gnmr" in s and s["gnmr/active"] == 0 for s in step_logs)
    assert "gnmr/summary/gnmr_exceedance_rate" in reporter.seen[-1]
    assert not os.path.exists(tmp_path / "gnmr_trace.jsonl")


@pytest.mark.slow
def test_gradient_checkpointing_same_norms(switching_run, tiny_llama_dir, tmp_path):
    trainer = Trainer(
        model=build(tiny_llama_dir), train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)],
        args=targs(tmp_path, max_steps=12, gradient_checkpointing=True,
                   gradient_checkpointing_kwargs={"use_reentrant": False}),
    )
    trainer.train()
    trace = read_trace(tmp_path)
    ref = switching_run["trace"][:12]
    assert any(r["active"] for r in trace)
    for r, q in zip(trace, ref, strict=True):
        # recomputation sees the same path as the forward: the same gradients as without checkpointing
        assert r["norms"] == pytest.approx(q["norms"], rel=1e-5)
        assert r["active"] == q["active"]


# ---------------------------------------------------------------------------------------------------------
# clipping takeover and bit identity
# ---------------------------------------------------------------------------------------------------------


class PreClipTrainer(Trainer):
    """Records each decoder layer's gradient norm right before the Trainer clips."""

    unit_norms: list

    def _clip_grad_norm(self, model):
        layers = layer_modules(self.model)
        self.unit_norms.append([
            torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad.double()) for p in layer.parameters()
                                                  if p.requires_grad])).item()
            for layer in layers
        ])
        return super()._clip_grad_norm(model)


@pytest.mark.slow
def test_pre_clip_norms_and_bit_identical_update(tiny_llama_dir, tmp_path):
    max_norm = 0.05
    plain_model = build(tiny_llama_dir, "plain")
    init = trainable(plain_model)
    plain = PreClipTrainer(model=plain_model, args=targs(tmp_path / "plain", max_grad_norm=max_norm),
                           train_dataset=dataset())
    plain.unit_norms = []
    plain.train()

    model = build(tiny_llama_dir, "plain")
    trainer = Trainer(model=model, train_dataset=dataset(), callbacks=[GNMRCallback(MONITOR)],
                      args=targs(tmp_path / "gnmr", max_grad_norm=max_norm, save_strategy="steps", save_steps=4))
    trainer.train()
    trace = read_trace(tmp_path / "gnmr")

    # clipping really happened at every step
    grad_norms = [h["grad_norm"] for h in plain.state.log_history if "grad_norm" in h]
    assert len(grad_norms) == 10 and min(grad_norms) > 2 * max_norm
    # the Trainer logs the same (pre-clip) grad_norm with the callback
    assert [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h] == grad_norms
    # the controller saw the unclipped per-layer norms
    for r, ref in zip(trace, plain.unit_norms, strict=True):
        assert r["norms"] == pytest.approx(ref, rel=1e-6)
    # the update is bit-identical to the plain Trainer's (and did change the weights)
    after_plain, after = trainable(plain_model), trainable(model)
    assert all(torch.equal(after_plain[k], after[k]) for k in after)
    assert not all(torch.equal(init[k], after[k]) for k in after)
    # the user's value is back, and the checkpoint's training_args carry it
    assert trainer.args.max_grad_norm == max_norm
    saved = torch.load(tmp_path / "gnmr" / "checkpoint-4" / "training_args.bin", weights_only=False)
    assert saved.max_grad_norm == max_norm
    # the GNMR state of step 4 is in the checkpoint's trainer_state.json, and no other file is written
    with open(tmp_path / "gnmr" / "checkpoint-4" / "trainer_state.json", encoding="utf-8") as f:
        saved_state = json.load(f)["stateful_callbacks"]["GNMRState"]["attributes"]["saved"]
    assert saved_state["step"] == 4 and saved_state["controller"]["t"] == 4
    assert saved_state["active"] == trace[3]["active"]
    assert not [n for n in os.listdir(tmp_path / "gnmr" / "checkpoint-4") if n.startswith("gnmr")]


@pytest.mark.slow
def test_monitor_only_bit_identical_with_accumulation(tiny_llama_dir, tmp_path):
    kw = dict(max_steps=6, per_device_train_batch_size=2, gradient_accumulation_steps=2, max_grad_norm=0.0)
    plain_model, model = build(tiny_llama_dir, "plain"), build(tiny_llama_dir, "plain")
    init = trainable(model)
    Trainer(model=plain_model, args=targs(tmp_path / "plain", **kw), train_dataset=dataset()).train()
    trainer = Trainer(model=model, args=targs(tmp_path / "gnmr", **kw), train_dataset=dataset(),
                      callbacks=[GNMRCallback({"max_active": 0})])
    trainer.train()
    after_plain, after = trainable(plain_model), trainable(model)
    assert all(torch.equal(after_plain[k], after[k]) for k in after)
    assert not all(torch.equal(init[k], after[k]) for k in after)
    trace = read_trace(tmp_path / "gnmr")
    # monitor-only: GNMR/Delta for every layer, nothing ever active
    assert len(trace) == 6 and all(r["active"] == [] and r["recovery_bytes"] == 0 for r in trace)
    assert all(len(r["gnmr"]) == NUM_LAYERS and all(math.isfinite(x) for x in r["gnmr"]) for r in trace)
    assert trace[0]["gnmr"] == [1.0] * NUM_LAYERS and trace[-1]["gnmr"] != [1.0] * NUM_LAYERS


@pytest.mark.slow
def test_gradient_accumulation_same_norms(tiny_llama_dir, tmp_path):
    traces = []
    for bs, ga in ((8, 1), (2, 4)):
        out = tmp_path / f"ga{ga}"
        Trainer(model=build(tiny_llama_dir, "plain"), train_dataset=dataset(), callbacks=[GNMRCallback({"max_active": 0})],
                args=targs(out, max_steps=5, per_device_train_batch_size=bs, gradient_accumulation_steps=ga)).train()
        traces.append(read_trace(out))
    for a, b in zip(*traces, strict=True):
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-4)
    assert len({round(r["norms"][0], 6) for r in traces[0]}) == 5  # the norms do vary from step to step


# ---------------------------------------------------------------------------------------------------------
# resume
# ---------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def straight_trace(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight")
    with one_thread():
        Trainer(model=build(tiny_llama_dir), args=targs(out, max_steps=12), train_dataset=dataset(),
                callbacks=[GNMRCallback(SWITCHY)]).train()
    return read_trace(out)


@pytest.mark.slow
@pytest.mark.parametrize("restore_flag", [False, True])
def test_resume_equals_uninterrupted(straight_trace, tiny_llama_dir, tmp_path, restore_flag):
    kw = dict(save_strategy="steps", save_steps=6, restore_callback_states_from_checkpoint=restore_flag)
    # first part runs past the checkpoint (to step 9) and "dies": lines 7..9 must be dropped on resume
    Trainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=9, **kw), train_dataset=dataset(),
            callbacks=[GNMRCallback(SWITCHY)]).train()
    assert [r["step"] for r in read_trace(tmp_path)] == list(range(1, 10))
    model = build(tiny_llama_dir)
    rec = ActiveRecorder()

    class ActiveAtBegin(TrainerCallback):
        def on_step_begin(self, args, state, control, model=None, **kw):
            if state.global_step == 6:
                self.active = gnmr_hf.active_units(model)

    at_begin = ActiveAtBegin()
    trainer = Trainer(model=model, args=targs(tmp_path, max_steps=12, **kw), train_dataset=dataset(),
                      callbacks=[GNMRCallback(SWITCHY), rec, at_begin])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-6"))
    resumed = read_trace(tmp_path)
    assert [r["step"] for r in resumed] == list(range(1, 13))
    assert resumed == straight_trace  # 1..6 kept from the first part, 7..12 equal the uninterrupted run
    # the dual-path layers were put back in the saved active set before step 7
    assert at_begin.active == straight_trace[5]["active"]
    assert rec.active == [r["active"] for r in straight_trace[6:]]
    gnmr_cbs = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GNMRCallback)]
    assert len(gnmr_cbs) == 1
    # the restored history matters: a controller started at step 7 decides differently
    fresh = GNMRController(NUM_LAYERS, GNMRConfig(**SWITCHY))
    fresh_active = [fresh.step(torch.tensor(r["norms"], dtype=torch.float64)).nonzero().flatten().tolist()
                    for r in straight_trace[6:]]
    assert fresh_active != [r["active"] for r in straight_trace[6:]]


# ---------------------------------------------------------------------------------------------------------
# non-finite gradients
# ---------------------------------------------------------------------------------------------------------


class InjectNaNTrainer(Trainer):
    """After the backward of optimizer step ``nan_step``, keeps the real gradients and sets unit
    ``nan_unit``'s to NaN, so the Trainer's norm pass (and GNMR) sees them."""

    nan_step: int
    nan_unit: int
    saved: list | None = None

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        if self.state.global_step + 1 == self.nan_step:
            self.saved = [(p, p.grad.clone()) for p in self.model.parameters() if p.grad is not None]
            for p in layer_modules(self.model)[self.nan_unit].parameters():
                if p.requires_grad:
                    p.grad.fill_(float("nan"))
        return loss


class RestoreGrads(TrainerCallback):
    """After the norm pass, puts the real gradients back (as a loss scaler that skips the bad values
    would), so the run continues with finite weights."""

    def __init__(self, trainer_box):
        self.box = trainer_box

    def on_pre_optimizer_step(self, args, state, control, **kw):
        trainer = self.box[0]
        if trainer.saved:
            for p, g in trainer.saved:
                p.grad.copy_(g)
            trainer.saved = None


def test_nan_gradient_escalates_unit(tiny_llama_dir, tmp_path):
    box = []
    cfg = dict(SWITCHY, max_active=1, alpha=3.0, beta=3.0)  # quiet thresholds: only the NaN unit is risky
    trainer = InjectNaNTrainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=10, max_grad_norm=0.0),
                               train_dataset=dataset(), callbacks=[GNMRCallback(cfg), RestoreGrads(box)])
    trainer.nan_step, trainer.nan_unit = 5, 3
    box.append(trainer)
    trainer.train()
    trace = read_trace(tmp_path)
    assert trainer.state.global_step == 10 and len(trace) == 10
    assert not any(r["active"] for r in trace[:4])
    bad = trace[4]
    assert math.isnan(bad["norms"][3]) and bad["nonfinite"] == 1 and bad["risk"][3] == math.inf
    assert all(math.isfinite(x) for x in bad["norms"][:3])
    assert bad["active"] == [3] and 3 in bad["promoted"]
    for r in trace[5:]:
        assert all(math.isfinite(x) for x in r["norms"] + r["gnmr"] + r["delta"])
    assert all(torch.isfinite(p).all() for p in trainable(trainer.model).values())


@pytest.mark.slow
def test_nan_in_backward_clips_like_the_trainer(tiny_llama_dir, tmp_path):
    """A NaN born in the backward: the Trainer's own norm pass spreads it to every gradient before any
    callback runs; with the callback the weights end exactly as in a plain run (NaN where the plain
    run has NaN), and GNMR sees every unit non-finite."""

    def poison(model, at_call):
        calls = [0]
        p = next(p for n, p in model.named_parameters() if "layers.2." in n and p.requires_grad)

        def hook(param):
            calls[0] += 1
            if calls[0] == at_call:
                param.grad.view(-1)[0] = float("nan")

        p.register_post_accumulate_grad_hook(hook)
        return model

    kw = dict(max_steps=3, max_grad_norm=0.5)
    plain_model = poison(build(tiny_llama_dir, "plain"), 2)
    Trainer(model=plain_model, args=targs(tmp_path / "plain", **kw), train_dataset=dataset()).train()
    model = poison(build(tiny_llama_dir, "plain"), 2)
    Trainer(model=model, args=targs(tmp_path / "gnmr", **kw), train_dataset=dataset(),
            callbacks=[GNMRCallback({"max_active": 0})]).train()
    a, b = trainable(plain_model), trainable(model)
    assert any(torch.isnan(v).any() for v in a.values())
    for k in a:
        torch.testing.assert_close(a[k], b[k], rtol=0, atol=0, equal_nan=True)
    trace = read_trace(tmp_path / "gnmr")
    assert all(math.isfinite(x) for x in trace[0]["norms"])
    # the per-unit norms come from the same pass as the total, before the NaN coefficient spreads
    assert trace[1]["nonfinite"] == 1 and math.isnan(trace[1]["norms"][2])
    assert all(math.isfinite(x) for i, x in enumerate(trace[1]["norms"]) if i != 2)
    assert trace[2]["nonfinite"] == NUM_LAYERS  # the NaN update poisoned every weight


# ---------------------------------------------------------------------------------------------------------
# policies
# ---------------------------------------------------------------------------------------------------------


class MicroPolicy:
    """Duck-typed policy: activates the unit with the largest micro-batch spread; records what it saw."""

    needs_microbatch_norms = True

    def __init__(self, num_units, recoverable):
        self.num_units, self.recoverable = num_units, recoverable
        self.seen_micro, self.seen_norms, self._buf, self.last_record = [], [], [], None
        self.returned = []

    def initial_mask(self):
        return torch.zeros(self.num_units, dtype=torch.bool)

    def observe_microbatch(self, sq_norms):
        self._buf.append(sq_norms.tolist())

    def step(self, norms):
        self.seen_micro.append(self._buf)
        self.seen_norms.append(norms.tolist())
        spread = [max(v[b] for v in self._buf) for b in range(self.num_units)]
        self._buf = []
        mask = torch.zeros(self.num_units, dtype=torch.bool)
        mask[max(range(self.num_units), key=spread.__getitem__)] = True
        self.last_record = {"active": mask.nonzero().flatten().tolist()}
        self.returned.append(mask.clone())
        return mask

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass

    def summary(self):
        return {"steps": len(self.seen_norms)}


class MicroRefTrainer(Trainer):
    """Independent reference: per-layer squared norm of what each micro-batch added to .grad."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        layers = layer_modules(self.model)
        before = [[None if p.grad is None else p.grad.clone() for p in layer.parameters() if p.requires_grad]
                  for layer in layers]
        loss = super().training_step(model, inputs, num_items_in_batch)
        row = []
        for layer, prev in zip(layers, before):
            ps = [p for p in layer.parameters() if p.requires_grad]
            row.append(sum(float(((p.grad - (0 if g is None else g)).double() ** 2).sum()) for p, g in zip(ps, prev)))
        self.micro.append(row)
        return loss


@pytest.mark.slow
def test_policy_with_microbatch_norms(tiny_llama_dir, tmp_path):
    made = []

    def factory(num_units, recoverable):
        made.append(MicroPolicy(num_units, recoverable))
        return made[-1]

    trainer = MicroRefTrainer(model=build(tiny_llama_dir), train_dataset=dataset(),
                              args=targs(tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=3),
                              callbacks=[GNMRCallback(policy=factory)])
    trainer.micro = []
    trainer.train()
    policy = made[0]
    assert policy.recoverable == [True] * NUM_LAYERS
    assert [len(m) for m in policy.seen_micro] == [3, 3, 3]
    flat = [row for m in policy.seen_micro for row in m]
    for got, ref in zip(flat, trainer.micro, strict=True):
        assert got == pytest.approx(ref, rel=1e-5)
    trace = read_trace(tmp_path)
    # the trace's decisions are the masks the policy returned, and the model ran them
    assert [r["active"] for r in trace] == [m.nonzero().flatten().tolist() for m in policy.returned]
    assert len(policy.returned) == 3 and all(len(r["active"]) == 1 for r in trace)
    assert trainer.state.log_history[-1]["gnmr/summary/steps"] == 3


@pytest.mark.slow
def test_policy_from_triggers_module_resumes(tiny_llama_dir, tmp_path):
    """The project's own baseline policies plug in through functools.partial; a policy is not JSON-safe,
    yet a Trainer that rebuilds the callback from its saved args (restore flag on) resumes it exactly."""
    from gnmr_hf.core.policies import RandomPolicy

    factory = functools.partial(RandomPolicy, max_active=1)
    kw = dict(max_steps=4, save_strategy="steps", save_steps=2, restore_callback_states_from_checkpoint=True)
    first = Trainer(model=build(tiny_llama_dir), train_dataset=dataset(), args=targs(tmp_path, **kw),
                    callbacks=[GNMRCallback(policy=factory)])
    first.train()
    straight = read_trace(tmp_path)
    assert all(len(r["active"]) == 1 for r in straight) and len({r["active"][0] for r in straight}) > 1
    assert gnmr_hf.active_units(first.model) == []  # the low-cost path after train() (docs/design.md)

    user_cb = GNMRCallback(policy=factory)
    trainer = Trainer(model=build(tiny_llama_dir), train_dataset=dataset(), args=targs(tmp_path, **kw),
                      callbacks=[user_cb])
    trainer.train(resume_from_checkpoint=str(tmp_path / "checkpoint-2"))
    # the Trainer rebuilds only the state carrier; the user's callback (with its policy) stays
    gnmr_cbs = [cb for cb in trainer.callback_handler.callbacks if isinstance(cb, GNMRCallback)]
    assert gnmr_cbs == [user_cb] and user_cb.policy is factory
    assert read_trace(tmp_path) == straight


# ---------------------------------------------------------------------------------------------------------
# errors
# ---------------------------------------------------------------------------------------------------------


class NoLayers(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(128, 8)
        self.head = torch.nn.Linear(8, 128)

    def forward(self, input_ids=None, labels=None, **kw):
        logits = self.head(self.emb(input_ids))
        return {"loss": torch.nn.functional.cross_entropy(logits.flatten(0, 1), labels.flatten()), "logits": logits}


@pytest.mark.slow
def test_clear_errors(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="max_active"):
        GNMRCallback({"max_active": -1})
    with pytest.raises(ValueError, match="unknown field"):
        GNMRCallback({"max_activ": 3})
    with pytest.raises(ValueError, match="init_fraction"):
        GNMRCallback(init_fraction=1.5)
    with pytest.raises(ValueError, match="not both"):
        GNMRCallback({"max_active": 2}, policy=MicroPolicy)
    with pytest.raises(TypeError, match="config"):
        GNMRCallback(config=3)

    with pytest.raises(ValueError, match="found no units"):
        Trainer(model=NoLayers(), args=targs(tmp_path, max_steps=1), train_dataset=dataset(),
                callbacks=[GNMRCallback()]).train()

    for field, value, match in (("fsdp", "full_shard", "GNMRCallback does not support FSDP"),
                                ("deepspeed", "ds_config.json", "GNMRCallback does not support DeepSpeed")):
        trainer = Trainer(model=build(tiny_llama_dir, "plain"), args=targs(tmp_path, max_steps=1),
                          train_dataset=dataset(), callbacks=[GNMRCallback()])
        setattr(trainer.args, field, value)  # as a launcher config would have set it
        with pytest.raises(ValueError, match=match):
            trainer.train()


@pytest.mark.slow
def test_init_fraction_uses_the_shared_rule(tiny_llama_dir, tmp_path):
    from gnmr_hf.core.controller import init_steps_from_fraction

    # 5% of 6 steps is 0.3: the shared rule (at least one step for a positive fraction) gives 1,
    # plain rounding would give 0; 25% of 6 is 1.5, rounded half up to 2
    for fraction, expect in ((0.05, 1), (0.25, 2)):
        cb = GNMRCallback({"max_active": 0, "alpha_init": 1.5}, init_fraction=fraction)
        Trainer(model=build(tiny_llama_dir, "plain"), args=targs(tmp_path / str(fraction), max_steps=6),
                train_dataset=dataset(), callbacks=[cb]).train()
        assert cb.controller.config.init_steps == expect == init_steps_from_fraction(fraction, 6)
        assert cb.config.init_steps == 0  # the user's config is left as given


def test_state_lives_in_a_carrier(tiny_llama_dir, tmp_path):
    """The callback is not rebuilt by the Trainer (its units/policy need not be JSON-safe); its run state
    is carried by a GNMRState whose rebuilt copy is complete and JSON-safe."""
    from transformers.trainer_callback import ExportableState

    from gnmr_hf.trainer.state import GNMRState

    units = lambda m: [(f"l{i}", layer) for i, layer in enumerate(layer_modules(m))]  # noqa: E731
    cb = GNMRCallback(units=units, policy=MicroPolicy)
    trainer = Trainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=2),
                      train_dataset=dataset(), callbacks=[cb])
    assert not isinstance(cb, ExportableState)
    carriers = [c for c in trainer.callback_handler.callbacks if isinstance(c, GNMRState)]
    assert carriers == [cb.state_carrier]
    assert cb.state_carrier.state() == {"args": {}, "attributes": {"saved": None}}  # nothing run yet
    trainer.train()
    state = json.loads(json.dumps(cb.state_carrier.state()))
    assert state["attributes"]["saved"]["units"] == ["l0", "l1", "l2", "l3"]
    assert state["attributes"]["saved"]["step"] == 2 and state["attributes"]["saved"]["policy"] == "MicroPolicy"
    rebuilt = GNMRState(**state["args"])  # as the Trainer rebuilds it
    for k, v in state["attributes"].items():
        setattr(rebuilt, k, v)
    assert rebuilt.state() == state


# ---------------------------------------------------------------------------------------------------------
# DDP: two CPU processes (gloo)
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_ddp_two_processes_agree(tiny_llama_dir, tmp_path):
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--multi_gpu", "--num_processes", "2",
           "--num_machines", "1", "--mixed_precision", "no", "--dynamo_backend", "no",
           os.path.join(REPO, "tests", "ddp_worker.py"), "--model", str(tiny_llama_dir), "--out", str(tmp_path)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=REPO, ACCELERATE_USE_CPU="1")
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    ranks = []
    for r in (0, 1):
        with open(tmp_path / f"rank{r}.json", encoding="utf-8") as f:
            ranks.append(json.load(f))
    assert ranks[0]["world_size"] == ranks[1]["world_size"] == 2
    assert ranks[0]["decisions"] == ranks[1]["decisions"] and len(ranks[0]["decisions"]) == 8
    assert ranks[0]["model_active"] == ranks[1]["model_active"] == ranks[0]["decisions"]
    assert len({tuple(d) for d in ranks[0]["decisions"]}) >= 2
    # only the main process writes the trace, and it has the decisions both ranks took
    trace = read_trace(tmp_path / "run")
    assert [r["active"] for r in trace] == ranks[0]["decisions"]
    assert ranks[1]["trace_written"] is False
    # the forced disagreement (rank 1's policy flips a unit at step 3) raised on both ranks
    for r in ranks:
        assert "ranks disagree" in r["forced_error"] and "step 3" in r["forced_error"]
