"""Issue 52, items 1, 13 and the card half of 3: what `gnmr-hf export` may write, and what its model card says.

Item 1: an output that is (or holds, or lies inside) the model folder, is or holds the adapter's or the
profile's folder, or is the current folder or a parent of it is refused in one line, with or without
--force, and nothing at all is touched; --force replaces only an earlier export (its .gnmr_export.json
marker), by rename, the old one removed only once the new one is in place; an export interrupted while
writing or while renaming leaves the old export as it was and no half-written folder. Every test snapshots
every file's bytes and mtime (and, on refusals, every folder's) in the whole workspace around the output.

Item 13 / 3: the card names the model (no absolute path), labels the gap closed in-sample on the profile's
batch count, gives the held-out figure when measured, points at the measured after-training results, and its
fine-tune command names the BF16 source with a recipe that parses, not the exported folder.

The plans here are free (they split groups vLLM fuses), so every export is written with --target transformers.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import stat
from pathlib import Path

import pytest
import torch

from tests.test_architectures import _build
from tests.test_dual_path import load

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import gnmr_hf  # noqa: E402
from gnmr_hf import export  # noqa: E402

MARKER = ".gnmr_export.json"
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """A tiny Llama (in a folder named like the offline alias, as gguf_checkpoint writes it), a profile.json
    with a plan measured in-sample on 2 batches and held out on 1, one without a held-out figure, an adapter."""
    root = tmp_path_factory.mktemp("export_r4")
    path = _build("llama", root / "smollm2-135m-instruct")
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": (x := torch.randint(0, 128, (2, 12), generator=g)), "labels": x} for _ in range(3)]
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    prof = gnmr_hf.profile_sensitivity(model, batches[:2], criteria=("first_order",))
    with_h = gnmr_hf.plan(prof, budget_fraction=0.3, model=model, batches=batches[:2], heldout=batches[2:])
    no_h = gnmr_hf.plan(prof, budget_fraction=0.3, model=model, batches=batches[:2])
    prof.to_json(root / "prof" / "profile.json", skip_modules=with_h.skip_modules(), plan=with_h.to_dict(),
                 command="gnmr-hf profile --batches 2 --heldout-batches 1")
    prof.to_json(root / "prof_noh" / "profile.json", skip_modules=no_h.skip_modules(), plan=no_h.to_dict())
    from transformers import AutoModelForCausalLM

    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(root / "adapter")
    return {"root": root, "model": path, "plan": with_h, "plan_noh": no_h}


@pytest.fixture
def ws(made, tmp_path, monkeypatch):
    """A user's workspace: models/<model>, runs/prof, ads/ad, work/deep (the current folder), user files."""
    w = tmp_path / "ws"
    shutil.copytree(made["model"], w / "models" / made["model"].name)
    shutil.copytree(made["root"] / "prof", w / "runs" / "prof")
    shutil.copytree(made["root"] / "prof_noh", w / "runs" / "prof_noh")
    shutil.copytree(made["root"] / "adapter", w / "ads" / "ad")
    (w / "work" / "deep").mkdir(parents=True)
    (w / "work" / "notes.txt").write_text("my notes")
    (w / "work" / "deep" / "data.jsonl").write_text('{"q": 1}\n')
    (w / "models" / "README-mine.md").write_text("beside the model")
    monkeypatch.chdir(w / "work" / "deep")
    return {"w": w, "model": w / "models" / made["model"].name, "prof": w / "runs" / "prof",
            "prof_noh": w / "runs" / "prof_noh", "adapter": w / "ads" / "ad"}


def snapshot(root: Path, outside: Path | None = None, dirs: bool = True) -> dict[str, tuple]:
    """Every file's bytes (digest) and mtime under ``root`` (and every folder's mtime with ``dirs``),
    leaving out ``outside`` and what is under it."""
    out = {}
    for p in sorted(root.rglob("*")):
        if outside is not None and (p == outside or outside in p.parents):
            continue
        st = p.lstat()
        if p.is_file():
            out[str(p.relative_to(root))] = ("file", hashlib.sha256(p.read_bytes()).hexdigest(), st.st_mtime_ns)
        elif dirs:
            out[str(p.relative_to(root))] = ("dir", st.st_mtime_ns)
    return out


def names_outside(root: Path, outside: Path) -> set[str]:
    return {str(p.relative_to(root)) for p in root.rglob("*") if not (p == outside or outside in p.parents)}


def _cli(ws, output, *extra, plan=None):
    from gnmr_hf.cli import main

    return main(["export", "--model", str(ws["model"]), "--plan", str(plan or ws["prof"]), "--output", str(output),
                 "--target", "transformers", *extra])


# -------------------------------------------------------------------------------- item 1: refusals


