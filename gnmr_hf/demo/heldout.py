"""The held-out loss: each run's adapter scored on GSM8K test problems no run trained on, on the base it trained
on and is served on, with the memory that served model holds; kept in ``heldout/<run>.json``."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from gnmr_hf.demo.config import SERVED, DemoError
from gnmr_hf.demo.report import PhaseTimer
from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.memory import model_bytes

# torch, datasets, transformers, gnmr_hf.recipe and gnmr_hf.evaluation.evaluate (which load torch, transformers,
# peft and bitsandbytes at their top) are imported inside the functions that score: `gnmr-hf demo --help` and
# `import gnmr_hf.demo` stay without them


def train_test_overlap(train: Path, test: Path) -> int:
    """How many questions of the GSM8K ``test`` file are also in the ``train`` file (0 if either is missing)."""
    if not (train.is_file() and test.is_file()):
        return 0

    def questions(path: Path) -> set[str]:
        return {json.loads(line)["question"] for line in path.read_text().splitlines() if line.strip()}

    return len(questions(train) & questions(test))


def heldout_problems(data_dir: Path, n: int) -> list[dict[str, str]]:
    """The first ``n`` problems of the offline GSM8K test split (``gnmr_hf.offline.eval_data``; disjoint from the
    generated training problems, :func:`train_test_overlap`): the text the held-out loss is measured on."""
    path = data_dir / "gsm8k" / "test.jsonl"
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{"question": r["question"], "answer": r["answer"]} for r in rows[:n]]


def token_loss(model, batches) -> tuple[float, int]:
    """Mean cross-entropy per scored target token over collated ``batches`` (``labels`` -100 where not scored):
    every batch's summed next-token loss over the count of scored targets, so batches weigh by their tokens.
    Returns ``(loss, tokens)``."""
    import torch

    total, count = 0.0, 0
    model.eval()
    for batch in batches:
        batch = dict(batch)
        labels = batch.pop("labels")
        with torch.no_grad():
            logits = model(**batch).logits.float()
        shift_logits, shift_labels = logits[:, :-1], labels[:, 1:]
        total += float(torch.nn.functional.cross_entropy(shift_logits.reshape(-1, shift_logits.shape[-1]),
                                                         shift_labels.reshape(-1), ignore_index=-100,
                                                         reduction="sum"))
        count += int((shift_labels != -100).sum())
    if count == 0:
        raise DemoError("the held-out problems hold no target token (max_seq_len too short?)")
    return total / count, count


def heldout_loss(model, tokenizer, script, problems: list[dict[str, str]], batch_size: int = 8) -> tuple[float, int]:
    """Mean loss per response token over ``problems``, tokenised as the recipes train
    (:func:`gnmr_hf.recipe.tokenize_dataset`: the prompt masked, the worked answer and EOS scored) and padded as
    the Trainer's collator pads. Returns ``(loss, tokens)``."""
    import datasets
    from transformers import DataCollatorForSeq2Seq

    from gnmr_hf.recipe import tokenize_dataset

    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    rows = tokenize_dataset(script, datasets.Dataset.from_list(problems), tokenizer)
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    return token_loss(model, (collate([rows[j] for j in range(i, min(i + batch_size, len(rows)))])
                              for i in range(0, len(rows), batch_size)))


def served_form(name: str, run_dir: Path | None) -> tuple[str, Path | None]:
    """The base ``name``'s adapter is served on, as it trained: ``(precision, plan)`` for
    :func:`gnmr_hf.evaluation.evaluate.load_model` (a planned run's ``profile.json``: its linears on their rungs,
    the rest NF4; the paper's controller keeps no recovery path after training, so gnmr / gnmr-nf4 serve on
    their low base). The untuned base: BF16."""
    if run_dir is None:
        return "bf16", None
    precision, planned = SERVED[name]
    return precision, (run_dir / "profile.json" if planned else None)


