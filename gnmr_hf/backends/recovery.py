"""The checkpoint-weight recovery path shared by the bitsandbytes backends (INT8 and 4-bit).

A quantised linear layer (``Linear8bitLt``, ``Linear4bit``) keeps its quantised weight for the low-cost
path; its recovery path is ``F.linear(x, W, bias)`` with ``W`` the **original weight read from the
checkpoint's safetensors** (not a de-quantised copy). Everything about that weight is the same for
every such backend and lives here once:

- :class:`RecoveryWeight`: where the weight lives between promotions (``storage=``), the
  compute-device copy while promoted, and the byte accounting;
- :class:`CheckpointRecovery`: the mixin that turns an existing quantised layer into a dual-path
  layer in place (``module.__class__`` is swapped, so the quantised parameters and their state stay),
  with the switch, the recovery forward, the device moves and the refusal to have its weight rewritten;
- :func:`attach_recovery`: the plan (every layer of a type inside the units, its checkpoint key,
  checked before anything changes), the source check and the conversion.

The source check
----------------
A checkpoint of the same architecture but other weights (another model of the same size, another seed)
passes every name and shape check, and its "recovery" path would then run unrelated weights. The
low-cost weight is a witness of the checkpoint it was quantised from: before anything is converted,
every planned layer's de-quantised low-cost weight ``W_low`` is compared with the recovery tensor
``W_rec`` (the copy about to be stored; for ``storage="disk"`` each tensor is read once for the check),
and ``prepare_dual_path`` raises ``ValueError`` at the first layer where
``||W_low - W_rec|| / ||W_rec||`` (Frobenius norms, float32) exceeds its low path's threshold
(``source_tolerances`` of the backend class: INT8 0.1, NF4 and FP4 0.4; measured figures in
docs/design.md). The checkpoint the model was loaded from gives about 0.01 (INT8) and 0.1 (NF4, FP4);
weights unrelated to the low-cost ones give at least 1 (about 1.4 for weights of equal norms). A
checkpoint near the loaded one is not detected: a difference of up to about 0.42 x ||W|| on NF4 (4.6x
its own error) and 0.10 x ||W|| on INT8 passes (docs/design.md, the measured margin). ``check_source=False`` skips the check.

Storage of the recovery weights (``storage=``):

- ``"host"``: kept in CPU memory (pinned when CUDA is available); promotion copies it to the
  layer's device (on a side CUDA stream, non-blocking; the forward waits on the copy's event) and
  demotion frees the copy. On a CPU-only machine the copy is a real CPU copy, so timings and the
  byte count model the accelerator case.
- ``"device"``: always resident on the layer's device (fastest switch, no memory saving).
- ``"disk"``: read from the safetensors file at each promotion, freed on demotion.

The recovery weights are plain attributes, neither parameters nor buffers, so they never reach
``state_dict``, the optimizer or DDP's buffer broadcast, and the adapter PEFT saves is a stock adapter.

Paths change between optimizer steps only (the callback's job). Under gradient checkpointing the
backward recomputes the forward with the path of that moment, so a switch between a step's forward
and its backward would make the recomputation differ (non-reentrant checkpointing then raises).
"""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf.backends.base import DORA_REFUSED, DualPathModule
from gnmr_hf.backends.checkpoint import FLOAT_DTYPES, CheckpointIndex, canonical_name, find_key
from gnmr_hf.rungs import planned_rungs
from gnmr_hf.rungs.int8 import int8_linear  # noqa: F401  (the INT8 rung's module; re-exported)
from gnmr_hf.units import UnitSpec, resolve_units, unwrap_model

#: the stock rungs a quantised linear may be kept on, cheapest first: INT8 (the checkpoint weight quantised row-wise
#: by bitsandbytes) or its checkpoint weight in BF16 (or the recovery dtype); the precision ladder plans over the
#: registry's (:func:`gnmr_hf.rungs.planned_rungs`, these and any a user registers)
RUNGS = planned_rungs()
#: the rungs the dual path's recovery weights hold (:class:`Int8RecoveryWeight`, :class:`RecoveryWeight`)
DUAL_PATH_RUNGS = ("int8", "bf16")


