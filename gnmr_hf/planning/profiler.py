"""``profile_sensitivity``: every criterion asked for, on the same prepared batches, into one profile; and the
identity of the model a profile was taken on (:func:`model_identity`, recorded in ``profile.json``)."""

from __future__ import annotations

import hashlib
import json
import os
import warnings
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any

from torch import nn

from gnmr_hf.backends.base import active_units
from gnmr_hf.backends.checkpoint import CheckpointIndex
from gnmr_hf.offline.gguf_models import model_name
from gnmr_hf.planning.criteria import _RUNNERS, DEFAULT_CRITERION, _criteria, _reference
from gnmr_hf.planning.passes import _batch_digest, _device, _keep_modules, _prepare_batches, _set_path, _units
from gnmr_hf.planning.planner import held_unit_bytes
from gnmr_hf.planning.results import SensitivityProfile, UnitScore
from gnmr_hf.units import UnitSpec, unwrap_model


def profile_sensitivity(
    model: nn.Module,
    batches: Iterable[dict[str, Any]],
    criteria: str | Sequence[str] = (DEFAULT_CRITERION,),
    units: UnitSpec = None,
    progress: bool = False,
) -> SensitivityProfile:
    """Score every unit of a dual-path model by how much keeping it on BF16 is worth, on ``batches``.

    Args:
        model: a model prepared with :func:`gnmr_hf.prepare_dual_path` (``units="linears"`` for one unit per
            linear), optionally PEFT-wrapped (needed for ``lora_grad``). Profiled in eval mode (dropout off);
            its training mode, its units' paths and its parameters' gradients are restored afterwards.
        batches: mappings (a dict, a ``BatchEncoding``) with ``input_ids``, ``attention_mask`` and ``labels``
            (-100 where no loss; derived from ``input_ids`` and the mask when missing), e.g. a few batches of
            the training data as the Trainer's collator makes them; a list of them, a
            ``torch.utils.data.DataLoader`` (iterated once: :func:`plan` must see the same batches again, so
            pass a list or an unshuffled loader), or one mapping. The profile records each batch's
            target-token count and fingerprint (``meta``), which :func:`plan` checks.
        criteria: names from :data:`CRITERIA` (a comma-separated string, or ``"all"``); see the module
            docstring. ``lora_grad`` on a model without trainable parameters in the units is skipped
            with a warning (and listed in ``profile.skipped``).
        units: the unit specification (default: the grain recorded by ``prepare_dual_path``).
        progress: show tqdm progress bars.

    Returns:
        A :class:`SensitivityProfile`, with the all-low and all-high losses and each criterion's cost.

    Raises:
        ValueError: no dual-path layer in the model, an unknown criterion, an empty batch list or a batch
            without target tokens.
    """
    names = _criteria(criteria)
    info = _units(model, units)
    prepared, counts = _prepare_batches(model, batches)
    total = sum(counts)
    weights = [n / total for n in counts]
    resolved = [(u.name, u.module) for u in info]
    start = active_units(model, resolved)
    was_training = model.training
    model.eval()
    scores: dict[str, list[float]] = {}
    costs: dict[str, dict[str, Any]] = {}
    skipped: dict[str, str] = {}
    try:
        seen_low: dict[int, float] = {}  # batch -> L_low, from any criterion's forward at the low point
        for name in names:
            result = _RUNNERS[name](model, info, prepared, weights, progress, seen_low)
            if isinstance(result, str):
                warnings.warn(f"profile_sensitivity: {name} skipped: {result}", stacklevel=2)
                skipped[name] = result
                continue
            values, costs[name] = result
            scores.update(values)
        losses, costs["reference"] = _reference(model, info, prepared, weights, seen_low)
    finally:
        _set_path(info, start)
        model.train(was_training)
    out_units = [UnitScore(index=i, name=u.name, modules=u.modules, bytes=u.bytes, layer=u.layer, op=u.op,
                           scores={k: float(v[i]) for k, v in scores.items()}) for i, u in enumerate(info)]
    base = unwrap_model(model)
    # the model by its name (an alias, a hub id, a folder's base name), never this machine's folder: profile.json travels
    raw = str(getattr(getattr(base, "config", None), "_name_or_path", "") or "")
    meta = {"model": type(base).__name__, "name_or_path": model_name(raw) if raw else "",
            "device": str(_device(model)), "batch_tokens": counts,
            "batch_digests": [_batch_digest(b) for b in prepared]}
    identity = _recovery_identity(info)
    if identity is not None:
        meta["model_identity"] = identity
    held = held_unit_bytes(info)
    if any(held):
        meta["held_unit_bytes"] = held
    return SensitivityProfile(units=out_units, criteria=[n for n in names if n not in skipped], losses=losses,
                              costs=costs, batches=len(prepared), tokens=total, keep_modules=_keep_modules(model),
                              skipped=skipped, meta=meta)




