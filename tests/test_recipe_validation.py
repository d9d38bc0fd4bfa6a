"""recipes/finetune.py refuses settings its precision would ignore, before any model is loaded.

``load_config`` parses and checks every value (``gnmr.init_fraction`` with GNMRCallback's own rule among
them); ``validate`` (the first thing ``run`` does) checks the given keys against the precision: the
``gnmr:`` block outside gnmr / gnmr-nf4 unless the run is monitor-only (and then not the keys that choose
or store recovery weights), ``monitor: true`` on a GNMR precision, ``bnb_4bit_*`` outside nf4 / gnmr-nf4.
Only keys set in a config file or on the command line count; defaults never do.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
SMOL = RECIPES / "smollm2-135m"
PRECISIONS = ("bf16", "int8", "gnmr", "nf4", "gnmr-nf4")


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_recipe_validation", RECIPES / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_recipe_validation"] = module
    spec.loader.exec_module(module)
    return module


def check(ft, *args):
    return ft.validate(ft.load_config([str(a) for a in args]))


def yaml_file(tmp_path, text, name="r.yaml"):
    path = tmp_path / name
    path.write_text(text)
    return path


# ---------------------------------------------------------------- the gnmr block outside GNMR precisions


@pytest.mark.parametrize("precision", ["bf16", "int8", "nf4"])
def test_gnmr_block_in_the_file_with_a_precision_that_runs_no_gnmr(ft, tmp_path, precision):
    f = yaml_file(tmp_path, f"precision: {precision}\ngnmr:\n  max_active: 4\n  alpha: 1.2\n")
    with pytest.raises(ft.RecipeError) as err:
        check(ft, "--config", f)
    assert str(err.value) == (
        f"gnmr.max_active (set in {f}) has no effect with precision {precision}: the gnmr block applies to "
        "precision gnmr or gnmr-nf4, or to a monitor-only run (gnmr.monitor: true, its statistics settings only)")


def test_gnmr_flag_on_the_command_line_and_a_block_from_an_included_file(ft):
    with pytest.raises(ft.RecipeError, match=r"^gnmr\.window \(set on the command line\) has no effect with "
                                             r"precision nf4: "):
        check(ft, "--config", SMOL / "nf4.yaml", "--gnmr.window", "3")
    # gnmr-nf4.yaml includes gnmr.yaml, which holds the block: the message names that file
    with pytest.raises(ft.RecipeError, match=rf"^gnmr\.max_active \(set in {SMOL / 'gnmr.yaml'}\) has no effect "
                                             r"with precision nf4: "):
        check(ft, "--config", SMOL / "gnmr-nf4.yaml", "--precision", "nf4")


def test_monitor_only_runs_take_the_statistics_settings_only(ft, tmp_path):
    for precision in ("bf16", "int8", "nf4"):
        r = check(ft, "--config", SMOL / f"{precision}.yaml", "--gnmr.monitor", "true", "--gnmr.alpha", "2.0",
                  "--gnmr.init_fraction", "0.1", "--gnmr.window", "3")
        assert r.gnmr.monitor is True and r.gnmr.config.alpha == 2.0 and r.gnmr.config.window == 3
        # what GNMRCallback asks of a model without dual-path layers, recorded as such in run.json
        assert r.gnmr.config.max_active == 0 and r.gnmr.to_dict()["max_active"] == 0
    assert check(ft, "--config", SMOL / "bf16.yaml", "--gnmr.monitor", "true",
                 "--gnmr.max_active", "0").gnmr.config.max_active == 0
    for key, value in [("storage", "disk"), ("max_active", "4"), ("lock_steps", "2"), ("full_recovery_steps", "1")]:
        with pytest.raises(ft.RecipeError) as err:
            check(ft, "--config", SMOL / "int8.yaml", "--gnmr.monitor", "true", f"--gnmr.{key}", value)
        assert str(err.value) == (
            f"gnmr.{key} (set on the command line) has no effect on a monitor-only run (precision int8, "
            "gnmr.monitor: true): no layer has a recovery path; it applies to precision gnmr or gnmr-nf4")
    # monitor: false says what happens on any precision
    assert check(ft, "--config", SMOL / "bf16.yaml", "--gnmr.monitor", "false").gnmr.monitor is False
    assert check(ft, "--config", SMOL / "gnmr.yaml", "--gnmr.monitor", "false").gnmr.config.max_active == 8


@pytest.mark.parametrize("precision", ["gnmr", "gnmr-nf4"])
def test_monitor_true_on_a_gnmr_precision(ft, precision):
    with pytest.raises(ft.RecipeError) as err:
        check(ft, "--config", SMOL / f"{precision}.yaml", "--gnmr.monitor", "true")
    assert str(err.value) == (
        f"gnmr.monitor: true (set on the command line) has no effect with precision {precision}: its callback "
        "switches layers to the recovery path; a monitor-only run is precision bf16, int8 or nf4 with "
        "gnmr.monitor: true")


# ---------------------------------------------------------------- bnb_4bit_* outside the 4-bit precisions


@pytest.mark.parametrize("precision", ["bf16", "int8", "gnmr"])
def test_bnb_4bit_keys_with_a_precision_without_a_4bit_base(ft, tmp_path, precision):
    with pytest.raises(ft.RecipeError) as err:
        check(ft, "--config", SMOL / f"{precision}.yaml", "--bnb-4bit-use-double-quant", "true")
    assert str(err.value) == (
        f"bnb_4bit_use_double_quant (set on the command line) has no effect with precision {precision}: it "
        "applies to the 4-bit base of precision nf4 or gnmr-nf4 only")
    # given counts, not the value: `false` in the file is refused too (nf4.yaml with another precision)
    f = yaml_file(tmp_path, f"precision: {precision}\nbnb_4bit_use_double_quant: false\n")
    with pytest.raises(ft.RecipeError, match=rf"^bnb_4bit_use_double_quant \(set in {f}\) has no effect with "
                                             rf"precision {precision}: "):
        check(ft, "--config", f)
    with pytest.raises(ft.RecipeError, match=rf"set in {SMOL / 'nf4.yaml'}\) has no effect with precision {precision}"):
        check(ft, "--config", SMOL / "nf4.yaml", "--precision", precision)


def test_defaults_are_not_given(ft):
    # ScriptArguments' default bnb_4bit_use_double_quant and an absent gnmr block: nothing to refuse
    for precision in PRECISIONS:
        r = check(ft, "--precision", precision)
        assert r.given == {"precision": "on the command line"} and r.gnmr.given == {}
    assert check(ft, "--config", SMOL / "gnmr-nf4.yaml", "--bnb_4bit_use_double_quant=true").script.bnb_4bit_use_double_quant


@pytest.mark.parametrize("model", ["smollm2-135m", "llama2-13b"])
@pytest.mark.parametrize("precision", PRECISIONS)
def test_every_shipped_recipe_is_valid(ft, model, precision):
    r = check(ft, "--config", RECIPES / model / f"{precision}.yaml")
    assert r.script.precision == precision
    assert ("max_active" in r.gnmr.given) == (precision in ("gnmr", "gnmr-nf4"))


# ---------------------------------------------------------------- gnmr values, checked at parse time


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gnmr.init_fraction", "1.5"], "gnmr.init_fraction must be a number in [0, 1], got 1.5"),
        (["--gnmr.init_fraction", "-0.1"], "gnmr.init_fraction must be a number in [0, 1], got -0.1"),
        (["--gnmr.init_fraction", "abc"], "gnmr.init_fraction must be a number in [0, 1], got 'abc'"),
        (["--gnmr.init_fraction", "true"], "gnmr.init_fraction must be a number in [0, 1], got True"),
        (["--gnmr.init_steps", "3"], "gnmr: give init_fraction (0.025) or init_steps (3), not both"),
        (["--gnmr.alpha", "-1"], "gnmr: GNMRConfig.alpha"),
    ],
)
def test_gnmr_values_are_checked_by_load_config(ft, args, message):
    with pytest.raises(ft.RecipeError) as err:
        ft.load_config(["--config", str(SMOL / "gnmr.yaml"), *args])
    assert str(err.value).startswith(message), str(err.value)


# ---------------------------------------------------------------- through main(): one line, no model loaded


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--config", SMOL / "nf4.yaml", "--gnmr.max_active", "3"],
         "gnmr.max_active (set on the command line) has no effect with precision nf4: "),
        (["--config", SMOL / "int8.yaml", "--bnb_4bit_use_double_quant", "true"],
         "bnb_4bit_use_double_quant (set on the command line) has no effect with precision int8: "),
        (["--config", SMOL / "gnmr.yaml", "--gnmr.init_fraction", "1.5"],
         "gnmr.init_fraction must be a number in [0, 1], got 1.5"),
    ],
)
def test_main_prints_one_line_before_loading_anything(ft, tmp_path, capsys, monkeypatch, args, message):
    def never(*a, **k):
        raise AssertionError("nothing may be loaded")

    monkeypatch.setattr(ft, "load_model", never)
    monkeypatch.setattr(ft, "resolve_model_path", never)
    out = tmp_path / "out"
    out.mkdir()
    (out / "run.json").write_text("{}")  # a previous complete run: left alone by a refused one
    # a model folder that does not exist: loading it would fail with another message
    code = ft.main([*map(str, args), "--model", str(tmp_path / "no-such-model"), "--output_dir", str(out)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.startswith(f"finetune.py: error: {message}") and err.count("\n") == 1, err
    assert "no-such-model" not in err and "Traceback" not in err
    assert (out / "run.json").read_text() == "{}"
