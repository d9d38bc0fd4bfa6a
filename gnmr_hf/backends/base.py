"""Backend-agnostic control of dual-path modules.

A *dual-path module* is any ``nn.Module`` that subclasses :class:`DualPathModule`: it runs a
low-cost path by default and a recovery path after ``set_recovery(True)``. Each backend (INT8 and
4-bit bitsandbytes layers with the checkpoint's BF16 weight in :mod:`gnmr_hf.backends.bnb_int8` and
:mod:`gnmr_hf.backends.bnb_4bit`, saved-activation quantisation in :mod:`gnmr_hf.backends.act_quant`)
lives in its own file; the functions here only find such modules inside the units and flip them, so
the callback drives every backend through the same calls. This module imports no backend.
"""

from __future__ import annotations

import abc
from collections.abc import Iterable, Iterator
from typing import Any

from torch import nn

from gnmr_hf.units import Unit, UnitSpec, resolve_units


class DualPathModule(metaclass=abc.ABCMeta):
    """Abstract mixin for modules with a low-cost and a recovery path (combined with an ``nn.Module``).

    Subclasses implement :meth:`set_recovery` and :meth:`recovery_device_bytes` and keep
    ``self.recovery`` (bool) true while the recovery path is selected. (``ABCMeta`` rather than
    ``abc.ABC``: the latter's empty ``__slots__`` would change the object layout of a subclass listing
    this mixin first, and backends convert existing modules in place with a ``__class__`` swap.)
    """

    recovery: bool = False

    @abc.abstractmethod
    def set_recovery(self, on: bool) -> None:
        """Select the recovery path (True) or the low-cost path (False) for the next forward."""

    @abc.abstractmethod
    def recovery_device_bytes(self) -> int:
        """Bytes of accelerator (or, on CPU, process) memory currently held for the recovery path."""


DORA_REFUSED = (
    "{name}: DoRA (LoraConfig(use_dora=True)) is not supported over a dual-path layer: PEFT's DoRA takes "
    "its weight norm (and, in training with LoRA dropout, its base output) from the quantised low-cost "
    "weight, so a layer on the recovery path would mix the original weight with a norm of the quantised "
    "one. Use plain LoRA (use_dora=False) with the dual path, or train DoRA on a model not prepared with "
    "prepare_dual_path."
)


def check_adapters(module: nn.Module, prefix: str = "") -> list[DualPathModule]:
    """The dual-path modules inside ``module``, refusing PEFT adapters that cannot run over them (DoRA).

    Called by :func:`set_active_units` and :func:`recoverable_units` (so before any layer is put on
    its recovery path, and when the callback sets up) and by ``prepare_dual_path``.

    Args:
        module: a unit (or a whole model).
        prefix: the module's qualified name, for the message.

    Raises:
        ValueError: a LoRA layer with a DoRA magnitude vector wraps a dual-path module.
    """
    found = []
    for m in module.modules():  # this runs at every step: per-type facts are looked up, not recomputed
        kind = _KINDS.get(type(m))
        if kind is None:
            # PEFT's tuner layers have get_base_layer (duck-typed, so this module needs no peft import)
            kind = _KINDS[type(m)] = 1 if issubclass(type(m), DualPathModule) else 2 if hasattr(m, "get_base_layer") else 0
        if kind == 1:
            found.append(m)
        # a LoRA layer's submodule `lora_magnitude_vector` holds one entry per DoRA adapter
        elif kind == 2 and m._modules.get("lora_magnitude_vector") and isinstance(m.get_base_layer(), DualPathModule):
            name = next(n for n, sub in module.named_modules() if sub is m)
            raise ValueError(DORA_REFUSED.format(name=".".join(p for p in (prefix, name) if p) or type(m).__name__))
    return found


# type -> 1 (a dual-path module), 2 (a PEFT tuner layer, which may hold DoRA), 0 (anything else)
_KINDS: dict[type, int] = {}


def dual_path_modules(module: nn.Module) -> Iterator[DualPathModule]:
    """Every dual-path module inside ``module`` (itself included)."""
    for m in module.modules():
        if isinstance(m, DualPathModule):
            yield m


def _check_indices(indices: Iterable[int], num_units: int) -> set[int]:
    out = set()
    for i in indices:
        if isinstance(i, bool) or not isinstance(i, int):
            try:
                i = int(i)  # numpy / 0-d tensor ints
            except (TypeError, ValueError):
                raise TypeError(f"unit index {i!r} is not an integer") from None
        if not 0 <= i < num_units:
            raise IndexError(f"unit index {i} is out of range for {num_units} units")
        out.add(i)
    return out


def set_active_units(model: nn.Module, indices: Iterable[int], units: UnitSpec | list[Unit] = None) -> None:
    """Put exactly the units in ``indices`` on the recovery path and all others on the low-cost path.

    Args:
        model: a model prepared with :func:`prepare_dual_path` (PEFT-wrapped or not).
        indices: unit indices (decoder-layer indices by default).
        units: the unit specification (see :func:`gnmr_hf.units.resolve_units`) or resolved units.
    """
    resolved = _resolve(model, units)
    wanted = _check_indices(indices, len(resolved))
    for b, (name, unit) in enumerate(resolved):
        mods = check_adapters(unit, name)
        if b in wanted and not mods:
            raise ValueError(f"unit {b} ({name}) has no recovery path (no dual-path module inside it)")
        for m in mods:
            if m.recovery != (b in wanted):
                m.set_recovery(b in wanted)


def active_units(model: nn.Module, units: UnitSpec | list[Unit] = None) -> list[int]:
    """Indices of the units currently on the recovery path.

    Args:
        model: a model holding dual-path modules (PEFT-wrapped or not).
        units: the unit specification (see :func:`gnmr_hf.units.resolve_units`) or resolved units.
    """
    return [b for b, (_, unit) in enumerate(_resolve(model, units)) if any(m.recovery for m in dual_path_modules(unit))]


def recoverable_units(model: nn.Module, units: UnitSpec | list[Unit] = None) -> list[bool]:
    """For each unit, whether it holds at least one dual-path module.

    Raises:
        ValueError: a unit holds an adapter that cannot run over a dual-path layer (see :func:`check_adapters`).
    """
    return [bool(check_adapters(unit, name)) for name, unit in _resolve(model, units)]


def recovery_device_bytes(model: nn.Module) -> int:
    """Device bytes held right now by recovery-path weights, summed over the whole model."""
    return sum(m.recovery_device_bytes() for m in dual_path_modules(model))


def _resolve(model: nn.Module, units: Any) -> list[Unit]:
    if isinstance(units, list) and units and isinstance(units[0], tuple):
        # resolved units of another model (say, one loaded again) would switch that model's layers and
        # leave this one untouched without a word
        own = {id(m) for m in model.modules()}
        stray = [name for name, unit in units if id(unit) not in own]
        if stray:
            raise ValueError(
                f"{len(stray)} of {len(units)} units given (first: {stray[0]!r}) are not modules of this model; "
                "resolve the units from the model itself (gnmr_hf.units.resolve_units(model))"
            )
        return units
    return resolve_units(model, units)
