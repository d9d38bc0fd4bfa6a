"""The export dispatcher: one file per format and :func:`register_format`.

``gnmr-hf export --format NAME`` (:func:`gnmr_hf.export.main`) looks ``NAME`` up here and runs it:

=========================  =====================================================================================
file                       format
=========================  =====================================================================================
``bitsandbytes.py``        ``bitsandbytes`` (the default): pre-quantised NF4 / FP4 / INT8 with the plan's BF16
                           linears in ``llm_int8_skip_modules`` (:func:`~gnmr_hf.exports.bitsandbytes.export_planned`)
``compressed_tensors.py``  ``compressed-tensors``: W4A16 / W8A16 / BF16 per linear (:mod:`gnmr_hf.export_ct`)
``gguf.py``                ``gguf``: one GGUF file for llama.cpp, each linear at its rung's GGUF type
                           (:mod:`gnmr_hf.export_gguf`)
``card.py``                the bitsandbytes folder's model card (``README.md``) and the pieces any card shares
=========================  =====================================================================================

A format is an :class:`ExportFormat`: ``run(args, model_path) -> summary`` (``args``: the parsed command line;
``model_path``: the resolved BF16 model folder), ``describe(summary) -> str`` (the line printed),
``check(args) -> str | None`` (the first option that does not apply to it, as a one-line reason; the command
refuses it before anything runs) and ``errors`` (the exceptions printed as one ``error:`` line, exit 2). A new
format is one file that calls ``register_format(ExportFormat(...))`` and is imported by this package (or by the
user, before ``main``): a GGUF exporter's file defines its ``run`` over ``export_gguf(...)`` and registers it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from gnmr_hf.export_folder import ExportError, OutputFolderError
from gnmr_hf.exports import bitsandbytes, compressed_tensors, gguf  # the stock formats (registered below)


def _no_check(args: Any) -> str | None:
    return None


@dataclass(frozen=True)
class ExportFormat:
    """One ``gnmr-hf export --format`` (see the module docstring)."""

    name: str
    run: Callable[[Any, str], dict[str, Any]]
    describe: Callable[[dict[str, Any]], str]
    check: Callable[[Any], str | None] = _no_check
    help: str = ""
    errors: tuple[type[BaseException], ...] = field(default=(ExportError, OutputFolderError, FileNotFoundError))


_FORMATS: dict[str, ExportFormat] = {}


def register_format(fmt: ExportFormat, replace: bool = False) -> ExportFormat:
    """Add ``fmt`` to ``gnmr-hf export --format`` (``replace``: over one of the same name); returns it."""
    if not isinstance(fmt, ExportFormat):
        raise TypeError(f"register_format takes a gnmr_hf.exports.ExportFormat, got {type(fmt).__name__}")
    if not fmt.name or not isinstance(fmt.name, str) or fmt.name.startswith("-"):
        raise ValueError(f"export format name {fmt.name!r}: a non-empty name not starting with '-'")
    if fmt.name in _FORMATS and not replace and _FORMATS[fmt.name] is not fmt:
        raise ValueError(f"export format {fmt.name!r} is registered already (register_format(..., replace=True))")
    _FORMATS[fmt.name] = fmt
    return fmt


def unregister_format(name: str) -> None:
    """Remove a format a user registered (the stock ones stay: removing one raises)."""
    if name in STOCK:
        raise ValueError(f"export format {name!r} is a stock format")
    _FORMATS.pop(name, None)


def get_format(name: str) -> ExportFormat:
    """The registered format ``name`` (``ValueError`` naming the known ones otherwise)."""
    try:
        return _FORMATS[name]
    except KeyError:
        raise ValueError(f"unknown export format {name!r}: one of {', '.join(_FORMATS)}") from None


def format_names() -> tuple[str, ...]:
    """The registered formats, the stock ones first."""
    return tuple(_FORMATS)


def _register_stock() -> None:
    register_format(ExportFormat(
        "bitsandbytes", bitsandbytes.run, bitsandbytes.describe, bitsandbytes.check_options,
        help="NF4/FP4/INT8 with the planned linears on BF16 (the default)",
        errors=(ExportError, FileNotFoundError)))
    register_format(ExportFormat(
        "compressed-tensors", compressed_tensors.run, compressed_tensors.describe, compressed_tensors.check_options,
        help="W4A16 / W8A16 / BF16 per linear (the ladder), stock from_pretrained and vLLM (the serve extra)",
        errors=(ExportError, OutputFolderError, FileNotFoundError, ImportError)))
    register_format(ExportFormat(
        "gguf", gguf.run, gguf.describe, gguf.check_options,
        help="one GGUF file for llama.cpp: Q4_0 (--low-type) / Q8_0 / BF16 per linear, or --uniform TYPE",
        errors=(ExportError, FileNotFoundError)))


#: the formats this package registers
STOCK = ("bitsandbytes", "compressed-tensors", "gguf")
_register_stock()

__all__ = ["STOCK", "ExportFormat", "format_names", "get_format", "register_format", "unregister_format"]