LADDER_SERVING = ("no bitsandbytes checkpoint mixes 4- and 8-bit linears: export it as compressed-tensors "
                  "(gnmr-hf export --format compressed-tensors: INT4 / INT8 / BF16 per linear), serve it with "
                  "gnmr_hf.load_planned(model_path, profile.json), or merge the adapter into the BF16 base (--merge)")


def check_rungs(rungs: dict[str, str]) -> None:
    """Raise ``ValueError`` naming every entry of ``rungs`` (linear name -> rung) that is not a registered planned
    rung (:func:`gnmr_hf.rungs.planned_rungs`)."""
    known = planned_rungs()
    bad = {n: r for n, r in rungs.items() if r not in known}
    if bad:
        raise ValueError(f"unknown rung(s) {bad}: each is one of {known}")


def _dual_path_rungs(rungs: dict[str, str] | None) -> dict[str, str]:
    """``rungs`` as a dict, each a rung the dual path's recovery weights hold (:data:`DUAL_PATH_RUNGS`)."""
    rungs = dict(rungs or {})
    check_rungs(rungs)
    other = {n: r for n, r in rungs.items() if r not in DUAL_PATH_RUNGS}
    if other:
        raise ValueError(f"rung(s) {other} have no recovery path: the dual path recovers on "
                         f"{' or '.join(DUAL_PATH_RUNGS)} (gnmr_hf.load_planned loads a plan with any registered rung)")
    return rungs


STORAGES = ("host", "device", "disk")

MERGE_REFUSED = (
    "{key}: the base weight of a dual-path layer cannot be replaced. PEFT's merge_adapter() / "
    "merge_and_unload() would fold the LoRA delta into the quantised low-cost weight only, and a layer on "
    "the recovery path would then run the checkpoint's original weight without the LoRA delta. Merge on a "
    "stock base model instead (save the adapter with model.save_pretrained(adapter_dir) first):\n"
    "    model = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base_path, dtype=torch.bfloat16), "
    "adapter_dir)\n"
    "    merged = model.merge_and_unload()"
)

# one side stream per CUDA device for promotion copies, so they overlap the compute stream
_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device) -> Any:
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


class RecoveryWeight:
    """One recovery tensor of the checkpoint, shared by every dual-path module that maps to it.

    Holds the host copy (``"host"``), the resident copy (``"device"``) or nothing (``"disk"``), and the
    compute-device copy while at least one module holding it is promoted. Tied weights (two modules,
    one checkpoint tensor) are therefore stored and counted once.

    Args:
        index: the checkpoint.
        key: the tensor's name in the checkpoint.
        storage: ``"host"``, ``"device"`` or ``"disk"``.
        dtype: the dtype the weight is kept and computed in.
    """

    def __init__(self, index: CheckpointIndex, key: str, storage: str, dtype: torch.dtype):
        self.index = index
        self.key = key
        self.storage = storage
        self.dtype = dtype
        self.stored: torch.Tensor | None = None  # host copy ("host") or resident copy ("device")
        self.live: torch.Tensor | None = None  # compute-device copy while promoted ("host", "disk")
        self.ready: Any = None  # CUDA event the compute stream waits on before using `live`
        self.holders: list[nn.Module] = []  # modules currently promoted with this tensor
        self.owners: list[nn.Module] = []  # every module mapped to this tensor

    def acquire(self, module: nn.Module, device: torch.device) -> tuple[torch.Tensor, Any]:
        """The weight on ``device`` for ``module`` (copied there if needed) and the event to wait on."""
        if module not in self.holders:
            self.holders.append(module)
        if self.storage == "device":
            return self.stored, None
        if self.live is None or self.live.device != device:
            src = self.stored if self.storage == "host" else self.index.read(self.key, self.dtype)
            if device.type == "cuda":
                stream = _copy_stream(device)
                with torch.cuda.stream(stream):
                    self.live = src.to(device, non_blocking=True)
                    self.ready = torch.cuda.Event()
                    self.ready.record(stream)
            else:
                # a real copy on CPU too, so device bytes and switch times model the accelerator case
                self.live = src.to(device, copy=True) if self.storage == "host" else src
                self.ready = None
        return self.live, self.ready

    def release(self, module: nn.Module) -> None:
        """``module`` no longer uses the device copy; the last holder frees it."""
        if module in self.holders:
            self.holders.remove(module)
        if not self.holders:
            self.live = None
            self.ready = None

    rung = "bf16"

    def weight_bytes(self, module: nn.Module) -> int:
        """What ``module``'s recovery weight holds while promoted: its checkpoint weight in the kept dtype."""
        return module.out_features * module.in_features * torch.finfo(self.dtype).bits // 8

    def device_bytes(self, module: nn.Module) -> int:
        """Device bytes of this tensor, counted by one module only (so tied weights count once)."""
        if self.storage == "device":
            return self.stored.numel() * self.stored.element_size() if self.owners[0] is module else 0
        if self.live is not None and self.holders and self.holders[0] is module:
            return self.live.numel() * self.live.element_size()
        return 0


