"""Serving groups: the linears a server fuses into one module, read from the architecture.

vLLM loads q/k/v of a LLaMA-style layer into one ``...self_attn.qkv_proj`` module and gate/up into one
``...mlp.gate_up_proj``; o_proj and down_proj stay single. A fused module has one quantisation method, so
a plan that keeps ``v_proj`` in BF16 but quantises ``q_proj`` cannot be served by vLLM: it needs every
member of a group on the same rung. This module says which linears form a group for a given architecture
(:data:`VLLM_FUSED`, transcribed from vLLM's ``packed_modules_mapping``), which groups a plan splits, and how
vLLM matches the skip list of a bitsandbytes checkpoint against its own (fused) module names.

- :func:`serving_groups`: the groups of a model, each with vLLM's module name and its transformers linears;
  an architecture without a known layout is refused in one line naming the linears found.
- :func:`split_groups`: the groups a plan (a set of kept linears, or a ``{linear: rung}`` mapping) splits.
- :func:`is_layer_skipped_bnb`: vLLM's rule for ``llm_int8_skip_modules``, applied to vLLM's names;
  :func:`vllm_skip_entries`: the fused aliases a skip list needs so vLLM keeps a whole kept group unquantised.
- :func:`purchases` / :func:`grouped_ladder_units` / :func:`expand_rungs`: a plan over groups instead of
  linears (a group's price and gain are the sums of its members'), for ``plan(...)`` and ``choose_rungs``.

Sources (vLLM, read 2026-12-06 through the code index): ``packed_modules_mapping`` of ``LlamaForCausalLM``
(vllm/model_executor/models/llama.py @ 0035bdf2b1ac; ``MistralForCausalLM`` is registered to the same class,
vllm/model_executor/models/registry.py), ``Qwen2ForCausalLM`` (qwen2.py @ 013a27925170), ``Qwen3ForCausalLM``
(qwen3.py @ 002456df36fc), ``Gemma2ForCausalLM`` (gemma2.py @ 025adfb93174), ``Gemma3ForCausalLM`` (gemma3.py @
004dc924965c), ``Olmo2ForCausalLM`` (olmo2.py @ 028aedf62ade), ``Phi3ForCausalLM`` (phi3.py @ d3390218a7f8: already
fused in transformers, each group maps to itself); ``is_layer_skipped_bnb``
(vllm/model_executor/layers/quantization/bitsandbytes.py @ 01f5395fdf04); compressed-tensors' fused-layer rule
``should_ignore_layer`` / ``_match_fused_layer`` (vllm/model_executor/layers/quantization/compressed_tensors/
utils.py @ 008014e8503b).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from torch import nn

from gnmr_hf.backends.base import DualPathModule
from gnmr_hf.backends.checkpoint import canonical_name
from gnmr_hf.units import unwrap_model

#: what vLLM fuses, per transformers architecture: fused module -> its members (vLLM's packed_modules_mapping)
_LLAMA_STYLE = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}
VLLM_FUSED: dict[str, dict[str, tuple[str, ...]]] = {
    "LlamaForCausalLM": _LLAMA_STYLE,
    "MistralForCausalLM": _LLAMA_STYLE,
    "Qwen2ForCausalLM": _LLAMA_STYLE,
    "Qwen3ForCausalLM": _LLAMA_STYLE,
    "Gemma2ForCausalLM": _LLAMA_STYLE,
    "Gemma3ForCausalLM": _LLAMA_STYLE,
    "Olmo2ForCausalLM": _LLAMA_STYLE,
    "Phi3ForCausalLM": {"qkv_proj": ("qkv_proj",), "gate_up_proj": ("gate_up_proj",)},
}
#: the decoder linears vLLM keeps single (its module name is the transformers one)
VLLM_SINGLE: dict[str, tuple[str, ...]] = {arch: ("o_proj", "down_proj") for arch in VLLM_FUSED}


@dataclass(frozen=True)
class ServingGroup:
    """One module at serving time: vLLM's ``name`` and the transformers linears it is loaded from."""

    name: str  # model.layers.3.self_attn.qkv_proj (vLLM); a single linear's own name
    members: tuple[str, ...]  # model.layers.3.self_attn.q_proj, ... (transformers, checkpoint order)

    @property
    def fused(self) -> bool:
        """True when vLLM's module is not one of the transformers linears (an alias is needed)."""
        return self.members != (self.name,)


