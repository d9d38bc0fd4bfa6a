"""``gnmr-hf demo`` from an installed wheel: the recipes travel in the package, not next to a clone.

The wheel is built from a copy of the source (so no build/ or egg-info lands in the working tree),
installed with ``pip install --target`` into a folder that is put first on ``PYTHONPATH`` (the
environment's own packages stay importable behind it), and run from a folder without ``recipes/``.
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
def installed(tmp_path_factory) -> Path:
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
    (wheel,) = (work / "dist").glob("gnmr_hf-*.whl")
    site = work / "site"
    subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "-q", "--target", str(site), str(wheel)],
                   check=True, capture_output=True, timeout=600)
    return site


def _env(site: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(site), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                HF_DATASETS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")


def test_wheel_holds_every_subpackage_and_the_recipes(installed):
    pkg = installed / "gnmr_hf"
    # every package of the source tree is in the wheel (pyproject.toml lists them by hand)
    source = {p.parent.relative_to(ROOT) for p in (ROOT / "gnmr_hf").rglob("__init__.py")}
    assert {p.parent.relative_to(installed) for p in pkg.rglob("__init__.py")} == source
    for name in ("finetune.py", "smollm2-135m/base.yaml", "smollm2-135m/gnmr-nf4.yaml", "llama2-13b/nf4.yaml",
                 "accelerate/cpu.yaml", "accelerate/cpu-ddp.yaml"):
        assert (pkg / "recipes" / name).is_file(), name
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
