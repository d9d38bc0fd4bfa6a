"""GNMRCallback when things go wrong: steps that raise, fp16 loss-scaler overflow steps, DTensor
parameters, and the fused norm pass checked against torch's own clip.

References: plain Trainer runs with the same faults, torch.nn.utils.clip_grad_norm_, and a fresh
GNMRController fed the norms of the steps the optimizer really took.
"""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from transformers import Trainer  # noqa: E402

from gnmr_hf.core.controller import GNMRConfig, GNMRController  # noqa: E402
from gnmr_hf.trainer.callback import GNMRCallback  # noqa: E402
from gnmr_hf.trainer.grad_norms import UnitGradNorms  # noqa: E402
from tests.test_callback import (  # noqa: E402
    MONITOR,
    NUM_LAYERS,
    SWITCHY,
    build,
    dataset,
    layer_modules,
    one_thread,
    read_trace,
    targs,
    trainable,
)

OOM = "DefaultCPUAllocator: can't allocate memory: you tried to allocate 123456789 bytes. Error code 12"


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


def raise_at_forward(model, call: int, error: Exception):
    """Make the ``call``-th forward of ``model`` (counted from 1, once) raise ``error``."""
    calls = [0]

    def hook(module, args, kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise error

    model.register_forward_pre_hook(hook, with_kwargs=True)
    return model


# ---------------------------------------------------------------------------------------------------------
# issue 10.1: clipping survives a failed step
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.slow
def test_step_that_raises_leaves_clipping_intact(tiny_llama_dir, tmp_path):
    """A forward raises in step 3; train() again with the same args and callback clips as a plain Trainer."""
    max_norm = 0.05
    results = {}
    for arm in ("plain", "gnmr"):
        model = raise_at_forward(build(tiny_llama_dir, "plain"), 3, ValueError("bad batch"))
        init = trainable(model)
        args = targs(tmp_path / arm, max_steps=6, max_grad_norm=max_norm)
        callbacks = [GNMRCallback(MONITOR)] if arm == "gnmr" else []
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
        with pytest.raises(ValueError, match="bad batch"):
            trainer.train()
        assert args.max_grad_norm == max_norm  # back to the user before the error reached them
        trainer.train()
        assert args.max_grad_norm == max_norm
        grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        results[arm] = (init, trainable(model), grad_norms)
    init, plain, plain_norms = results["plain"]
    _, gnmr, gnmr_norms = results["gnmr"]
    assert min(plain_norms) > 2 * max_norm  # clipping really acts in the second run
    assert gnmr_norms == plain_norms
    assert all(torch.equal(plain[k], gnmr[k]) for k in plain)
    assert not all(torch.equal(init[k], gnmr[k]) for k in gnmr)
    assert all(torch.isfinite(v).all() for v in gnmr.values())
    assert [r["step"] for r in read_trace(tmp_path / "gnmr")] == list(range(1, 7))


@pytest.mark.slow
def test_auto_find_batch_size_retry_clips_like_the_trainer(tiny_llama_dir, tmp_path):
    """An out-of-memory error in the first step: the Trainer's own retry with a smaller batch clips."""
    max_norm = 0.05
    results = {}
    for arm in ("plain", "gnmr"):
        model = raise_at_forward(build(tiny_llama_dir, "plain"), 1, RuntimeError(OOM))
        args = targs(tmp_path / arm, max_steps=5, max_grad_norm=max_norm, auto_find_batch_size=True,
                     per_device_train_batch_size=8)
        callbacks = [GNMRCallback(MONITOR)] if arm == "gnmr" else []
        trainer = Trainer(model=model, args=args, train_dataset=dataset(), callbacks=callbacks)
        trainer.train()
        assert trainer._train_batch_size == 7  # the retry ran (8 * 0.9)
        assert args.max_grad_norm == max_norm
        grad_norms = [h["grad_norm"] for h in trainer.state.log_history if "grad_norm" in h]
        results[arm] = (trainable(model), grad_norms)
    (plain, plain_norms), (gnmr, gnmr_norms) = results["plain"], results["gnmr"]
    assert len(plain_norms) == 5 and min(plain_norms) > 2 * max_norm
    assert gnmr_norms == plain_norms
    assert all(torch.equal(plain[k], gnmr[k]) for k in plain)
    trace = read_trace(tmp_path / "gnmr")
    assert [r["step"] for r in trace] == list(range(1, 6))


# ---------------------------------------------------------------------------------------------------------
# the fused norm pass
# ---------------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("max_norm", [0.5, float("inf")])
def test_fused_clip_matches_torch(max_norm):
    """UnitGradNorms.clip_ clips bit-identically to torch.nn.utils.clip_grad_norm_ (mixed dtypes, a
    parameter without gradient, a parameter outside every unit) and sums the per-unit norms."""
    g = torch.Generator().manual_seed(0)
    units = [(f"u{b}", torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.Linear(7, 3))) for b in range(3)]
    units[1][1][0].to(torch.bfloat16)
    outside = torch.nn.Linear(4, 4)
    params = [p for _, m in units for p in m.parameters()] + list(outside.parameters())
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(p.dtype)
    units[2][1][1].bias.grad = None
    copies = [None if p.grad is None else p.grad.clone() for p in params]

    norms = UnitGradNorms(units)
    total, sq = norms.clip_(params, max_norm)

    ref_params = [torch.nn.Parameter(p.detach().clone()) for p in params]
    for r, c in zip(ref_params, copies):
        r.grad = None if c is None else c.clone()
    ref_total = torch.nn.utils.clip_grad_norm_(ref_params, max_norm)
    assert torch.equal(total, ref_total)
    for p, r in zip(params, ref_params):
        assert (p.grad is None and r.grad is None) or torch.equal(p.grad, r.grad)
    if max_norm < ref_total:
        assert not all(c is None or torch.equal(c, p.grad) for c, p in zip(copies, params))  # it did clip
    expect = [
        sum(float(c.double().norm() ** 2) for p, c in zip(params, copies) if c is not None
            and any(p is q for q in m.parameters()))
        for _, m in units
    ]
    assert sq.tolist() == pytest.approx(expect, rel=1e-6)
    assert all(math.isfinite(x) and x > 0 for x in sq.tolist())


