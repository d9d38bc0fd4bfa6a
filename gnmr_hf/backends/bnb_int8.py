"""INT8 low-cost path / BF16 recovery path for bitsandbytes ``Linear8bitLt`` layers.

The low-cost path is the stock bitsandbytes LLM.int8() forward of the ``Linear8bitLt`` that
``from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True))`` created. The
recovery path is ``F.linear(x, W, bias)`` with ``W`` the **original BF16 weight read from the
checkpoint's safetensors** (not a de-quantised INT8 copy).

How it plugs into PEFT
----------------------
:func:`prepare_dual_path` turns each ``Linear8bitLt`` inside the decoder layers into a
:class:`DualPathLinear8bitLt` *in place* (``module.__class__`` is swapped, so the already-quantised
``Int8Params``, the bias and bnb's ``MatmulLtState`` stay as they are). Because the new class is a
subclass of ``bnb.nn.Linear8bitLt``, PEFT's own dispatcher (``peft.tuners.lora.bnb.dispatch_bnb_8bit``,
an ``isinstance`` check) wraps it with PEFT's stock LoRA ``Linear8bitLt``: plain
``peft.get_peft_model(model, LoraConfig(...))`` works with no registration, LoRA's forward is
``base_layer(x) + lora_B(lora_A(dropout(x))) * scaling`` on either path, and the saved adapter is a
stock PEFT adapter (the recovery weights are plain attributes, neither parameters nor buffers, so they
never reach ``state_dict``, the optimizer or DDP's buffer broadcast). ``LoraConfig._register_custom_module``
is therefore not needed (and would only replace PEFT's tested bnb LoRA layer by a copy of it).

What PEFT reads from the base layer and why it is safe: ``in_features``/``out_features``, ``state``
and ``index`` (dispatch), ``weight.device``/``dtype`` (to place the adapter; the ``Int8Params`` are
unchanged). Not supported on a dual-path layer: ``merge_adapter``/``merge_and_unload`` (they rewrite
the INT8 weight only; merge on a stock base instead) and DoRA (its weight norm is taken from the
de-quantised INT8 weight).

Storage of the recovery weights (``storage=``):

- ``"host"``: BF16 kept in CPU memory (pinned when CUDA is available); promotion copies it to the
  layer's device (on a side CUDA stream, non-blocking; the forward waits on the copy's event) and
  demotion frees the copy. On a CPU-only machine the copy is a real CPU copy, so timings and the
  byte count model the accelerator case.
- ``"device"``: BF16 always resident on the layer's device (fastest switch, no memory saving).
- ``"disk"``: read from the safetensors file (``safe_open``) at each promotion, freed on demotion.

Paths change between optimizer steps only (the callback's job). Under gradient checkpointing the
backward recomputes the forward with the path of that moment, so a switch between a step's forward
and its backward would make the recomputation differ (non-reentrant checkpointing then raises).
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from gnmr_hf._import_utils import require
from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.units import UnitSpec, resolve_units

require("bitsandbytes", "The INT8/BF16 dual path")
require("safetensors", "The INT8/BF16 dual path")

import bitsandbytes as bnb  # noqa: E402
from safetensors import safe_open  # noqa: E402

STORAGES = ("host", "device", "disk")

_SAFETENSORS_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}

# one side stream per CUDA device for promotion copies, so they overlap the compute stream
_COPY_STREAMS: dict[torch.device, Any] = {}


def _copy_stream(device: torch.device):
    stream = _COPY_STREAMS.get(device)
    if stream is None:
        stream = _COPY_STREAMS[device] = torch.cuda.Stream(device=device)
    return stream


class CheckpointIndex:
    """Names, shapes and files of the tensors of a safetensors checkpoint (headers only, no data read).

    Args:
        source: a checkpoint folder, a single ``.safetensors`` file, or a hub id whose snapshot is
            already in the local Hugging Face cache (nothing is downloaded).
    """

    def __init__(self, source: str | os.PathLike):
        self.source = str(source)
        self.files = _safetensors_files(_resolve_source(source))
        self.file_of: dict[str, str] = {}
        self.shape_of: dict[str, tuple[int, ...]] = {}
        self.dtype_of: dict[str, str] = {}
        for path in self.files:
            with safe_open(path, framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    self.file_of[key] = path
                    self.shape_of[key] = tuple(sl.get_shape())
                    self.dtype_of[key] = sl.get_dtype()

    def __contains__(self, key: str) -> bool:
        return key in self.file_of

    def read(self, key: str, dtype: torch.dtype) -> torch.Tensor:
        """Read one tensor into (pageable) CPU memory, cast to ``dtype``."""
        with safe_open(self.file_of[key], framework="pt", device="cpu") as f:
            # copy=True: get_tensor may return a view of the memory-mapped file, which would leave the
            # bytes in the page cache instead of process memory
            return f.get_tensor(key).to(dtype, copy=True)

    def read_many(self, keys: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read several tensors, opening each file once."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.file_of[k], []).append(k)
        out = {}
        for path, ks in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for k in ks:
                    out[k] = f.get_tensor(k).to(dtype, copy=True)
        return out


def _resolve_source(source: str | os.PathLike) -> Path:
    path = Path(source).expanduser()
    if path.exists():
        return path
    text = str(source)
    # "org/name" (or "name") that is not a local path: a hub id, resolved from the local cache only
    if text.count("/") <= 1 and not text.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download
            from huggingface_hub.errors import LocalEntryNotFoundError
        except ImportError:  # pragma: no cover - huggingface_hub comes with transformers
            raise FileNotFoundError(f"recovery_source {text!r} is not a local path") from None
        try:
            return Path(
                snapshot_download(
                    text, local_files_only=True, allow_patterns=["*.safetensors", "*.safetensors.index.json"]
                )
            )
        except (LocalEntryNotFoundError, ValueError, OSError) as e:
            raise FileNotFoundError(
                f"recovery_source {text!r} is neither a local checkpoint folder nor a hub id with a snapshot "
                f"in the local Hugging Face cache (nothing is downloaded; run `huggingface-cli download {text}` "
                f"first or pass the folder): {e}"
            ) from None
    raise FileNotFoundError(f"recovery_source {text!r} does not exist")


def _safetensors_files(path: Path) -> list[str]:
    if path.is_file():
        if path.suffix != ".safetensors":
            raise ValueError(f"recovery_source {str(path)!r} is not a .safetensors file")
        return [str(path)]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted({str(path / f) for f in weight_map.values()})
    else:
        files = sorted(str(p) for p in path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(
            f"recovery_source {str(path)!r} holds no .safetensors files: the recovery path needs the "
            "checkpoint's original weights in safetensors format"
        )
    return files


class _RecoveryWeight:
    """One recovery tensor of the checkpoint, shared by every dual-path module that maps to it.

    Holds the host copy ("host"), the resident copy ("device") or nothing ("disk"), and the
    compute-device copy while at least one module holding it is promoted. Tied weights (two modules,
    one checkpoint tensor) are therefore stored and counted once.
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

    def nbytes(self) -> int:
        shape = self.index.shape_of[self.key]
        n = 1
        for s in shape:
            n *= s
        return n * torch.empty((), dtype=self.dtype).element_size()

    def acquire(self, module: nn.Module, device: torch.device) -> tuple[torch.Tensor, Any]:
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
        if module in self.holders:
            self.holders.remove(module)
        if not self.holders:
            self.live = None
            self.ready = None

    def device_bytes(self, module: nn.Module) -> int:
        # counted by one module only, so tied weights are counted once
        if self.storage == "device":
            return self.stored.numel() * self.stored.element_size() if self.owners[0] is module else 0
        if self.live is not None and self.holders and self.holders[0] is module:
            return self.live.numel() * self.live.element_size()
        return 0


