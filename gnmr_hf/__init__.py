"""GNMR (Gradient Norm-to-Mean Ratio) runtime precision control for the Hugging Face stack.

``import gnmr_hf`` is cheap: the public names are resolved lazily, so neither bitsandbytes, peft,
transformers nor lm_eval is imported until the object that needs it is used.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

# public name -> module that defines it
_LAZY = {
    "GNMRConfig": "gnmr_hf.controller",
    "GNMRController": "gnmr_hf.controller",
    "GNMRCallback": "gnmr_hf.callback",
    "prepare_dual_path": "gnmr_hf.dual_path",
    "set_active_units": "gnmr_hf.dual_path",
    "active_units": "gnmr_hf.dual_path",
    "recoverable_units": "gnmr_hf.dual_path",
    "recovery_device_bytes": "gnmr_hf.dual_path",
    "find_decoder_layers": "gnmr_hf.units",
    "smollm2_checkpoint": "gnmr_hf.smollm2",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from gnmr_hf.callback import GNMRCallback
    from gnmr_hf.controller import GNMRConfig, GNMRController
    from gnmr_hf.dual_path import (
        active_units,
        prepare_dual_path,
        recoverable_units,
        recovery_device_bytes,
        set_active_units,
    )
    from gnmr_hf.smollm2 import smollm2_checkpoint
    from gnmr_hf.units import find_decoder_layers


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gnmr_hf' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return __all__