class Int8RecoveryWeight:
    """The INT8 rung of a recovery path: the checkpoint weight quantised row-wise by bitsandbytes
    (:func:`int8_linear`), resident on the layer's device (its price is what it holds: ``n`` int8 weights and
    one FP32 scale per output row, what ``Linear8bitLt`` stores), computed as ``Linear8bitLt`` computes it.
    Same interface as :class:`RecoveryWeight`; ``storage`` is always ``"device"``."""

    storage = "device"
    dtype = torch.int8
    rung = "int8"
    stored = None  # no floating-point copy: the rung holds only what Linear8bitLt holds

    def __init__(self, key: str, weight: torch.Tensor, threshold: float = 6.0):
        self.key = key
        self.module = int8_linear(weight, threshold)
        w = self.module.weight  # int8 weights and one FP32 scale a row (the first forward moves both into
        self._bytes = w.numel() * w.element_size() + w.SCB.numel() * w.SCB.element_size()  # module.state)
        self.holders: list[nn.Module] = []
        self.owners: list[nn.Module] = []

    def acquire(self, module: nn.Module, device: torch.device) -> tuple[nn.Module, Any]:
        if module not in self.holders:
            self.holders.append(module)
        if self.module.weight.device != device:
            self.module = self.module.to(device)
        return self.module, None

    def release(self, module: nn.Module) -> None:
        if module in self.holders:
            self.holders.remove(module)

    def stored_bytes(self) -> int:
        return self._bytes

    def device_bytes(self, module: nn.Module) -> int:
        return self.stored_bytes() if self.owners and self.owners[0] is module else 0

    def weight_bytes(self, module: nn.Module) -> int:
        """What this rung holds for ``module`` while promoted (and, resident, always)."""
        return self.stored_bytes()


