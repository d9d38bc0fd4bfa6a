"""The skip list: the ``llm_int8_skip_modules`` names that load a plan's linears unquantised."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from gnmr_hf.planning.plan import skip_list
from gnmr_hf.planning.results import SensitivityProfile


class ChosenLinears(Protocol):
    """What :func:`skip_modules` reads of a plan: a :class:`gnmr_hf.planning.planner.PrecisionPlan` has both (the
    planner imports this module, so this module names it by its fields)."""

    modules: Sequence[str]
    keep_modules: Sequence[str]


def skip_modules(chosen: ChosenLinears | SensitivityProfile | Sequence[str], keep: Sequence[str] | None = None) -> list[str]:
    """The ``llm_int8_skip_modules`` list that loads exactly the planned linears unquantised.

    Use it with a stock ``BitsAndBytesConfig(load_in_4bit=True, ..., llm_int8_skip_modules=list)`` (or
    ``load_in_8bit``). The entries are the linears' full qualified names (``model.layers.1.self_attn.v_proj``):
    transformers 5 matches an entry from the start of a module name up to a module boundary, or as a
    suffix, and older versions as a substring followed by ``.`` or as the whole name; a full name matches
    only itself (and its children) under every one of these rules, so ``model.layers.1.…`` never catches
    ``model.layers.11.…``. A given list *replaces* transformers' default (which keeps the output embedding
    ``lm_head`` unquantised), so the profile's default-kept modules come first.

    Args:
        chosen: a :class:`PrecisionPlan`, or qualified module names.
        keep: modules to keep unquantised besides the plan's (default: the plan's ``keep_modules``, i.e.
            what transformers keeps when no list is given; ``[]`` for none).
    """
    if isinstance(chosen, SensitivityProfile):
        raise TypeError("skip_modules takes a plan: skip_modules(gnmr_hf.plan(profile, budget_fraction=0.1))")
    elif hasattr(chosen, "modules") and hasattr(chosen, "keep_modules"):  # a PrecisionPlan (read by its fields,
        modules, default_keep = list(chosen.modules), chosen.keep_modules  # so this module imports no planner)
    else:
        modules, default_keep = [str(m) for m in chosen], ["lm_head"]
    return skip_list(modules, default_keep if keep is None else keep)


