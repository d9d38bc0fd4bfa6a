"""What the hardware computes fast: ``compute_dtype: auto``.

BF16 where the machine has BF16 arithmetic units, FP32 elsewhere:

- a CUDA device that supports BF16 (``torch.cuda.is_available()`` and ``torch.cuda.is_bf16_supported()``,
  without counting emulation where torch can tell);
- a Linux CPU whose ``/proc/cpuinfo`` flags list ``amx_bf16`` (AMX tiles, e.g. Sapphire Rapids) or
  ``avx512_bf16`` (AVX512-BF16, e.g. Cooper Lake, Zen 4): oneDNN's BF16 matmuls use them
  (``bench/cost/matmul_dtype.py``: ~8x faster than FP32 at one thread on an AMX machine);
- anything else, FP32: a CPU without those flags emulates BF16 products and is several times slower
  than in FP32, and where the flags cannot be read (not Linux) nothing is guessed.

``python -m gnmr_hf.hardware`` prints the choice and the reason.
"""

from __future__ import annotations

import sys
from pathlib import Path

CPUINFO = Path("/proc/cpuinfo")
BF16_CPU_FLAGS = ("amx_bf16", "avx512_bf16")
_FLAG_NAMES = {"amx_bf16": "AMX-BF16", "avx512_bf16": "AVX512-BF16"}


def read_cpuinfo() -> str | None:
    """The text of ``/proc/cpuinfo``, or None where there is none (not Linux, or unreadable)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return CPUINFO.read_text()
    except OSError:
        return None


def cpu_flags(cpuinfo: str | None = None) -> set[str] | None:
    """The CPU feature flags of the first ``flags`` line of ``cpuinfo`` (default: :func:`read_cpuinfo`);
    None where there is no cpuinfo to read, an empty set where it has no ``flags`` line."""
    text = read_cpuinfo() if cpuinfo is None else cpuinfo
    if text is None:
        return None
    for line in text.splitlines():
        key, sep, value = line.partition(":")
        if sep and key.strip() == "flags":
            return set(value.split())
    return set()


def _cuda_bf16() -> tuple[bool, str]:
    """(CUDA computes BF16, a description of the device) -- (False, "") without CUDA."""
    import torch

    if not torch.cuda.is_available():
        return False, ""
    try:  # torch >= 2.3 can tell native BF16 from emulation (pre-Ampere GPUs)
        supported = torch.cuda.is_bf16_supported(including_emulation=False)
    except TypeError:
        supported = torch.cuda.is_bf16_supported()
    try:
        name = torch.cuda.get_device_name()
    except Exception:  # a mocked or half-initialised CUDA: the decision does not need the name
        name = "the CUDA device"
    return bool(supported), name


def auto_compute_dtype() -> tuple[str, str]:
    """``("bfloat16" | "float32", reason)``: the compute dtype ``compute_dtype: auto`` resolves to here.

    The reason is one line for the user, e.g. ``"CPU has AMX-BF16, AVX512-BF16: /proc/cpuinfo flags
    amx_bf16, avx512_bf16"``.
    """
    cuda, name = _cuda_bf16()
    if cuda:
        return "bfloat16", f"CUDA device {name} supports BF16"
    prefix = f"CUDA device {name} has no native BF16; " if name else ""
    flags = cpu_flags()
    if flags is None:
        return "float32", (prefix + f"no /proc/cpuinfo on {sys.platform} to tell whether the CPU has BF16 "
                           "units, so FP32")
    found = [f for f in BF16_CPU_FLAGS if f in flags]
    if found:
        return "bfloat16", (prefix + f"CPU has {', '.join(_FLAG_NAMES[f] for f in found)}: "
                            f"/proc/cpuinfo flags {', '.join(found)}")
    return "float32", (prefix + "CPU has neither amx_bf16 nor avx512_bf16 in /proc/cpuinfo: BF16 would be "
                       "emulated and slower than FP32")


def resolve_compute_dtype(name: str) -> tuple[str, str | None]:
    """``name`` unchanged (reason None), or for ``"auto"`` :func:`auto_compute_dtype`'s answer."""
    if name == "auto":
        return auto_compute_dtype()
    return name, None


def main(argv: list[str] | None = None) -> int:
    dtype, reason = auto_compute_dtype()
    print(f"compute_dtype auto -> {dtype}: {reason}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
