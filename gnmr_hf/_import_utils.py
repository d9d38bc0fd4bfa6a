"""Availability checks for optional dependencies, and errors that name the extra to install."""

from __future__ import annotations

import importlib.util
from functools import cache

# module name -> pip extra of gnmr_hf that installs it
_EXTRAS = {
    "bitsandbytes": "bnb",
    "peft": "train",
    "transformers": "train",
    "accelerate": "train",
    "datasets": "train",
    "yaml": "train",
    "lm_eval": "eval",
    "matplotlib": "plot",
    "gguf": "gguf",
}


@cache
def is_available(module: str) -> bool:
    return importlib.util.find_spec(module) is not None


def require(module: str, feature: str) -> None:
    """Raise an ``ImportError`` that says which extra installs ``module`` if it is missing."""
    if not is_available(module):
        extra = _EXTRAS.get(module, "all")
        raise ImportError(
            f"{feature} needs the '{module}' package, which is not installed. "
            f"Install it with: pip install 'gnmr_hf[{extra}]'"
        )