# ---------------------------------------------------------------------------------------------------------
# issue 10.2: fp16 loss-scaler overflow steps
# ---------------------------------------------------------------------------------------------------------


class ScalerTrainer(Trainer):
    """The fp16 loss-scaling path on CPU: a real ``torch.amp.GradScaler("cpu")`` in the accelerator (so
    ``accelerator.backward`` scales the loss and ``AcceleratedOptimizer.step`` runs ``scaler.step`` /
    ``update`` and reports skipped steps), and ``unscale_gradients`` doing what accelerate does with
    ``mixed_precision="fp16"`` on a GPU (``scaler.unscale_`` of each optimizer), which it only enables
    on GPUs. The forward stays FP32: what is tested is the scaler's bookkeeping, not fp16 arithmetic.
    ``overflow_at``: optimizer steps whose gradients get an Inf entry in their last micro-batch, as an
    fp16 overflow would produce."""

    overflow_at: tuple[int, ...] = ()

    def create_accelerator_and_postprocess(self):
        super().create_accelerator_and_postprocess()
        acc = self.accelerator
        acc.scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10, growth_interval=1000)

        def unscale_gradients(optimizer=None):
            for opt in acc._optimizers:
                while hasattr(opt, "optimizer"):
                    opt = opt.optimizer
                acc.scaler.unscale_(opt)

        acc.unscale_gradients = unscale_gradients

    def training_step(self, model, inputs, num_items_in_batch=None):
        loss = super().training_step(model, inputs, num_items_in_batch)
        last = self.accelerator.gradient_state.sync_gradients
        if last and self.state.global_step + 1 in self.overflow_at:
            p = next(p for p in layer_modules(self.model)[1].parameters() if p.requires_grad)
            p.grad.view(-1)[0] = float("inf")
        return loss


@pytest.mark.slow
def test_overflow_step_is_skipped_by_the_controller(tiny_llama_dir, tmp_path):
    trainer = ScalerTrainer(model=build(tiny_llama_dir), args=targs(tmp_path, max_steps=10, max_grad_norm=1.0),
                            train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)])
    trainer.overflow_at = (4, 7)
    trainer.train()
    trace = read_trace(tmp_path)
    assert [r["step"] for r in trace] == list(range(1, 11))
    skipped = [r["step"] for r in trace if r.get("skipped")]
    assert skipped == [4, 7]
    scale = trainer.accelerator.scaler.get_scale()
    assert scale == 2.0**10 * 0.5**2  # the real scaler backed off twice: it did skip those steps
    for r in trace:
        if r.get("skipped"):
            assert math.isinf(r["norms"][1]) and all(math.isfinite(x) for i, x in enumerate(r["norms"]) if i != 1)
            prev = trace[r["step"] - 2]["active"]
            assert r["active"] == prev  # the active set is unchanged
            assert "gnmr" not in r and "promoted" not in r
        else:
            assert all(math.isfinite(x) and x > 0 for x in r["norms"])

    # the decisions and the full controller state (statistics, locks) are those of a controller that
    # never saw the skipped steps
    ref = GNMRController(NUM_LAYERS, GNMRConfig(**SWITCHY))
    for r in trace:
        if not r.get("skipped"):
            mask = ref.step(torch.tensor(r["norms"], dtype=torch.float64))
            assert r["active"] == mask.nonzero().flatten().tolist()
    assert trainer.callback_handler.callbacks[0].controller.state_dict() == ref.state_dict()
    assert len({tuple(r["active"]) for r in trace}) >= 2  # the decisions do move
    logs = [h for h in trainer.state.log_history if "loss" in h]
    assert [h["gnmr/skipped"] for h in logs] == [1.0 if r.get("skipped") else 0.0 for r in trace]
    assert all(torch.isfinite(p).all() for p in trainable(trainer.model).values())