class CheckpointRecovery(DualPathModule):
    """Mixin for a quantised linear layer whose recovery path runs on the checkpoint's original weight.

    A backend declares ``class DualPathX(CheckpointRecovery, X)`` for a bitsandbytes layer class ``X``;
    :func:`attach_recovery` converts existing ``X`` modules in place. ``recovery`` False: the stock
    ``X`` forward. ``recovery`` True: ``F.linear(x, W, bias)`` with the module's own bias (so a bias
    trained by PEFT's ``bias="all"`` is the same on both paths). Because the class still subclasses
    ``X``, PEFT's own dispatcher wraps it with PEFT's stock LoRA layer for ``X``. The base weights stay
    frozen; gradients flow to the input (and so to LoRA) on both paths.
    """

    _gnmr_source: RecoveryWeight
    _gnmr_weight: torch.Tensor | None
    _gnmr_ready: Any

    #: low path name -> the largest relative error ``||W_low - W_rec|| / ||W_rec||`` accepted by the source
    #: check (set by each backend; a low path missing here is not checked)
    source_tolerances: dict[str, float] = {}

    @classmethod
    def check_convertible(cls, module: nn.Module, name: str) -> None:
        """Raise ``ValueError`` if ``module`` cannot be converted (a backend's own conditions; run for every
        planned module before any is converted)."""

    @classmethod
    def low_weight(cls, module: nn.Module) -> tuple[str, torch.Tensor | None]:
        """The low path's name (a key of :attr:`source_tolerances`) and ``module``'s low-cost weight,
        de-quantised (on the weight's device), for the source check; ``None`` when it cannot be read
        (then the layer is not checked)."""
        return type(module).__name__, None

    @classmethod
    def convert(cls, module: nn.Module, source: RecoveryWeight) -> nn.Module:
        """Turn ``module`` into a dual-path module in place (returns the same object)."""
        if isinstance(module, CheckpointRecovery):  # prepared before: drop the old recovery weight
            module.set_recovery(False)
            if module in module._gnmr_source.owners:
                module._gnmr_source.owners.remove(module)
        module.__class__ = cls
        module._gnmr_source = source
        module._gnmr_weight = None
        module._gnmr_ready = None
        module.recovery = False
        source.owners.append(module)
        return module

    def set_recovery(self, on: bool) -> None:
        """Select the recovery path (True) or the low-cost quantised path (False) for the next forward."""
        on = bool(on)
        if on == self.recovery:
            return
        if on:
            self._gnmr_weight, self._gnmr_ready = self._gnmr_source.acquire(self, self.weight.device)
        else:
            self._gnmr_source.release(self)
            self._gnmr_weight = None
            self._gnmr_ready = None
        self.recovery = on

    def recovery_device_bytes(self) -> int:
        """Bytes held on this layer's compute device for its recovery weight right now."""
        return self._gnmr_source.device_bytes(self)

    @property
    def recovery_key(self) -> str:
        """Name of the checkpoint tensor the recovery path uses."""
        return self._gnmr_source.key

    def forward(self, x: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        if not self.recovery:
            return super().forward(x, *args, **kwargs)
        w = self._gnmr_weight
        if isinstance(w, nn.Module):  # the INT8 rung: bitsandbytes' Linear8bitLt over the checkpoint weight
            out = w(x)
            return out if self.bias is None else out + self.bias.to(out.dtype)
        if self._gnmr_ready is not None:
            # the promotion copy ran on the side stream: order the compute stream after it, and tell
            # the caching allocator the compute stream uses the block, so freeing it on demotion waits
            stream = torch.cuda.current_stream(w.device)
            stream.wait_event(self._gnmr_ready)
            w.record_stream(stream)
            self._gnmr_ready = None
        bias = self.bias
        if torch.is_autocast_enabled(x.device.type) or x.dtype == w.dtype:
            if bias is not None and bias.dtype != w.dtype and not torch.is_autocast_enabled(x.device.type):
                bias = bias.to(w.dtype)
            return F.linear(x, w, bias)
        # like the bitsandbytes layers, the output has the input's dtype; the product itself is in the
        # weight's dtype, as in the unquantised model
        out = F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype))
        return out.to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        device = self.weight.device
        src = self._gnmr_source
        # recovery weights are plain attributes (kept out of state_dict/DDP): follow the module's device
        if isinstance(src, Int8RecoveryWeight):
            if src.module.weight.device != device:
                src.module = src.module.to(device)
        elif src.storage == "device" and src.stored is not None and src.stored.device != device:
            src.stored = src.stored.to(device)
        if self.recovery and self._gnmr_weight is not None and self._gnmr_weight.device != device:
            src.release(self)
            self.recovery = False
            self.set_recovery(True)
        return out

    def __setattr__(self, name: str, value: Any) -> None:
        if name == "_gnmr_weight":
            # a plain attribute, never a registered child: the INT8 rung's Linear8bitLt would otherwise join
            # the model's modules and state_dict while promoted (and be taken for a quantised layer itself)
            self._modules.pop(name, None)
            object.__setattr__(self, name, value)
            return
        # PEFT's merge (and unmerge) writes a new quantised weight into the base layer: refused, since the
        # recovery path would keep the original weight without the LoRA delta. A parameter over the same
        # storage (PEFT's dequantize_module_weight re-assigns `weight.to(device)` on CPU) changes nothing.
        # FSDP2 swaps the weight between its DTensor shard and the all-gathered parameter at every unshard/reshard
        if (name == "weight" and "_gnmr_source" in self.__dict__ and not _same_tensor(value, self._parameters.get("weight"))
                and not _fsdp_swap(value, self._parameters.get("weight"))):
            raise ValueError(MERGE_REFUSED.format(key=self._gnmr_source.key))
        super().__setattr__(name, value)

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, recovery={self.recovery}, rung={self._gnmr_source.rung}, "
            f"storage={self._gnmr_source.storage}, recovery_key={self._gnmr_source.key!r}"
        )