@pytest.mark.parametrize("force", [True, False])
@pytest.mark.parametrize("case, why", [
    ("cwd", "is the current folder"),
    ("cwd_parent", "holds the current folder"),
    ("model", "is the model folder"),
    ("holds_model", "holds the model folder"),
    ("inside_model", "lies inside the model folder"),
    ("profile", "is the profile's folder"),
    ("holds_profile", "holds the profile's folder"),
    ("adapter", "is the adapter folder"),
    ("holds_adapter", "holds the adapter folder"),
])
def test_a_protected_output_is_refused_in_one_line_and_nothing_is_touched(ws, capsys, case, why, force):
    w = ws["w"]
    output = {"cwd": ".", "cwd_parent": "..", "model": ws["model"], "holds_model": w / "models",
              "inside_model": ws["model"] / "export", "profile": ws["prof"], "holds_profile": w / "runs",
              "adapter": ws["adapter"], "holds_adapter": w / "ads"}[case]
    extra = (["--adapter", str(ws["adapter"])] if "adapter" in case else []) + (["--force"] if force else [])
    before = snapshot(w)
    assert _cli(ws, output, *extra) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gnmr-hf export: error:") and why in err[0], err
    assert snapshot(w) == before  # every file's bytes and mtime, every folder's mtime: nothing at all
    # the same through the library call
    with pytest.raises(export.ExportError, match=why):
        export.export_planned(ws["model"], ws["prof"], output, force=force,
                              adapter=ws["adapter"] if "adapter" in case else None, target="transformers")
    assert snapshot(w) == before


def test_force_on_a_folder_no_export_wrote_is_refused(ws, capsys):
    w = ws["w"]
    mine = w / "mine"
    (mine / "sub").mkdir(parents=True)
    (mine / "a.txt").write_text("a")
    (mine / "sub" / "b.bin").write_bytes(b"\x00\x01")
    (mine / "config.json").write_text("{}")  # looks like a model folder, but no export wrote it
    before = snapshot(w)
    assert _cli(ws, mine, "--force") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "not a folder an earlier export wrote" in err[0] and MARKER in err[0]
    assert snapshot(w) == before
    # an earlier export the user has since put files into (e.g. git init to publish it): not deleted either
    assert _cli(ws, w / "exp") == 0
    capsys.readouterr()
    (w / "exp" / ".git").mkdir()
    (w / "exp" / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    before = snapshot(w)
    assert _cli(ws, w / "exp", "--force") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "did not write" in err[0] and ".git/HEAD" in err[0]
    assert snapshot(w) == before


def test_an_output_under_a_file_or_a_file_is_refused_in_one_line(ws, capsys):
    w = ws["w"]
    before = snapshot(w)
    for output in (w / "work" / "notes.txt", w / "work" / "notes.txt" / "exp"):
        assert _cli(ws, output, "--force") == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "notes.txt is a file" in err[0], err
    assert snapshot(w) == before


def test_force_replaces_an_earlier_export_by_rename_and_touches_nothing_else(ws, monkeypatch):
    w, out = ws["w"], ws["w"] / "exp"
    old_mask = os.umask(0o022)  # a server's user other than the exporter's reads the folder (mkdtemp made it 0700)
    try:
        export.export_planned(ws["model"], ws["prof"], out, target="transformers")  # NF4
    finally:
        os.umask(old_mask)
    assert stat.S_IMODE(out.stat().st_mode) == 0o755
    private = [str(f.relative_to(out)) for f in out.rglob("*") if stat.S_IMODE(f.stat().st_mode) & 0o044 != 0o044]
    assert private == []
    marker = json.loads((out / MARKER).read_text())
    assert marker["kind"] == "nf4" and sorted(marker["files"]) == sorted(
        str(p.relative_to(out)) for p in out.rglob("*") if p.is_file() and p.name != MARKER)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["load_in_4bit"] is True
    outside = snapshot(w, outside=out, dirs=False)
    names = names_outside(w, out)

    import gnmr_hf.export_folder as ef

    removed = []
    real_rmtree = shutil.rmtree

    def rmtree(path, *a, **k):  # whenever anything is removed, the new export is already in place
        removed.append(Path(path).name)
        assert json.loads((out / "config.json").read_text())["quantization_config"].get("load_in_8bit") is True
        return real_rmtree(path, *a, **k)

    monkeypatch.setattr(ef.shutil, "rmtree", rmtree)
    summary = export.export_planned(ws["model"], ws["prof"], out, quant="int8", force=True, target="transformers")
    assert removed and all(n.startswith(".exp-old-") for n in removed)  # only the old export, renamed aside
    assert Path(summary["folder"]) == out.resolve()
    assert json.loads((out / "config.json").read_text())["quantization_config"]["load_in_8bit"] is True
    assert json.loads((out / MARKER).read_text())["kind"] == "int8"
    assert snapshot(w, outside=out, dirs=False) == outside  # bytes and mtimes of every file beside it
    assert names_outside(w, out) == names  # and no temporary folder left beside it


def _tree(folder: Path) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in folder.rglob("*") if p.is_file()}


def test_an_export_interrupted_while_writing_leaves_the_old_one_intact(ws, monkeypatch):
    w, out = ws["w"], ws["w"] / "exp"
    export.export_planned(ws["model"], ws["prof"], out, target="transformers")
    old = _tree(out)
    before = snapshot(w)
    import transformers

    def half_written(self, folder, *a, **k):
        (Path(folder) / "model.safetensors").write_bytes(b"half")
        raise OSError("No space left on device")

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", half_written)
    with pytest.raises(OSError, match="No space"):
        export.export_planned(ws["model"], ws["prof"], out, quant="int8", force=True, target="transformers")
    assert _tree(out) == old and snapshot(w) == before  # the old export as it was, no half-written folder


