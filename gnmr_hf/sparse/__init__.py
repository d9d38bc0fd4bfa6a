"""Dynamic sparse training (SET, RigL) with SMET's optimizer-state warm-up, and GNMR in control of it.

- :class:`SparseLinear` / :func:`prepare_sparse` (:mod:`gnmr_hf.sparse.layer`): linears at an exact density,
  holding their active blocks only, with the topology update; each is a dual-path module whose recovery
  path is SMET's warm-up for its regrown weights.
- :class:`SparseAdamW` (:mod:`gnmr_hf.sparse.optim`): AdamW with per-slot timesteps, the local warm-up and
  density-aware learning-rate scaling; moments for active blocks only.
- :class:`DSTCallback` (:mod:`gnmr_hf.sparse.callback`): the topology updates in a ``Trainer`` run.

Names resolve lazily: importing this package imports torch only; ``DSTCallback`` brings transformers in.
See docs/sparse.md.
"""

from __future__ import annotations

import importlib
from typing import Any

_LAZY = {
    "SparseLinear": "gnmr_hf.sparse.layer",
    "prepare_sparse": "gnmr_hf.sparse.layer",
    "sparse_linears": "gnmr_hf.sparse.layer",
    "realised_density": "gnmr_hf.sparse.layer",
    "SparseAdamW": "gnmr_hf.sparse.optim",
    "DSTCallback": "gnmr_hf.sparse.callback",
    "topology": "gnmr_hf.sparse.callback",
}

__all__ = sorted(_LAZY)


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gnmr_hf.sparse' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
