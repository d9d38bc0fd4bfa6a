"""MX stress proxy: a residual-MLP student learns a frozen random teacher in simulated MX formats.

The small model of arXiv 2506.20752 (docs/mx.md) on which block-scaled MX training spikes and
diverges, with GNMR and the baseline triggers choosing which residual blocks run on the BF16
recovery path:

    student  L blocks  x <- x + fc2(gelu(fc1(LayerNorm(x))))   hidden 4 x width, fc1 without bias
    teacher  L blocks  h <- fc2(gelu(fc1(h)))                   frozen, default init, output scaled to
                                                                standard deviation ``teacher_std``
    data     fresh standard Gaussian inputs every step; fixed validation batches; MSE; Adam

Methods (units = the residual blocks; ``max_active`` defaults to 25 % of them):

    bf16     every block on the recovery path (BF16), all run
    fixed    every block on the MX low path (weights, activations and gradients), all run
    gnmr     MX, up to max_active blocks in BF16 chosen by GNMR + Delta-GNMR (the controller)
    random   MX, max_active random blocks in BF16 every step
    adapt    BF16 warm-up of ``adapt_warmup_steps`` steps, then a fixed top-25 % by mean GNMR in BF16
    gsnr     MX, the max_active lowest-GSNR blocks in BF16 (batch split into ``microbatches`` >= 2)

The policies are driven directly (no Trainer): per-block gradient norms before clipping go to
``policy.step`` and the mask it returns goes to ``set_active_units`` for the next step.

Spikes and divergence (:func:`detect_spikes`, :func:`diverged`): with l_t the training loss of
step t and m_{t-1} = min(l_1 .. l_{t-1}) its running minimum, step t is *in a spike* when l_t is
non-finite or l_t > ``spike_factor`` * m_{t-1} (t >= 2); a spike is a maximal run of consecutive
such steps (its start, end and peak are reported). A run *diverged* when any loss is non-finite or
when the mean of its last ``tail`` losses is above ``spike_factor`` times the run's minimum.

Usage:
    python recipes/stress/mx_proxy.py --method fixed --fmt mxfp8_e4m3 --width 128 --depth 4 \
        --batch 256 --lr 1e-3 --steps 1000 --seed 0 --out runs/mx/fixed-0.json

The output JSON holds the config, losses every ``log_every`` steps, validation losses, the spikes,
the divergence flag, the policy summary (promotion ratio, hit-maxO rate, exceedance rates), the
wall time, and with ``--oracle`` the per-step recovery gaps and the oracle agreement of the trigger.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import pickle
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

ROOT = Path(__file__).resolve().parents[2]
if str(ROOT) not in sys.path:  # run as a script from a checkout
    sys.path.insert(0, str(ROOT))

from gnmr_hf.backends.base import set_active_units  # noqa: E402

METHODS = ("bf16", "fixed", "gnmr", "random", "adapt", "gsnr")
MX_FORMATS = ("mxfp8_e4m3", "mxfp8_e5m2", "mxfp6_e3m2", "mxfp6_e2m3", "mxfp4_e2m1")


# ---------------------------------------------------------------- config
@dataclass
class ProxyConfig:
    """One proxy run.

    Args:
        width (`int`): residual width d (a multiple of ``block_size``).
        depth (`int`): number of residual blocks L (= the units).
        batch (`int`): training batch size.
        lr (`float`): Adam learning rate (peak, with ``cosine``).
        steps (`int`): optimizer steps.
        fmt (`str`): the MX element format of the low path (one of ``MX_FORMATS``).
        method (`str`): one of ``METHODS``.
        seed (`int`): seeds the student, the teacher, the data and the random policy.
        max_active (`int` or `None`): the budget maxO; None means 25 % of ``depth`` (at least 1).
        cosine (`bool`): cosine decay of the learning rate to 0 over ``steps`` (after ``warmup_steps``).
        warmup_steps (`int`): linear learning-rate warm-up steps.
        teacher_std (`float`): the teacher's output is rescaled to this standard deviation (measured
            on a calibration batch at init) so the target is O(1), not buried under the label noise.
        noise_std (`float`): Gaussian label noise added to the teacher's output.
        block_size (`int`): MX block size.
        quantize_norms (`bool`): also MX-quantise the LayerNorm affine weights on the low path.
        emulate_bf16 (`bool`): run the BF16 recovery path as float32 GEMMs on BF16-rounded operands
            (``prepare_mx(emulate_bf16=True)``): native BF16 GEMMs are ~10x slower than float32 on CPUs
            without BF16 matrix units.
        val_batches (`int`), val_batch_size (`int`), val_every (`int`): fixed validation set and how
            often it is evaluated, twice: on the BF16 path (the weights' quality in BF16, ``val``) and
            on the training path, the mask of the next step (the model as trained, ``val_train_path``).
        log_every (`int`): training losses kept in the JSON every this many steps (spikes are
            detected on every step).
        spike_factor (`float`): the spike / divergence threshold factor (10 in the study).
        microbatches (`int`): micro-batches per step (the batch is split; gradients accumulate). The
            ``gsnr`` trigger needs >= 2 and gets 2 when left at 1.
        adapt_warmup_steps (`int` or `None`): BF16 profiling steps of ``adapt`` (None: 10 % of steps).
        alpha, alpha_init, beta, window, lock_steps: the GNMR controller's thresholds.
        init_fraction (`float`): share of the run using ``alpha_init`` (the two-stage alpha).
        full_recovery_steps (`int`): GNMR's optional full-recovery warm-up.
        oracle (`bool`): per step, also compute every block's gradient on the all-MX and the all-BF16
            path on the same batch (two extra backward passes) and record the per-unit recovery gap.
        record_units (`bool`): keep the per-step GNMR and active set in the JSON (on with ``oracle``).
        checkpoint_every (`int`): save a checkpoint every this many steps (0: never) to ``checkpoint_dir``.
        checkpoint_dir (`str` or `None`): where checkpoints go (``step_<t>.pt``).
        resume_from (`str` or `None`): a checkpoint to continue from; ``fmt`` / ``method`` may differ
            from the run that wrote it (the in-situ intervention).
        threads (`int`): torch threads.
    """

    width: int = 128
    depth: int = 4
    batch: int = 256
    lr: float = 1e-3
    steps: int = 1000
    fmt: str = "mxfp8_e4m3"
    method: str = "fixed"
    seed: int = 0
    max_active: int | None = None
    cosine: bool = False
    warmup_steps: int = 0
    teacher_std: float = 1.0
    noise_std: float = 0.0
    block_size: int = 32
    quantize_norms: bool = False
    emulate_bf16: bool = True
    val_batches: int = 4
    val_batch_size: int = 1024
    val_every: int = 100
    log_every: int = 10
    spike_factor: float = 10.0
    microbatches: int = 1
    adapt_warmup_steps: int | None = None
    alpha: float = 1.1
    alpha_init: float | None = 1.5
    beta: float = 1.5
    window: int = 5
    lock_steps: int = 1
    init_fraction: float = 0.025
    full_recovery_steps: int = 0
    oracle: bool = False
    record_units: bool = False
    checkpoint_every: int = 0
    checkpoint_dir: str | None = None
    resume_from: str | None = None
    threads: int = 1

    def __post_init__(self) -> None:
        for name in ("width", "depth", "batch", "steps", "block_size", "val_batches", "val_batch_size",
                     "val_every", "log_every", "microbatches", "threads"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"ProxyConfig.{name} must be an integer >= 1, got {value!r}")
        for name in ("warmup_steps", "checkpoint_every", "full_recovery_steps", "lock_steps"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ValueError(f"ProxyConfig.{name} must be an integer >= 0, got {value!r}")
        for name in ("lr", "teacher_std", "spike_factor"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
                raise ValueError(f"ProxyConfig.{name} must be a finite number > 0, got {value!r}")
        if not (math.isfinite(self.noise_std) and self.noise_std >= 0):
            raise ValueError(f"ProxyConfig.noise_std must be >= 0, got {self.noise_std!r}")
        if self.method not in METHODS:
            raise ValueError(f"ProxyConfig.method must be one of {METHODS}, got {self.method!r}")
        if self.fmt not in MX_FORMATS:
            raise ValueError(f"ProxyConfig.fmt must be one of {MX_FORMATS}, got {self.fmt!r}")
        if self.width % self.block_size:
            raise ValueError(f"ProxyConfig.width ({self.width}) must be a multiple of block_size ({self.block_size})")
        if self.max_active is None:
            self.max_active = max(1, self.depth // 4)
        if isinstance(self.max_active, bool) or not isinstance(self.max_active, int) or not 0 <= self.max_active <= self.depth:
            raise ValueError(f"ProxyConfig.max_active must be an integer in [0, depth], got {self.max_active!r}")
        if self.method == "gsnr" and self.microbatches == 1:
            self.microbatches = 2
        if self.batch % self.microbatches:
            raise ValueError(f"ProxyConfig.batch ({self.batch}) must be divisible by microbatches ({self.microbatches})")
        if self.adapt_warmup_steps is None:
            self.adapt_warmup_steps = max(1, self.steps // 10)
        if self.adapt_warmup_steps < 1:
            raise ValueError(f"ProxyConfig.adapt_warmup_steps must be >= 1, got {self.adapt_warmup_steps!r}")
        if self.checkpoint_every and not self.checkpoint_dir:
            raise ValueError("ProxyConfig.checkpoint_every needs checkpoint_dir")
        if self.oracle:
            self.record_units = True


# ---------------------------------------------------------------- spikes and divergence
def detect_spikes(losses: list[float], factor: float = 10.0) -> list[dict[str, Any]]:
    """The spikes of a per-step loss sequence (see the module docstring for the definition).

    Args:
        losses (`list[float]`): l_1, l_2, ... (one per step; index i is step i + 1).
        factor (`float`): a step is in a spike when its loss exceeds ``factor`` times the running
            minimum of the losses before it, or is non-finite.

    Returns:
        A list of ``{"start", "end", "peak"}`` dicts (1-based steps, inclusive; ``peak`` is the largest
        loss in the spike, ``inf`` when one is non-finite).
    """
    spikes: list[dict[str, Any]] = []
    running_min = math.inf
    current: dict[str, Any] | None = None
    for i, loss in enumerate(losses):
        loss = float(loss)
        finite = math.isfinite(loss)
        if i > 0 and (not finite or loss > factor * running_min):
            peak = loss if finite else math.inf
            if current is None:
                current = {"start": i + 1, "end": i + 1, "peak": peak}
                spikes.append(current)
            else:
                current["end"] = i + 1
                current["peak"] = max(current["peak"], peak)
        else:
            current = None
        if finite:
            running_min = min(running_min, loss)
    return spikes


def diverged(losses: list[float], factor: float = 10.0, tail: int = 20) -> bool:
    """Whether a run diverged: a non-finite loss, or the mean of the last ``tail`` losses above
    ``factor`` times the minimum loss of the run."""
    if not losses:
        return False
    values = [float(v) for v in losses]
    if not all(math.isfinite(v) for v in values):
        return True
    last = values[-tail:]
    return sum(last) / len(last) > factor * min(values)


# ---------------------------------------------------------------- models
class Block(nn.Module):
    """x + fc2(gelu(fc1(LayerNorm(x)))): the proxy's residual block."""

    def __init__(self, width: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.fc1 = nn.Linear(width, 4 * width, bias=False)
        self.fc2 = nn.Linear(4 * width, width)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Student(nn.Module):
    def __init__(self, width: int, depth: int) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return x


class Teacher(nn.Module):
    """Frozen random MLP of the student's width and depth; output rescaled to a target std."""

    def __init__(self, width: int, depth: int, calibration: torch.Tensor, target_std: float) -> None:
        super().__init__()
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)) for _ in range(depth)
        )
        self.requires_grad_(False)
        self.register_buffer("scale", torch.ones(()))
        with torch.no_grad():
            # default init shrinks the signal layer by layer (output std ~1e-3 at depth 4): without
            # this gain the target would sit below any label noise (docs/mx.md)
            self.scale.fill_(target_std / self(calibration).std().item())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x * self.scale


