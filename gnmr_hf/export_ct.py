"""The precision ladder as a compressed-tensors checkpoint: one folder that stock transformers loads with no
arguments and vLLM serves natively, each decoder linear at its planned rung.

``export_compressed_tensors(model_path, plan, out_dir, adapter=None, group_size=128)`` merges the adapter
(a PEFT LoRA folder, optional) into the original BF16 weights (not into 4-bit values), then writes every
decoder linear through the ``compressed-tensors`` library (``QuantizationConfig`` / ``apply_quantization_config``
/ ``calculate_qparams`` / ``ModelCompressor``, the steps llm-compressor takes without calibration data):

=============  ===========================================================================================
rung           stored as
=============  ===========================================================================================
low (default)  ``W4A16``: INT4 weight-only, group-wise symmetric (group 128: vLLM's W4A16 preset), BF16 scales
``int8``       ``W8A16``: INT8 weight-only, per output channel, symmetric, BF16 scales
``bf16``       unquantised, in ``quantization_config.ignore`` (as ``lm_head`` and every non-decoder module)
=============  ===========================================================================================

Both quantised schemes are stored ``pack-quantized`` (int32-packed codes, ``weight_scale``, ``weight_shape``).
Every quantised linear is named in its config group's ``targets`` (no ``Linear`` class target): vLLM resolves a
fused module (``qkv_proj``, ``gate_up_proj``) by its members' names and takes the first member's scheme, so the
export refuses a plan that puts the members of a fused group on different rungs
(:func:`gnmr_hf.planning.groups.split_groups`; plan with groups) unless ``target="transformers"``, a folder for
transformers only, which its model card states.

The INT4 rung has no NF4: a plan profiled against NF4 ranks the gains of another quantiser. :func:`int4_fake_quant`
is the export's INT4 quantiser in plain torch (quantise, dequantise; bit-exact to the library's on the same BF16
weight, tests/test_export_ct.py), the low path to profile a plan meant for this export against;
:func:`fake_quantize_model` applies the whole plan to a model in place (the reference the tests compare the stock
load against). :func:`ct_rung_gains` profiles a ladder against that low path (the gradient at the uniform W4A16
model, each rung's first-order gain, its price in the folder's bytes: :func:`ct_rung_prices`), for
``choose_rungs`` with the serving groups (bench/value/serve_bench.py plans and measures it).

From the command line: ``gnmr-hf export --format compressed-tensors --group-size N`` (gnmr_hf/export.py).

Quantisation runs on the CPU, in the weights' BF16, as the library computes there (on a CUDA device it would
divide in FP32 in a Triton kernel, which can round a code differently).
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from gnmr_hf.export_folder import (
    ExportError,
    check_model_folder,
    check_output,
    check_sources,
    folder_name,
    model_name,
    plan_file,
    staged_output,
)
from gnmr_hf.planning.groups import (
    ServingLayoutError,
    decoder_linears,
    describe_split,
    serving_groups,
    split_groups,
)
from gnmr_hf.planning.int4 import (  # noqa: F401  (re-exported: the export's quantisers and prices)
    INT4_PROFILE,
    _largest_group,
    ct_rung_gains,
    ct_rung_prices,
    ct_shapes,
    ct_tensor_bytes,
    fake_quantize_model,
    int4_fake_quant,
    int8_fake_quant,
    weight_fake_quant,
)
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.rungs import get_rung, planned_rungs
from gnmr_hf.rungs.int4 import INT4_LOWS
from gnmr_hf.serving import EXPORT_TARGETS, serve_target

#: the schemes by rung (the low rung is every decoder linear the plan does not name)
SCHEMES = {"low": "W4A16", "int8": "W8A16", "bf16": "BF16"}
#: ``vllm`` is vLLM on CUDA (``vllm-gpu``, every scheme); ``vllm-cpu`` vLLM's CPU build (W4A16 and BF16 only)
TARGETS = EXPORT_TARGETS
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "special_tokens_map.json",
                    "vocab.json", "merges.txt", "added_tokens.json", "chat_template.jinja", "generation_config.json")
SERVE_EXTRA = "the compressed-tensors export needs the serve extra: pip install 'gnmr_hf[serve]' (compressed-tensors)"
#: what the bitsandbytes export and load_planned say of a plan from ``gnmr-hf profile --low int4`` (``low: "int4"``)



def _require_compressed_tensors():
    try:
        import compressed_tensors
    except ImportError as e:
        raise ImportError(SERVE_EXTRA) from e
    return compressed_tensors


# --------------------------------------------------------------------------------------- the plan


def read_rungs(plan: str | os.PathLike | Mapping[str, str]) -> tuple[dict[str, str], dict[str, Any], Path | None]:
    """``{linear: rung}`` (a registered planned rung, ``"int8"`` / ``"bf16"``; every other decoder linear low) from
    a mapping, or from a plan file (or the folder holding its ``profile.json``) read by
    :meth:`gnmr_hf.planning.plan.Plan.load`, whichever schema wrote it. Returns the rungs, the file's data
    (``{}`` for a mapping) and its path."""
    rungs, loaded = _read_plan(plan)
    return rungs, (loaded.data if loaded else {}), (loaded.source if loaded else None)


def _read_plan(plan: str | os.PathLike | Mapping[str, str]) -> tuple[dict[str, str], Plan | None]:
    """The rungs and the :class:`Plan` (None for a mapping); one-line :class:`ExportError` otherwise."""
    if isinstance(plan, Mapping):
        rungs = dict(plan)
        known = planned_rungs()
        bad = {n: r for n, r in rungs.items() if not isinstance(n, str) or r not in known}
        if bad:
            name, rung = next(iter(bad.items()))
            raise ExportError(f"the plan puts {name!r} on {rung!r}: each rung is one of {', '.join(known)}")
        return rungs, None
    path = plan_file(plan)  # export_folder's words for a missing file
    try:
        loaded = Plan.load(path)
    except PlanError as e:
        raise ExportError(f"{e}: it holds no plan (a ladder plan's rungs mapping, or gnmr-hf profile --budget's "
                          "skip_modules)") from None
    if not loaded.planned:
        raise ExportError(f"{loaded.source} holds no plan: neither a rungs mapping (a ladder plan) nor a skip_modules "
                          "list (gnmr-hf profile --budget)")
    return dict(loaded.rungs), loaded


def _check_plan(model_path: Path, rungs: dict[str, str], data: dict[str, Any], group_size: int, target: str,
                low_format: str = "int4"):
    """Everything about the plan against the model, from its config alone (a meta model): the linears' names and
    shapes, the decoder linears, the serving groups; one-line :class:`ExportError` on a mismatch."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    modules = dict(meta.named_modules())
    linears = decoder_linears(meta)
    decoder = set(linears)
    foreign = [n for n in rungs if n not in modules]
    if foreign:
        raise ExportError(f"the plan names {foreign[0]!r}, which is not a module of {model_path} ({len(linears)} "
                          f"decoder linears, e.g. {linears[0]}): a plan made for another model?")
    not_decoder = [n for n, r in rungs.items() if n not in decoder and r == "int8"]
    if not_decoder:
        raise ExportError(f"the plan puts {not_decoder[0]!r} on INT8, which is not a decoder linear of {model_path}")
    units = data.get("units") if isinstance(data.get("units"), list) else []
    if units and len(units) not in (len(linears), meta.config.num_hidden_layers):
        raise ExportError(f"the profile has {len(units)} units; {model_path} has {len(linears)} decoder linears and "
                          f"{meta.config.num_hidden_layers} layers: a profile of another model")
    rungs = {n: r for n, r in rungs.items() if n in decoder}
    low = [n for n in linears if n not in rungs]
    short = [n for n in low if modules[n].in_features % group_size]
    if group_size <= 0 or short:
        g = _largest_group([modules[n].in_features for n in low], group_size) if group_size > 0 else None
        fix = f"use group_size={g}" if g else "no power-of-two group size of at least 16 divides them all"
        where = f"the input size of {short[0]} ({modules[short[0]].in_features})" if short else "positive sizes"
        raise ExportError(f"group_size {group_size} does not divide {where}: {fix}")
    groups = None
    if target.startswith("vllm"):
        try:
            groups = serving_groups(meta, linears)
        except ServingLayoutError as e:
            raise ExportError(f"{e}: export with target='transformers' for a transformers-only folder") from None
        split = split_groups(rungs, groups)
        if split:
            raise ExportError(f"the plan splits {len(split)} serving group(s) vLLM fuses: {describe_split(split, rungs)}; "
                              "vLLM needs one scheme per fused group: plan with serving groups "
                              "(gnmr_hf.planning.groups), or export with target='transformers' for a transformers-only "
                              "folder")
    shapes, other = ct_shapes(meta, linears)
    if low_format not in serve_target(target).lows:
        scheme = get_rung(low_format).exports["compressed-tensors"]
        raise ExportError(f"target {target}: stock transformers does not load a {scheme} folder (transformers 5.25.0 "
                          "mis-sizes its packed zero points, tests/test_int4_settings.py); vLLM serves it: export for "
                          "vllm-cpu or vllm-gpu, or plan over symmetric INT4 (low int4) for transformers")
    if target == "vllm-cpu" and "int8" in rungs.values():
        as_bf16 = {n: "bf16" if r == "int8" else r for n, r in rungs.items()}
        w4, mine, cpu = (ct_tensor_bytes(shapes, r, other, group_size, low_format) for r in ({}, rungs, as_bf16))
        n = sum(r == "int8" for r in rungs.values())
        raise ExportError(f"vllm-cpu: vLLM's CPU build has no W8A16 kernel ({serve_target('vllm-cpu').evidence}), "
                          f"and the plan puts {n} linear(s) on INT8: it loads on vllm-gpu (+{100 * (mine / w4 - 1):.1f} "
                          f"% over uniform W4A16) or, with those linears on BF16, on vllm-cpu at "
                          f"+{100 * (cpu / w4 - 1):.1f} %; plan for the CPU with gnmr-hf profile --serve vllm-cpu")
    return rungs, linears, shapes, other, groups


