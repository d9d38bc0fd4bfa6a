"""Entry points refuse a wrong argument before their heavy imports, and an alias does not shadow a folder.

- A misspelt model name (``gemma3-27m``) is refused by ``gnmr-hf profile`` / ``eval`` / ``export`` and by
  ``recipes/finetune.py`` in one line that suggests the closest alias, before ``transformers`` (and for the
  ``gnmr-hf`` commands ``torch``) is imported: each is checked in a subprocess that inspects ``sys.modules``
  at the refusal (``gnmr_hf.preflight``). So are a missing data path, a budget that does not parse and a missing
  recipe file.
- A model folder in the current directory named like an alias (``./smollm2-135m-instruct`` with a
  ``config.json``) is used, and one line says so; a folder of that name that is not a model folder
  (``recipes/gemma3-270m`` seen from ``recipes/``) leaves the alias in use, also said in one line.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from gnmr_hf import preflight
from gnmr_hf.offline import gguf_models

ROOT = Path(__file__).resolve().parents[1]
RECIPE = ROOT / "recipes" / "gemma3-270m" / "planned-ladder-nf4.yaml"

# runs gnmr-hf's main (or the recipe script as __main__) in a fresh interpreter and reports what was imported
_CLI = """
import json, sys
from gnmr_hf.cli import main
rc = main(sys.argv[1:])
print(json.dumps({"rc": rc, "transformers": "transformers" in sys.modules, "torch": "torch" in sys.modules}))
"""
_SCRIPT = """
import json, runpy, sys
script, sys.argv = sys.argv[1], sys.argv[1:]
try:
    runpy.run_path(script, run_name="__main__")
    rc = 0
except SystemExit as e:
    rc = e.code