class MicroRecorder:
    """A policy that records the micro-batch squared norms it is given and always chooses nothing."""

    needs_microbatch_norms = True

    def __init__(self, num_units, recoverable):
        self.num_units, self.micro, self.last_record, self._buf = num_units, [], {}, []

    def initial_mask(self):
        return torch.zeros(self.num_units, dtype=torch.bool)

    def observe_microbatch(self, sq_norms):
        self._buf.append(sq_norms.tolist())

    def step(self, norms):
        self.micro.append(self._buf)
        self._buf = []
        return torch.zeros(self.num_units, dtype=torch.bool)

    def state_dict(self):
        return {}

    def load_state_dict(self, sd):
        pass

    def summary(self):
        return {}


class UnscaledMicroRef(ScalerTrainer):
    """Independent reference: per-layer squared norm of what each micro-batch added, divided by the
    loss scale squared (the gradients are scaled until the optimizer step unscales them)."""

    def training_step(self, model, inputs, num_items_in_batch=None):
        layers = layer_modules(self.model)
        before = [[None if p.grad is None else p.grad.clone() for p in layer.parameters() if p.requires_grad]
                  for layer in layers]
        scale = self.accelerator.scaler.get_scale()
        loss = super().training_step(model, inputs, num_items_in_batch)
        row = []
        for layer, prev in zip(layers, before):
            ps = [p for p in layer.parameters() if p.requires_grad]
            row.append(sum(float(((p.grad - (0 if g is None else g)).double() ** 2).sum()) for p, g in zip(ps, prev))
                       / scale**2)
        self.ref_micro.append(row)
        return loss


@pytest.mark.slow
def test_microbatch_norms_are_unscaled(tiny_llama_dir, tmp_path):
    made = []

    def factory(n, recoverable):
        made.append(MicroRecorder(n, recoverable))
        return made[-1]

    trainer = UnscaledMicroRef(model=build(tiny_llama_dir), train_dataset=dataset(), callbacks=[GNMRCallback(policy=factory)],
                               args=targs(tmp_path, max_steps=3, per_device_train_batch_size=2, gradient_accumulation_steps=3))
    trainer.ref_micro = []
    trainer.train()
    flat = [row for m in made[0].micro for row in m]
    assert [len(m) for m in made[0].micro] == [3, 3, 3]
    for got, ref in zip(flat, trainer.ref_micro, strict=True):
        assert got == pytest.approx(ref, rel=1e-5)
    # the unscaled values are those of a run without loss scaling: far below the scaled ones
    assert max(max(r) for r in flat) < 1e3


@pytest.mark.gpu
def test_fp16_overflow_on_gpu(tiny_llama_dir, tmp_path):
    """fp16=True on CUDA: an Inf gradient at step 3 makes the real scaler skip it; GNMR skips it too."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")

    class Overflow(Trainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            loss = super().training_step(model, inputs, num_items_in_batch)
            if self.state.global_step + 1 == 3:
                next(p for p in layer_modules(self.model)[2].parameters() if p.requires_grad).grad.view(-1)[0] = math.inf
            return loss

    trainer = Overflow(model=build(tiny_llama_dir), train_dataset=dataset(), callbacks=[GNMRCallback(SWITCHY)],
                       args=targs(tmp_path, max_steps=6, use_cpu=False, fp16=True))
    trainer.train()
    trace = read_trace(tmp_path)
    assert [r["step"] for r in trace if r.get("skipped")] == [3]
    assert trace[2]["active"] == trace[1]["active"]
    ref = GNMRController(NUM_LAYERS, GNMRConfig(**SWITCHY))
    for r in trace:
        if not r.get("skipped"):
            assert r["active"] == ref.step(torch.tensor(r["norms"], dtype=torch.float64)).nonzero().flatten().tolist()


# ---------------------------------------------------------------------------------------------------------
# issue 10.5a: DTensor parameters are refused
# ---------------------------------------------------------------------------------------------------------


def test_dtensor_parameters_refused(tiny_llama_dir, tmp_path):
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Replicate
    from transformers import TrainerControl, TrainerState

    created = not torch.distributed.is_initialized()
    if created:
        store = torch.distributed.HashStore()
        torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        mesh = init_device_mesh("cpu", (1,))
        model = build(tiny_llama_dir, "plain")
        lora = layer_modules(model)[1].self_attn.q_proj.lora_A["default"]
        lora.weight = torch.nn.Parameter(DTensor.from_local(lora.weight.detach(), mesh, [Replicate()]))
        cb = GNMRCallback()
        args = targs(tmp_path, max_steps=1)
        with pytest.raises(ValueError, match=r"DTensor \(tensor-parallel\).*layers\.1\.self_attn\.q_proj"):
            cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
        assert cb.controller is None
    finally:
        if created:
            torch.distributed.destroy_process_group()