def _safetensors_bytes(folder: Path) -> int:
    """The data bytes of the safetensors files in ``folder`` (each file less its 8-byte length and header)."""
    total = 0
    for f in folder.glob("*.safetensors"):
        with open(f, "rb") as fh:
            header = int.from_bytes(fh.read(8), "little")
        total += f.stat().st_size - 8 - header
    return total


# ------------------------------------------------------------------------------------------ the export


def export_compressed_tensors(model_path: str | os.PathLike, plan: str | os.PathLike | Mapping[str, str],
                              out_dir: str | os.PathLike, adapter: str | os.PathLike | None = None,
                              group_size: int | None = None, force: bool = False, target: str | None = None,
                              measured: Mapping[str, Any] | None = None, low: str | None = None) -> dict[str, Any]:
    """Write ``model_path`` (with ``adapter`` merged) as a compressed-tensors folder at the plan's rungs.

    Args:
        model_path: the BF16 model folder (safetensors).
        plan: ``{linear: "int8" | "bf16"}``, or a ``profile.json`` / its folder (a ladder plan's ``rungs`` or a
            BF16 plan's ``skip_modules``); every other decoder linear goes to W4A16.
        out_dir: the folder to write (the --force contract of :mod:`gnmr_hf.export_folder`).
        adapter: a PEFT LoRA folder merged into the BF16 weights first (post-training quantisation without).
        group_size: the W4A16 group; it must divide every low linear's input size. None (the default): the
            plan's own for a plan profiled against this export's INT4 (``gnmr-hf profile --low int4`` records
            ``group_size``; another explicit size is refused), else 128 (vLLM's preset).
        force: replace an earlier export at ``out_dir``.
        target: None (the default): the plan's own serving target (``gnmr-hf profile --serve``) where it
            names one of these, else ``"vllm"``. ``"vllm"`` / ``"vllm-gpu"`` (refuses a plan that splits a fused group), ``"vllm-cpu"`` (also
            refuses INT8 rungs: vLLM's CPU build has no W8A16 kernel) or ``"transformers"`` (allows both).
        measured: figures for the model card (e.g. ``{"held-out loss": 2.31}``), measured by the caller.
        low: the INT4 scheme of the unplanned linears: ``"int4"`` (W4A16, symmetric) or ``"int4-asym"``
            (W4A16_ASYM, a zero point per group: vLLM serves it, stock transformers does not load it). None (the
            default): the plan's own low where it was profiled against one of these (another is refused), else
            ``"int4"``.

    Returns:
        A summary: the folder, the scheme counts, the tensor bytes of this folder, of the uniform W4A16 model
        and of BF16, the bytes on disk.

    Raises:
        ImportError: the ``serve`` extra (compressed-tensors) is missing.
        ExportError / OutputFolderError: bad input, in one line, before anything is written.
    """
    _require_compressed_tensors()
    if target is not None and target not in TARGETS:
        raise ExportError(f"target {target!r}: one of {', '.join(TARGETS)}")
    if group_size is not None and (isinstance(group_size, bool) or not isinstance(group_size, int)):
        raise ExportError(f"group_size must be an integer, got {group_size!r}")
    model_path = Path(model_path)
    check_model_folder(model_path)
    rungs, loaded = _read_plan(plan)
    data, plan_path = (loaded.data, loaded.source) if loaded else ({}, None)
    if target is None:
        target = loaded.serve if loaded is not None and loaded.serve in TARGETS else "vllm"
    group_size, profiled = _profiled_against(loaded, group_size)
    low = _low_format(loaded, low)
    if adapter is not None and not (Path(adapter) / "adapter_config.json").is_file():
        raise ExportError(f"{adapter} is not a PEFT adapter folder (no adapter_config.json)")
    protect = [("model folder", model_path, True)]
    if adapter is not None:
        protect.append(("adapter folder", adapter, True))
    if plan_path is not None:
        protect.append(("profile's folder", plan_path.parent, False))
    out = check_output(out_dir, force, protect)
    rungs, linears, shapes, other, groups = _check_plan(model_path, rungs, data, group_size, target, low)
    # the plan's recorded model identity and the adapter's shapes, as load_planned / gnmr-hf eval check them
    check_sources(model_path, plan_path, data, adapter)

    counts = {SCHEMES[r]: sum(1 for n in linears if rungs.get(n, "low") == r) for r in SCHEMES}
    summary = {"folder": str(out), "format": "compressed-tensors", "target": target, "group_size": group_size,
               "low": low, "low_scheme": get_rung(low).exports["compressed-tensors"],
               "schemes": counts, "rungs": {n: rungs[n] for n in linears if n in rungs},
               "model": model_name(model_path), "adapter": str(adapter) if adapter is not None else None,
               "tensor_bytes": ct_tensor_bytes(shapes, rungs, other, group_size, low),
               "w4a16_tensor_bytes": ct_tensor_bytes(shapes, {}, other, group_size, low),
               "bf16_tensor_bytes": ct_tensor_bytes(shapes, dict.fromkeys(shapes, "bf16"), other, group_size),
               "measured": dict(measured or {}), "plan": data.get("plan"), "profiled_against": profiled}
    # names, not this machine's folders: the marker travels with the folder
    marker = {"format": "compressed-tensors", "model": summary["model"],
              "plan": f"{folder_name(plan_path.parent)}/{plan_path.name}" if plan_path else None,
              "adapter": folder_name(adapter) if adapter is not None else None}
    with staged_output(out, marker) as tmp:
        model = _merged_bf16(model_path, adapter)
        _write(model, rungs, linears, group_size, tmp, low)
        del model
        for f in _TOKENIZER_FILES:
            if (model_path / f).is_file() and not (tmp / f).exists():
                shutil.copy2(model_path / f, tmp / f)
        written = _safetensors_bytes(tmp)
        if written != summary["tensor_bytes"]:
            raise RuntimeError(f"the folder's tensors hold {written} bytes, {summary['tensor_bytes']} predicted: "
                               "the size accounting is off")
        (tmp / "README.md").write_text(model_card(summary, summary["model"]))
    summary["bytes_on_disk"] = sum(p.stat().st_size for p in out.rglob("*") if p.is_file())
    return summary


