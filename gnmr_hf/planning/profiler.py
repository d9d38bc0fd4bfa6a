"""``profile_sensitivity``: every criterion asked for, on the same prepared batches, into one profile."""

from __future__ import annotations

import warnings
from collections.abc import Iterable, Sequence
from typing import Any

from torch import nn

from gnmr_hf.planning.criteria import _RUNNERS, DEFAULT_CRITERION, _criteria, _reference
from gnmr_hf.planning.passes import _batch_digest, _device, _keep_modules, _prepare_batches, _set_path, _units
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
    from gnmr_hf.backends.base import active_units

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
    meta = {"model": type(base).__name__, "name_or_path": str(getattr(getattr(base, "config", None),
                                                                      "_name_or_path", "") or ""),
            "device": str(_device(model)), "batch_tokens": counts,
            "batch_digests": [_batch_digest(b) for b in prepared]}
    return SensitivityProfile(units=out_units, criteria=[n for n in names if n not in skipped], losses=losses,
                              costs=costs, batches=len(prepared), tokens=total, keep_modules=_keep_modules(model),
                              skipped=skipped, meta=meta)