# ------------------------------------------------------------------------------------ model identity

#: config.json keys that say how a checkpoint was saved or loaded, not which model it is
_VOLATILE_CONFIG_KEYS = frozenset({"transformers_version", "torch_dtype", "dtype", "quantization_config", "use_cache",
                                   "auto_map"})
#: values read from the start of each checkpoint tensor for the weight fingerprint
_FINGERPRINT_VALUES = 64


def _stable_config(config: Any) -> Any:
    if isinstance(config, dict):
        return {k: _stable_config(v) for k, v in sorted(config.items())
                if k not in _VOLATILE_CONFIG_KEYS and not k.startswith("_")}
    if isinstance(config, list):
        return [_stable_config(v) for v in config]
    return config


def model_identity(model_path: str | os.PathLike) -> dict[str, Any]:
    """Which model a checkpoint holds: ``{"config": ..., "weights": ..., "tensors": n}``.

    ``config`` is a SHA-256 (16 hex digits) of the folder's ``config.json`` without the keys that say how it
    was saved or loaded (``transformers_version``, ``dtype``, ``quantization_config``, ``use_cache``,
    ``auto_map``, ``_``-prefixed ones); None when there is no ``config.json`` beside the weights. ``weights``
    is a SHA-256 of every safetensors tensor's name, shape and first 64 values rounded to BF16 (so a BF16
    and an FP32 save of the same BF16 weights agree; the reads are a few hundred bytes a tensor). Two
    checkpoints with the same layer names and shapes but other weights (another seed, a fine-tune merged into
    the weights) differ in ``weights``.
    """
    import torch
    from safetensors import safe_open

    index = CheckpointIndex(model_path)
    heads = {}
    for path in index.files:
        with safe_open(path, framework="pt", device="cpu") as fh:
            for key in fh.keys():
                sl = fh.get_slice(key)
                shape = list(sl.get_shape())
                if not shape:
                    head = fh.get_tensor(key)
                else:  # the first row (the first values of a vector)
                    head = sl[0:1] if len(shape) > 1 else sl[0:_FINGERPRINT_VALUES]
                heads[key] = (shape, head.reshape(-1)[:_FINGERPRINT_VALUES])
    digest = hashlib.sha256()
    for key in sorted(heads):
        shape, head = heads[key]
        if head.is_floating_point():
            head = head.to(torch.bfloat16).view(torch.int16)
        digest.update(json.dumps([key, shape]).encode())
        digest.update(head.to(torch.int64).numpy().tobytes())
    config_file = Path(index.files[0]).parent / "config.json"
    config = None
    if config_file.is_file():
        text = json.dumps(_stable_config(json.loads(config_file.read_text())), sort_keys=True)
        config = hashlib.sha256(text.encode()).hexdigest()[:16]
    return {"config": config, "weights": digest.hexdigest()[:16], "tensors": len(heads)}


def identity_mismatch(recorded: Any, model_path: str | os.PathLike) -> str | None:
    """Why ``model_path`` is not the model ``recorded`` (a :func:`model_identity`) was taken from; None if it is."""
    if not isinstance(recorded, dict) or "weights" not in recorded:
        return "its model_identity is not one gnmr_hf wrote (no 'weights')"
    here = model_identity(model_path)
    if recorded["weights"] != here["weights"]:
        return (f"its weights' fingerprint is {recorded['weights']}, {model_path}'s is {here['weights']} "
                f"({recorded.get('tensors', '?')} against {here['tensors']} tensors)")
    if recorded.get("config") and here["config"] and recorded["config"] != here["config"]:
        return f"the weights agree, but its config.json hash is {recorded['config']}, {model_path}'s {here['config']}"
    return None


def _recovery_identity(info) -> dict[str, Any] | None:
    """The :func:`model_identity` of the checkpoint the units' recovery paths read (None: no checkpoint, as for
    the MX and activation-quantisation backends, or one that cannot be read)."""
    for u in info:
        for m in u.dual:
            index = getattr(getattr(m, "_gnmr_source", None), "index", None)
            if index is not None:
                try:
                    return model_identity(index.source)
                except (OSError, ValueError):
                    return None
    return None