def _fsdp_swap(a: Any, b: Any) -> bool:
    """Whether assigning ``a`` over ``b`` is FSDP2 swapping a weight between its ``DTensor`` shard and its
    all-gathered parameter (one side a ``DTensor``, the other a tensor of the same global shape and dtype)."""
    if not (torch.distributed.is_available() and isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor)):
        return False
    from torch.distributed.tensor import DTensor

    return isinstance(a, DTensor) != isinstance(b, DTensor) and a.shape == b.shape and a.dtype == b.dtype


def _same_tensor(a: Any, b: Any) -> bool:
    if a is b:
        return True
    return (
        isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.device == b.device
        and a.dtype == b.dtype and a.shape == b.shape and a.data_ptr() == b.data_ptr()
    )


def attach_recovery(
    model: nn.Module,
    recovery_source: str | os.PathLike,
    dual_type: type[CheckpointRecovery],
    load_hint: str,
    storage: str = "host",
    units: UnitSpec = None,
    dtype: torch.dtype = torch.bfloat16,
    check_source: bool = True,
    rungs: dict[str, str] | None = None,
    int8_threshold: float = 6.0,
) -> nn.Module:
    """Convert every module of ``dual_type``'s quantised layer class inside the units into ``dual_type``,
    reading its weight from ``recovery_source``. Every check runs before any module is changed.

    Args:
        model: the quantised model (optionally wrapped by PEFT or DDP); converted in place and returned.
        recovery_source: see :class:`~gnmr_hf.backends.checkpoint.CheckpointIndex`.
        dual_type: the dual-path class, ``class DualPathX(CheckpointRecovery, X)``; every ``X`` is converted.
        load_hint: how to load the model so that it holds ``X`` layers (for the error message).
        storage: ``"host"``, ``"device"`` or ``"disk"`` (see the module docstring).
        units: which modules are the units (default: the decoder layers).
        dtype: the floating-point dtype the recovery weights are kept and computed in.
        check_source: compare every layer's de-quantised low-cost weight with its recovery tensor and
            refuse a checkpoint the model was not loaded from (see the module docstring); False skips it.
        rungs: full linear name -> ``"bf16"`` (every layer's default) or ``"int8"`` (its recovery path the INT8
            rung, :class:`Int8RecoveryWeight`, resident whatever ``storage`` says): a precision-ladder plan's.
        int8_threshold: ``Linear8bitLt``'s outlier threshold for the INT8 rungs (transformers' default 6.0).

    Raises:
        ValueError: unknown ``storage`` or ``dtype``; no ``X`` in the model or in the units; a recovery
            tensor missing from the checkpoint, of the wrong shape or not floating point; a PEFT DoRA
            adapter over one of the layers; a recovery tensor too far from the layer's low-cost weight
            (``check_source``; the message names the first such layer, the error and the threshold).
        FileNotFoundError: ``recovery_source`` does not exist or has no safetensors files.
    """
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
        raise ValueError(f"dtype must be a floating-point torch.dtype (e.g. torch.bfloat16), got {dtype!r}")
    # the quantised layer class the dual-path class extends (DualPathX(CheckpointRecovery, X) -> X)
    layer_type = next(c for c in dual_type.__mro__ if issubclass(c, nn.Module) and not issubclass(c, DualPathModule))
    if not any(isinstance(m, layer_type) for m in model.modules()):
        found = sorted({type(m).__name__ for m in model.modules() if isinstance(m, nn.Linear)})
        raise ValueError(
            f"the model holds no bitsandbytes {layer_type.__name__} (its linear layers: {found}): load it with "
            f"{load_hint} before prepare_dual_path"
        )
    base = unwrap_model(model)
    index = CheckpointIndex(recovery_source)
    names = {id(m): canonical_name(n) for n, m in base.named_modules()}

    plan: list[tuple[nn.Module, str, str]] = []  # (module, its name, its checkpoint key)
    seen: set[int] = set()
    for unit_name, unit in resolve_units(model, units):
        for sub_name, m in unit.named_modules():
            if not isinstance(m, layer_type) or id(m) in seen:
                continue
            seen.add(id(m))
            name = names.get(id(m)) or canonical_name(f"{unit_name}.{sub_name}")
            dual_type.check_convertible(m, name)
            plan.append((m, name, _checked_key(index, name, base, m)))
    if not plan:
        raise ValueError(
            f"no bitsandbytes {layer_type.__name__} module inside the units: nothing to give a recovery path "
            "(were the decoder layers skipped by llm_int8_skip_modules?)"
        )
    rungs = _dual_path_rungs(rungs)
    unknown = sorted(set(rungs) - {name for _, name, _ in plan})
    if unknown:
        raise ValueError(f"{len(unknown)} rung name(s) are not quantised linears inside the units, e.g. {unknown[0]!r}")
    int8_keys = {key for _, name, key in plan if rungs.get(name) == "int8"}
    planned = {id(m) for m, _, _ in plan}
    for name, m in model.named_modules():  # a model wrapped by PEFT before prepare: DoRA cannot run over it
        if getattr(m, "lora_magnitude_vector", None) and id(m.get_base_layer()) in planned:
            raise ValueError(DORA_REFUSED.format(name=name))

    sources: dict[str, RecoveryWeight | Int8RecoveryWeight] = {}
    for _m, _name, key in plan:
        if key not in sources:
            sources[key] = RecoveryWeight(index, key, storage, dtype)
    tensors = index.read_many(sources, dtype) if storage != "disk" else index.read_many(int8_keys, dtype)
    if check_source:
        check_recovery_source(plan, index, dual_type, tensors)
    devices = {key: m.weight.device for m, _, key in plan}
    for key in int8_keys:  # the INT8 rungs: quantised once from the checkpoint weight, resident
        sources[key] = Int8RecoveryWeight(key, tensors.pop(key).to(devices[key]), int8_threshold)
    if storage != "disk":
        pin = storage == "host" and torch.cuda.is_available()
        for key, src in sources.items():
            if key in int8_keys:
                continue
            t = tensors.pop(key)
            if storage == "host":
                src.stored = t.pin_memory() if pin else t
            else:
                src.stored = t.to(devices[key])
    for m, _name, key in plan:
        dual_type.convert(m, sources[key])
    return model