def units(model: Student) -> list[tuple[str, nn.Module]]:
    """The proxy's units: its residual blocks, as ``(name, module)`` pairs."""
    return [(f"blocks.{i}", b) for i, b in enumerate(model.blocks)]


def unit_params(model: Student) -> list[list[nn.Parameter]]:
    return [list(b.parameters()) for b in model.blocks]


def unit_grad_norms(params: list[list[nn.Parameter]]) -> torch.Tensor:
    """L2 norm of each unit's gradient (all its parameters together), shape [U]."""
    out = []
    for ps in params:
        norms = torch._foreach_norm([p.grad for p in ps if p.grad is not None])
        out.append(torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(()))
    return torch.stack(out).double()


def unit_grads(params: list[list[nn.Parameter]]) -> list[torch.Tensor]:
    """Each unit's gradient flattened into one vector (a copy)."""
    return [torch.cat([p.grad.reshape(-1) for p in ps]).clone() for ps in params]


# ---------------------------------------------------------------- the run
def _mx():
    from gnmr_hf.backends import mx  # the MX low path (another module of the package)

    return mx


def build(cfg: ProxyConfig) -> dict[str, Any]:
    """Student (with the MX dual path), teacher, data generators and validation set for ``cfg``."""
    torch.manual_seed(cfg.seed)
    student = Student(cfg.width, cfg.depth)
    gen_teacher = torch.Generator().manual_seed(10_000 + cfg.seed)
    calibration = torch.randn(4096, cfg.width, generator=gen_teacher)
    torch.manual_seed(20_000 + cfg.seed)
    teacher = Teacher(cfg.width, cfg.depth, calibration, cfg.teacher_std)
    _mx().prepare_mx(student, fmt=cfg.fmt, units=units, block_size=cfg.block_size,
                     quantize_norms=cfg.quantize_norms, emulate_bf16=cfg.emulate_bf16)
    gen_val = torch.Generator().manual_seed(30_000 + cfg.seed)
    val = []
    for _ in range(cfg.val_batches):
        x = torch.randn(cfg.val_batch_size, cfg.width, generator=gen_val)
        y = teacher(x) + cfg.noise_std * torch.randn(x.shape, generator=gen_val)
        val.append((x, y))
    return {"student": student, "teacher": teacher, "val": val,
            "data": torch.Generator().manual_seed(40_000 + cfg.seed)}


