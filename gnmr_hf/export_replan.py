"""``gnmr-hf export --replan DATA``: an export of a trained run planned anew for what it writes.

A run trained over NF4 (a recipe's ladder, QLoRA) was planned against NF4; its export is INT4 (compressed-tensors
W4A16) or a GGUF type, another quantiser on other weights (the adapter merged). :func:`replan` plans for the
export itself: the adapter merged into the BF16 weights, that merged model profiled against the export's own
quantiser (:func:`gnmr_hf.planning.make.make_plan` over ``int4`` or the GGUF low: the first-order rung gains at the
uniform low point of the merged weights) on the first blocks of the run's own text, within ``budget`` (default
``+10%`` over the uniform low form), for the target's rungs and groups (:data:`gnmr_hf.serving.TARGETS`). The plan
is saved beside the output (``OUTPUT.plan.json``, :meth:`gnmr_hf.planning.plan.Plan.save`) and the export writes
it; ``gnmr-hf export`` then scores the export on the text's last blocks (never the ones planned on) against the
merged model (:mod:`gnmr_hf.export_score`).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.export_folder import ExportError
from gnmr_hf.export_score import merged_bf16
from gnmr_hf.planning.make import make_plan
from gnmr_hf.planning.plan import GGUF_LOWS, Plan, PlanError
from gnmr_hf.rungs import get_rung
from gnmr_hf.rungs.int4 import INT4_LOWS, int4_low
from gnmr_hf.serving import serve_target

#: what the export's --replan profiles on: batches of BATCH_SIZE blocks of BLOCK tokens from the text's start
BLOCK, BATCH_SIZE = 512, 4


def plan_path(output: str | os.PathLike) -> Path:
    """Where the re-made plan is saved: ``OUTPUT.plan.json`` beside the folder or file the export writes."""
    out = Path(output).expanduser()
    return out.with_name(out.name + ".plan.json")


def replan_low(fmt: str, low_type: str | None) -> str:
    """The low a re-made plan is over: for compressed-tensors ``int4`` (``low_type`` W4A16, the default) or
    ``int4-asym`` (W4A16_ASYM), the GGUF low of ``low_type`` for gguf."""
    if fmt == "compressed-tensors":
        try:
            return int4_low(low_type)
        except ValueError as e:
            raise ExportError(f"--low-type {e}") from None
    if fmt == "gguf":
        low = (low_type or "Q4_0").lower()
        if low not in GGUF_LOWS:
            raise ExportError(f"--replan plans a GGUF file over {', '.join(t for t in GGUF_LOWS.values())} (the types "
                              f"the planner prices and profiles), not --low-type {low_type}")
        return low
    raise ExportError(f"--replan is for --format compressed-tensors and gguf (an export whose low type is not the "
                      f"training's), not {fmt}")


def profile_blocks(tokenizer_dir: str | os.PathLike, text: str, batches: int, keep_tail: int) -> list[dict[str, Any]]:
    """``batches`` batches of :data:`BATCH_SIZE` blocks of :data:`BLOCK` tokens from the start of ``text``, none
    reaching into its last ``keep_tail`` tokens (what the export is scored on); one line when the text is short."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    ids = tok(text, add_special_tokens=False)["input_ids"]
    usable = len(ids) - keep_tail
    need = batches * BATCH_SIZE * BLOCK
    if usable < need:
        raise ExportError(f"--replan: the text holds {len(ids)} tokens; planning on {batches} batch(es) of "
                          f"{BATCH_SIZE} x {BLOCK} takes {need} from its start and scoring keeps its last {keep_tail}: "
                          "give more text, fewer --replan-batches or fewer --score-blocks")
    out = []
    for b in range(batches):
        x = torch.tensor([ids[(b * BATCH_SIZE + i) * BLOCK:(b * BATCH_SIZE + i + 1) * BLOCK] for i in range(BATCH_SIZE)])
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def replan(model_path: str | os.PathLike, adapter: str | os.PathLike | None, fmt: str, text: str,
           output: str | os.PathLike, *, budget: str | None = None, low_type: str | None = None,
           group_size: int | None = None, target: str | None = None, batches: int = 2, keep_tail: int = 0,
           source: str = "the given text", force: bool = False) -> tuple[Plan, Path]:
    """Plan the export of ``model_path`` with ``adapter`` merged for ``fmt`` (see the module docstring), save it
    at :func:`plan_path` of ``output`` and return it with its file. ``budget``: default ``+10%`` over the uniform
    low form (``+10%int4``, ``+10%q4_0``); ``target``: the compressed-tensors target (default ``vllm``: whole
    fused groups, INT8 and BF16 rungs; ``vllm-cpu``: BF16 only; ``transformers``: free); a GGUF plan is free.
    Raises :class:`~gnmr_hf.export_folder.ExportError` in one line, before anything is written."""
    low = replan_low(fmt, low_type)
    serve = "gguf" if fmt == "gguf" else {"vllm": "vllm-gpu"}.get(target or "vllm", target or "vllm")
    spec = serve_target(serve)
    rungs = tuple(r for r in ("int8", "bf16") if r in spec.rungs)
    budget = budget or f"+10%{low}"
    gs = (group_size or 128) if low in INT4_LOWS else None
    label = get_rung(low).exports["compressed-tensors"] if gs else GGUF_LOWS[low]  # W4A16, W4A16_ASYM, Q4_0 ...
    if low not in spec.lows:  # before anything is loaded
        raise ExportError(f"--replan for {serve}: it does not load {label} ({spec.evidence})")
    path = plan_path(output)
    if path.exists() and not force:
        raise ExportError(f"{path} exists (an earlier --replan's plan): give another --output, or --force")
    out = Path(output).expanduser()
    if out.exists() and not force and (out.is_file() or any(out.iterdir())):
        raise ExportError(f"{out} exists: give another --output, or --force to replace an earlier export")
    batches_ = profile_blocks(model_path, text, batches, keep_tail)
    model = merged_bf16(model_path, adapter).float()
    print(f"[export] replanning: {'the adapter merged, ' if adapter else ''}the model profiled against "
          f"{f'{label} (group {gs})' if gs else label} on {batches} batch(es) of {BATCH_SIZE} x {BLOCK} "
          f"tokens from the start of {source}, budget {budget}, for {serve} ...", flush=True)
    try:
        plan = make_plan(model, batches_, budget, rungs, spec.groups, low=low, group_size=gs, model_path=model_path,
                         budget_text=budget, serve=serve)
    except PlanError as e:
        raise ExportError(f"--replan: {e}") from None
    finally:
        del model
    plan.chosen_by.update(writer="gnmr-hf export --replan", adapter=str(adapter) if adapter else None, data=source,
                          currency=(f"compressed-tensors folder bytes over uniform {label}" if gs else
                                    f"GGUF tensor bytes over the uniform {label} file"))
    saved = plan.save(path)
    os.chmod(saved, 0o644)
    n8, n16 = len(plan.on("int8")), len(plan.on("bf16"))
    print(f"[export] the serving plan: {n8} linear(s) on INT8{' (Q8_0)' if fmt == 'gguf' else ''}, {n16} on BF16, "
          f"{plan.price_bytes} B over uniform {label} (budget "
          f"{plan.budget_bytes} B); saved to {saved}", flush=True)
    return plan, saved