class DualPathLinear8bitLt(bnb.nn.Linear8bitLt, DualPathModule):
    """A bitsandbytes ``Linear8bitLt`` that can run on the checkpoint's original BF16 weight instead.

    Never constructed directly: :func:`prepare_dual_path` converts existing ``Linear8bitLt`` modules in
    place, keeping their quantised weight. ``recovery`` False: the stock bnb INT8 forward.
    ``recovery`` True: ``F.linear(x, W_bf16, bias)`` with the module's own bias (so a bias trained by
    PEFT's ``bias="all"`` is the same on both paths). The base weights stay frozen; gradients flow to
    the input (and so to LoRA) on both paths.
    """

    _gnmr_source: _RecoveryWeight
    _gnmr_weight: torch.Tensor | None
    _gnmr_ready: Any

    @classmethod
    def convert(cls, module: bnb.nn.Linear8bitLt, source: _RecoveryWeight) -> DualPathLinear8bitLt:
        """Turn ``module`` into a dual-path module in place (returns the same object)."""
        if isinstance(module, cls):
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
        """Select the recovery path (True) or the low-cost INT8 path (False) for the next forward."""
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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.recovery:
            return super().forward(x)
        w = self._gnmr_weight
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
        # like bnb.matmul, the output has the input's dtype; the product itself is in the weight's dtype,
        # as in the BF16 model
        out = F.linear(x.to(w.dtype), w, None if bias is None else bias.to(w.dtype))
        return out.to(x.dtype)

    def _apply(self, fn, recurse: bool = True):
        out = super()._apply(fn, recurse)
        device = self.weight.device
        src = self._gnmr_source
        # recovery weights are plain attributes (kept out of state_dict/DDP): follow the module's device
        if src.storage == "device" and src.stored is not None and src.stored.device != device:
            src.stored = src.stored.to(device)
        if self.recovery and self._gnmr_weight is not None and self._gnmr_weight.device != device:
            src.release(self)
            self.recovery = False
            self.set_recovery(True)
        return out

    def extra_repr(self) -> str:
        return (
            f"{super().extra_repr()}, recovery={self.recovery}, storage={self._gnmr_source.storage}, "
            f"recovery_key={self._gnmr_source.key!r}"
        )