def make_trigger(cfg: ProxyConfig) -> Any:
    """The trigger policy of ``cfg.method`` (None for ``bf16`` and ``fixed``)."""
    if cfg.method in ("bf16", "fixed"):
        return None
    from gnmr_hf.core.controller import GNMRConfig, init_steps_from_fraction
    from gnmr_hf.core.policies import make_policy

    gcfg = GNMRConfig(max_active=cfg.max_active, lock_steps=cfg.lock_steps, alpha=cfg.alpha,
                      alpha_init=cfg.alpha_init, beta=cfg.beta, window=cfg.window,
                      init_steps=init_steps_from_fraction(cfg.init_fraction, cfg.steps),
                      full_recovery_steps=cfg.full_recovery_steps if cfg.method == "gnmr" else 0)
    return make_policy(cfg.method, cfg.depth, gcfg, warmup_steps=cfg.adapt_warmup_steps, seed=cfg.seed)


def _mask_indices(cfg: ProxyConfig, policy: Any, mask: torch.Tensor | None) -> list[int]:
    if cfg.method == "bf16":
        return list(range(cfg.depth))
    if cfg.method == "fixed":
        return []
    if cfg.method == "adapt" and policy.in_warmup:  # the ADAPT profile is taken on the BF16 path
        return list(range(cfg.depth))
    return mask.nonzero().flatten().tolist()


