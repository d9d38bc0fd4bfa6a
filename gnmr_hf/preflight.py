"""Argument checks that need neither torch nor transformers, run before an entry point's heavy imports.

``gnmr-hf profile`` (and ``eval``, ``export``) and ``recipes/finetune.py`` import torch and transformers before
they look at their arguments; on a busy machine that took 18 s and 49 s before a misspelt model name was
refused. :func:`check_command` and :func:`check_recipe` refuse, in the command's own one line, what the
command would refuse anyway and can be seen without those imports: a model that is no alias, folder or hub id
(with the closest alias suggested), a ``--data`` / ``dataset`` path that does not exist, a budget that does
not parse, a missing ``--config`` file. Anything they cannot judge cheaply passes; the command's own checks
run afterwards as before.
"""

from __future__ import annotations

import glob
import os
from collections.abc import Sequence

from gnmr_hf.memory import parse_budget, parse_memory_budget
from gnmr_hf.offline.gguf_models import ModelNotFoundError, locate_model

# what gnmr-hf profile's --low takes (gnmr_hf.planning.cli._LOW)
_PROFILE_LOWS = ("nf4", "fp4", "int8", "int4", "int4-asym", "q4_0", "q4_1", "q5_0", "q5_1")


def _values(argv: Sequence[str], *names: str) -> dict[str, str]:
    """``--name value`` / ``--name=value`` of ``argv`` (the last one wins), without argparse (which prints and
    exits on what it cannot parse: that is the command's own parser's job)."""
    out: dict[str, str] = {}
    i = 0
    while i < len(argv):
        arg = argv[i]
        if arg == "--":
            break
        key, eq, value = arg.partition("=")
        if key in names:
            if eq:
                out[key] = value
            elif i + 1 < len(argv):
                out[key] = argv[i + 1]
                i += 1
        i += 1
    return out


def _model(name: str) -> str | None:
    try:
        locate_model(name)
    except ModelNotFoundError as e:
        return str(e)
    return None


def check_command(command: str, argv: Sequence[str]) -> str | None:
    """The one-line error ``gnmr-hf COMMAND`` would end with for ``argv``, where it is visible without torch and
    transformers, else None. ``--help`` always passes."""
    if "-h" in argv or "--help" in argv:
        return None
    if command not in ("profile", "eval", "export"):
        return None
    opts = _values(argv, "--model", "--data", "--budget")
    if "--model" in opts:
        why = _model(opts["--model"])
        if why:
            return why
    if command != "profile":
        return None
    data = opts.get("--data")
    if data and not os.path.exists(data):
        return f"--data {data}: no such file or folder"
    if "--budget" in opts:
        try:
            if parse_memory_budget(opts["--budget"], lows=_PROFILE_LOWS) is None:
                parse_budget(opts["--budget"])
        except ValueError as e:
            return (str(e).strip().splitlines() or ["bad --budget"])[0]
    return None


def _config_value(path: str, key: str, _seen: tuple[str, ...] = ()) -> str | None:
    """``key`` of a recipe YAML through its ``include:`` chain (the including file wins), or None where it is
    not set or the file cannot be read (the recipe's own parser reports that)."""
    import yaml

    real = os.path.realpath(path)
    if real in _seen or not os.path.isfile(path):
        return None
    try:
        with open(path, encoding="utf-8") as f:
            data = yaml.safe_load(f) or {}
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None
    if not isinstance(data, dict):
        return None
    if data.get(key) is not None:
        return str(data[key])
    include = data.get("include")
    if include is None:
        return None
    return _config_value(os.path.join(os.path.dirname(path), str(include)), key, (*_seen, real))


def _dataset(name: str) -> str | None:
    """A ``dataset`` that names a local path that does not exist (``text:PATH``, a ``.json``/``.jsonl`` file or
    a path written as one); a hub id or ``generated-arithmetic`` passes."""
    if name.startswith("text:"):
        source = name[len("text:"):]
        if glob.has_magic(source) or os.path.exists(source):
            return None
        return f"dataset {name}: {source} is neither a folder, a file nor a glob that matches files"
    if os.path.exists(name):
        return None
    if name.endswith((".json", ".jsonl")) or name.startswith(("./", "../", "/", "~")):
        return f"dataset {name}: no such file or folder (a .json/.jsonl file or folder of them, a hub id, " \
               "generated-arithmetic or text:PATH)"
    return None


def check_recipe(argv: Sequence[str]) -> str | None:
    """The one-line error ``recipes/finetune.py`` would end with for ``argv``, where it is visible without
    transformers (the recipe's parser is ``transformers.HfArgumentParser``), else None: the ``--config`` file
    missing, its ``model`` (or ``--model``) no alias, folder or hub id, its ``dataset`` a missing path."""
    if "-h" in argv or "--help" in argv:
        return None
    opts = _values(argv, "--config", "--model", "--dataset")
    config = opts.get("--config")
    if config and not os.path.isfile(config):
        return f"config file {config} not found"
    model = opts.get("--model") or (_config_value(config, "model") if config else None)
    if model:
        why = _model(model)
        if why:
            return why
    dataset = opts.get("--dataset") or (_config_value(config, "dataset") if config else None)
    if dataset:
        return _dataset(dataset)
    return None
