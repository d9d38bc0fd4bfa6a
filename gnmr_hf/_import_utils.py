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


# loggers whose import-time messages say nothing a user of this package can act on
_IMPORT_NOISE = ("torch.utils._pytree",)  # "<enum ...> is an Enum subclass ... register_constant() is deprecated"
_CUDA_ONLY_NOISE = ("torchao",)  # "Failed to load .../torchao/_C_mxfp8...so": CUDA kernels, absent on a CPU build


def quiet_import_noise() -> None:
    """For the command-line entry points (gnmr-hf, recipes/finetune.py): raise the level of the loggers
    that print messages at import time which a CPU user cannot act on (torchao's missing CUDA kernels,
    without CUDA; torch's pytree deprecation notes) to ERROR. Nothing else changes."""
    import logging

    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        for name in _CUDA_ONLY_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)
