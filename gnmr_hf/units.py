"""Finding the units GNMR controls (by default: the decoder layers of a causal LM).

A *unit* is a module; its gradient norm is taken over all trainable parameters inside it, and its
recovery path covers every dual-path module inside it. Units are given as a list of
``(qualified_name, module)`` pairs, in the order that defines the unit indices.

Two granularities are built in: the decoder layers (the default, the paper's unit) and
``"linears"``, every linear layer inside the decoder layers in the model's module order (7 per LLaMA
layer: q, k, v, o, gate, up, down), each with its PEFT LoRA wrapper when there is one, so the unit's
gradient norm is its own LoRA's and its recovery path its own base weight. ``prepare_dual_path(...,
units="linears")`` records the choice on the model, and every later ``units=None`` (the callback,
``set_active_units``, ``active_units``) then means the same units.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

Unit = tuple[str, nn.Module]
UnitSpec = Union[None, str, Sequence[str], Callable[[nn.Module], Sequence[Unit]]]

LINEARS = "linears"
UNIT_GRAINS = ("layers", LINEARS)  # the built-in unit specifications given as a string
# attribute of the (unwrapped) model recording the unit grain prepare_dual_path was given
_RECORDED = "_gnmr_unit_spec"

# names a transformers causal LM gives its decoder-layer list (LLaMA/Mistral/Qwen: "layers", GPT-2: "h",
# OPT: "layers", Falcon: "h", GPT-NeoX: "layers", Bloom: "h", MPT: "blocks")
_LAYER_LIST_NAMES = ("layers", "h", "blocks", "block", "decoder_layers")


def unwrap_model(model: nn.Module) -> nn.Module:
    """The transformers model inside DDP / accelerate wrappers (``.module``) and PEFT
    (``get_base_model()``); ``model`` itself when it is not wrapped."""
    while isinstance(getattr(model, "module", None), nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _num_layers(model: nn.Module) -> int | None:
    config = getattr(model, "config", None)
    for attr in ("num_hidden_layers", "n_layer", "num_layers"):
        n = getattr(config, attr, None)
        if isinstance(n, int) and n > 0:
            return n
    return None


def find_decoder_layers(model: nn.Module) -> list[Unit]:
    """Return the decoder layers of ``model`` as ``(qualified_name, module)`` pairs.

    Works on a plain transformers model, a PEFT-wrapped one and a DDP-wrapped one: it looks for the
    ``nn.ModuleList`` that holds ``config.num_hidden_layers`` blocks. Raises ``ValueError`` if there
    is none (pass the units explicitly then).
    """
    n = _num_layers(model)
    if n is None:
        # PEFT and DDP keep the transformers model a few attributes down
        for attr in ("module", "base_model", "model"):
            inner = getattr(model, attr, None)
            if isinstance(inner, nn.Module) and _num_layers(inner) is not None:
                n = _num_layers(inner)
                break
    candidates: list[tuple[str, nn.ModuleList]] = []
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 0:
            if n is not None and len(module) != n:
                continue
            if name.rsplit(".", 1)[-1] in _LAYER_LIST_NAMES:
                candidates.append((name, module))
    if not candidates:
        raise ValueError(
            f"could not find the decoder layers of {type(model).__name__}: no nn.ModuleList named one of "
            f"{_LAYER_LIST_NAMES}" + (f" with {n} entries (config.num_hidden_layers)" if n else "")
            + ". Pass the units explicitly (a list of module names or a callable)."
        )
    # the outermost list wins (an encoder-decoder model would need explicit units)
    name, layers = candidates[0]
    return [(f"{name}.{i}", layer) for i, layer in enumerate(layers)]


def _is_linear(m: nn.Module) -> bool:
    return isinstance(m, nn.Linear)


def find_linear_units(model: nn.Module) -> list[Unit]:
    """Every linear layer inside the decoder layers, in module order, as ``(qualified_name, module)``.

    A linear wrapped by PEFT (a LoRA layer with ``get_base_layer()``) is one unit, the wrapper (so the
    unit holds the LoRA parameters and the base layer); PEFT's own ``lora_A``/``lora_B`` linears are not
    units. Names are those of ``model.named_modules()`` (e.g. ``base_model.model.model.layers.3.self_attn.v_proj``
    under PEFT); :func:`short_name` gives the readable ``layers.3.self_attn.v_proj``.
    """
    units: list[Unit] = []
    for layer_name, layer in find_decoder_layers(model):
        inside: list[str] = []  # wrappers already taken: their submodules are not units
        for sub, m in layer.named_modules():
            if any(sub.startswith(p + ".") for p in inside):
                continue
            base = m.get_base_layer() if hasattr(m, "get_base_layer") and m is not layer else None
            if base is not None and base is not m and _is_linear(base):
                inside.append(sub)
                units.append((f"{layer_name}.{sub}", m))
            elif _is_linear(m) and sub:
                units.append((f"{layer_name}.{sub}", m))
    if not units:
        found = sorted({type(m).__name__ for _, layer in find_decoder_layers(model) for m in layer.modules()
                        if not list(m.children())})
        raise ValueError(f"no linear layer inside the decoder layers of {type(model).__name__} (they hold "
                         f"{', '.join(found) or 'no leaf module'}): this layout needs explicit units")
    return units


def short_name(name: str) -> str:
    """A unit name without the wrappers' prefixes: ``base_model.model.model.layers.3.mlp`` -> ``layers.3.mlp``."""
    parts = name.split(".")
    for i, p in enumerate(parts):
        if p in _LAYER_LIST_NAMES and i + 1 < len(parts) and parts[i + 1].isdigit():
            return ".".join(parts[i:])
    return name


