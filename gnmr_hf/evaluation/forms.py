"""What is scored: the form a model arrives in (a BF16 checkpoint, an exported bitsandbytes or compressed-tensors
folder, a plan on its training base, the merged model), the options checked against it, and the record of the
loaded model's linears per precision and the bytes it holds (``scored`` in the summary)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.memory import model_bytes

#: the quantisation methods of a pre-quantised folder the evaluation loads as stock from_pretrained does
PREQUANTISED = ("bitsandbytes", "compressed-tensors")


def folder_quantisation(model: str | os.PathLike) -> str | None:
    """The ``quant_method`` of a local folder's ``config.json`` ``quantization_config`` (an exported bitsandbytes
    or compressed-tensors folder), None for a BF16 checkpoint, a hub id or an unreadable config."""
    path = Path(model) / "config.json"
    try:
        config = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    return str(q.get("quant_method") or "unknown") if isinstance(q, dict) and q else None


def _dtype_label(config: dict[str, Any]) -> str:
    name = str(config.get("dtype") or config.get("torch_dtype") or "bfloat16").removeprefix("torch.")
    return {"bfloat16": "BF16", "float32": "FP32", "float16": "FP16"}.get(name, name.upper())


def folder_format(model: str | os.PathLike) -> str | None:
    """What a pre-quantised folder stores, from its ``config.json`` ``quantization_config``: the quantisation
    method and the linears' formats, e.g. ``"compressed-tensors W4A16+W8A16+BF16"`` (one ``W<bits>A<bits>`` per
    scheme of ``config_groups``, ascending; then the dtype of the ``ignore`` list's linears) or
    ``"bitsandbytes NF4+BF16"``; None for a folder without one (a BF16 checkpoint), a hub id or an unreadable
    config. The summary's ``precision`` of such a folder (the folder is loaded as stock ``from_pretrained`` loads
    it, nothing quantised at load)."""
    try:
        config = json.loads((Path(model) / "config.json").read_text())
    except (OSError, ValueError):
        return None
    q = config.get("quantization_config") if isinstance(config, dict) else None
    if not isinstance(q, dict) or not q:
        return None
    method = str(q.get("quant_method") or "unknown")
    kept = _dtype_label(config)
    kinds: list[tuple[int, int, str]] = []
    if method == "compressed-tensors":
        for group in (q.get("config_groups") or {}).values():
            weights = group.get("weights") if isinstance(group, dict) else None
            if not isinstance(weights, dict) or weights.get("num_bits") is None:
                continue
            acts = group.get("input_activations")
            a_bits = acts.get("num_bits", 16) if isinstance(acts, dict) else 16
            kinds.append((int(weights["num_bits"]), int(a_bits), f"W{weights['num_bits']}A{a_bits}"))
        labels = [k for *_, k in sorted(set(kinds))]
        if q.get("ignore"):
            labels.append(kept)
    elif method == "bitsandbytes":
        labels = [str(q.get("bnb_4bit_quant_type") or "fp4").upper() if q.get("load_in_4bit") else
                  "INT8" if q.get("load_in_8bit") else "unknown"]
        # transformers keeps the output head unquantised when the skip list is left out
        if q.get("llm_int8_skip_modules") is None or q.get("llm_int8_skip_modules"):
            labels.append(kept)
    else:
        labels = []
    return " ".join([method, "+".join(labels)]) if labels else method


def check_form(model: str, precision: str | None, skip_modules: list[str] | None, plan) -> str:
    """The precision to load ``model`` at, the options checked against the form (one-line :class:`EvalError`):
    a pre-quantised folder takes no ``--precision int8|nf4``, ``--skip-modules`` or ``--plan`` (its config says
    how it is quantised); ``--plan`` loads the low linears at ``precision`` (``nf4`` unless ``int8``), without
    ``--skip-modules``. ``precision`` None: ``bf16`` (``nf4`` with a plan)."""
    method = folder_quantisation(model)
    if method is not None:
        if method not in PREQUANTISED:
            raise EvalError(f"--model {model} is quantised with {method!r}; the evaluation loads bitsandbytes and "
                            "compressed-tensors folders")
        given = ("--plan" if plan is not None else "--skip-modules" if skip_modules is not None else
                 f"--precision {precision}" if precision not in (None, "bf16") else None)
        if given:
            raise EvalError(f"--model {model} is a pre-quantised {method} folder (its config.json's quantization_config "
                            f"says how each linear is stored): leave {given} out, or give the BF16 checkpoint it was "
                            "exported from")
        return "bf16"
    if plan is not None:
        if precision == "bf16":
            raise EvalError("--plan keeps the planned linears on their rungs and loads the others low: --precision nf4 "
                            "(the default with --plan) or int8, not bf16")
        if skip_modules is not None:
            raise EvalError("--plan and --skip-modules both say which linears stay unquantised: give one (a ladder "
                            "plan: --plan)")
        return precision or "nf4"
    return precision or "bf16"


def linear_precision(module) -> str:
    """How one loaded linear stores its weight: ``NF4`` / ``FP4`` (bitsandbytes 4-bit), ``INT8`` (LLM.int8),
    ``W4A16`` / ``W8A16`` (a compressed-tensors scheme), else its weight's dtype (``BF16``, ``FP32``, ...)."""
    try:
        import bitsandbytes as bnb
    except ImportError:
        bnb = None
    if bnb is not None and isinstance(module, bnb.nn.Linear4bit):
        return str(getattr(module.weight, "quant_type", "4bit")).upper()
    if bnb is not None and isinstance(module, bnb.nn.Linear8bitLt):
        return "INT8"
    scheme = getattr(module, "quantization_scheme", None)
    weights = getattr(scheme, "weights", None) if scheme is not None else None
    if weights is not None:
        return f"W{weights.num_bits}A16" if scheme.input_activations is None else f"W{weights.num_bits}A{scheme.input_activations.num_bits}"
    names = {torch.bfloat16: "BF16", torch.float32: "FP32", torch.float16: "FP16"}
    return names.get(module.weight.dtype, str(module.weight.dtype).removeprefix("torch."))


