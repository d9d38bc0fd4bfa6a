"""``gnmr-hf export --format gguf``: the plan (the adapter merged into the BF16 weights first when one is given)
as one GGUF file for llama.cpp, each decoder linear at its rung's GGUF type (``--low-type`` for the linears the
plan leaves low, Q4_0 by default; INT8 -> Q8_0, BF16 -> BF16), or every decoder linear at ``--uniform TYPE`` (the
baseline, no plan). The exporter itself is :func:`gnmr_hf.export_gguf.export_gguf`; this file is its entry in
the dispatcher. ``--output`` names the ``.gguf`` file.
"""

from __future__ import annotations

from typing import Any

from gnmr_hf.export_gguf import export_gguf


def check_options(args) -> str | None:
    """The first option that does not apply to ``--format gguf``, as a one-line reason."""
    if args.merge:
        return "--merge is bitsandbytes'; --format gguf merges --adapter into the BF16 weights itself"
    if args.quant is not None:
        return (f"--quant {args.quant} is bitsandbytes' low precision; --format gguf takes --low-type "
                "(Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, BF16)")
    if args.double_quant:
        return "--double-quant is bitsandbytes' (4-bit scales quantised); GGUF types carry their own block scales"
    if args.group_size is not None:
        return "--group-size is the compressed-tensors INT4 group; a GGUF type's block is fixed (32 for Q4_0 / Q8_0)"
    if args.uniform and args.plan:
        return "give --plan or --uniform TYPE, not both"
    if not args.uniform and not args.plan and not getattr(args, "replan", None):
        return "--format gguf needs --plan (a profile.json), --replan DATA or --uniform TYPE (the baseline)"
    return None


def run(args, model_path: str) -> dict[str, Any]:
    """:func:`gnmr_hf.export_gguf.export_gguf` with the command's options."""
    return export_gguf(model_path, args.plan, args.output, adapter=args.adapter, low_type=args.low_type,
                       uniform=args.uniform, force=args.force)


def describe(s: dict[str, Any]) -> str:
    """The line ``gnmr-hf export`` prints for the file written."""
    linears = ", ".join(f"{t} {n}" for t, n in sorted(s["linears_by_type"].items()))
    return (f"wrote {s['file']} (GGUF, {s['architecture']}, for llama.cpp): decoder linears {linears}; "
            f"{s['bytes'] / 2**20:.1f} MiB on disk; tokenizer {s['tokenizer']}")