@torch.no_grad()
def validate(student: Student, val: list[tuple[torch.Tensor, torch.Tensor]], active: list[int],
             on: list[int] | range | None = None) -> float:
    """Mean validation MSE with the blocks ``on`` on the BF16 path (None: all of them, the weights'
    quality in BF16); the training mask ``active`` is restored afterwards."""
    set_active_units(student, range(len(student.blocks)) if on is None else on, units=units)
    loss = sum(F.mse_loss(student(x), y).item() for x, y in val) / len(val)
    set_active_units(student, active, units=units)
    return loss


def _lr_lambda(cfg: ProxyConfig):
    def f(step: int) -> float:
        if step < cfg.warmup_steps:
            return (step + 1) / cfg.warmup_steps
        if not cfg.cosine:
            return 1.0
        progress = (step - cfg.warmup_steps) / max(1, cfg.steps - cfg.warmup_steps)
        return 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))

    return f


def _backward(student: Student, x: torch.Tensor, y: torch.Tensor, microbatches: int,
              params: list[list[nn.Parameter]], policy: Any) -> float:
    """Forward and backward of one step, micro-batched; feeds GSNR its micro-batch norms. Returns the loss."""
    total = 0.0
    prev = None
    for xs, ys in zip(x.chunk(microbatches), y.chunk(microbatches)):
        loss = F.mse_loss(student(xs), ys) / microbatches
        loss.backward()
        total += loss.item()
        if getattr(policy, "needs_microbatch_norms", False):
            grads = unit_grads(params)
            contrib = grads if prev is None else [g - p for g, p in zip(grads, prev)]
            policy.observe_microbatch(torch.stack([c.double().pow(2).sum() for c in contrib]))
            prev = grads
    return total