def describe_scored(model, form: str, checkpoint: str | os.PathLike | None = None) -> dict[str, Any]:
    """What a loaded model scores with: ``form``, its linears per precision (every linear but the output head,
    which is given apart; a PEFT adapter's own LoRA matrices are not counted), the bytes it holds now, as loaded
    (:func:`gnmr_hf.memory.model_bytes`: parameters, buffers, quantisation states; ``held_when`` ``"loaded"``:
    :func:`held_after_scoring` re-counts them once it has scored) and the bytes of the checkpoint files it was
    read from (``checkpoint``'s ``*.safetensors``; None for a hub id)."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    head = base.get_output_embeddings()
    counts: dict[str, int] = {}
    head_precision = None
    for name, module in base.named_modules():
        if not isinstance(module, torch.nn.Linear) or ".lora_" in name:
            continue
        kind = linear_precision(module)
        if module is head:
            head_precision = kind
            continue
        counts[kind] = counts.get(kind, 0) + 1
    files = sorted(Path(checkpoint).glob("*.safetensors")) if checkpoint is not None and Path(checkpoint).is_dir() else []
    held = model_bytes(model)["total"]
    return {"form": form, "linears": dict(sorted(counts.items())), "lm_head": head_precision,
            "weights_held_bytes": held, "weights_held_at_load_bytes": held, "held_when": "loaded",
            "held_decompressed": None,
            "checkpoint_bytes": sum(f.stat().st_size for f in files) if files else None,
            "checkpoint": None if checkpoint is None else str(checkpoint)}


#: what ``scored["held_decompressed"]`` says of a compressed-tensors folder once transformers has scored it
CT_DECOMPRESSED = ("transformers scores a compressed-tensors folder de-compressed: on the first forward it unpacks "
                   "the quantised linears' weights to {dtype} (their scales kept), so the model scored holds them "
                   "at {dtype} size; the scores are the quantised weights', the memory is not the quantised model's")


def _decompressed_linears(model) -> tuple[int, str]:
    """How many of ``model``'s compressed-tensors linears hold their weights de-compressed (``quantization_status``
    ``decompressed``: transformers de-compresses them on the first forward), and the dtype they hold them in."""
    names = {"torch.bfloat16": "BF16", "torch.float32": "FP32", "torch.float16": "FP16"}
    n, dtype = 0, "BF16"
    for module in model.modules():
        status = getattr(module, "quantization_status", None)
        if status is None or str(getattr(status, "value", status)).lower() != "decompressed":
            continue
        n += 1
        weight = getattr(module, "weight", None)
        if weight is not None and hasattr(weight, "dtype"):
            dtype = names.get(str(weight.dtype), str(weight.dtype).removeprefix("torch."))
    return n, dtype


def held_after_scoring(model, scored: dict[str, Any]) -> dict[str, Any]:
    """``scored`` (:func:`describe_scored`) with ``weights_held_bytes`` re-counted on ``model`` as it is now, after
    scoring (``held_when`` ``"after scoring"``; the count at load stays in ``weights_held_at_load_bytes``), and
    ``held_decompressed`` saying so when the model holds de-compressed compressed-tensors linears
    (:data:`CT_DECOMPRESSED`)."""
    out = dict(scored)
    out.setdefault("weights_held_at_load_bytes", scored.get("weights_held_bytes"))
    out["weights_held_bytes"] = model_bytes(model)["total"]  # INT8 row scales moved by a forward included
    out["held_when"] = "after scoring"
    n, dtype = _decompressed_linears(model)
    if n:
        out["held_decompressed"] = f"{n} linears de-compressed; " + CT_DECOMPRESSED.format(dtype=dtype)
    return out


def format_scored(scored: dict[str, Any]) -> str:
    """The summary's one line on what was scored."""
    mib = 2**20
    linears = ", ".join(f"{n} {k}" for k, n in scored["linears"].items())
    disk = ("" if scored.get("checkpoint_bytes") is None else
            f"; checkpoint read {scored['checkpoint_bytes'] / mib:.1f} MiB on disk")
    when = " after scoring" if scored.get("held_when") == "after scoring" else ""
    at_load = scored.get("weights_held_at_load_bytes")
    if at_load is not None and at_load != scored["weights_held_bytes"]:
        when += f" ({at_load / mib:.1f} MiB at load)"
    note = f"; {scored['held_decompressed']}" if scored.get("held_decompressed") else ""
    return (f"scored: {scored['form']}: {sum(scored['linears'].values())} linears ({linears}), lm_head "
            f"{scored['lm_head']}; weights held {scored['weights_held_bytes'] / mib:.1f} MiB{when}{disk}{note}")



def _export_marker(model: str) -> dict[str, Any]:
    """The marker ``gnmr-hf export`` leaves in its folders (:data:`gnmr_hf.export_folder.MARKER`), or ``{}``."""
    try:
        data = json.loads((Path(model) / ".gnmr_export.json").read_text())
    except (OSError, ValueError):
        return {}
    return data if isinstance(data, dict) else {}

