"""``compute_dtype: auto`` (gnmr_hf.hardware): BF16 on CUDA with BF16 and on CPUs with AMX-BF16 /
AVX512-BF16, FP32 otherwise; the real answer on this machine agrees with its /proc/cpuinfo."""

from __future__ import annotations

import sys

import pytest
import torch

from gnmr_hf import hardware

OLD_CPU = "processor\t: 0\nmodel name\t: Old CPU\nflags\t\t: fpu sse2 avx2 avx512f avx512_vnni\n\n"
AMX_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f amx_tile amx_bf16 amx_int8\n"
AVX512_BF16_CPU = "processor\t: 0\nflags\t\t: fpu avx2 avx512f avx512_bf16\n"


@pytest.fixture
def no_cuda(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)


def test_cpu_flags_parsing():
    assert hardware.cpu_flags(OLD_CPU) == {"fpu", "sse2", "avx2", "avx512f", "avx512_vnni"}
    assert hardware.cpu_flags("processor : 0\n") == set()


def test_fp32_on_a_cpu_without_the_flags(monkeypatch, no_cuda):
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: OLD_CPU)
    dtype, reason = hardware.auto_compute_dtype()
    assert dtype == "float32"
    assert "neither amx_bf16 nor avx512_bf16" in reason


@pytest.mark.parametrize(("text", "named"), [(AMX_CPU, "AMX-BF16"), (AVX512_BF16_CPU, "AVX512-BF16")])
def test_bf16_on_a_cpu_with_either_flag(monkeypatch, no_cuda, text, named):
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: text)
    dtype, reason = hardware.auto_compute_dtype()
    assert dtype == "bfloat16" and named in reason


def test_fp32_where_the_flags_cannot_be_read(monkeypatch, no_cuda):
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: None)
    dtype, reason = hardware.auto_compute_dtype()
    assert dtype == "float32" and "no /proc/cpuinfo" in reason


def test_not_linux_reads_nothing(monkeypatch):
    monkeypatch.setattr(hardware.sys, "platform", "darwin")
    assert hardware.read_cpuinfo() is None


def test_bf16_on_cuda_with_bf16(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", lambda including_emulation=True: True)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Fake GPU")
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: OLD_CPU)  # the CPU does not matter then
    assert hardware.auto_compute_dtype() == ("bfloat16", "CUDA device Fake GPU supports BF16")


def test_cuda_without_native_bf16_falls_back_to_the_cpu_rule(monkeypatch):
    asked = {}

    def supported(including_emulation=True):
        asked["including_emulation"] = including_emulation
        return including_emulation  # an emulating GPU (pre-Ampere)

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_bf16_supported", supported)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda *a: "Old GPU")
    monkeypatch.setattr(hardware, "read_cpuinfo", lambda: OLD_CPU)
    dtype, reason = hardware.auto_compute_dtype()
    assert asked == {"including_emulation": False}
    assert dtype == "float32" and reason.startswith("CUDA device Old GPU has no native BF16")


def test_resolve_keeps_explicit_dtypes():
    assert hardware.resolve_compute_dtype("float16") == ("float16", None)
    assert hardware.resolve_compute_dtype("auto")[0] in ("bfloat16", "float32")


def test_the_real_answer_on_this_machine():
    dtype, reason = hardware.auto_compute_dtype()
    if torch.cuda.is_available() and torch.cuda.is_bf16_supported():
        pytest.skip("a CUDA machine: the GPU decides (test_bf16_on_cuda_with_bf16)")
    if not sys.platform.startswith("linux"):
        assert dtype == "float32"
        return
    with open("/proc/cpuinfo") as f:
        flags = next((line.split(":", 1)[1].split() for line in f if line.startswith("flags")), [])
    has = [f for f in ("amx_bf16", "avx512_bf16") if f in flags]
    assert dtype == ("bfloat16" if has else "float32"), (dtype, reason, has)
    assert all(f in reason for f in has)


def test_module_prints_its_choice(capsys):
    assert hardware.main([]) == 0
    out = capsys.readouterr().out
    assert out.startswith("compute_dtype auto -> ") and ": " in out