def oracle_gaps(student: Student, x: torch.Tensor, y: torch.Tensor, params: list[list[nn.Parameter]],
                active: list[int]) -> torch.Tensor:
    """Per-unit recovery gap on one batch (:func:`gnmr_hf.core.oracle.recovery_gap`), shape [U].

    The low-path gradient comes from the all-MX path and the recovery gradient from the all-BF16 path,
    so a unit's gap is its error if left on the low path whatever the trigger chose (the step as run
    would shrink the gap of the units the trigger already recovered). Two extra backward passes; the
    mask ``active`` is restored and the gradients cleared.
    """
    from gnmr_hf.core.oracle import recovery_gap

    grads = {}
    for name, on in (("low", []), ("high", range(len(params)))):
        set_active_units(student, on, units=units)
        student.zero_grad(set_to_none=True)
        F.mse_loss(student(x), y).backward()
        grads[name] = [[p.grad.detach().clone() for p in ps] for ps in params]
    student.zero_grad(set_to_none=True)
    set_active_units(student, active, units=units)
    return recovery_gap(grads["low"], grads["high"])


def run(cfg: ProxyConfig) -> dict[str, Any]:
    """Train the proxy as ``cfg`` says and return the result record (see the module docstring)."""
    torch.set_num_threads(cfg.threads)
    parts = build(cfg)
    student, teacher, val, data = parts["student"], parts["teacher"], parts["val"], parts["data"]
    opt = torch.optim.Adam(student.parameters(), lr=cfg.lr, betas=(0.9, 0.999))
    sched = torch.optim.lr_scheduler.LambdaLR(opt, _lr_lambda(cfg))
    policy = make_trigger(cfg)
    params = unit_params(student)

    start, losses, val_losses, resumed, saved_mask = 0, [], [], None, None
    val_train_path: list[list] = []  # not carried over a resume: the path may have changed
    if cfg.resume_from:
        # weights_only: a checkpoint is a user-given path; tensors, numbers, lists and dicts are all it holds,
        # so nothing in it may run code when it is read (a crafted pickle is refused by torch's safe unpickler)
        ckpt = load_checkpoint(cfg.resume_from)
        student.load_state_dict(ckpt["student"])
        opt.load_state_dict(ckpt["optimizer"])
        sched.load_state_dict(ckpt["scheduler"])
        data.set_state(ckpt["data"])
        start, losses, val_losses = ckpt["step"], list(ckpt["losses"]), [list(v) for v in ckpt["val"]]
        prev = ckpt["config"]
        resumed = {"path": str(cfg.resume_from), "step": start, "fmt": prev["fmt"], "method": prev["method"]}
        if policy is not None and ckpt.get("policy") is not None and prev["method"] == cfg.method:
            policy.load_state_dict(ckpt["policy"])
            saved_mask = torch.tensor(ckpt["mask"], dtype=torch.bool)

    mask = None
    if policy is not None:
        # a policy restored from the checkpoint continues with the mask it had chosen for the next step;
        # a different method (the in-situ switch) starts fresh
        mask = policy.initial_mask() if saved_mask is None else saved_mask
    active = _mask_indices(cfg, policy, mask)
    set_active_units(student, active, units=units)

    per_unit: dict[str, list] = {"gnmr": [], "active": [], "gap": []}
    acc = None
    if cfg.oracle:
        from gnmr_hf.core.oracle import OracleAccumulator

        acc = OracleAccumulator(cfg.depth, max(1, cfg.max_active))
    over_budget = 0  # oracle steps not scored because the set run exceeded max_active
    step_times = []
    active_unit_steps = 0  # the BF16 blocks actually run, summed over steps (adapt's warm-up included)
    t0 = time.perf_counter()
    for t in range(start + 1, cfg.steps + 1):
        x = torch.randn(cfg.batch, cfg.width, generator=data)
        with torch.no_grad():
            y = teacher(x) + cfg.noise_std * torch.randn(x.shape, generator=data) if cfg.noise_std else teacher(x)
        ts = time.perf_counter()
        if acc is not None:
            gaps = oracle_gaps(student, x, y, params, active)
            per_unit["gap"].append(gaps.tolist())
            if len(active) <= cfg.max_active:  # the set in effect at step t, chosen from step t-1
                acc.add(t, gaps, {cfg.method: active})
            else:  # a BF16 warm-up (adapt, full_recovery_steps) holds more than the budget: not comparable
                over_budget += 1
        opt.zero_grad(set_to_none=True)
        active_unit_steps += len(active)
        loss = _backward(student, x, y, cfg.microbatches, params, policy)
        norms = unit_grad_norms(params)  # before any clipping
        losses.append(loss)
        if not math.isfinite(loss):
            step_times.append(time.perf_counter() - ts)
            break  # a non-finite loss is a divergence; nothing after it is meaningful
        opt.step()
        sched.step()
        if cfg.record_units:
            per_unit["active"].append(list(active))
        if policy is not None:
            mask = policy.step(norms)
            if cfg.record_units:
                per_unit["gnmr"].append([float(v) for v in policy.last_record["gnmr"]])
            active = _mask_indices(cfg, policy, mask)
            set_active_units(student, active, units=units)
        step_times.append(time.perf_counter() - ts)
        if t % cfg.val_every == 0 or t == cfg.steps:
            val_losses.append([t, validate(student, val, active)])
            val_train_path.append([t, validate(student, val, active, on=active)])
        if cfg.checkpoint_every and t % cfg.checkpoint_every == 0:
            save_checkpoint(cfg, t, student, opt, sched, data, policy, mask, losses, val_losses)
    wall = time.perf_counter() - t0

    spikes = detect_spikes(losses, cfg.spike_factor)
    summary = policy.summary() if policy is not None else None
    finite = [v for v in losses if math.isfinite(v)]
    result = {
        "config": dataclasses.asdict(cfg),
        "resumed_from": resumed,
        "losses": [[i + 1, v] for i, v in enumerate(losses) if (i + 1) % cfg.log_every == 0 or i == len(losses) - 1
                   or (i + 1) <= start],
        "val": val_losses,
        "final_val_loss": val_losses[-1][1] if val_losses and val_losses[-1][0] == len(losses) else math.nan,
        "val_train_path": val_train_path,
        "final_val_loss_train_path": (val_train_path[-1][1] if val_train_path and val_train_path[-1][0] == len(losses)
                                      else math.nan),
        "min_train_loss": min(finite) if finite else math.nan,
        "final_train_loss": losses[-1] if losses else math.nan,
        "steps_done": len(losses),
        "spikes": spikes,
        "n_spikes": len(spikes),
        "diverged": diverged(losses, cfg.spike_factor),
        "policy": summary,
        # measured from the sets actually run, not the policy's own count: adapt's BF16 warm-up is
        # outside its masks but costs the same
        "promotion_ratio": active_unit_steps / (cfg.depth * (len(losses) - start)) if len(losses) > start else 0.0,
        "hit_max_rate": summary["hit_max_rate"] if summary else None,
        "gnmr_exceedance_rate": summary["gnmr_exceedance_rate"] if summary else None,
        "delta_exceedance_rate": summary["delta_exceedance_rate"] if summary else None,
        "wall_time_s": wall,
        "step_time_median_s": sorted(step_times)[len(step_times) // 2] if step_times else math.nan,
    }
    if cfg.record_units:
        result["per_unit"] = {k: v for k, v in per_unit.items() if v}
    if acc is not None:
        table = acc.table().get(cfg.method, {})
        result["oracle"] = {"skipped_steps": len(acc.skipped), "over_budget_steps": over_budget,
                            **{k: (v if math.isfinite(v) else None) for k, v in table.items()}}
    return result


class CheckpointError(ValueError):
    """A ``resume_from`` file that is missing or not a checkpoint of this script."""


def load_checkpoint(path: str | os.PathLike) -> dict:
    """A checkpoint :func:`save_checkpoint` wrote, read with ``torch.load(..., weights_only=True)``: only
    tensors and plain containers are unpickled, so a file that would run code when unpickled is refused.

    Raises:
        CheckpointError: the file is missing or not such a checkpoint (one line naming it).
    """
    if not os.path.isfile(path):
        raise CheckpointError(f"resume_from {path}: no such file")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CheckpointError(f"resume_from {path}: refused, not a plain checkpoint (torch.load with "
                              f"weights_only=True: {first})") from None


def save_checkpoint(cfg: ProxyConfig, step: int, student: Student, opt, sched, data: torch.Generator,
                    policy: Any, mask: torch.Tensor | None, losses: list[float], val_losses: list) -> Path:
    """Everything needed to continue the run exactly: weights, Adam, schedule, data RNG, policy, history."""
    path = Path(cfg.checkpoint_dir) / f"step_{step}.pt"
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"step": step, "config": dataclasses.asdict(cfg), "student": student.state_dict(),
                "optimizer": opt.state_dict(), "scheduler": sched.state_dict(), "data": data.get_state(),
                "policy": policy.state_dict() if policy is not None else None,
                "mask": mask.tolist() if mask is not None else None,
                "losses": list(losses), "val": [list(v) for v in val_losses]}, path)
    return path


