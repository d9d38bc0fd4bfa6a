"""``prepare_dual_path``: one public verb that picks the backend from the layers it finds.

Like PEFT's ``dispatch_*`` chain in ``peft/tuners/lora/``, each backend in :data:`BACKENDS` names the
layer classes it gives a recovery path; the first backend whose layers the model holds wins. Layers are
recognised by class name and defining package, so a plain model never imports bitsandbytes, and a
backend module is imported only when its layers are found.
"""

from __future__ import annotations

import importlib
import os
from collections import Counter
from dataclasses import dataclass
from typing import Any

from torch import nn

from gnmr_hf.units import record_spec


@dataclass(frozen=True)
class Backend:
    """One entry of the dispatch chain.

    Args:
        name: what the backend is, for messages (``"bitsandbytes INT8"``).
        module: the module defining ``prepare_dual_path(model, recovery_source, storage=..., **kwargs)``.
        package: the package that defines the layer classes (``"bitsandbytes"``).
        layers: the class names (in ``package``) the backend gives a recovery path.
    """

    name: str
    module: str
    package: str
    layers: tuple[str, ...]

    def matches(self, module: nn.Module) -> bool:
        """Whether ``module`` is (a subclass of) one of this backend's layer classes."""
        return any(c.__name__ in self.layers and c.__module__.split(".")[0] == self.package for c in type(module).__mro__)


# First match wins. The MX low path (backends/mx.py) has its own prepare_mx for plain models; a backend
# that converts quantised layers found in a loaded model goes into this list.
BACKENDS: tuple[Backend, ...] = (
    Backend("bitsandbytes INT8 (load_in_8bit)", "gnmr_hf.backends.bnb_int8", "bitsandbytes", ("Linear8bitLt",)),
    Backend("bitsandbytes 4-bit NF4/FP4 (load_in_4bit)", "gnmr_hf.backends.bnb_4bit", "bitsandbytes", ("Linear4bit",)),
)


def find_backend(model: nn.Module) -> Backend:
    """The first backend of :data:`BACKENDS` whose layers ``model`` holds.

    Raises:
        ValueError: no supported layer in the model; the message names the layer types found.
    """
    modules = list(model.modules())
    for backend in BACKENDS:
        if any(backend.matches(m) for m in modules):
            return backend
    found = Counter(type(m).__name__ for m in modules if isinstance(m, nn.Linear) or "Linear" in type(m).__name__)
    supported = "; ".join(f"{b.package}.{'/'.join(b.layers)} ({b.name})" for b in BACKENDS)
    raise ValueError(
        f"prepare_dual_path found no layer it can give a recovery path in {type(model).__name__}: its linear "
        f"layers are {dict(found) or 'none'}. Supported: {supported}. Load the model quantised, e.g. "
        "from_pretrained(path, quantization_config=BitsAndBytesConfig(load_in_4bit=True)), then call "
        "prepare_dual_path with the checkpoint it was loaded from."
    )


def prequantised(folder: str | os.PathLike) -> str | None:
    """What quantised the checkpoint in ``folder`` (or beside a ``.safetensors`` file) when its ``config.json``
    carries a ``quantization_config`` (e.g. ``"bitsandbytes nf4"``: a ``gnmr-hf export`` folder), else None (no
    such file, unreadable, or a plain checkpoint). A pre-quantised checkpoint holds packed low-bit weights,
    not the BF16 weights a recovery path reads, so it cannot be its own recovery source."""
    import json
    from pathlib import Path

    path = Path(folder).expanduser()
    config = (path if path.is_dir() else path.parent) / "config.json"
    try:
        q = json.loads(config.read_text()).get("quantization_config")
    except (OSError, ValueError, AttributeError):
        return None
    if not q:
        return None
    if not isinstance(q, dict):
        return "a quantization_config"
    kind = "nf4" if q.get("load_in_4bit") and q.get("bnb_4bit_quant_type", "fp4") == "nf4" else \
        "fp4" if q.get("load_in_4bit") else "int8" if q.get("load_in_8bit") else None
    return " ".join(x for x in (str(q.get("quant_method") or "quantised"), kind) if x)


PREQUANTISED = ("{source} is a pre-quantised model folder (its config.json has a quantization_config: {what}): its "
                "packed weights cannot be the BF16 recovery source; give the original BF16 model folder it was "
                "quantised from (for a gnmr-hf export folder, the --model that export read)")