def _transformers_model(model: nn.Module) -> nn.Module:
    # DDP / accelerate wrappers keep the model in `.module`; PEFT gives it through get_base_model()
    while hasattr(model, "module") and isinstance(model.module, nn.Module):
        model = model.module
    if hasattr(model, "get_base_model"):
        model = model.get_base_model()
    return model


def _canonical_name(name: str) -> str:
    # PEFT wraps the target as `<name>.base_layer`
    return ".".join(p for p in name.split(".") if p != "base_layer")


def _tied_sources(base: nn.Module) -> dict[str, str]:
    tied: dict[str, str] = {}
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        mapping = getattr(base, attr, None)
        if isinstance(mapping, dict):
            tied.update({str(k): str(v) for k, v in mapping.items()})
    return tied


def _find_key(index: CheckpointIndex, name: str, base: nn.Module) -> str | None:
    """The checkpoint key holding the weight of the module named ``name`` (relative to ``base``)."""
    key = name + ".weight"
    candidates = [key]
    tied = _tied_sources(base)
    if key in tied:
        candidates.append(tied[key])
    prefix = getattr(base, "base_model_prefix", "") or ""
    for k in list(candidates):
        if prefix and k.startswith(prefix + "."):
            candidates.append(k[len(prefix) + 1 :])  # a checkpoint of the bare backbone
        elif prefix:
            candidates.append(f"{prefix}.{k}")
    for k in candidates:
        if k in index:
            return k
    # last resort: a unique key ending with the module's name (checkpoints saved under another prefix)
    for k in candidates:
        matches = [c for c in index.file_of if c.endswith("." + k)]
        if len(matches) == 1:
            return matches[0]
    return None


def _is_8bit(base: nn.Module, model: nn.Module) -> bool:
    if getattr(base, "is_loaded_in_8bit", False):
        return True
    return any(isinstance(m, bnb.nn.Linear8bitLt) for m in model.modules())


