"""``gnmr-hf export --format compressed-tensors``: the plan (a ladder or a BF16-only plan, the adapter merged
first when one is given) through :func:`gnmr_hf.export_ct.export_compressed_tensors`: INT4 / INT8 / BF16 per
linear in one checkpoint that stock ``from_pretrained`` and vLLM load (``--group-size``: the INT4 group, 128 by
default). The exporter itself, its quantisers and its model card are :mod:`gnmr_hf.export_ct`; this file is its
entry in the dispatcher.
"""

from __future__ import annotations

from typing import Any


def check_options(args) -> str | None:
    """The first option that does not apply to ``--format compressed-tensors``, as a one-line reason."""
    if args.merge:
        return ("--merge writes the merged BF16 model (format bitsandbytes' --merge); --format compressed-tensors "
                "merges --adapter into the BF16 weights itself before quantising")
    if args.quant is not None:
        return (f"--quant {args.quant} is bitsandbytes' low precision; compressed-tensors stores the low rung as INT4 "
                "(W4A16) and the INT8 rung as W8A16: leave --quant out (--group-size sets the INT4 group)")
    if args.double_quant:
        return "--double-quant is bitsandbytes' (4-bit scales quantised); compressed-tensors keeps BF16 scales"
    return None


def run(args, model_path: str) -> dict[str, Any]:
    """:func:`gnmr_hf.export_ct.export_compressed_tensors` with the command's options."""
    from gnmr_hf.export_ct import (
        export_compressed_tensors,  # torch (the planning package): imported when used
    )

    return export_compressed_tensors(model_path, args.plan, args.output, adapter=args.adapter,
                                     group_size=args.group_size, force=args.force, target=args.target,
                                     low=getattr(args, "ct_low", None))


def describe(s: dict[str, Any]) -> str:
    """The line ``gnmr-hf export`` prints for the folder written."""
    mib = 2**20
    c = s["schemes"]
    low = s.get("low_scheme", "W4A16")
    return (f"wrote {s['folder']} (compressed-tensors, for {s['target']}): {low} {c['W4A16']} / W8A16 {c['W8A16']} / "
            f"BF16 {c['BF16']} decoder linears, INT4 group {s['group_size']}; {s['bytes_on_disk'] / mib:.1f} MiB on "
            f"disk; tensors {s['tensor_bytes'] / mib:.1f} MiB ({100 * (s['tensor_bytes'] / s['w4a16_tensor_bytes'] - 1):+.1f} "
            f"% over uniform {low}, {s['w4a16_tensor_bytes'] / mib:.1f} MiB; BF16 {s['bf16_tensor_bytes'] / mib:.1f} MiB)")