def recorded_spec(model: nn.Module) -> str | None:
    """The unit grain ``prepare_dual_path`` recorded on ``model`` (``None``: the decoder layers)."""
    return getattr(unwrap_model(model), _RECORDED, None)


def record_spec(model: nn.Module, units: UnitSpec) -> None:
    """Record a string unit grain on ``model`` so that ``units=None`` later means the same units."""
    base = unwrap_model(model)
    if isinstance(units, str):
        base.__dict__[_RECORDED] = units  # a plain attribute (not a module or parameter)
    elif units is None:
        base.__dict__.pop(_RECORDED, None)


def resolve_units(model: nn.Module, units: UnitSpec = None) -> list[Unit]:
    """Turn a unit specification into ``(qualified_name, module)`` pairs.

    Args:
        units: ``None`` for the grain recorded by ``prepare_dual_path(..., units=...)``, else the decoder
            layers (:func:`find_decoder_layers`); ``"layers"`` for the decoder layers; ``"linears"`` for
            every linear inside them (:func:`find_linear_units`); a sequence of module names (exact
            qualified names, or suffixes such as ``"model.layers.3.mlp"`` that match exactly one module of
            a PEFT-wrapped model); or a callable ``model -> [(name, module)]``.
    """
    if units is None:
        units = recorded_spec(model)
    if units is None or units == "layers":
        return find_decoder_layers(model)
    if units == LINEARS:
        return find_linear_units(model)
    if callable(units):
        resolved = list(units(model))
        if not resolved:
            raise ValueError("the units callable returned no units")
        return resolved
    if isinstance(units, str):
        raise ValueError(f"units: unknown grain {units!r}: give one of {UNIT_GRAINS}, a sequence of module names "
                         "or a callable")
    modules = dict(model.named_modules())
    resolved = []
    for spec in units:
        if spec in modules:
            resolved.append((spec, modules[spec]))
            continue
        matches = [n for n in modules if n.endswith("." + spec)]
        if len(matches) != 1:
            raise ValueError(
                f"unit {spec!r} matches {len(matches)} modules of the model"
                + (f" ({matches[:3]}...)" if matches else "")
                + "; give the exact qualified name"
            )
        resolved.append((matches[0], modules[matches[0]]))
    if not resolved:
        raise ValueError("units is empty")
    return resolved
