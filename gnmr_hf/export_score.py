"""Every export scores itself: the written folder (or GGUF file) against the same model merged in BF16 and against
the uniform low form, on held-out text.

:func:`score_export` reads the export back the way its server's stand-in here reads it (compressed-tensors: stock
``AutoModelForCausalLM.from_pretrained(folder)``, its weights decompressed at a first forward and computed in FP32;
gguf: transformers' GGUF loader in FP32) and computes, on the same token blocks, in FP32:

- ``merged``: the BF16 model with the adapter merged (``merge_and_unload``; the plain BF16 model without one);
- ``export``: the export as read back;
- ``uniform``: every decoder linear at the format's low type, quantised in torch in this process from the merged
  BF16 weights (compressed-tensors: :func:`gnmr_hf.planning.int4.fake_quantize_model`, W4A16 at the export's
  group; gguf: the ``gguf`` package's own quantise-dequantise at the low type, e.g. Q4_0).

``kept`` = (L_uniform - L_export) / (L_uniform - L_merged) is the share of the uniform-to-merged gap the export
keeps; :func:`loses_more` is the warning rule: the export loses more to quantisation than its plan recovered,
L_export - L_merged > L_uniform - L_export. ``gnmr-hf export --score-data FILE`` calls it after the format's
``run`` and prints :func:`score_line` (and :func:`warning_line`), writes :func:`card_section` on the folder's
model card and the figures in its ``.gnmr_export.json``.

Held-out text (:func:`heldout_blocks`): the file tokenised whole with the model's tokenizer, cut into blocks of
``block`` tokens counted from the end of the file (at most ``blocks`` of them), so the blocks are not the start
of the file a profile reads first.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gnmr_hf.export_folder import MARKER, ExportError
from gnmr_hf.rungs import get_rung
from gnmr_hf.rungs.int4 import INT4_LOWS

#: the formats :func:`score_export` reads back
SCORED_FORMATS = ("compressed-tensors", "gguf")
HOW_TO_ASK = ("not scored: give --score-data FILE (held-out text) to score the export against the merged BF16 "
              "model and the uniform low form")

# the compressed-tensors card's line for an unscored folder (gnmr_hf.export_ct.model_card), replaced when scored
_NOT_MEASURED = ("Loss: not measured by the export (`gnmr-hf export --score-data FILE` scores it on held-out text "
                 "against the merged BF16 model); score the folder with `gnmr-hf eval --model FOLDER`.")


class ScoreError(ValueError):
    """The export cannot be scored (no tokenizer, too little text, an unscored format): one line."""


def heldout_blocks(tokenizer_dir: str | os.PathLike, text: str, block: int = 256, blocks: int = 16) -> list[list[int]]:
    """``text`` tokenised whole by the tokenizer in ``tokenizer_dir``, cut into at most ``blocks`` blocks of
    ``block`` tokens taken from the end (the last ``blocks * block`` tokens, in file order)."""
    if block < 2 or blocks < 1:
        raise ScoreError(f"not scored: --score-block {block} / --score-blocks {blocks}: a block holds at least 2 tokens, "
                         "at least one block")
    try:
        from transformers import AutoTokenizer

        tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    except (OSError, ValueError, TypeError) as e:
        raise ScoreError(f"not scored: {Path(tokenizer_dir).name} has no tokenizer this can load "
                         f"({str(e).splitlines()[0][:120]})") from None
    ids = tok(text, add_special_tokens=False)["input_ids"]
    n = min(blocks, len(ids) // block)
    if n < 1:
        raise ScoreError(f"not scored: the score text holds {len(ids)} tokens, fewer than one block of {block} "
                         "(--score-block)")
    tail = ids[len(ids) - n * block:]
    return [tail[i * block:(i + 1) * block] for i in range(n)]


def nll(model, blocks: list[list[int]]) -> tuple[float, int]:
    """Mean next-token NLL (nats) of ``model`` over ``blocks`` and the tokens scored (each block's last
    ``len - 1``), computed in the model's own dtype (give an FP32 model)."""
    import torch

    total, count = 0.0, 0
    with torch.no_grad():
        for ids in blocks:
            x = torch.tensor([ids])
            logits = model(input_ids=x).logits[0, :-1].float()
            total += float(torch.nn.functional.cross_entropy(logits, x[0, 1:], reduction="sum"))
            count += len(ids) - 1
    return total / count, count


def kept_share(merged: float, export: float, uniform: float) -> float:
    """The share of the uniform-to-merged gap the export keeps: (L_uniform - L_export) / (L_uniform - L_merged)
    (nan when the uniform form loses nothing)."""
    gap = uniform - merged
    return (uniform - export) / gap if gap != 0 else float("nan")


def loses_more(merged: float, export: float, uniform: float) -> bool:
    """The warning rule: the export loses more to quantisation than its plan recovered,
    L_export - L_merged > L_uniform - L_export."""
    return export - merged > uniform - export