class ServingLayoutError(ValueError):
    """A model whose serving layout is unknown, or whose linears do not fit it (one line)."""


# why the bitsandbytes routes refuse a plan of gnmr-hf profile --low int4 (gnmr_hf.planning.int4)
INT4_PROFILE = "profiled against the compressed-tensors INT4 export: export it with --format compressed-tensors"


def architecture_of(model: Any) -> str:
    """The transformers architecture name of a model (its class), a config (``architectures[0]``) or a string."""
    if isinstance(model, str):
        return model
    archs = getattr(model, "architectures", None)
    if archs and not hasattr(model, "named_modules"):
        return str(archs[0])
    return type(unwrap_model(model)).__name__


def decoder_linears(model: Any) -> list[str]:
    """The linears inside the decoder layers of ``model`` (plain, bitsandbytes, PEFT-wrapped or dual-path),
    by their transformers names (``model.layers.3.self_attn.v_proj``), in module order."""
    out: dict[str, None] = {}
    for name, m in unwrap_model(model).named_modules():
        name = canonical_name(name)
        parts = name.split(".")
        if "layers" in parts[:-1] and not any(p.startswith("lora_") for p in parts) \
                and isinstance(m, (nn.Linear, DualPathModule)):
            out[name] = None
    return list(out)


def _leaf_summary(names: Iterable[str]) -> str:
    counts: dict[str, int] = {}
    for n in names:
        leaf = n.rsplit(".", 1)[-1]
        counts[leaf] = counts.get(leaf, 0) + 1
    return ", ".join(f"{leaf} x{c}" for leaf, c in counts.items()) or "none"


def serving_groups(model: Any, linears: Sequence[str] | None = None) -> list[ServingGroup]:
    """The serving groups of ``model``'s decoder linears, in module order (each linear in exactly one).

    Args:
        model: a transformers model (plain, quantised, PEFT-wrapped or dual-path), a config, or an
            architecture name such as ``"LlamaForCausalLM"`` (then ``linears`` is required).
        linears: the decoder linears' transformers names (default: :func:`decoder_linears` of ``model``).

    Raises:
        ServingLayoutError: an architecture vLLM's fused layout is not known for, or linears that do not
            fit it (an unexpected linear, a fused group missing a member): one line naming what was found.
    """
    arch = architecture_of(model)
    if linears is None:
        if isinstance(model, str) or not hasattr(model, "named_modules"):
            raise ValueError("serving_groups(architecture, linears=[...]): give the decoder linears' names")
        linears = decoder_linears(model)
    linears = list(linears)
    fused = VLLM_FUSED.get(arch)
    if fused is None:
        raise ServingLayoutError(f"{arch}: no known vLLM fused layout (known: {', '.join(sorted(VLLM_FUSED))}); its "
                                 f"decoder linears: {_leaf_summary(linears)}")
    member_of = {leaf: group for group, members in fused.items() for leaf in members}
    singles = set(VLLM_SINGLE[arch])
    odd = [n for n in linears if n.rsplit(".", 1)[-1] not in member_of and n.rsplit(".", 1)[-1] not in singles]
    if odd:
        raise ServingLayoutError(f"{arch}: linear(s) outside vLLM's layout for it, e.g. {odd[0]} ({len(odd)} in all; "
                                 f"decoder linears: {_leaf_summary(linears)})")
    groups: dict[str, list[str]] = {}
    for n in linears:
        parent, _, leaf = n.rpartition(".")
        key = f"{parent}.{member_of[leaf]}" if leaf in member_of else n
        groups.setdefault(key, []).append(n)
    out = []
    for key, members in groups.items():
        parent, _, leaf = key.rpartition(".")
        if leaf in fused:
            order = [f"{parent}.{m}" for m in fused[leaf]]
            if sorted(members) != sorted(order):
                missing = sorted(set(order) - set(members))
                raise ServingLayoutError(f"{arch}: the fused group {key} lacks {', '.join(missing)} (found "
                                         f"{', '.join(members)}): not the layout vLLM loads")
            members = order
        out.append(ServingGroup(key, tuple(members)))
    return out


