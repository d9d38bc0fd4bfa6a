"""Availability checks for optional dependencies, and errors that name the extra to install."""

from __future__ import annotations

import importlib.util
import sys
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
    without CUDA; torch's pytree deprecation notes) to ERROR. Nothing else changes.

    Whether there is CUDA is asked of torch only when torchao is about to be imported (torchao imports
    torch itself), so a command that fails on its arguments, or never reaches torchao, does not pay
    torch's import for this check."""
    import logging

    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    if "torch" in sys.modules or any(name in sys.modules for name in _CUDA_ONLY_NOISE):
        _quiet_cuda_only_noise()
    elif not any(isinstance(f, _BeforeCudaOnlyNoise) for f in sys.meta_path):
        sys.meta_path.insert(0, _BeforeCudaOnlyNoise())


def _quiet_cuda_only_noise() -> None:
    import logging

    try:
        import torch

        cuda = torch.cuda.is_available()
    except ImportError:
        cuda = False
    if not cuda:
        for name in _CUDA_ONLY_NOISE:
            logging.getLogger(name).setLevel(logging.ERROR)


class _BeforeCudaOnlyNoise:
    """A ``sys.meta_path`` entry that finds nothing: on the first import of a :data:`_CUDA_ONLY_NOISE` package
    it removes itself and, before that package's code runs, quiets its logger if there is no CUDA."""

    def find_spec(self, fullname, path=None, target=None):
        if fullname.partition(".")[0] in _CUDA_ONLY_NOISE:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            _quiet_cuda_only_noise()
        return None