def _profiled_against(plan: Plan | None, group_size: int | None) -> tuple[int, str]:
    """The group size to export with and, for the model card, which quantiser the plan was profiled against.

    A plan over INT4 (:attr:`Plan.is_int4`: ``gnmr-hf profile --low int4``) carries its ``group_size`` (the gains
    it ranked are this export's at that group: another explicit size is refused) and the ``model_identity`` of the
    model it was profiled on (another model is refused, as every plan file that records one is:
    :func:`gnmr_hf.export_folder.check_sources`). Any other plan (NF4 / FP4 / INT8 profiles, a trained ladder's
    plan, a mapping) is accepted at ``group_size`` (default 128)."""
    if plan is None:
        return group_size or 128, "not recorded (the rungs were given as a mapping)"
    if plan.is_gguf:
        raise ExportError(f"{plan.source or 'the plan'} was {plan.export_only}")
    if not plan.is_int4:
        low = plan.data.get("low") if isinstance(plan.data.get("low"), str) else None  # recorded, or not
        if low:
            return group_size or 128, (f"bitsandbytes {low.upper()} (`gnmr-hf profile --low {low}`): its gains rank "
                                       "that quantiser's errors, not this folder's INT4; `gnmr-hf profile --low int4` "
                                       "profiles against this export's own")
        return group_size or 128, ("not recorded in the plan file (a recipe's or trained ladder's plan is profiled "
                                   "against its bitsandbytes low path, e.g. NF4, not this folder's INT4)")
    recorded = plan.group_size
    if recorded is None or recorded <= 0:
        raise ExportError(f"{plan.source} is an int4 profile without a valid group_size ({recorded!r}): profile again "
                          "with gnmr-hf profile --low int4")
    if group_size is not None and group_size != recorded:
        raise ExportError(f"--group-size {group_size}: {plan.source} was profiled against INT4 with group {recorded}: "
                          f"leave --group-size out (or give {recorded}), or profile again with --group-size {group_size}")
    return recorded, (f"this export's own INT4 quantiser (W4A16, group {recorded}; `gnmr-hf profile --low int4`): "
                      "the gains it ranked are this folder's")


