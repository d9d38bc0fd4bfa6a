"""Reading the original (unquantised) weights of a checkpoint: the source of every recovery path.

A recovery path needs the checkpoint's own BF16 tensors, not a de-quantised copy of the low-cost
weight. :class:`CheckpointIndex` reads the safetensors headers of a local folder, a single file or a
hub id already in the local Hugging Face cache (nothing is downloaded), and :func:`find_key` maps a
module of a (possibly PEFT-wrapped) transformers model to the checkpoint tensor holding its weight.
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path

import torch
from torch import nn

from gnmr_hf._import_utils import require

require("safetensors", "Reading recovery weights from a checkpoint")

from safetensors import safe_open  # noqa: E402

# safetensors dtype names of the floating-point tensors a recovery path can be read from
FLOAT_DTYPES = {
    "BF16": torch.bfloat16,
    "F16": torch.float16,
    "F32": torch.float32,
    "F64": torch.float64,
}


class CheckpointIndex:
    """Names, shapes and files of the tensors of a safetensors checkpoint (headers only, no data read).

    Args:
        source: a checkpoint folder, a single ``.safetensors`` file, or a hub id whose snapshot is
            already in the local Hugging Face cache (nothing is downloaded).

    Raises:
        FileNotFoundError: ``source`` does not exist, is not in the local cache, or holds no
            ``.safetensors`` files.
        ValueError: ``source`` is a file that is not a ``.safetensors`` file.
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
        return self.read_many([key], dtype)[key]

    def read_many(self, keys: Iterable[str], dtype: torch.dtype) -> dict[str, torch.Tensor]:
        """Read several tensors into CPU memory, cast to ``dtype``, opening each file once."""
        by_file: dict[str, list[str]] = {}
        for k in keys:
            by_file.setdefault(self.file_of[k], []).append(k)
        out = {}
        for path, ks in by_file.items():
            with safe_open(path, framework="pt", device="cpu") as f:
                for k in ks:
                    # copy=True: get_tensor may return a view of the memory-mapped file, which would
                    # leave the bytes in the page cache instead of process memory
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


def canonical_name(name: str) -> str:
    """A module's name with PEFT's ``base_layer`` hops removed (PEFT wraps a target as ``<name>.base_layer``)."""
    return ".".join(p for p in name.split(".") if p != "base_layer")


def _tied_sources(base: nn.Module) -> dict[str, str]:
    tied: dict[str, str] = {}
    for attr in ("all_tied_weights_keys", "_tied_weights_keys"):
        mapping = getattr(base, attr, None)
        if isinstance(mapping, dict):
            tied.update({str(k): str(v) for k, v in mapping.items()})
    return tied


def find_key(index: CheckpointIndex, name: str, base: nn.Module) -> str | None:
    """The checkpoint key holding the weight of the module named ``name``.

    Args:
        index: the checkpoint.
        name: the module's qualified name inside ``base`` (see :func:`canonical_name`).
        base: the transformers model (for its tied weights and ``base_model_prefix``).

    Returns:
        The key, or None when the checkpoint has no tensor for this module. Tied weights, a
        checkpoint of the bare backbone (no ``base_model_prefix``) and a unique key that ends with
        the module's name (a checkpoint saved under another prefix) are all found.
    """
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