# ---------------------------------------------------------------- command line
def parse_args(argv: list[str] | None = None) -> tuple[ProxyConfig, str | None]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    for f in dataclasses.fields(ProxyConfig):
        flag = "--" + f.name
        default = f.default
        if f.type in ("bool",):
            p.add_argument(flag, action=argparse.BooleanOptionalAction, default=default)
        elif f.type in ("int",):
            p.add_argument(flag, type=int, default=default)
        elif f.type in ("float",):
            p.add_argument(flag, type=float, default=default)
        elif f.type in ("int | None",):
            p.add_argument(flag, type=int, default=default)
        elif f.type in ("float | None",):
            p.add_argument(flag, type=lambda s: None if s.lower() == "none" else float(s), default=default)
        else:
            p.add_argument(flag, default=default, choices={"method": METHODS, "fmt": MX_FORMATS}.get(f.name))
    p.add_argument("--out", help="write the result JSON here (default: print a summary only)")
    args = vars(p.parse_args(argv))
    out = args.pop("out")
    return ProxyConfig(**args), out


def main(argv: list[str] | None = None) -> dict[str, Any]:
    cfg, out = parse_args(argv)
    try:
        result = run(cfg)
    except CheckpointError as e:
        raise SystemExit(f"mx_proxy: {e}") from None
    if out:
        path = Path(out)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_suffix(".tmp")
        tmp.write_text(json.dumps(result))
        os.replace(tmp, path)  # a half-written JSON never counts as a finished run
    print(json.dumps({k: result[k] for k in ("steps_done", "n_spikes", "diverged", "final_val_loss",
                                             "min_train_loss", "promotion_ratio", "wall_time_s")}))
    return result


if __name__ == "__main__":
    main()