def _low_format(plan: Plan | None, low: str | None) -> str:
    """The INT4 low the export writes: ``low``, else the plan's own INT4 low (another ``low`` than the one it was
    profiled against is refused), else ``"int4"``."""
    own = plan.low if plan is not None and plan.is_int4 else None
    if low is not None and low not in INT4_LOWS:
        raise ExportError(f"low {low!r}: the compressed-tensors export writes {' or '.join(INT4_LOWS)}")
    if own and low and low != own:
        raise ExportError(f"{plan.source} was profiled against {own} ({get_rung(own).exports['compressed-tensors']}): "
                          f"export it at that low, or profile again with --low {low}")
    return low or own or "int4"


def _merged_bf16(model_path: Path, adapter):
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval()


def _write(model, rungs: Mapping[str, str], linears: list[str], group_size: int, folder: Path,
           low: str = "int4") -> None:
    """The library's own steps: schemes attached, scales computed from the weights, codes packed, saved."""
    import torch
    from compressed_tensors.compressors import ModelCompressor
    from compressed_tensors.offload import update_offload_parameter
    from compressed_tensors.quantization import apply_quantization_config
    from compressed_tensors.quantization.utils import calculate_qparams

    # the plan's own compressed-tensors config (gnmr_hf.planning.Plan.ct_config)
    # (a BF16 plan's skip list may name modules that are no decoder linear, lm_head: unquantised anyway)
    planned = {n: r for n, r in rungs.items() if n in set(linears)}
    config = Plan(rungs=planned, low=low, group_size=group_size,
                  rung_set=tuple(sorted(set(planned.values()))) or ("bf16",)).ct_config(linears)
    groups = bool(config)
    if groups:
        apply_quantization_config(model, config, show_progress=False)
    modules = dict(model.named_modules())
    quantised = [n for n in linears if getattr(modules[n], "quantization_scheme", None) is not None]
    with torch.no_grad():
        for name in quantised:  # every scheme the config attached (W4A16, W8A16: each rung's own entry)
            m = modules[name]
            args = m.quantization_scheme.weights
            w = m.weight  # (out, in), BF16
            x = w.unflatten(-1, (w.shape[-1] // args.group_size, args.group_size)) if args.group_size else w.unsqueeze(1)
            scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)  # (out, groups): the min-max observer's
            update_offload_parameter(m, "weight_scale", scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                update_offload_parameter(m, "weight_zero_point", zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model) if groups else None
    if compressor is not None:
        compressor.compress_model(model)
    model.save_pretrained(folder)
    if compressor is not None:
        compressor.update_config(str(folder))


def model_card(summary: dict[str, Any], model: str | os.PathLike) -> str:
    """The folder's README.md: the scheme of every linear (counts), the sizes, what loads it. ``model`` names the
    source (a path is reduced to :func:`gnmr_hf.export_folder.model_name`), the adapter is named by its folder's
    base name: the card never records an absolute path (it is published)."""
    name = model_name(model)  # idempotent on a name
    mib = 2**20
    c = summary["schemes"]
    lines = ["---", "library_name: transformers", "tags: [gnmr_hf, compressed-tensors, mixed-precision, w4a16]", "---",
             "", f"# {name}: the precision ladder as a compressed-tensors checkpoint", "",
             f"Exported by `gnmr_hf.export_compressed_tensors` from the BF16 checkpoint of `{name}`"
             + (f", the LoRA adapter `{folder_name(summary['adapter'])}` merged into the original BF16 weights first." if
                summary["adapter"] else ", no adapter (the base model quantised for serving)."), "",
             "| scheme | decoder linears |", "|---|---|",
             f"| {summary['low_scheme']}: INT4 weight-only, group {summary['group_size']}, "
             f"{'symmetric' if INT4_LOWS[summary['low']] else 'asymmetric (a zero point per group)'} | {c['W4A16']} |",
             f"| W8A16: INT8 weight-only, per channel, symmetric | {c['W8A16']} |",
             f"| BF16 (unquantised, in `ignore`) | {c['BF16']} |", "",
             "`lm_head`, the embeddings and the norms stay unquantised. Linears above the INT4 rung:", ""]
    lines += [f"- `{n}`: {SCHEMES[r]}" for n, r in summary["rungs"].items()] or ["- none"]
    lines += ["", "| | tensor bytes |", "|---|---|",
              f"| this folder | {summary['tensor_bytes'] / mib:.2f} MiB |",
              f"| every decoder linear {summary['low_scheme']} | {summary['w4a16_tensor_bytes'] / mib:.2f} MiB |",
              f"| BF16 | {summary['bf16_tensor_bytes'] / mib:.2f} MiB |", ""]
    over = summary["tensor_bytes"] / summary["w4a16_tensor_bytes"] - 1
    lines += [f"Over uniform {summary['low_scheme']}: **{100 * over:+.1f} %** of the tensor bytes.", ""]
    if summary.get("profiled_against"):
        lines += [f"The plan was profiled against: {summary['profiled_against']}.", ""]
    if summary["measured"]:
        lines += ["Measured (by the caller of the export):", ""]
        lines += [f"- {k}: {v}" for k, v in summary["measured"].items()] + [""]
    else:
        lines += ["Loss: not measured by the export (`gnmr-hf export --score-data FILE` scores it on held-out text "
                  "against the merged BF16 model); score the folder with `gnmr-hf eval --model FOLDER`.", ""]
    if summary["target"] == "vllm-cpu":
        lines += ["Served by vLLM's CPU build (`vllm serve FOLDER`: compressed-tensors, its W4A16 kernel "
                  "CPUWNA16; BF16 linears unquantised) and by vLLM on CUDA; q/k/v and gate/up of each layer share "
                  "one scheme, as vLLM's fused modules need.", ""]
    elif summary["target"] == "transformers":
        lines += ["**For transformers only**: the plan puts members of a group vLLM fuses (q/k/v, gate/up) on "
                  "different schemes, which vLLM refuses or mis-assigns.", ""]
    else:
        lines += ["Served by vLLM (`vllm serve FOLDER`: compressed-tensors, the W4A16 / W8A16 weight-only kernels); "
                  "q/k/v and gate/up of each layer share one scheme, as vLLM's fused modules need.", ""]
    lines += ["## Use", "", "```python", "from transformers import AutoModelForCausalLM",
              "model = AutoModelForCausalLM.from_pretrained(FOLDER)   # no arguments; needs compressed-tensors",
              "```", ""]
    return "\n".join(lines)