print(json.dumps({"rc": rc, "transformers": "transformers" in sys.modules, "torch": "torch" in sys.modules}))
"""


def _run(code: str, args: list[str], cwd: Path) -> tuple[dict, list[str]]:
    env = dict(os.environ, PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr.strip().splitlines()


@pytest.mark.parametrize("command", ["profile", "eval", "export"])
def test_gnmr_hf_refuses_a_misspelt_alias_before_torch_with_a_suggestion(command, tmp_path):
    args = [command, "--model", "gemma3-27m", "--output", str(tmp_path / "out")]
    if command == "export":
        args += ["--plan", str(tmp_path)]
    got, err = _run(_CLI, args, tmp_path)
    assert got == {"rc": 2, "transformers": False, "torch": False}
    assert len(err) == 1, err
    assert err[0].startswith(f"gnmr-hf {command}: error: model 'gemma3-27m'")
    assert "did you mean 'gemma3-270m'?" in err[0]


@pytest.mark.parametrize("args, says", [
    (["--data", "no-such-train.jsonl"], "--data no-such-train.jsonl: no such file or folder"),
    (["--budget", "12"], "budget '12': a bare number above 1 is ambiguous"),
    (["--budget", "+10%nf5"], "budget '+10%nf5' is not a percentage"),
])
def test_profile_refuses_missing_data_and_bad_budgets_before_torch(args, says, tmp_path):
    got, err = _run(_CLI, ["profile", "--output", str(tmp_path / "prof"), *args], tmp_path)
    assert got == {"rc": 2, "transformers": False, "torch": False}
    assert len(err) == 1 and err[0].startswith("gnmr-hf profile: error: ") and says in err[0], err


def test_the_recipe_script_refuses_a_misspelt_alias_before_transformers(tmp_path):
    script = str(ROOT / "recipes" / "finetune.py")
    got, err = _run(_SCRIPT, [script, "--config", str(RECIPE), "--model", "smollm2-135m-instuct",
                              "--output_dir", str(tmp_path / "out")], tmp_path)
    assert got == {"rc": 2, "transformers": False, "torch": False}
    assert len(err) == 1 and err[0].startswith("finetune.py: error: model 'smollm2-135m-instuct'"), err
    assert "did you mean 'smollm2-135m-instruct'?" in err[0]


def test_the_recipe_script_reads_the_model_and_data_through_the_include_chain(tmp_path):
    """A recipe whose own ``model:`` is misspelt, and one whose ``dataset:`` file is missing (both inherit the
    rest from the shipped recipe by ``include:``); a missing ``--config`` file."""
    script = str(ROOT / "recipes" / "finetune.py")
    bad_model = tmp_path / "bad-model.yaml"
    bad_model.write_text(f"include: {RECIPE}\nmodel: gemma-270m\n")
    bad_data = tmp_path / "bad-data.yaml"
    bad_data.write_text(f"include: {RECIPE}\ndataset: data/missing.jsonl\n")
    cases = [(bad_model, "model 'gemma-270m'", "did you mean 'gemma3-270m'?"),
             (bad_data, "dataset data/missing.jsonl: no such file or folder", ""),
             (tmp_path / "no-such.yaml", f"config file {tmp_path / 'no-such.yaml'} not found", "")]
    for config, says, hint in cases:
        got, err = _run(_SCRIPT, [script, "--config", str(config), "--output_dir", str(tmp_path / "out")], tmp_path)
        assert got == {"rc": 2, "transformers": False, "torch": False}, config
        assert len(err) == 1 and err[0].startswith(f"finetune.py: error: {says}") and hint in err[0], err


def test_what_the_commands_accept_passes_the_preflight(tmp_path, monkeypatch):
    """No false refusal: aliases, folders, hub ids, the budgets profile takes, an existing data file, --help."""
    monkeypatch.setattr(gguf_models, "is_installed", lambda alias: True)
    (tmp_path / "train.jsonl").write_text("{}\n")
    for model in (*gguf_models.MODELS, str(tmp_path), "org/some-model"):
        for budget in ("10%", "0.1", "300MB", "+10%nf4", "+5%int4"):
            assert preflight.check_command("profile", ["--model", model, f"--budget={budget}", "--data",
                                                       str(tmp_path / "train.jsonl"), "-o", "x"]) is None
        assert preflight.check_command("eval", ["--model", model]) is None
        assert preflight.check_recipe(["--config", str(RECIPE), "--model", model]) is None
    assert preflight.check_recipe(["--config", str(RECIPE)]) is None  # model: gemma3-270m, generated data
    assert preflight.check_recipe(["--config", str(RECIPE), "--dataset", "openai/gsm8k"]) is None
    assert preflight.check_recipe(["--config", str(RECIPE), "--dataset", f"text:{tmp_path}/*.txt"]) is None
    assert preflight.check_command("profile", ["--model", "gemma3-27m", "--help"]) is None
    assert preflight.check_command("report", ["--model", "gemma3-27m"]) is None


def test_the_suggestion_is_the_closest_alias_or_none(monkeypatch, tmp_path):
    monkeypatch.chdir(tmp_path)
    for typo, alias in [("smollm2-135m-instuct", "smollm2-135m-instruct"), ("SmolLM2-135M-Instruct",
                                                                            "smollm2-135m-instruct"),
                        ("gemma3_270m", "gemma3-270m"), ("./gemma3-270", "gemma3-270m")]:
        with pytest.raises(gguf_models.ModelNotFoundError, match=f"did you mean '{alias}'"):
            gguf_models.resolve_model(typo)
    with pytest.raises(gguf_models.ModelNotFoundError) as e:
        gguf_models.resolve_model("llama-7b")
    assert "did you mean" not in str(e.value) and all(a in str(e.value) for a in gguf_models.MODELS)


# ---------------------------------------------------------------- a folder named like an alias
@pytest.fixture
def converted(tmp_path, monkeypatch):
    """``$GNMR_HF_CACHE`` where every alias is "converted" (the done-marker; nothing is loaded from it)."""
    cache = tmp_path / "cache"
    for alias in gguf_models.MODELS:
        (cache / alias).mkdir(parents=True)
        (cache / alias / gguf_models._DONE_MARKER).write_text("a test fake\n")
    monkeypatch.setenv("GNMR_HF_CACHE", str(cache))
    monkeypatch.setattr(gguf_models, "_NOTED", set(), raising=False)
    return cache


def test_a_model_folder_in_the_current_directory_wins_over_the_alias_and_says_so(converted, tmp_path, monkeypatch,
                                                                                  capsys):
    work = tmp_path / "work"
    (work / "smollm2-135m-instruct").mkdir(parents=True)
    (work / "smollm2-135m-instruct" / "config.json").write_text("{}")
    monkeypatch.chdir(work)
    assert gguf_models.resolve_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert gguf_models.resolve_model("smollm2-135m-instruct") == "smollm2-135m-instruct"
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["model smollm2-135m-instruct: using the folder ./smollm2-135m-instruct in the current directory, "
                   "not the offline alias (run from another directory for the alias)"]  # once, not per call
    # the other alias, with no folder of its name here, is the converted checkpoint, silently
    assert gguf_models.resolve_model("gemma3-270m") == str(converted / "gemma3-270m")
    assert capsys.readouterr().err == ""


def test_a_folder_named_like_an_alias_that_is_no_model_leaves_the_alias_and_says_so(converted, monkeypatch, capsys):
    monkeypatch.chdir(ROOT / "recipes")  # recipes/gemma3-270m: the recipes, not a model
    assert gguf_models.resolve_model("gemma3-270m") == str(converted / "gemma3-270m")
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["model gemma3-270m: ./gemma3-270m in the current directory is not a model folder (no "
                   "config.json); using the offline alias"]


def test_profile_loads_the_folder_in_the_current_directory(converted, tmp_path, monkeypatch, capsys):
    """End to end through ``gnmr-hf profile``: the folder reaches the tokenizer load, not the alias's cache."""
    from gnmr_hf.planning import cli
    from tests.conftest import make_tiny_llama

    class Reached(Exception):
        pass

    def stop(path, shown):
        raise Reached(path)

    work = tmp_path / "work"
    make_tiny_llama(work / "gemma3-270m", num_layers=1, hidden=32)
    monkeypatch.chdir(work)
    monkeypatch.setattr(cli, "_load_tokenizer", stop)
    with pytest.raises(Reached) as e:
        cli.main(["--model", "gemma3-270m", "--output", str(tmp_path / "prof")])
    assert Path(e.value.args[0]) == Path("gemma3-270m")
    assert "using the folder ./gemma3-270m" in capsys.readouterr().err


def test_profile_checks_the_folder_it_took_for_an_alias(converted, tmp_path, monkeypatch, capsys):
    """The folder that won over the alias is checked as any folder: profile reads BF16 safetensors from it."""
    from gnmr_hf.planning import cli

    (tmp_path / "work" / "gemma3-270m").mkdir(parents=True)
    (tmp_path / "work" / "gemma3-270m" / "config.json").write_text("{}")
    monkeypatch.chdir(tmp_path / "work")
    assert cli.main(["--model", "gemma3-270m", "--output", str(tmp_path / "prof")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1] == ("gnmr-hf profile: error: --model gemma3-270m: no *.safetensors files (the BF16 weights the "
                       "recovery path reads)")
