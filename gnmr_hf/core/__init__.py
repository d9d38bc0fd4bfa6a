"""The pure core (torch and NumPy only, no Hugging Face imports): the GNMR configuration and controller
(:mod:`~gnmr_hf.core.controller`), the trigger policies behind the ``TriggerPolicy`` protocol
(:mod:`~gnmr_hf.core.policies`) and the oracle diagnostic's maths (:mod:`~gnmr_hf.core.oracle`).

The names below resolve lazily, so importing one submodule does not import the others."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

# public name -> module that defines it
_LAZY = {
    "GNMRConfig": "gnmr_hf.core.controller",
    "GNMRController": "gnmr_hf.core.controller",
    "HybridPolicy": "gnmr_hf.core.policies",
    "StaticPolicy": "gnmr_hf.core.policies",
    "StaticSetPolicy": "gnmr_hf.core.policies",
}

__all__ = ["GNMRConfig", "GNMRController", "HybridPolicy", "StaticPolicy", "StaticSetPolicy"]  # = sorted(_LAZY)

if TYPE_CHECKING:  # pragma: no cover
    from gnmr_hf.core.controller import GNMRConfig, GNMRController
    from gnmr_hf.core.policies import HybridPolicy, StaticPolicy, StaticSetPolicy


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'gnmr_hf.core' has no attribute {name!r}")
    value = getattr(importlib.import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(__all__) | set(globals()))
