"""The planner's package (gnmr_hf.planning): one file per job, the compatibility of what earlier code wrote and
imported, the layering (no demo, no recipe script by path), the criteria registry and the data-free
``weight_error`` criterion."""

import ast
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import gnmr_hf
from gnmr_hf import planning

ROOT = Path(__file__).resolve().parents[1]
FIXTURE = ROOT / "tests" / "data" / "profile_format1.json"


# ------------------------------------------------------------------------------------ compatibility


def test_a_profile_json_written_before_the_package_loads_and_plans_the_same():
    # written by gnmr_hf/profile.py as it was before the split (the command is in the file)
    raw = json.loads(FIXTURE.read_text())
    assert "before gnmr_hf.planning" in raw["command"]
    prof = planning.SensitivityProfile.from_json(FIXTURE)
    assert [u.name for u in prof.units] == [u["name"] for u in raw["units"]]
    assert [u.scores for u in prof.units] == [u["scores"] for u in raw["units"]]
    assert prof.criteria == raw["criteria"] == ["first_order", "output"]
    assert prof.losses["low"] == raw["losses"]["low"] and prof.keep_modules == raw["keep_modules"]
    # the plans the old code wrote come out again, and so does the skip list a stock load reads
    again = [planning.plan(prof, budget_fraction=f) for f in (0.05, 0.10, 0.25)]
    assert [p.modules for p in again] == [p["modules"] for p in raw["price"]]
    assert again[1].modules == raw["plan"]["modules"] and again[1].modules  # something was planned
    assert planning.skip_modules(again[1]) == raw["skip_modules"]
    assert raw["skip_modules"][:len(raw["keep_modules"])] == raw["keep_modules"]


def test_the_former_module_and_the_top_level_names_are_the_same_objects():
    import gnmr_hf.profile as former

    for name in ("profile_sensitivity", "plan", "measure_plan", "skip_modules", "SensitivityProfile", "PrecisionPlan"):
        assert getattr(gnmr_hf, name) is getattr(planning, name) is getattr(former, name), name
    assert former.main is planning.cli.main
    assert former.CRITERIA is planning.CRITERIA and former.parse_budget is planning.parse_budget
    # gnmr-hf profile is the planning package's CLI
    from gnmr_hf.cli import _COMMANDS

    assert _COMMANDS["profile"][0] == "gnmr_hf.planning.cli"


# ------------------------------------------------------------------------------------------ layering


def _imports(path: Path) -> set[str]:
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            out.add(node.module)
    return out


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_the_planning_package_imports_neither_the_demo_nor_the_recipe_script_by_path():
    files = sorted((ROOT / "gnmr_hf" / "planning").glob("*.py"))
    assert {f.stem for f in files} >= {"criteria", "passes", "profiler", "results", "planner", "budget", "skiplist",
                                      "ladder", "cli"}
    for f in files:
        text = f.read_text()
        assert not any(m == "gnmr_hf.demo" or m.startswith("gnmr_hf.demo.") for m in _imports(f)), f
        assert "spec_from_file_location" not in text and "import finetune" not in text, f
    # the plot lives with the other plots, and it does not import the planner back (type hints only)
    r = subprocess.run([sys.executable, "-c", "import sys, gnmr_hf.reporting.profile_plot; "
                        "print(any(m.startswith('gnmr_hf.planning') for m in sys.modules))"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().splitlines()[-1] == "False", r.stderr[-2000:]
    # at run time: loading the CLI pulls in neither the demo nor a recipe script module
    code = ("import sys, gnmr_hf.planning.cli; "
            "print(sorted(m for m in sys.modules if m.startswith('gnmr_hf.demo') or 'finetune' in m))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    assert r.stdout.strip().splitlines()[-1] == "[]"


def test_the_profile_cli_reads_a_recipes_data_through_the_same_function_as_the_recipe(tmp_path):
    # one function, gnmr_hf.recipe.training_rows, for both: the recipe script imports it from the package
    import importlib.util

    spec = importlib.util.spec_from_file_location("finetune_under_test", ROOT / "recipes" / "finetune.py")
    finetune = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(finetune)
    from gnmr_hf import recipe

    assert finetune.training_rows is recipe.training_rows and finetune.load_config is recipe.load_config
    assert "training_rows(" in (ROOT / "recipes" / "finetune.py").read_text()
    assert "training_rows(" in (ROOT / "gnmr_hf" / "planning" / "cli.py").read_text()


# ------------------------------------------------------------------------------------------ registry


def test_the_registry_is_the_one_list_of_criteria():
    from gnmr_hf.planning import criteria

    assert list(criteria.CRITERIA) == list(criteria.REGISTRY) == list(criteria._RUNNERS)
    assert "weight_error" in criteria.CRITERIA and criteria.CRITERIA["output"] == ("output", "output_rel")
    assert criteria.SCORE_NAMES.count("weight_error") == 1
    assert criteria._criteria("all") == list(criteria.REGISTRY)


# ------------------------------------------------------------------------------------ weight_error


peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def _scaled_checkpoint(path: Path, name: str, factor: float) -> Path:
    """A tiny LLaMA whose linear ``name`` has its weights times ``factor`` (its NF4 error grows with it)."""
    from safetensors.torch import load_file, save_file

    from tests.conftest import make_tiny_llama

    make_tiny_llama(path, num_layers=2)
    f = path / "model.safetensors"
    tensors = load_file(f)
    tensors[name] = (tensors[name].float() * factor).to(tensors[name].dtype)
    save_file(tensors, f, metadata={"format": "pt"})
    return path


def test_weight_error_is_the_frobenius_error_of_the_nf4_weights_and_needs_no_data(tmp_path):
    import bitsandbytes.functional as BF
    from safetensors.torch import load_file

    from gnmr_hf.backends.base import dual_path_modules
    from tests.test_dual_path import load

    path = _scaled_checkpoint(tmp_path / "m", "model.layers.1.mlp.up_proj.weight", 8.0)
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), path, units="linears", dtype=torch.float32).eval()
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(0))
    prof = gnmr_hf.profile_sensitivity(model, [{"input_ids": ids, "labels": ids}], criteria=("weight_error",))
    ckpt = load_file(path / "model.safetensors")
    # independently: the checkpoint's weight against bitsandbytes' own de-quantisation of the stored NF4 weight
    expected = {}
    for name, m in model.named_modules():
        if m not in set(dual_path_modules(model)):
            continue
        w_low = BF.dequantize_4bit(m.weight.data, m.weight.quant_state).float()
        expected[name] = float((ckpt[name + ".weight"].float() - w_low).double().square().sum())
    assert len(expected) == len(prof.units) == 14
    for u in prof.units:
        (name,) = u.modules
        assert u.scores["weight_error"] == pytest.approx(expected[name], rel=1e-5), name
    # planned per byte, the budget of the scaled linear buys exactly it: the answer is known
    scaled = next(u for u in prof.units if u.modules == ["model.layers.1.mlp.up_proj"])
    p = gnmr_hf.plan(prof, budget_bytes=scaled.bytes, criterion="weight_error")
    assert p.modules == ["model.layers.1.mlp.up_proj"]
    assert max(prof.units, key=lambda u: u.scores["weight_error"] / u.bytes) is scaled
    assert prof.costs["weight_error"]["backwards"] == 0