def merged_bf16(model_path: str | os.PathLike, adapter: str | os.PathLike | None):
    """The BF16 model with ``adapter`` merged (``merge_and_unload``), as the exports quantise it."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if adapter is not None:
        import peft

        model = peft.PeftModel.from_pretrained(model, str(adapter)).merge_and_unload()
    return model.eval()


def stock_ct_fp32(folder: str | os.PathLike, model_path: str | os.PathLike, probe: list[int]):
    """The stock-loaded compressed-tensors folder's weights (decompressed at its first forward) in an FP32 copy of
    the model's architecture."""
    import torch
    from transformers import AutoModelForCausalLM

    stock = AutoModelForCausalLM.from_pretrained(folder)  # no arguments: as a user loads it
    with torch.no_grad():
        stock(input_ids=torch.tensor([probe]))
    served = stock.state_dict()
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    want = plain.state_dict()
    missing = [k for k in want if k not in served]
    if missing:
        raise ScoreError(f"the stock-loaded {Path(folder).name} has no {missing[0]} after its first forward")
    plain.load_state_dict({k: served[k].to(torch.float32) for k in want})
    return plain.eval()


def ct_folder_fp32(folder: str | os.PathLike, model_path: str | os.PathLike):
    """The compressed-tensors folder's weights as compressed-tensors itself decompresses them (its
    ``PackedQuantizationCompressor.decompress`` on each quantised linear's packed codes, scales and zero points;
    every other tensor as stored) in an FP32 copy of the model's architecture: for a folder stock transformers
    does not load (W4A16_ASYM: it mis-sizes the packed zero points). A symmetric folder gives the stock load's
    weights exactly (tests/test_export_int4_asym.py)."""
    import json

    import torch
    from compressed_tensors.compressors.pack_quantized.base import PackedQuantizationCompressor
    from compressed_tensors.quantization import QuantizationConfig
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    folder = Path(folder)
    config = QuantizationConfig.model_validate(json.loads((folder / "config.json").read_text())["quantization_config"])
    stored: dict[str, Any] = {}
    for f in sorted(folder.glob("*.safetensors")):
        stored.update(load_file(f))
    for group in config.config_groups.values():
        for name in group.targets:
            own = {k[len(name) + 1:]: stored.pop(k) for k in [k for k in stored if k.startswith(name + ".weight_")]}
            if "weight_packed" not in own:
                raise ScoreError(f"{folder.name}: {name} is in quantization_config but has no weight_packed")
            stored[f"{name}.weight"] = PackedQuantizationCompressor.decompress(own, group)["weight"]
    plain = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    want = plain.state_dict()
    tied = getattr(plain.config, "tie_word_embeddings", False)
    missing = [k for k in want if k not in stored and not (tied and k == "lm_head.weight")]
    if missing:
        raise ScoreError(f"{folder.name} holds no {missing[0]}")
    plain.load_state_dict({k: stored[k].to(torch.float32) for k in want if k in stored}, strict=False)
    return plain.eval()


def gguf_fp32(file: str | os.PathLike):
    """The GGUF file through transformers' GGUF loader, in FP32."""
    import torch
    from transformers import AutoModelForCausalLM

    file = Path(file)
    return AutoModelForCausalLM.from_pretrained(file.parent, gguf_file=file.name, dtype=torch.float32).eval()


def gguf_fake_quantize(model, qtype: str):
    """``model`` (in place) with every decoder linear quantised-dequantised at GGUF type ``qtype`` by the
    ``gguf`` package (the export's quantiser, :func:`gnmr_hf.planning.gguf_plan.gguf_fake_quant`). Returns it."""
    import torch

    from gnmr_hf.planning.gguf_plan import gguf_fake_quant
    from gnmr_hf.planning.groups import decoder_linears

    modules = dict(model.named_modules())
    with torch.no_grad():
        for name in decoder_linears(model):
            w = modules[name].weight
            w.copy_(gguf_fake_quant(w, qtype))
    return model


