"""The output-folder contract every exporter keeps (``gnmr-hf export``; any later exporter reuses it).

An export writes a whole folder, and ``--force`` replaces one, so the folder it may write is checked
before anything is loaded or written (:func:`check_output`, one-line :class:`OutputFolderError`):

- refused outright: an output that is, holds (is a parent of) or lies inside a protected folder (the model
  folder the export reads, the adapter folder; the profile's folder: is or holds), an output that is the
  current folder or one of its parents, an existing file or a symbolic link;
- an existing empty folder is written;
- an existing non-empty folder is refused unless ``force``; with ``force`` it is replaced only when an
  earlier export wrote it: it holds the marker file :data:`MARKER` (``.gnmr_export.json``, written into
  every export, listing the files it wrote) and no file the export did not write (a user's notes, a
  ``.git`` folder are not deleted).

The folder is built beside the target (:func:`staged_output`: a hidden temporary folder in the same parent)
and moved into place by rename: the old export renamed aside, the new one renamed in, the old one removed
last. An exception while writing (a full disk, Ctrl-C) removes the temporary folder and leaves the old
export as it was; at no point is anything deleted before the new folder is complete. The folder and its files
get the modes the umask gives new ones (0755 / 0644 under the usual 022), so a server running as another user
reads them: the temporary folder is private and transformers writes ``model.safetensors`` 0600.

Both exports also check their inputs the same way (:func:`check_sources`): the plan against the model, as
``load_planned`` and ``gnmr-hf eval --plan`` check it (the ``model_identity`` it records, else the shapes of its
units), and the adapter against the model, as ``gnmr-hf eval --adapter`` checks it (``check_adapter_matches``).
What an export writes to travel (the model card, :data:`MARKER`) names the model and the adapter
(:func:`model_name`, :func:`folder_name`), never a folder of this machine.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from gnmr_hf.offline.gguf_models import model_name as name_of

MARKER = ".gnmr_export.json"
_WRITTEN_BY = "gnmr_hf export"


class ExportError(ValueError):
    """Bad input to an export, refused before anything is written (one line).

    Lives here, with the output-folder contract both exports share, so that neither export module imports the
    other at the top (``gnmr_hf.export`` re-exports it)."""


def plan_file(plan: str | os.PathLike) -> Path:
    """A plan given to an export: a ``profile.json``, or the folder holding one; one ``ExportError`` line when
    there is none."""
    from gnmr_hf.planning.plan import PlanError
    from gnmr_hf.planning.plan import plan_file as _plan_file

    try:
        return _plan_file(plan)  # a folder means DIR/profile.json: the rule lives in gnmr_hf.planning.plan
    except PlanError as e:
        raise ExportError(f"no such profile.json: {e}") from None


def check_model_folder(model_path: Path) -> dict[str, Any]:
    """The source of an export: a BF16 checkpoint folder (config.json, .safetensors weights, not quantised);
    its config. One ``ExportError`` line otherwise."""
    if not (model_path / "config.json").is_file():
        raise ExportError(f"{model_path} is not a model folder (no config.json)")
    if not list(model_path.glob("*.safetensors")):
        raise ExportError(f"{model_path} holds no .safetensors weights (the BF16 checkpoint is needed)")
    config = json.loads((model_path / "config.json").read_text())
    if config.get("quantization_config"):
        raise ExportError(f"{model_path} is quantised already (its config.json has a quantization_config): "
                          "export from the original BF16 checkpoint")
    return config


def model_name(model: str | os.PathLike) -> str:
    """How a record meant to travel names a model: :func:`gnmr_hf.offline.gguf_models.model_name` (the alias, the hub
    id, else the folder's base name; never a folder of this machine)."""
    return name_of(model)


def folder_name(folder: str | os.PathLike) -> str:
    """How a record meant to travel names a folder of the user's (an adapter, a plan's folder): its base name."""
    return Path(str(folder).rstrip("/") or str(folder)).name or str(folder)


def check_sources(model_path: str | os.PathLike, plan_path: str | os.PathLike | None, plan: dict[str, Any],
                  adapter: str | os.PathLike | None = None, meta: Any = None) -> None:
    """The plan and the adapter an export reads are ``model_path``'s: one ``ExportError`` line naming what differs.

    Both exports call this, with the checks ``load_planned`` / ``gnmr-hf eval --plan`` and ``gnmr-hf eval
    --adapter`` make, not copies of them:
    - the plan file (``plan_path``, its JSON ``plan``; None for rungs given as a mapping, which are not
      checked): :func:`gnmr_hf.planning.ladder._check_same_model`, the ``model_identity`` it records (a hash
      of the config and a fingerprint of the weights: another model with the same layer names and shapes, a
      fine-tune merged into the weights are refused), else the shapes of the units it records;
    - the adapter: :func:`gnmr_hf.evaluation.evaluate.check_adapter_matches`, its target modules and every
      LoRA matrix's shape against the model's linears (``meta``: the model on the meta device, built from
      config.json when not given), so that an adapter of another model (other layers, another width) is not
      merged or shipped beside it.
    """
    if plan_path is not None:
        from gnmr_hf.planning.ladder import _check_same_model

        try:
            _check_same_model(Path(plan_path), plan, model_path,
                              fix="export the model the plan was made for, or plan this one (gnmr-hf profile)")
        except ValueError as e:
            raise ExportError(str(e)) from None
    if adapter is not None:
        from gnmr_hf.evaluation.evaluate import EvalError, check_adapter_matches

        if meta is None:
            from gnmr_hf.planning.ladder import _meta_model

            meta = _meta_model(model_path)
        try:
            check_adapter_matches(meta, adapter, base=f"the model {model_path}")
        except EvalError as e:
            raise ExportError(str(e)) from None


class OutputFolderError(ValueError):
    """An output folder an export may not write or replace (one line)."""


def read_marker(folder: str | os.PathLike) -> dict[str, Any] | None:
    """The marker an earlier export wrote into ``folder`` (None when there is none, or it is not one)."""
    path = Path(folder) / MARKER
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(data, dict) or data.get("written_by") != _WRITTEN_BY or not isinstance(data.get("files"), list):
        return None
    return data


def _files(folder: Path) -> list[str]:
    """Every file under ``folder`` (symbolic links as files), relative, sorted."""
    out = []
    for root, dirs, files in os.walk(folder):
        rel = Path(root).relative_to(folder)
        out += [(rel / f).as_posix() for f in files]
        out += [(rel / d).as_posix() for d in dirs if (Path(root) / d).is_symlink()]
    return sorted(out)


def _describe(label: str, path: Path) -> str:
    return f"the {label} ({path})"


def check_output(out_dir: str | os.PathLike, force: bool = False,
                 protect: Sequence[tuple[str, str | os.PathLike, bool]] = ()) -> Path:
    """Check that ``out_dir`` may be written (see the module docstring); returns it resolved.

    Args:
        out_dir: the folder to write.
        force: replace an earlier export there.
        protect: ``(label, folder, refuse_inside)`` per folder the export reads or that must survive it:
            the output may not be it nor hold it, nor (with ``refuse_inside``) lie inside it.

    Raises:
        OutputFolderError: one line naming the folder and why.
    """
    given = Path(out_dir).expanduser()
    if given.is_symlink():
        raise OutputFolderError(f"output folder {given} is a symbolic link: give the folder itself")
    out = given.resolve()
    for label, folder, refuse_inside in protect:
        p = Path(folder).expanduser().resolve()
        if out == p:
            raise OutputFolderError(f"output folder {given} is {_describe(label, p)}: the export never writes over it; "
                                    "choose another folder")
        if out in p.parents:
            raise OutputFolderError(f"output folder {given} holds {_describe(label, p)}: the export never writes over "
                                    "it; choose another folder")
        if refuse_inside and p in out.parents:
            raise OutputFolderError(f"output folder {given} lies inside {_describe(label, p)}: choose a folder outside it")
    cwd = Path.cwd().resolve()
    if out == cwd:
        raise OutputFolderError(f"output folder {given} is the current folder: give a new folder for the export")
    if out in cwd.parents:
        raise OutputFolderError(f"output folder {given} holds the current folder ({cwd}): give a new folder for the export")
    if not out.exists():
        above = next((p for p in out.parents if p.exists()), None)
        if above is not None and not above.is_dir():
            raise OutputFolderError(f"output folder {given}: {above} is a file, not a folder")
        return out
    if not out.is_dir():
        raise OutputFolderError(f"output folder {given} is a file, not a folder")
    present = _files(out)
    if not present and not any(out.iterdir()):
        return out
    if not force:
        raise OutputFolderError(f"output folder {given} exists and is not empty: choose another folder or pass --force "
                                f"(which replaces only a folder an earlier export wrote)")
    marker = read_marker(out)
    if marker is None:
        raise OutputFolderError(f"output folder {given} is not a folder an earlier export wrote (no {MARKER} in it): "
                                "--force replaces only an export; choose another folder or remove it yourself")
    foreign = sorted(set(present) - set(marker["files"]) - {MARKER})
    if foreign:
        raise OutputFolderError(f"output folder {given} is an earlier export holding {len(foreign)} file(s) the export did "
                                f"not write (e.g. {foreign[0]}): --force would delete them; move them out first")
    return out


def _install(new: Path, out: Path) -> None:
    """Move the finished folder ``new`` to ``out``: the old one renamed aside, the new one in, the old removed last."""
    if not out.exists():
        os.rename(new, out)
        return
    aside = Path(tempfile.mkdtemp(prefix=f".{out.name}-old-", dir=out.parent))
    os.replace(out, aside)  # onto the empty placeholder: an atomic rename, nothing deleted
    try:
        os.rename(new, out)
    except BaseException:
        os.replace(aside, out)  # put the old export back
        raise
    shutil.rmtree(aside, ignore_errors=True)


def _umask() -> int:
    """The process's umask (read by setting it and putting it back)."""
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def _readable(folder: Path) -> None:
    """``folder`` and everything under it at the modes the umask gives a new one: mkdtemp makes ``folder`` private
    (0700), transformers' save_pretrained writes ``model.safetensors`` private (0600 under any umask), and an export
    is read by servers that may run as another user."""
    mask = _umask()
    for f in [folder, *folder.rglob("*")]:
        os.chmod(f, (0o777 if f.is_dir() else 0o666) & ~mask)


@contextmanager
def staged_output(out: Path, marker: dict[str, Any]) -> Iterator[Path]:
    """A temporary folder beside ``out`` (checked by :func:`check_output`) to write the export into.

    On a normal exit the marker (``marker`` plus the list of files written) goes into it and it is moved
    into place (:func:`_install`); on an exception it is removed and ``out`` is left as it was.
    """
    out.parent.mkdir(parents=True, exist_ok=True)
    new = Path(tempfile.mkdtemp(prefix=f".{out.name}-new-", dir=out.parent))
    try:
        yield new
        if out.is_dir() and any(out.iterdir()) and read_marker(out) is None:  # filled since check_output
            raise OutputFolderError(f"output folder {out} was filled while the export ran and is not an export: "
                                    "left as it is")
        files = _files(new)
        _readable(new)
        (new / MARKER).write_text(json.dumps({**marker, "written_by": _WRITTEN_BY, "files": files}, indent=1) + "\n")
        _install(new, out)
    finally:
        if new.exists():
            shutil.rmtree(new, ignore_errors=True)
