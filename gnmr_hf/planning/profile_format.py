"""The contract of a sensitivity profile's dict (``profile.json``, docs/profile.md), checked field by field:
:func:`check_profile_dict`. Imports nothing of the package, so that both the profile type
(:mod:`gnmr_hf.planning.results`) and the plan reader (:mod:`gnmr_hf.planning.plan`) check a file by it without
importing each other.
"""

from __future__ import annotations

from typing import Any

#: the profile.json format this gnmr_hf reads and writes
FORMAT_VERSION = 1


def _is_int(v: Any) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _is_number(v: Any) -> bool:
    return (isinstance(v, (int, float)) and not isinstance(v, bool)) or v is None


def _check_profile_dict(data: Any) -> None:
    """The contract of a profile dict / ``profile.json`` (docs/profile.md): one-line ValueError naming the field."""
    if not isinstance(data, dict):
        raise ValueError(f"not a sensitivity profile: a JSON object was expected, got {type(data).__name__}")
    if "units" not in data or "losses" not in data:
        raise ValueError("not a sensitivity profile (no 'units' / 'losses')")
    fmt = data.get("format", FORMAT_VERSION)  # every profile ever written has it; a hand-built dict may not
    if fmt != FORMAT_VERSION or not _is_int(fmt):
        raise ValueError(f"format {fmt!r} is not a profile format this gnmr_hf reads (it reads {FORMAT_VERSION})")
    for key in ("criteria", "costs", "batches", "tokens"):
        if key not in data:
            raise ValueError(f"missing field {key!r} (a profile holds format, units, losses, criteria, costs, "
                             "batches, tokens)")

    def need(ok: bool, field_name: str, what: str, value: Any) -> None:
        if not ok:
            shown = repr(value)
            shown = shown if len(shown) <= 60 else shown[:57] + "..."
            raise ValueError(f"{field_name} must be {what}, got {type(value).__name__} {shown}")

    losses = data["losses"]
    need(isinstance(losses, dict), "losses", "an object with low and high", losses)
    for key in ("low", "high"):
        if key not in losses:
            raise ValueError(f"missing field 'losses.{key}'")
        need(_is_number(losses[key]) and losses[key] is not None, f"losses.{key}", "a number", losses[key])
    crit = data["criteria"]
    need(isinstance(crit, list) and all(isinstance(c, str) for c in crit), "criteria", "a list of names", crit)
    need(isinstance(data["costs"], dict), "costs", "an object", data["costs"])
    for key in ("batches", "tokens"):
        need(_is_int(data[key]) and data[key] >= 1, key, "an integer >= 1", data[key])
    for key, kind in (("keep_modules", list), ("skipped", dict), ("meta", dict)):
        if key in data:
            need(isinstance(data[key], kind), key, "a list" if kind is list else "an object", data[key])
    keep = data.get("keep_modules", [])
    need(all(isinstance(m, str) for m in keep), "keep_modules", "a list of module names", keep)
    meta = data.get("meta", {})
    for key in ("batch_tokens", "batch_digests"):
        if key in meta:
            kind = _is_int if key == "batch_tokens" else (lambda v: isinstance(v, str))
            need(isinstance(meta[key], list) and len(meta[key]) == data["batches"] and all(kind(v) for v in meta[key]),
                 f"meta.{key}", f"a list of {data['batches']} {'integers' if key == 'batch_tokens' else 'strings'}",
                 meta[key])
    units = data["units"]
    need(isinstance(units, list) and units, "units", "a non-empty list", units)
    names = None
    for i, u in enumerate(units):
        where = f"units[{i}]"
        need(isinstance(u, dict), where, "an object", u)
        for key in ("index", "name", "modules", "bytes", "scores"):
            if key not in u:
                raise ValueError(f"missing field '{where}.{key}'")
        need(_is_int(u["index"]), f"{where}.index", "an integer", u["index"])
        if u["index"] != i:
            raise ValueError(f"{where}.index is {u['index']}, not its position {i}: units must be listed in index "
                             "order, each once, none missing (plans and set_active_units count positions)")
        need(isinstance(u["name"], str), f"{where}.name", "a string", u["name"])
        need(isinstance(u["modules"], list) and all(isinstance(m, str) for m in u["modules"]), f"{where}.modules",
             "a list of module names", u["modules"])
        need(_is_int(u["bytes"]) and u["bytes"] >= 0, f"{where}.bytes", "an integer >= 0", u["bytes"])
        if u.get("layer") is not None:
            need(_is_int(u["layer"]) and u["layer"] >= 0, f"{where}.layer", "an integer >= 0 or null", u["layer"])
        if "op" in u:
            need(isinstance(u["op"], str), f"{where}.op", "a string", u["op"])
        sc = u["scores"]
        need(isinstance(sc, dict) and all(_is_number(v) for v in sc.values()), f"{where}.scores",
             "an object of score name -> number (or null)", sc)
        if names is None:
            names = set(sc)
        elif set(sc) != names:
            raise ValueError(f"{where}.scores has {sorted(sc)}, units[0].scores {sorted(names)}: every unit needs "
                             "the same scores")
    if not any(u["bytes"] > 0 for u in units):
        raise ValueError("units: every unit has 0 bytes (nothing to plan)")


#: the public name of the profile contract's check
check_profile_dict = _check_profile_dict