SOURCE_MISMATCH = (
    "recovery_source {source!r} does not match the model: the recovery tensor {key!r} of {name} differs "
    "from the layer's {low} low-cost weight by a relative error ||W_low - W_rec|| / ||W_rec|| = {error:.3g}, "
    "above the {low} threshold {tolerance:g} (the checkpoint the model was loaded from gives about 0.01 on "
    "INT8 and 0.1 on NF4/FP4, other weights of the same shapes 1 or more). Pass the checkpoint the model was "
    "loaded from, or check_source=False to skip this check."
)


def relative_error(low: torch.Tensor, rec: torch.Tensor) -> float:
    """``||low - rec|| / ||rec||`` (Frobenius norms, float32, on ``low``'s device): 0 when both are zero,
    ``inf`` when only ``rec`` is."""
    low = low.to(torch.float32)
    rec = rec.to(low.device, torch.float32)
    ref = torch.linalg.vector_norm(rec).item()
    diff = torch.linalg.vector_norm(low - rec).item()
    if ref == 0.0:
        return 0.0 if diff == 0.0 else float("inf")
    return diff / ref


def source_errors(
    plan: list[tuple[nn.Module, str, str]],
    index: CheckpointIndex,
    dual_type: type[CheckpointRecovery],
    tensors: dict[str, torch.Tensor] | None = None,
) -> Any:
    """Yield ``(name, key, low path, relative error)`` for every planned layer whose low-cost weight can be
    read, in plan order. Tensors missing from ``tensors`` are read from the checkpoint once each, one
    key at a time (so a ``"disk"`` preparation never holds the whole model in memory)."""
    tensors = tensors or {}
    by_key: dict[str, list[tuple[nn.Module, str]]] = {}
    for m, name, key in plan:
        by_key.setdefault(key, []).append((m, name))
    for key, mods in by_key.items():
        rec = tensors.get(key)
        for m, name in mods:
            low_path, low = dual_type.low_weight(m)
            if low is None:
                continue
            if rec is None:
                rec = index.read(key, torch.float32)
            yield name, key, low_path, relative_error(low, rec)
            del low


