"""Availability checks for optional dependencies, and errors that name the extra to install."""

from __future__ import annotations

import importlib.util
import logging
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
    without CUDA; torch's pytree deprecation notes) to ERROR, and :func:`quiet_bitsandbytes`. Nothing else changes.

    Whether there is CUDA is asked of torch only when torchao is about to be imported (torchao imports
    torch itself), so a command that fails on its arguments, or never reaches torchao, does not pay
    torch's import for this check."""
    import logging

    for name in _IMPORT_NOISE:
        logging.getLogger(name).setLevel(logging.ERROR)
    quiet_bitsandbytes()
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


# bitsandbytes' CPU backend tries an optional Hub kernel (kernels-community/quantization-bitsandbytes) at import and
# logs its failure, with the ``kernels`` package's own note about it, on every command: bitsandbytes then uses its
# own CPU code, so the lines say nothing a user of this package can act on
_HUB_KERNEL = "kernels-community/quantization-bitsandbytes"
_HUB_KERNEL_LOGGERS = ("bitsandbytes.backends.cpu.ops", "kernels._internals.hf_hub", "kernels")
# bitsandbytes' INT8 matmul says this on every call outside training (a profile's INT8 rungs, an INT8 evaluation):
# a logging message in bitsandbytes >= 0.49, a UserWarning before
MATMUL_CAST = "MatMul8bitLt: inputs will be cast"
_MATMUL_LOGGERS = ("bitsandbytes.autograd._functions",)


class _Once(logging.Filter):
    """A logger filter: a record whose message starts with ``prefix`` passes the first time only; one that contains
    ``drop`` never; every other record passes."""

    def __init__(self, prefix: str | None = None, drop: str | None = None) -> None:
        super().__init__()
        self.prefix, self.drop, self.seen = prefix, drop, False

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            message = record.getMessage()
        except Exception:  # a record that cannot be formatted is not ours to judge
            return True
        if self.drop is not None and self.drop in message:
            return False
        if self.prefix is not None and message.startswith(self.prefix):
            if self.seen:
                return False
            self.seen = True
        return True


def quiet_bitsandbytes() -> None:
    """Say bitsandbytes' INT8 cast note once per process (the first time, as bitsandbytes words it), and drop its
    failed optional Hub-kernel lookup at import (see :data:`_HUB_KERNEL`). Idempotent; imports nothing (the
    filters sit on the loggers by name, before bitsandbytes creates them)."""
    import warnings

    for name in _MATMUL_LOGGERS:
        _add_filter(name, _Once(prefix=MATMUL_CAST))
    for name in _HUB_KERNEL_LOGGERS:
        _add_filter(name, _Once(drop=_HUB_KERNEL))
    warnings.filterwarnings("once", message=MATMUL_CAST)  # older bitsandbytes: warnings.warn


def _add_filter(name: str, new: _Once) -> None:
    logger = logging.getLogger(name)
    if not any(isinstance(f, _Once) and (f.prefix, f.drop) == (new.prefix, new.drop) for f in logger.filters):
        logger.addFilter(new)


def quiet_lm_eval_git() -> None:
    """lm_eval records the commit of the folder it runs in with ``git describe`` once per ``simple_evaluate``, whose
    stderr reaches the terminal: outside a git folder, ``fatal: not a git repository`` for every task scored. Swap in
    the same lookup with git's stderr discarded (the hash recorded is the same, and lm_eval's fallback is kept).
    Idempotent; call it where lm_eval is about to run (it imports ``lm_eval.evaluator``)."""
    import lm_eval.evaluator
    import lm_eval.loggers.utils as lm_utils

    if getattr(lm_eval.evaluator.get_git_commit_hash, "_gnmr_quiet", False):
        return
    lm_eval.evaluator.get_git_commit_hash = lm_utils.get_git_commit_hash = _quiet_git_commit_hash


def _quiet_git_commit_hash() -> str | None:
    """``lm_eval.loggers.utils.get_git_commit_hash`` with git's stderr discarded."""
    import os
    import subprocess

    from lm_eval.loggers.utils import get_commit_from_path

    try:
        return subprocess.check_output(["git", "describe", "--always"], stderr=subprocess.DEVNULL).strip().decode()
    except (subprocess.CalledProcessError, FileNotFoundError, OSError):
        return get_commit_from_path(os.getcwd())


_quiet_git_commit_hash._gnmr_quiet = True  # type: ignore[attr-defined]
