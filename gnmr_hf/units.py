"""Finding the units GNMR controls (by default: the decoder layers of a causal LM).

A *unit* is a module; its gradient norm is taken over all trainable parameters inside it, and its
recovery path covers every dual-path module inside it. Units are given as a list of
``(qualified_name, module)`` pairs, in the order that defines the unit indices.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Union

from torch import nn

Unit = tuple[str, nn.Module]
UnitSpec = Union[None, Sequence[str], Callable[[nn.Module], Sequence[Unit]]]

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


def resolve_units(model: nn.Module, units: UnitSpec = None) -> list[Unit]:
    """Turn a unit specification into ``(qualified_name, module)`` pairs.

    Args:
        units: ``None`` for the decoder layers (:func:`find_decoder_layers`); a sequence of module
            names (exact qualified names, or suffixes such as ``"model.layers.3.mlp"`` that match
            exactly one module of a PEFT-wrapped model); or a callable ``model -> [(name, module)]``.
    """
    if units is None:
        return find_decoder_layers(model)
    if callable(units):
        resolved = list(units(model))
        if not resolved:
            raise ValueError("the units callable returned no units")
        return resolved
    if isinstance(units, str):
        raise TypeError("units must be a sequence of module names, not a single string")
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