def score_heldout(out: Path, name: str, checkpoint: Path, script, problems: list[dict[str, str]], dtype: str,
                  batch_size: int, fresh: bool = False) -> dict[str, Any]:
    """The held-out loss of ``name`` (the untuned base for ``"base"``, else the adapter in ``out/name``) on the
    base it is served on (:func:`served_form`), and the bytes that model holds (:func:`gnmr_hf.memory.model_bytes`,
    computing in ``dtype``). Kept in ``out/heldout/<name>.json`` and read back while its settings and the
    adapter are unchanged (an interrupted demo does not score it again)."""
    from gnmr_hf.evaluation.evaluate import load_model

    run_dir = None if name == "base" else out / name
    precision, plan = served_form(name, run_dir)
    settings = {"problems": len(problems), "dtype": dtype, "precision": precision, "batch_size": batch_size,
                "plan": None if plan is None else str(plan), "max_seq_len": script.max_seq_len,
                "trained": None if run_dir is None else (run_dir / "run.json").stat().st_mtime}
    path = out / "heldout" / f"{name}.json"
    if not fresh and path.is_file():
        try:
            kept = json.loads(path.read_text())
        except ValueError:
            kept = {}
        if kept.get("settings") == settings:
            return {**kept, "read_back": True}
    try:
        model, tokenizer = load_model(str(checkpoint), precision, adapter=run_dir, compute_dtype=dtype, plan=plan)
    except EvalError as e:
        raise DemoError(f"loading {name} for the held-out loss: {e}") from None
    loss, tokens = heldout_loss(model, tokenizer, script, problems, batch_size)
    adapter = 0
    if run_dir is not None:
        adapter = sum(p.nelement() * p.element_size() for n, p in model.named_parameters() if "lora_" in n)
    held = model_bytes(model)["total"]  # after the forwards: INT8 row scales counted where they moved
    record = {"loss": loss, "tokens": tokens, "weights_bytes": held - adapter, "adapter_bytes": adapter,
              "served_on": precision + (" + plan" if plan is not None else ""), "settings": settings}
    path.parent.mkdir(exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(record, indent=2) + "\n")
    os.replace(tmp, path)
    del model
    return record


def heldout_settings(n: int, dtype: str) -> str:
    """How the held-out loss is measured (the summary's note under the table)."""
    return (f"mean loss per response token (the worked answer and EOS, as the recipes train) on the "
            f"first {n} GSM8K test problems of the offline eval set, which no run trained "
            f"on; each adapter on the base it trained on and is served on (bf16: BF16, nf4 and "
            f"gnmr-nf4: NF4, the planned runs: their plan's rungs, the other linears NF4), computing "
            f"in {dtype}; served weights: what that model holds (gnmr_hf.memory.model_bytes), less "
            f"the adapter; gap closed: (L_nf4 - L) / (L_nf4 - L_bf16)")


def score_runs(out: Path, recipes: Path, precisions: list[str], overrides: dict[str, list[str]], checkpoint: Path,
               data_dir: Path, n: int, dtype: str, batch_size: int, fresh: bool,
               timer: PhaseTimer) -> dict[str, dict[str, Any]]:
    """The held-out loss of the untuned base and of each run (:func:`score_heldout`) on the first ``n`` test
    problems, each one phase of ``timer``; ``{name: record}``."""
    from gnmr_hf.recipe import RecipeError, load_config

    try:  # the prompt and answer templates the runs trained with (base.yaml's, shared by every recipe)
        script = load_config(["--config", str(recipes / "smollm2-135m" / f"{precisions[0]}.yaml"),
                              "--output_dir", str(out / precisions[0]), *overrides[precisions[0]]]).script
    except RecipeError as e:
        raise DemoError(f"recipe {precisions[0]}: {e}") from None
    problems = heldout_problems(data_dir, n)
    heldout: dict[str, dict[str, Any]] = {}
    names = ["base", *precisions]
    for i, name in enumerate(names, 1):
        timer.start()
        h = score_heldout(out, name, Path(checkpoint), script, problems, dtype, batch_size, fresh)
        phase = timer.stop(f"held-out {name}", note="read back" if h.get("read_back") else "")
        heldout[name] = h
        print(f"[demo] held-out loss {name} ({i}/{len(names)}, served on {h['served_on']}): {h['loss']:.4f} "
              f"over {h['tokens']} tokens, weights {h['weights_bytes'] / 2**20:.1f} MiB"
              + (" (read back)" if h.get("read_back") else f", {phase['wall_s']:.0f} s"), flush=True)
    return heldout