def prepare_dual_path(
    model: nn.Module,
    recovery_source: str | os.PathLike,
    storage: str = "host",
    units: UnitSpec = None,
    dtype: torch.dtype = torch.bfloat16,
) -> nn.Module:
    """Give every ``Linear8bitLt`` inside the decoder layers of an 8-bit model a BF16 recovery path.

    The usual flow, before PEFT (a PEFT-wrapped model is accepted too)::

        model = AutoModelForCausalLM.from_pretrained(
            path, quantization_config=BitsAndBytesConfig(load_in_8bit=True), dtype=torch.bfloat16)
        model = gnmr_hf.prepare_dual_path(model, recovery_source=path, storage="host")
        model = peft.get_peft_model(model, LoraConfig(...))   # stock PEFT, no registration needed
        gnmr_hf.set_active_units(model, [3, 7])               # layers 3 and 7 on BF16, others INT8

    Every layer starts on the low-cost INT8 path.

    Args:
        model: a transformers model loaded with ``BitsAndBytesConfig(load_in_8bit=True)`` (optionally
            already wrapped by PEFT or DDP). Converted in place and returned.
        recovery_source: the checkpoint the model was loaded from: a folder with ``*.safetensors``
            (sharded or not), a single ``.safetensors`` file, or a hub id whose snapshot is in the local
            cache (nothing is downloaded).
        storage: where the BF16 weights live between promotions: ``"host"``, ``"device"`` or ``"disk"``
            (see the module docstring).
        units: which modules are the units (default: the decoder layers); see
            :func:`gnmr_hf.units.resolve_units`. Every ``Linear8bitLt`` inside a unit gets a recovery path.
        dtype: dtype the recovery weights are kept and computed in (the paper's BF16).

    Raises:
        ValueError: unknown ``storage``; a model not loaded in 8-bit; no ``Linear8bitLt`` in the units;
            a recovery tensor missing from the checkpoint or with the wrong shape (the message names it).
        FileNotFoundError: ``recovery_source`` does not exist or has no safetensors files.
    """
    if storage not in STORAGES:
        raise ValueError(f"storage must be one of {STORAGES}, got {storage!r}")
    base = _transformers_model(model)
    if not _is_8bit(base, model):
        kind = "4-bit" if getattr(base, "is_loaded_in_4bit", False) else "not quantised by bitsandbytes"
        raise ValueError(
            f"the model is not loaded in 8-bit (it is {kind}): "
            "load it with from_pretrained(..., quantization_config=BitsAndBytesConfig(load_in_8bit=True)) "
            "before prepare_dual_path"
        )
    index = CheckpointIndex(recovery_source)
    names = {id(m): _canonical_name(n) for n, m in base.named_modules()}

    # (module, checkpoint key) for every Linear8bitLt inside a unit, checked before anything is changed
    plan: list[tuple[bnb.nn.Linear8bitLt, str]] = []
    seen: set[int] = set()
    for unit_name, unit in resolve_units(model, units):
        for sub_name, m in unit.named_modules():
            if not isinstance(m, bnb.nn.Linear8bitLt) or id(m) in seen:
                continue
            seen.add(id(m))
            name = names.get(id(m)) or _canonical_name(f"{unit_name}.{sub_name}")
            key = _find_key(index, name, base)
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
            if index.dtype_of[key] not in _SAFETENSORS_DTYPES:
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
            plan.append((m, key))
    if not plan:
        raise ValueError(
            "no bitsandbytes Linear8bitLt module inside the units: nothing to give a recovery path "
            "(were the decoder layers skipped by llm_int8_skip_modules?)"
        )

    sources: dict[str, _RecoveryWeight] = {}
    for _m, key in plan:
        if key not in sources:
            sources[key] = _RecoveryWeight(index, key, storage, dtype)
    if storage != "disk":
        pin = storage == "host" and torch.cuda.is_available()
        devices = {key: m.weight.device for m, key in plan}
        tensors = index.read_many(sources, dtype)
        for key, src in sources.items():
            t = tensors.pop(key)
            if storage == "host":
                src.stored = t.pin_memory() if pin else t
            else:
                src.stored = t.to(devices[key])
    for m, key in plan:
        DualPathLinear8bitLt.convert(m, sources[key])
    return model
