"""``gnmr-hf demo`` and the README's first commands from an installed wheel: the recipes travel in the
package, not next to a clone.

The wheel is built once from a copy of the source (so no build/ or egg-info lands in the working tree). It is
installed twice: with ``pip install --target`` into a folder that is put first on ``PYTHONPATH`` (the
environment's own packages stay importable behind it) for the demo, and with ``pip install --no-deps`` into a
fresh virtual environment (torch, transformers ... taken from this environment's site-packages through a
``.pth`` file) for the README's commands; both run from a folder without ``recipes/``.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    work = tmp_path_factory.mktemp("wheel")
    src = work / "src"
    src.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "corpus_sample")
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    for name in ("gnmr_hf", "recipes"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                    str(work / "dist"), str(src)], check=True, capture_output=True, timeout=600)
    (built,) = (work / "dist").glob("gnmr_hf-*.whl")
    return built


@pytest.fixture(scope="module")
def installed(wheel, tmp_path_factory) -> Path:
    site = tmp_path_factory.mktemp("site")
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return site


@pytest.fixture(scope="module")
def venv(wheel, tmp_path_factory) -> Path:
    """A fresh virtual environment holding the wheel (``pip install --no-deps``). ``--system-site-packages``
    alone would reach the base interpreter's packages, not this environment's (when the tests run in a venv),
    so this environment's site-packages are appended by a ``.pth`` file: plain paths, behind the new
    environment's own site-packages, so its gnmr_hf is the wheel's (an editable install's finder here is a
    ``.pth`` of its own, which a path line does not run)."""
    import site as site_module
    import sysconfig

    root = tmp_path_factory.mktemp("venv") / "env"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", str(root)], check=True,
                   capture_output=True, timeout=600)
    python = root / "bin" / "python"
    purelib = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
                             check=True, capture_output=True, text=True, timeout=60).stdout.strip()
    ours = [p for p in [*site_module.getsitepackages(), sysconfig.get_path("purelib")] if Path(p).is_dir()]
    Path(purelib, "zz_outer_env.pth").write_text("".join(f"{p}\n" for p in dict.fromkeys(ours)))
    subprocess.run([sys.executable, "-m", "pip", "--python", str(python), "install", "--no-deps", "-q", str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return root


def _env(site: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def test_wheel_holds_every_subpackage_and_the_recipes(installed):
    pkg = installed / "gnmr_hf"
    # every package of the source tree is in the wheel (pyproject.toml lists them by hand)
    source = {p.parent.relative_to(ROOT) for p in (ROOT / "gnmr_hf").rglob("__init__.py")}
    assert {p.parent.relative_to(installed) for p in pkg.rglob("__init__.py")} == source
    for name in ("finetune.py", "smollm2-135m/base.yaml", "smollm2-135m/gnmr-nf4.yaml", "llama2-13b/nf4.yaml",
                 "accelerate/cpu.yaml", "accelerate/cpu-ddp.yaml", "accelerate/fsdp2-qlora.json",
                 "gemma3-270m/planned-ladder-nf4.yaml"):
        assert (pkg / "recipes" / name).is_file(), name
    # every recipe of every model folder (the README's recommended path is Gemma's), the clone's byte for byte
    shipped = {p.relative_to(ROOT / "recipes") for p in (ROOT / "recipes").glob("*/*") if p.suffix in (".yaml", ".json")
               and p.parent.name != "stress"}
    assert {p.relative_to(pkg / "recipes") for p in (pkg / "recipes").glob("*/*")
            if p.is_file() and p.parent.name != "__pycache__"} == shipped
    assert all((pkg / "recipes" / p).read_bytes() == (ROOT / "recipes" / p).read_bytes() for p in shipped)
    assert not (pkg / "recipes" / "stress").exists()  # the stress bench is not part of the package
    assert (pkg / "evaluation" / "lm_eval_tasks" / "gsm8k.yaml").is_file()
    # the shipped recipe is the clone's, byte for byte
    assert (pkg / "recipes" / "finetune.py").read_bytes() == (ROOT / "recipes" / "finetune.py").read_bytes()


def test_demo_runs_from_the_wheel_outside_the_repository(installed, tmp_path, smollm2_dir):
    where = subprocess.run([sys.executable, "-c", "import gnmr_hf, gnmr_hf.demo as d; print(gnmr_hf.__file__); "
                            "print(d.find_recipes())"], capture_output=True, text=True, cwd=tmp_path,
                           env=_env(installed), timeout=300)
    assert where.returncode == 0, where.stderr[-3000:]
    module_file, recipes = where.stdout.split()[-2:]
    assert Path(module_file).is_relative_to(installed) and Path(recipes) == installed / "gnmr_hf" / "recipes"

    # the console script of the wheel, one short nf4 run, no evaluation
    script = installed / "bin" / "gnmr-hf"
    out = tmp_path / "demo"
    cmd = [sys.executable, str(script), "demo", "--out", str(out), "--low", "nf4", "--precisions", "nf4",
           "--max-steps", "2", "--tasks", "none", "--threads", "1", "--set", "num_generated=8",
           "--set", "per_device_train_batch_size=2", "--set", "max_seq_len=48",
           "--set", "compute_dtype=float32"]
    proc = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp_path, env=_env(installed), timeout=900)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert str(installed / "gnmr_hf" / "recipes" / "finetune.py") in proc.stdout
    record = json.loads((out / "nf4" / "run.json").read_text())
    assert record["global_step"] == 2 and record["config"]["script"]["precision"] == "nf4"
    assert record["config"]["script"]["compute_dtype"] == "float32"
    assert record["config_file"] == str(installed / "gnmr_hf" / "recipes" / "smollm2-135m" / "nf4.yaml")
    assert record["versions"]["gnmr_hf"] == "0.1.0"
    rows = json.loads((out / "summary_nf4.json").read_text())
    assert [r["run"] for r in rows] == ["nf4"] and rows[0]["steps"] == 2
    assert (out / "loss_curves_nf4.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_the_readme_first_commands_run_from_a_fresh_venv(venv, tmp_path):
    """The README's recommended path from the installed wheel, outside a clone: ``gnmr-hf --help``, ``gnmr-hf
    profile --help``, and the recommended Gemma recipe (``recipes/gemma3-270m/planned-ladder-nf4.yaml``) found
    through :func:`gnmr_hf.recipe.recipes_folder` and parsed with its include chain as ``finetune.py`` parses it;
    the shipped ``finetune.py`` itself runs (a misspelt model: its one line, with the suggestion)."""
    env = dict(os.environ, OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    env.pop("PYTHONPATH", None)
    bin_ = venv / "bin"

    def run(*cmd: str) -> subprocess.CompletedProcess:
        return subprocess.run(list(cmd), capture_output=True, text=True, cwd=tmp_path, env=env, timeout=600)

    top = run(str(bin_ / "gnmr-hf"), "--help")
    assert top.returncode == 0 and "profile" in top.stdout and "export" in top.stdout, top.stderr[-2000:]
    prof = run(str(bin_ / "gnmr-hf"), "profile", "--help")
    assert prof.returncode == 0 and "--budget" in prof.stdout, prof.stderr[-3000:]
    code = ("import json, gnmr_hf; from gnmr_hf.recipe import load_config, recipes_folder, validate; "
            "f = recipes_folder() / 'gemma3-270m' / 'planned-ladder-nf4.yaml'; "
            "r = validate(load_config(['--config', str(f), '--output_dir', 'out'])); "
            "print(json.dumps({'module': gnmr_hf.__file__, 'config': str(f), 'model': r.script.model, "
            "'precision': r.script.precision, 'profile': r.profile.enabled}))")
    got = run(str(bin_ / "python"), "-c", code)
    assert got.returncode == 0, got.stderr[-3000:]
    info = json.loads(got.stdout.strip().splitlines()[-1])
    pkg = Path(info["module"]).parent
    assert pkg.is_relative_to(venv) and Path(info["config"]) == pkg / "recipes" / "gemma3-270m" / "planned-ladder-nf4.yaml"
    assert info["model"] == "gemma3-270m" and info["precision"] == "gnmr-nf4" and info["profile"]
    script = run(str(bin_ / "python"), str(pkg / "recipes" / "finetune.py"), "--config", info["config"],
                 "--model", "gemma3-27m")
    assert script.returncode == 2 and "did you mean 'gemma3-270m'?" in script.stderr, script.stderr[-3000:]