def score_export(model_path: str | os.PathLike, export_path: str | os.PathLike, fmt: str,
                 adapter: str | os.PathLike | None, text: str, block: int = 256, blocks: int = 16,
                 group_size: int = 128, low_type: str = "Q4_0", source: str = "the given text",
                 planned: bool = True, ct_low: str = "int4") -> dict[str, Any]:
    """Score the export at ``export_path`` (``fmt``: ``"compressed-tensors"`` folder or ``"gguf"`` file) on the
    held-out ``text`` against the merged BF16 model and the uniform low form (W4A16 at ``group_size``, W4A16_ASYM
    for ``ct_low="int4-asym"``, whose folder compressed-tensors decompresses: :func:`ct_folder_fp32`; the GGUF
    ``low_type``), all in FP32 on the same blocks. Returns the figures: ``merged``, ``export``, ``uniform``
    (mean NLL, nats), ``kept``, ``tokens``, ``blocks``, ``block``, ``uniform_form``, ``warning`` (bool),
    ``source``, ``planned``. ``planned=False``: the export is the uniform baseline itself (``--uniform``, an empty
    plan), never warned about. Raises :class:`ScoreError` in one line when it cannot score."""
    import copy

    from gnmr_hf.planning.int4 import fake_quantize_model

    if fmt not in SCORED_FORMATS:
        raise ScoreError(f"not scored: the export scores {', '.join(SCORED_FORMATS)} exports, not {fmt}")
    blks = heldout_blocks(model_path, text, block, blocks)
    base = merged_bf16(model_path, adapter)
    low = copy.deepcopy(base)
    if fmt == "compressed-tensors":
        fake_quantize_model(low, {}, group_size, low=ct_low)
        sym = INT4_LOWS[ct_low]
        form = (f"every decoder linear {get_rung(ct_low).exports['compressed-tensors']} (INT4, group {group_size}, "
                f"{'symmetric' if sym else 'a zero point per group'})")
        served = stock_ct_fp32(export_path, model_path, blks[0][:8]) if sym else ct_folder_fp32(export_path, model_path)
    else:
        gguf_fake_quantize(low, low_type)
        form = f"every decoder linear {low_type} (the gguf package's quantiser)"
        served = gguf_fp32(export_path)
    merged, tokens = nll(base.float(), blks)
    del base
    uniform, _ = nll(low.float(), blks)
    del low
    export, _ = nll(served, blks)
    return {"merged": merged, "export": export, "uniform": uniform, "kept": kept_share(merged, export, uniform),
            "tokens": tokens, "blocks": len(blks), "block": block, "uniform_form": form, "source": source,
            "adapter": adapter is not None, "planned": planned,
            "warning": planned and loses_more(merged, export, uniform)}


def score_line(r: dict[str, Any]) -> str:
    """The one line ``gnmr-hf export`` prints."""
    return (f"scored on {r['tokens']} held-out tokens ({r['blocks']} x {r['block']} from the end of {r['source']}): "
            f"merged BF16 NLL {r['merged']:.4f}, export {r['export']:.4f}, uniform {r['uniform']:.4f}; "
            f"the export keeps {r['kept']:.3f} of the uniform-to-merged gap"
            + ("" if r.get("planned", True) else " (the export is the uniform baseline: no plan)"))


def warning_line(r: dict[str, Any]) -> str | None:
    """``warning: ...`` when the export loses more to quantisation than its plan recovered, else None."""
    if not r["warning"]:
        return None
    return (f"warning: the export loses more to quantisation than its plan recovered (export - merged "
            f"{r['export'] - r['merged']:.4f} nats > uniform - export {r['uniform'] - r['export']:.4f}): "
            "plan for this format's own quantiser (gnmr-hf profile --low int4 / --serve) or raise the budget")


def card_section(r: dict[str, Any]) -> str:
    """The model card's "Measured by the export" section."""
    merged = "the BF16 model with the LoRA adapter merged" if r["adapter"] else "the BF16 model"
    lines = ["## Measured by the export", "",
             f"Held-out text: {r['tokens']} tokens scored ({r['blocks']} blocks of {r['block']} tokens from the end of "
             f"{r['source']}), mean next-token NLL in nats, computed in FP32:", "",
             "| model | NLL |", "|---|---|",
             f"| merged BF16 ({merged}) | {r['merged']:.4f} |",
             f"| this export, as its loader reads it | {r['export']:.4f} |",
             f"| uniform: {r['uniform_form']} | {r['uniform']:.4f} |", "",
             f"Share of the uniform-to-merged gap this export keeps: **{r['kept']:.3f}** "
             "((uniform - export) / (uniform - merged))."
             + ("" if r.get("planned", True) else " This export is the uniform baseline itself (no plan)."), ""]
    w = warning_line(r)
    if w:
        lines += [w, ""]
    return "\n".join(lines)


def record(folder: str | os.PathLike, r: dict[str, Any]) -> None:
    """Write the figures on an export folder: the card's section (appended to ``README.md``) and
    ``measured_by_export`` in its ``.gnmr_export.json``."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ExportError(f"{folder} is not an export folder")
    card = folder / "README.md"
    if card.is_file():
        # the compressed-tensors card (gnmr_hf.export_ct.model_card) says the loss was not measured: now it is
        body = card.read_text().replace(_NOT_MEASURED, "Loss: measured by the export, below (\"Measured by the export\").")
        card.write_text(body.rstrip("\n") + "\n\n" + card_section(r))
    marker = folder / MARKER
    if marker.is_file():
        data = json.loads(marker.read_text())
        data["measured_by_export"] = {k: r[k] for k in ("merged", "export", "uniform", "kept", "tokens", "blocks",
                                                        "block", "uniform_form", "source", "planned",
                                                        "warning")}
        marker.write_text(json.dumps(data, indent=1) + "\n")