def test_an_export_interrupted_while_renaming_in_leaves_the_old_one_intact(ws, monkeypatch):
    w, out = ws["w"], ws["w"] / "exp"
    export.export_planned(ws["model"], ws["prof"], out, target="transformers")
    old = _tree(out)
    before = snapshot(w, dirs=False)
    names = {str(p.relative_to(w)) for p in w.rglob("*")}
    real = {"rename": os.rename, "replace": os.replace}

    def failing(kind):
        def f(src, dst, *a, **k):
            s, d = Path(src), Path(dst)
            if d.resolve() == out.resolve() and s.name.startswith(".exp-") and "-old-" not in s.name:
                raise KeyboardInterrupt  # the new folder is complete; moving it in is interrupted
            return real[kind](src, dst, *a, **k)
        return f

    monkeypatch.setattr(os, "rename", failing("rename"))
    monkeypatch.setattr(os, "replace", failing("replace"))
    with pytest.raises(KeyboardInterrupt):
        export.export_planned(ws["model"], ws["prof"], out, quant="int8", force=True, target="transformers")
    assert _tree(out) == old
    assert snapshot(w, dirs=False) == before and {str(p.relative_to(w)) for p in w.rglob("*")} == names


# -------------------------------------------------------------------------------- item 13 and 3: the card


def test_card_names_the_model_labels_in_sample_and_gives_held_out(ws, made):
    out = ws["w"] / "exp"
    export.export_planned(ws["model"], ws["prof"], out, target="transformers")
    card = (out / "README.md").read_text()
    # no absolute path: not the model folder's, not the workspace's, no token starting with "/"
    assert str(ws["model"]) not in card and str(ws["w"]) not in card and str(Path.home()) not in card
    assert not re.search(r"(?:^|[\s`(\"'])/[A-Za-z]", card), re.search(r"(?:^|[\s`(\"'])/[A-Za-z].{0,40}", card)
    assert "# smollm2-135m-instruct: NF4" in card and "`smollm2-135m-instruct`" in card
    measured = made["plan"].measured
    assert set(measured) == {"profile", "heldout"}
    assert f"in-sample: {measured['profile']['gap_closed']:.3f} on the 2 batches the plan was chosen on" in card
    assert f"held-out: {measured['heldout']['gap_closed']:.3f} on 1 batch the plan was not chosen on" in card
    # the after-training pointer names sections that exist in the docs page it names
    assert "docs/qlora_budget.md" in card
    headings = [ln.lstrip("#").strip() for ln in (REPO / "docs" / "qlora_budget.md").read_text().splitlines()
                if ln.startswith("#")]
    quoted = re.findall(r'"([^"]+)"', export.AFTER_TRAINING_DOCS)
    assert len(quoted) == 4 and all(any(h.startswith(q) for h in headings) for q in quoted), (quoted, headings)

    # without a held-out measurement the card says so (and never calls the in-sample figure more than it is)
    export.export_planned(ws["model"], ws["prof_noh"], ws["w"] / "exp2", target="transformers")
    card2 = (ws["w"] / "exp2" / "README.md").read_text()
    assert "held-out: not measured" in card2 and "in-sample: " in card2 and "on the 2 batches" in card2
    assert "held-out: 0" not in card2 and "held-out: 1" not in card2


def test_card_fine_tune_command_names_the_bf16_source_and_parses(ws, monkeypatch):
    from gnmr_hf.recipe import load_config

    out = ws["w"] / "exp"
    export.export_planned(ws["model"], ws["prof"], out, target="transformers")
    card = (out / "README.md").read_text()
    line = re.search(r"accelerate launch recipes/finetune\.py (.*)", card).group(1)
    assert "FOLDER" not in line.replace("BF16_MODEL_FOLDER", "") and str(out) not in card
    cmd = line.split()
    assert cmd[cmd.index("--model") + 1] == "smollm2-135m-instruct"  # the BF16 source, not this folder
    config = cmd[cmd.index("--config") + 1]
    assert (REPO / config).is_file()
    monkeypatch.chdir(REPO)
    recipe = load_config(cmd)  # the recipe's own validation takes the command as it stands
    assert recipe.script.model == "smollm2-135m-instruct" and recipe.profile.enabled
    # a model with no known recipe: the command still names the source folder, never the export
    assert "--model BF16_MODEL_FOLDER" in export.finetune_command("my-model")

    # what the card offers for the folder itself works: a LoRA on the exported folder trains
    from transformers import AutoModelForCausalLM

    m = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(out), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    m(input_ids=ids, labels=ids).loss.backward()
    grads = [p.grad for n, p in m.named_parameters() if "lora_" in n and p.requires_grad]
    assert grads and any(g is not None and g.abs().sum() > 0 for g in grads)