def check_recovery_source(
    plan: list[tuple[nn.Module, str, str]],
    index: CheckpointIndex,
    dual_type: type[CheckpointRecovery],
    tensors: dict[str, torch.Tensor] | None = None,
) -> None:
    """Raise ``ValueError`` (:data:`SOURCE_MISMATCH`) at the first planned layer whose relative error
    exceeds its low path's threshold in ``dual_type.source_tolerances`` (a NaN error is refused too)."""
    for name, key, low_path, error in source_errors(plan, index, dual_type, tensors):
        tolerance = dual_type.source_tolerances.get(low_path)
        if tolerance is not None and not error <= tolerance:
            raise ValueError(
                SOURCE_MISMATCH.format(
                    source=index.source, key=key, name=name, low=low_path.upper(), error=error, tolerance=tolerance
                )
            )


def _checked_key(index: CheckpointIndex, name: str, base: nn.Module, m: nn.Module) -> str:
    key = find_key(index, name, base)
    if key is None:
        raise ValueError(
            f"recovery_source {index.source!r} has no tensor for {name}.weight "
            f"(the checkpoint does not match the model; {len(index.file_of)} tensors, e.g. "
            f"{sorted(index.file_of)[:3]})"
        )
    want = (m.out_features, m.in_features)
    if index.shape_of[key] != want:
        raise ValueError(
            f"recovery tensor {key!r} in {index.source!r} has shape {list(index.shape_of[key])}, but "
            f"{name} needs {list(want)} (the checkpoint does not match the model)"
        )
    if index.dtype_of[key] not in FLOAT_DTYPES:
        raise ValueError(
            f"recovery tensor {key!r} in {index.source!r} is stored as {index.dtype_of[key]}, "
            "not a floating-point dtype: the recovery path needs the original unquantised weights"
        )
    bias_key = key[: -len("weight")] + "bias"
    if m.bias is not None and bias_key in index and index.shape_of[bias_key] != (m.out_features,):
        raise ValueError(
            f"recovery tensor {bias_key!r} has shape {list(index.shape_of[bias_key])}, but {name} "
            f"has a bias of shape {[m.out_features]}"
        )
    return key
