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
    "GNMRConfig": "gnmr_hf.core.controller",
    "GNMRController": "gnmr_hf.core.controller",
    "HybridPolicy": "gnmr_hf.core.policies",
    "StaticPolicy": "gnmr_hf.core.policies",
    "GNMRCallback": "gnmr_hf.trainer.callback",
    "attach": "gnmr_hf.trainer.callback",
    "prepare_dual_path": "gnmr_hf.backends.dispatch",
    "set_active_units": "gnmr_hf.backends.base",
    "active_units": "gnmr_hf.backends.base",
    "recoverable_units": "gnmr_hf.backends.base",
    "recovery_device_bytes": "gnmr_hf.backends.base",
    "find_decoder_layers": "gnmr_hf.units",
    "smollm2_checkpoint": "gnmr_hf.offline.smollm2",
    "gemma3_checkpoint": "gnmr_hf.offline.gguf_models",
    "prepare_for_training": "gnmr_hf.training",
    "export_planned": "gnmr_hf.export",
    "load_planned": "gnmr_hf.planning.ladder",
    "profile_sensitivity": "gnmr_hf.planning",
    "plan": "gnmr_hf.planning",
    "measure_plan": "gnmr_hf.planning",
    "skip_modules": "gnmr_hf.planning",
    "SensitivityProfile": "gnmr_hf.planning",
    "PrecisionPlan": "gnmr_hf.planning",
    "Plan": "gnmr_hf.planning",
    "make_plan": "gnmr_hf.planning",
    "PlanError": "gnmr_hf.planning",
    # a new precision or export format from the user's own code: register_rung(Rung(...)), register_format(...)
    "Rung": "gnmr_hf.rungs",
    "register_rung": "gnmr_hf.rungs",
    "ExportFormat": "gnmr_hf.exports",
    "register_format": "gnmr_hf.exports",
}

__all__ = sorted(_LAZY) + ["__version__"]

if TYPE_CHECKING:  # pragma: no cover
    from gnmr_hf.backends.base import (
        active_units,
        recoverable_units,
        recovery_device_bytes,
        set_active_units,
    )
    from gnmr_hf.backends.dispatch import prepare_dual_path
    from gnmr_hf.core.controller import GNMRConfig, GNMRController
    from gnmr_hf.core.policies import HybridPolicy, StaticPolicy
    from gnmr_hf.export import export_planned
    from gnmr_hf.exports import ExportFormat, register_format
    from gnmr_hf.offline.gguf_models import gemma3_checkpoint
    from gnmr_hf.offline.smollm2 import smollm2_checkpoint
    from gnmr_hf.planning import (
        Plan,
        PlanError,
        PrecisionPlan,
        SensitivityProfile,
        make_plan,
        measure_plan,
        plan,
        profile_sensitivity,
        skip_modules,
    )
    from gnmr_hf.planning.ladder import load_planned
    from gnmr_hf.rungs import Rung, register_rung
    from gnmr_hf.trainer.callback import GNMRCallback, attach
    from gnmr_hf.training import prepare_for_training
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