def split_groups(kept: Iterable[str] | Mapping[str, str], groups: Sequence[ServingGroup]) -> list[ServingGroup]:
    """The groups a plan splits: some members kept and others not (``kept``: linear names), or, for a
    ``{linear: rung}`` mapping, members on different rungs (a linear not in the mapping is on the low path)."""
    rung = dict(kept) if isinstance(kept, Mapping) else {n: "kept" for n in kept}
    return [g for g in groups if len({rung.get(m, "low") for m in g.members}) > 1]


def describe_split(split: Sequence[ServingGroup], kept: Iterable[str] | Mapping[str, str], limit: int = 3) -> str:
    """``model.layers.0.self_attn.qkv_proj (q_proj low, k_proj bf16, v_proj bf16), ...`` for a message."""
    rung = dict(kept) if isinstance(kept, Mapping) else {n: "kept" for n in kept}

    def member(m: str) -> str:
        return f"{m.rsplit('.', 1)[-1]} {rung.get(m, 'low')}"

    parts = [f"{g.name} ({', '.join(member(m) for m in g.members)})" for g in split[:limit]]
    more = f" and {len(split) - limit} more" if len(split) > limit else ""
    return "; ".join(parts) + more


# ----------------------------------------------------------------------------------------- vLLM's rules


def is_layer_skipped_bnb(prefix: str, llm_int8_skip_modules: Sequence[str]) -> bool:
    """vLLM's ``is_layer_skipped_bnb`` (bitsandbytes.py, see the module docstring): ``prefix`` (a vLLM module
    name such as ``model.layers.3.self_attn.qkv_proj``) stays unquantised when an entry equals one of its
    dotted components or one of its leading dotted parts."""
    components = prefix.split(".")
    substr_check = any(entry in components for entry in llm_int8_skip_modules)
    leading = {".".join(components[: i + 1]) for i in range(len(components))}
    return substr_check or bool(leading & set(llm_int8_skip_modules))


def vllm_linear_names(groups: Sequence[ServingGroup]) -> list[str]:
    """vLLM's names of the decoder's linear modules (one per group)."""
    return [g.name for g in groups]


def vllm_skip_entries(kept: Iterable[str], groups: Sequence[ServingGroup]) -> list[str]:
    """The fused aliases to add to ``llm_int8_skip_modules`` so vLLM keeps every fully kept fused group
    unquantised (``model.layers.3.self_attn.qkv_proj``); a single linear's own name already serves. A split
    group gets no alias (:func:`split_groups` finds those)."""
    kept = set(kept)
    return [g.name for g in groups if g.fused and all(m in kept for m in g.members)]


def _ct_match(name: str, target: str) -> bool:
    import re

    return bool(re.match(target[3:], name)) if target.startswith("re:") else name == target


def vllm_ct_scheme(layer_name: str, config_groups: Mapping[str, Mapping[str, Any]], ignore: Sequence[str],
                   fused: Mapping[str, Sequence[str]]) -> str | None:
    """The ``config_groups`` key vLLM's compressed-tensors loader gives the vLLM module ``layer_name`` (None:
    left unquantised), by its rule (compressed_tensors/utils.py, see the module docstring): a fused module's
    members must all be ignored or none (else vLLM raises: a ValueError here too), and match by its members'
    names, the first member's target deciding. Class-name targets (``Linear``) are not modelled: the
    exporter names every linear."""
    leaf = layer_name.rsplit(".", 1)[-1]
    if leaf in fused and layer_name not in ignore:
        shards = [layer_name[: -len(leaf)] + s for s in fused[leaf]]
        skipped = {any(_ct_match(s, t) for t in ignore) for s in shards}
        if len(skipped) > 1:
            raise ValueError(f"Found a different quantization schemes for {list(fused[leaf])} in {layer_name}. "
                             "vLLM requires all to use the same scheme.")
        if skipped.pop():
            return None
    elif any(_ct_match(layer_name, t) for t in ignore):
        return None
    target_of = {t: key for key, g in config_groups.items() for t in g.get("targets", [])}
    for t, key in target_of.items():
        if _ct_match(layer_name, t):
            return key
    if leaf in fused:
        shards = [layer_name[: -len(leaf)] + s for s in fused[leaf]]
        firsts = [next((t for t in target_of if _ct_match(s, t)), None) for s in shards]
        if all(firsts):
            return target_of[firsts[0]]
    return None


