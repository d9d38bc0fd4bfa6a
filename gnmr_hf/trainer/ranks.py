"""Rank agreement under ``torch.distributed``: every rank must take the same GNMR decision.

Each step launches one small ``all_reduce`` of (step, active mask) and its negation with ``MAX`` (max
and -min over ranks in one collective); the result is read back with the next step's norms, so the
check costs no extra device-to-host synchronisation.
"""

from __future__ import annotations

import torch


def world_size() -> int:
    """The ``torch.distributed`` world size (1 when it is not initialised)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_world_size()
    return 1


class RankAgreement:
    """Checks that all ranks took the same decision at each step.

    Args:
        num_units: number of units ``U``.
        device: where the collective runs (the current CUDA device for NCCL, CPU for gloo).
    """

    def __init__(self, num_units: int, device: torch.device) -> None:
        self.num_units = num_units
        self.device = device
        self.pending: torch.Tensor | None = None

    @classmethod
    def for_current_group(cls, num_units: int) -> RankAgreement:
        """A checker on the default process group's device."""
        backend = torch.distributed.get_backend()
        device = torch.device("cuda", torch.cuda.current_device()) if backend == "nccl" else torch.device("cpu")
        return cls(num_units, device)

    def launch(self, step: int, active: list[int]) -> None:
        """Start the collective for ``step``'s decision (read by :meth:`verify`)."""
        v = torch.zeros(self.num_units + 1, dtype=torch.float64)
        v[0] = step
        v[1:][active] = 1.0
        buf = torch.cat([v, -v])
        if self.device.type == "cuda":
            # pinned + non_blocking: a pageable host->device copy would wait for the stream
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        torch.distributed.all_reduce(buf, op=torch.distributed.ReduceOp.MAX)
        self.pending = buf

    def take(self) -> torch.Tensor | None:
        """The pending result (still on its device), cleared; ``None`` if nothing is pending."""
        buf, self.pending = self.pending, None
        return buf

    @staticmethod
    def verify(check: torch.Tensor) -> None:
        """Raise ``RuntimeError`` if the ranks' decisions in ``check`` (a :meth:`take` result) differ."""
        n = len(check) // 2
        hi, lo = check[:n], -check[n:]
        if not torch.equal(hi, lo):
            differ = torch.nonzero(hi != lo).flatten().tolist()
            units = [i - 1 for i in differ if i > 0]
            raise RuntimeError(
                f"GNMRCallback: ranks disagree on the GNMR decision of step {int(hi[0])}"
                + (f" (units {units})" if units else " (step counters differ)")
                + "; gradients or controller states differ between processes"
            )

    def flush(self) -> None:
        """Verify the last pending result now (at train end)."""
        buf = self.take()
        if buf is not None:
            self.verify(buf.cpu())
