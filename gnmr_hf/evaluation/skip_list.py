"""``--skip-modules``: the modules a bitsandbytes load keeps unquantised, read from a list or a plan file, and
matched against the loaded model by transformers' own rule."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.planning.plan import PLAN_FILE, Plan, PlanError


def read_skip_modules(spec: str | os.PathLike | list[str] | tuple[str, ...] | None) -> list[str] | None:
    """``--skip-modules``: a comma-separated list, a plan file (``gnmr-hf profile``'s or a planned recipe's
    ``profile.json``), or the folder holding it (``DIR`` means ``DIR/profile.json``).

    Returns the list, or None for ``None`` / an empty string. A plan file is read by
    :meth:`gnmr_hf.planning.plan.Plan.load` and gives its :meth:`~gnmr_hf.planning.plan.Plan.skip_modules`; a
    profile whose list is empty is refused: it keeps nothing unquantised, not even ``lm_head``.
    """
    if spec is None:
        return None
    if isinstance(spec, (list, tuple)):
        return [str(m) for m in spec]
    text = str(spec).strip()
    if not text:
        return None
    if Path(text).is_dir() or text.endswith(".json") or Path(text).is_file():
        return _plan_skip_modules(text)
    return [m.strip() for m in text.split(",") if m.strip()]


def _plan_skip_modules(text: str) -> list[str]:
    """The skip list of the plan in ``text`` (a file, or a folder's ``profile.json``), one :class:`EvalError` line
    when it has none."""
    if not Path(text).exists():
        raise EvalError(f"--skip-modules {text}: no such file (a profile.json from gnmr-hf profile, or a "
                        "comma-separated list of module names)")
    try:
        plan = Plan.load(text)
    except PlanError as e:  # not JSON, not a plan: say what it lacks and why
        why = str(e).removeprefix(f"{Path(text) / PLAN_FILE}: ").removeprefix(f"{Path(text)}: ")
        raise EvalError(f"--skip-modules {text}: no 'skip_modules' list of names in it ({why}; write one with "
                        "gnmr-hf profile --output DIR)") from None
    except ValueError as e:  # a key named twice: one line naming the file and the key
        raise EvalError(f"--skip-modules: {e}") from None
    int8 = sorted(n for n, r in plan.rungs.items() if r == "int8")
    if int8:
        raise EvalError(f"--skip-modules {text}: a precision-ladder plan with {len(int8)} INT8 linears (e.g. "
                        f"{int8[0]}), not a skip list: score it with --plan {text} (gnmr_hf.load_planned loads "
                        "it as trained)")
    if not plan.planned:
        if plan.data.get("skip_modules") == []:
            raise EvalError(f"--skip-modules {text}: its 'skip_modules' list is empty, which keeps nothing "
                            "unquantised, not even lm_head (leave --skip-modules out for the stock list)")
        raise EvalError(f"--skip-modules {text}: no 'skip_modules' list of names in it (write one with "
                        "gnmr-hf profile --output DIR)")
    try:
        return plan.skip_modules()
    except PlanError as e:
        raise EvalError(f"--skip-modules: {e}") from None


def _kept_linears(model, skip_modules: list[str]) -> tuple[list[str], list[str]]:
    """``(kept, unmatched)``: the loaded model's linears each entry keeps unquantised, by transformers'
    own matching rule, and the entries that keep none."""
    from transformers.quantizers.quantizers_utils import should_convert_module

    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)]
    kept, unmatched = set(), []
    for entry in skip_modules:
        hits = [n for n in linears if not should_convert_module(n, [entry])]
        kept.update(hits)
        if not hits:
            unmatched.append(entry)
    return sorted(kept), unmatched


def _check_skip_modules(precision: str, skip_modules: list[str] | None) -> None:
    if skip_modules is not None and precision == "bf16":
        raise EvalError("--skip-modules names modules to keep unquantised; it needs --precision int8 or nf4")