# ------------------------------------------------------------------------------- planning over groups


def purchases(unit_modules: Sequence[Sequence[str]], groups: Sequence[ServingGroup]) -> list[list[int]]:
    """The units bought together when a plan may not split a serving group: ``unit_modules[i]`` are unit i's
    linears (a profile's ``UnitScore.modules``); units sharing a group are one purchase (connected
    components), each a sorted list of unit indices, in order of their first unit. With one unit per linear
    a purchase is a group; with one unit per layer, a unit.

    Wiring into the greedy planner (a purchase's score and bytes are its units' sums)::

        buys = purchases([u.modules for u in profile.units], groups)
        picked = greedy_select(purchase_totals(buys, scores), purchase_totals(buys, sizes), budget)
        chosen = sorted(i for b in picked for i in buys[b])
    """
    parent = list(range(len(unit_modules)))

    def find(i: int) -> int:
        while parent[i] != i:
            parent[i] = parent[parent[i]]
            i = parent[i]
        return i

    unit_of: dict[str, int] = {}
    for i, mods in enumerate(unit_modules):
        for m in mods:
            unit_of[m] = i
    for g in groups:
        owners = [unit_of[m] for m in g.members if m in unit_of]
        for o in owners[1:]:
            parent[find(o)] = find(owners[0])
    comps: dict[int, list[int]] = {}
    for i in range(len(unit_modules)):
        comps.setdefault(find(i), []).append(i)
    return sorted(comps.values(), key=lambda c: c[0])


def purchase_totals(buys: Sequence[Sequence[int]], values: Sequence[float]) -> list[float]:
    """Each purchase's sum of ``values`` (unit scores, or bytes)."""
    return [sum(values[i] for i in b) for b in buys]


def grouped_ladder_units(units: Sequence[Any], groups: Sequence[ServingGroup]) -> list[Any]:
    """One :class:`~gnmr_hf.planning.ladder.LadderUnit` per serving group (named by vLLM's module name), its
    ``numel``, ``rows``, per-rung ``gains`` and ``prices`` the sums of its members' (one rung for the whole
    group). ``choose_rungs`` on them plans whole groups; :func:`expand_rungs` maps the result back::

        chosen = expand_rungs(choose_rungs(grouped_ladder_units(units, groups), budget), groups)
    """
    by = {u.name: u for u in units}
    missing = [m for g in groups for m in g.members if m not in by]
    if missing or len(by) != sum(len(g.members) for g in groups):
        extra = sorted(set(by) - {m for g in groups for m in g.members})
        raise ValueError(f"the ladder units are not the groups' linears: {len(missing)} member(s) without a unit "
                         f"(e.g. {missing[:1]}), {len(extra)} unit(s) in no group (e.g. {extra[:1]})")
    out = []
    for g in groups:
        us = [by[m] for m in g.members]
        rungs = list(us[0].gains)
        # the units' own class (ladder.LadderUnit), so that this module imports nothing of the ladder's back
        out.append(type(us[0])(name=g.name, numel=sum(u.numel for u in us), rows=sum(u.rows for u in us),
                              gains={r: sum(u.gains[r] for u in us) for r in rungs},
                              prices={r: sum(u.prices[r] for u in us) for r in rungs}))
    return out


def expand_rungs(chosen: Mapping[str, str], groups: Sequence[ServingGroup]) -> dict[str, str]:
    """``{group name: rung}`` (a plan over :func:`grouped_ladder_units`) as ``{linear: rung}``."""
    by = {g.name: g for g in groups}
    unknown = [n for n in chosen if n not in by]
    if unknown:
        raise ValueError(f"{len(unknown)} planned name(s) are no serving group, e.g. {unknown[0]}")
    return {m: r for n, r in chosen.items() for m in by[n].members}