def prepare_dual_path(
    model: nn.Module,
    recovery_source: str | os.PathLike,
    storage: str = "host",
    check_source: bool = True,
    **kwargs: Any,
) -> nn.Module:
    """Give every decoder layer of a quantised model a BF16 recovery path read from ``recovery_source``.

    The backend is chosen from the layers the model holds (first match wins): bitsandbytes
    ``Linear8bitLt`` (``BitsAndBytesConfig(load_in_8bit=True)``) goes to
    :mod:`gnmr_hf.backends.bnb_int8`, ``Linear4bit`` (``load_in_4bit=True``, NF4 or FP4, any
    ``bnb_4bit_compute_dtype``, with or without double quantisation) to :mod:`gnmr_hf.backends.bnb_4bit`.
    The usual flow, before PEFT (a PEFT-wrapped model is accepted too)::

        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                                         bnb_4bit_compute_dtype=torch.bfloat16),
            dtype=torch.bfloat16)
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
        model = peft.get_peft_model(model, LoraConfig(...))   # stock PEFT, no registration needed
        gnmr_hf.set_active_units(model, [3, 7])               # layers 3 and 7 on BF16, the others NF4

    Every layer starts on the low-cost path. PEFT's merge (``merge_adapter``/``merge_and_unload``) and
    DoRA are refused over the converted layers (merge the saved adapter on a stock base instead).

    Args:
        model: the quantised transformers model (optionally wrapped by PEFT or DDP); converted in place.
        recovery_source: the checkpoint the model was loaded from: a folder with ``*.safetensors``
            (sharded or not), a single ``.safetensors`` file, or a hub id whose snapshot is in the local
            cache (nothing is downloaded).
        storage: where the BF16 weights live between promotions: ``"host"`` (CPU memory, pinned with
            CUDA; copied to the device at promotion), ``"device"`` (always resident) or ``"disk"`` (read
            from the safetensors file at each promotion); see :mod:`gnmr_hf.backends.recovery`.
        check_source: before anything is converted, compare every layer's de-quantised low-cost weight
            with its recovery tensor and refuse a ``recovery_source`` the model was not loaded from (a
            relative error ``||W_low - W_rec|| / ||W_rec||`` above the low path's threshold: INT8
            ``bnb_int8.INT8_SOURCE_TOLERANCE``, NF4/FP4 ``bnb_4bit.NF4_SOURCE_TOLERANCE`` /
            ``FP4_SOURCE_TOLERANCE``; see docs/design.md). Costs one de-quantisation per layer, on the
            weights already in memory (``"disk"``: each tensor is read once). False skips it.
        **kwargs: ``units`` (which modules are the units: the decoder layers by default, ``"linears"``
            for every linear inside them, each its own unit; see :func:`gnmr_hf.units.resolve_units`;
            a string grain is recorded on the model, so the callback and ``set_active_units`` use the
            same units without being told), ``dtype`` (the dtype the recovery weights are kept
            and computed in, default ``torch.bfloat16``) and ``rungs`` (full linear name -> ``"bf16"`` or
            ``"int8"``: a layer whose recovery path is the INT8 rung, its checkpoint weight quantised row-wise
            by bitsandbytes and computed by ``Linear8bitLt``, resident; e.g. a precision-ladder plan's rungs;
            see :mod:`gnmr_hf.backends.recovery`).

    Returns:
        ``model``, converted in place.

    Raises:
        ValueError: the model holds no supported layer (the message names what it found); unknown
            ``storage`` or ``dtype``; a recovery tensor missing from the checkpoint or of the wrong
            shape (the message names it); a PEFT model with DoRA adapters; with ``check_source``, a
            checkpoint whose weights are not those the model was quantised from (the message names the
            first layer that differs, its relative error and the threshold).
        FileNotFoundError: ``recovery_source`` does not exist or has no safetensors files.
        ValueError: ``recovery_source`` is a pre-quantised folder (its ``config.json`` carries a
            ``quantization_config``, as a ``gnmr-hf export`` folder does): one line naming the folder to give.
    """
    backend = find_backend(model)
    what = prequantised(recovery_source)
    if what:
        raise ValueError(PREQUANTISED.format(source=f"recovery_source {str(recovery_source)!r}", what=what))
    prepare = importlib.import_module(backend.module).prepare_dual_path
    model = prepare(model, recovery_source=recovery_source, storage=storage, check_source=check_source, **kwargs)
    record_spec(model, kwargs.get("units"))  # units=None later (callback, set_active_units) means these units
    return model
