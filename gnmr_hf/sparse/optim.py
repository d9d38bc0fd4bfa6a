"""``SparseAdamW``: AdamW with SMET's treatment of sparse layers (per-weight timesteps, warm-up, 1/sqrt(d)).

For an ordinary parameter it is ``torch.optim.AdamW`` (same operations in the same order). For the
``values`` of a :class:`~gnmr_hf.sparse.layer.SparseLinear` (``[k, B]``: its active blocks) the moments
are shaped like the parameter, so gradients and Adam state exist for active blocks only, and the state
holds one more int32 per slot, ``age``: optimizer steps since the slot's block was (re)grown. A topology
update calls :meth:`SparseAdamW.reset_slots`, which zeroes the moved slots' moments and ages.

At each step, for a sparse layer:

- learning rate ``lr_d = lr / sqrt(density)`` with ``density_scaling`` (SMET's density-aware scaling),
  else ``lr``;
- on the low-cost path (``layer.recovery`` False; plain DST) every slot is bias-corrected with the
  optimizer's global step ``t``: a regrown weight starts from zero moments at a late ``t`` (the cold start);
- on the recovery path (``layer.recovery`` True; SMET's warm-up) slot ``i`` is bias-corrected with its own
  timestep ``a_i`` (its age after this step's increment, so ``a_i = 1`` at a regrown weight's first update;
  the implicit warm-up) and its rate is ``lr_d * min(1, a_i / W)`` with ``W = warmup_steps`` (the explicit
  warm-up: a linear ramp from 0 that reaches the full rate at the W-th update). Slots never moved have
  ``a_i = t`` and a finished ramp, so the two paths differ only on weights regrown in the last W steps.

The path is read at each ``step()``, so a decision GNMR takes after step t applies to update t+1.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from gnmr_hf.sparse.layer import SparseLinear


class SparseAdamW(torch.optim.Optimizer):
    """AdamW (decoupled weight decay) with SMET's warm-up for regrown weights of :class:`SparseLinear` layers.

    Args:
        params: parameters or parameter groups (as for ``torch.optim.AdamW``).
        layers: the :class:`SparseLinear` layers whose ``values`` are among ``params`` (see :meth:`from_model`).
        lr, betas, eps, weight_decay: as for ``torch.optim.AdamW``.
        warmup_steps: W, the length of the local learning-rate ramp of a regrown weight (recovery path).
        density_scaling: scale the sparse layers' learning rate by ``1 / sqrt(density)``.
    """

    def __init__(self, params: Iterable, layers: Iterable[SparseLinear] = (), lr: float = 1e-3,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 warmup_steps: int = 20, density_scaling: bool = True) -> None:
        if not lr >= 0:
            raise ValueError(f"lr must be >= 0, got {lr}")
        if not (0 <= betas[0] < 1 and 0 <= betas[1] < 1):
            raise ValueError(f"betas must be in [0, 1), got {betas}")
        if not eps >= 0:
            raise ValueError(f"eps must be >= 0 (it keeps the Adam denominator away from 0), got {eps}")
        if not weight_decay >= 0:
            raise ValueError(f"weight_decay must be >= 0, got {weight_decay}")
        if isinstance(warmup_steps, bool) or not isinstance(warmup_steps, int) or warmup_steps < 1:
            raise ValueError(f"warmup_steps must be a positive integer, got {warmup_steps!r}")
        super().__init__(params, {"lr": lr, "betas": tuple(betas), "eps": eps, "weight_decay": weight_decay})
        self.warmup_steps = warmup_steps
        self.density_scaling = bool(density_scaling)
        self._layers: dict[int, SparseLinear] = {id(m.values): m for m in layers}
        owned = {id(p) for g in self.param_groups for p in g["params"]}
        missing = [m for m in layers if id(m.values) not in owned]
        if missing:
            raise ValueError(f"{len(missing)} sparse layers' values are not among the optimizer's parameters")
        self.last_step: dict[int, dict] = {}  # id(layer) -> what the last step did to it (for logs and tests)

    @classmethod
    def from_model(cls, model: torch.nn.Module, **kwargs) -> SparseAdamW:
        """Every trainable parameter of ``model`` in one group, its :class:`SparseLinear` layers registered."""
        layers = [m for m in model.modules() if isinstance(m, SparseLinear)]
        return cls([p for p in model.parameters() if p.requires_grad], layers=layers, **kwargs)

    def layer_lr_scale(self, layer: SparseLinear) -> float:
        """The density-aware factor of ``layer``'s learning rate: ``1 / sqrt(density)`` or 1."""
        return 1.0 / math.sqrt(layer.density) if self.density_scaling else 1.0

    @torch.no_grad()
    def reset_slots(self, layer: SparseLinear, slots: torch.Tensor) -> None:
        """A topology update moved ``slots`` of ``layer`` to new blocks: their moments and ages restart at 0."""
        state = self.state.get(layer.values)
        if not state or len(slots) == 0:
            return
        state["exp_avg"][slots] = 0
        state["exp_avg_sq"][slots] = 0
        state["age"][slots] = 0

    @torch.no_grad()
    def step(self, closure=None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        self.last_step = {}
        for group in self.param_groups:
            lr, (beta1, beta2), eps, wd = group["lr"], group["betas"], group["eps"], group["weight_decay"]
            for p in group["params"]:
                if p.grad is None:
                    continue
                g = p.grad
                state = self.state[p]
                layer = self._layers.get(id(p))
                if not state:
                    state["step"] = torch.tensor(0.0)
                    state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                    if layer is not None:
                        state["age"] = torch.zeros(p.shape[0], dtype=torch.int32, device=p.device)
                state["step"] += 1
                t = float(state["step"])
                m, v = state["exp_avg"], state["exp_avg_sq"]
                if layer is None:
                    _adamw(p, g, m, v, lr, beta1, beta2, eps, wd, t)
                    continue
                state["age"] += 1
                lr_d = lr * self.layer_lr_scale(layer)
                if not layer.recovery:
                    _adamw(p, g, m, v, lr_d, beta1, beta2, eps, wd, t)
                    self.last_step[id(layer)] = {"recovery": False, "min_factor": 1.0}
                    continue
                a = state["age"].to(torch.float64).unsqueeze(1)  # [k, 1]
                factor = (a / self.warmup_steps).clamp_(max=1.0)
                step_lr = (lr_d * factor).to(p.dtype)  # per slot
                if wd != 0:
                    p.mul_(1 - step_lr * wd)
                m.lerp_(g, 1 - beta1)
                v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
                bc1 = (1 - beta1**a).to(p.dtype)
                bc2_sqrt = (1 - beta2**a).sqrt().to(p.dtype)
                denom = (v.sqrt() / bc2_sqrt).add_(eps)
                p.addcdiv_(m * (step_lr / bc1), denom, value=-1.0)
                self.last_step[id(layer)] = {"recovery": True, "min_factor": float(factor.min())}
        return loss

    def load_state_dict(self, state_dict: dict) -> None:
        # torch casts every non-"step" state tensor of a floating parameter to the parameter's dtype: keep the
        # int32 ages exact (a bf16 age would round above 256)
        ages = {pid: s["age"].clone() for pid, s in state_dict["state"].items() if "age" in s}
        super().load_state_dict(state_dict)
        params = [p for g in self.param_groups for p in g["params"]]
        for pid, age in ages.items():
            p = params[pid]
            self.state[p]["age"] = age.to(device=p.device, dtype=torch.int32)

    def state_bytes(self) -> int:
        """Bytes of optimizer state held now (moments, ages, step counters)."""
        return sum(t.numel() * t.element_size() for s in self.state.values() for t in s.values()
                   if isinstance(t, torch.Tensor))

    def grad_bytes(self) -> int:
        """Bytes of the parameters' gradients held now."""
        return sum(p.grad.numel() * p.grad.element_size() for g in self.param_groups for p in g["params"]
                   if p.grad is not None)


def _adamw(p, g, m, v, lr, beta1, beta2, eps, wd, t) -> None:
    # the operations of torch.optim.AdamW's single-tensor path, in its order
    if wd != 0:
        p.mul_(1 - lr * wd)
    m.lerp_(g, 1 - beta1)
    v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
    bias_correction1 = 1 - beta1**t
    bias_correction2 = 1 - beta2**t
    step_size = lr / bias_correction1
    denom = (v.sqrt() / math.sqrt(bias_correction2)).add_(eps)
    p.addcdiv_(m, denom, value=-step_size)
