"""recipes/finetune.py without training: HfArgumentParser over the recipe's dataclasses, include:
resolution, the gnmr: block, one-line errors, the NF4 quantisation config, plots from a run's files."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RECIPES = ROOT / "recipes"
PER_PRECISION = ("bf16", "int8", "gnmr", "nf4", "gnmr-nf4")


@pytest.fixture(scope="module")
def ft():
    spec = importlib.util.spec_from_file_location("finetune_recipe", RECIPES / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules["finetune_recipe"] = module
    spec.loader.exec_module(module)
    return module


def test_yaml_include_then_command_line_overrides(ft):
    from transformers import TrainingArguments

    path = str(RECIPES / "smollm2-135m" / "gnmr.yaml")
    base = ft.load_config(["--config", path])
    cfg = ft.load_config([
        "--config", path, "--max_steps", "3", "--learning_rate", "1e-4", "--chat_template", "yes",
        "--lora_target_modules", "q_proj", "v_proj", "--gnmr.beta_init=2.5", "--gnmr.max_active", "4",
        "--output-dir", "/tmp/x", "--max_train_examples", "7", "--warmup_steps", "2",
    ])
    # the file's values came through its include: (base.yaml) and its own keys (gnmr.yaml)
    assert base.script.precision == "gnmr" and base.training.learning_rate == pytest.approx(3e-4)
    assert base.training.max_steps == 60 and base.gnmr.config.max_active == 8 and base.gnmr.init_fraction == 0.025
    assert base.config_file == path
    assert isinstance(cfg.training, TrainingArguments)
    # every override changed the value and came out with the field's type
    assert cfg.training.max_steps == 3 and type(cfg.training.max_steps) is int
    assert cfg.training.learning_rate == pytest.approx(1e-4)
    assert cfg.script.chat_template is True and base.script.chat_template is False
    assert cfg.lora.lora_target_modules == ["q_proj", "v_proj"] and len(base.lora.lora_target_modules) == 7
    assert cfg.gnmr.config.beta_init == 2.5 and base.gnmr.config.beta_init is None
    assert cfg.gnmr.config.max_active == 4
    assert cfg.training.output_dir == "/tmp/x" and base.training.output_dir == "out/smollm2-135m/gnmr"
    assert cfg.script.max_train_examples == 7 and base.script.max_train_examples is None
    assert cfg.training.warmup_steps == 2 and base.training.warmup_steps == 0
    # untouched keys keep the file's values, the other GNMR fields among them
    assert cfg.lora.lora_r == 8 and cfg.gnmr.config.alpha == base.gnmr.config.alpha == 1.1


def test_recipe_defaults_sit_under_the_yaml(ft, tmp_path):
    import torch

    plain = ft.load_config([])
    # the recipe's own TrainingArguments defaults (not the Trainer's): CPU DDP, no reporting, our columns kept
    assert plain.training.use_cpu is (not torch.cuda.is_available())
    assert plain.training.report_to == [] and plain.training.remove_unused_columns is False
    assert plain.training.ddp_find_unused_parameters is False
    yaml_file = tmp_path / "r.yaml"
    yaml_file.write_text("remove_unused_columns: true\ndataset_config: null\nlr_scheduler_type: cosine\n")
    cfg = ft.load_config(["--config", str(yaml_file)])
    assert cfg.training.remove_unused_columns is True and cfg.script.dataset_config is None
    assert str(cfg.training.lr_scheduler_type.value) == "cosine"
    # no gnmr: block gives GNMRConfig's defaults and no callback unless the precision needs it
    assert cfg.gnmr.config.max_active == 10 and cfg.gnmr.monitor is False and cfg.gnmr.init_fraction is None


def test_include_merges_the_gnmr_block_and_stops_loops(ft, tmp_path):
    # PyYAML reads 1e-3 (no dot) as a string: the parser converts it like a command-line value
    (tmp_path / "base.yaml").write_text("max_steps: 5\nlearning_rate: 1e-3\ngnmr:\n  max_active: 3\n  alpha: 1.2\n")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "v.yaml").write_text("include: ../base.yaml\nmax_steps: 9\ngnmr:\n  alpha: 2.0\n")
    merged = ft.read_config_file(tmp_path / "sub" / "v.yaml")
    assert merged == {"max_steps": 9, "learning_rate": "1e-3", "gnmr": {"max_active": 3, "alpha": 2.0}}
    cfg = ft.load_config(["--config", str(tmp_path / "sub" / "v.yaml")])
    assert cfg.training.max_steps == 9 and cfg.training.learning_rate == pytest.approx(1e-3)
    assert cfg.gnmr.config.max_active == 3 and cfg.gnmr.config.alpha == 2.0

    (tmp_path / "a.yaml").write_text("include: b.yaml\n")
    (tmp_path / "b.yaml").write_text("include: a.yaml\n")
    with pytest.raises(ft.RecipeError, match="config include loop: .*a.yaml -> .*b.yaml -> .*a.yaml"):
        ft.read_config_file(tmp_path / "a.yaml")


@pytest.mark.parametrize("model", ["smollm2-135m", "llama2-13b"])
def test_variants_differ_from_their_base_only_where_they_should(ft, model):
    """nf4 is int8 with a 4-bit base, gnmr-nf4 is gnmr with a 4-bit base: same protocol otherwise."""
    folder = RECIPES / model
    files = {p: ft.read_config_file(folder / f"{p}.yaml") for p in PER_PRECISION}
    base = ft.read_config_file(folder / "base.yaml")
    own = {"precision", "output_dir", "gnmr", "bnb_4bit_use_double_quant"}
    for precision, values in files.items():
        assert values["precision"] == precision and values["output_dir"].endswith(f"/{precision}")
        assert {k: v for k, v in values.items() if k not in own} == base, precision
    assert files["gnmr-nf4"]["gnmr"] == files["gnmr"]["gnmr"]
    assert "gnmr" not in files["nf4"] and "gnmr" not in files["bf16"]


def test_smollm2_budget_is_a_quarter_of_its_layers_rounded_half_up(ft, smollm2_dir):
    layers = json.loads((Path(smollm2_dir) / "config.json").read_text())["num_hidden_layers"]
    for precision in ("gnmr", "gnmr-nf4"):
        cfg = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / f"{precision}.yaml")])
        assert cfg.gnmr.config.max_active == int(layers / 4 + 0.5) == 8  # 7.5 -> 8, the paper's 10 of 40
    cfg = ft.load_config(["--config", str(RECIPES / "llama2-13b" / "gnmr-nf4.yaml")])
    assert cfg.gnmr.config.max_active == 10  # of LLaMA-2 13B's 40 layers


@pytest.mark.parametrize(
    "args, message",
    [
        (["--max_step", "3"], "unknown key(s) on the command line: 'max_step' (did you mean 'max_steps'?)"),
        (["--precision", "fp4"], "argument --precision: invalid choice: 'fp4' (choose from 'bf16', 'int8', "
                                 "'gnmr', 'nf4', 'gnmr-nf4')"),
        (["--max_steps", "three"], "invalid int value: 'three'"),
        (["--chat_template", "maybe"], "Truthy value expected: got maybe"),
        (["--gnmr.max_activ", "3"], "unknown key(s) in the gnmr block: 'gnmr.max_activ' "
                                    "(did you mean 'gnmr.max_active'?)"),
        (["--gnmr.storage", "gpu"], "gnmr.storage must be host, device or disk, got 'gpu'"),
        (["--gnmr.window", "0"], "gnmr: GNMRConfig.window must be an integer >= 1, got 0"),
        (["--max_seq_len", "0"], "max_seq_len must be >= 1, got 0"),
        pytest.param(["--model", "/nonexistent/model-folder"], "model '/nonexistent/model-folder': no such folder",
                     marks=pytest.mark.slow),  # run() starts TrainingArguments' device setup first
        (["--config", "/nonexistent.yaml"], "config file /nonexistent.yaml not found"),
    ],
)
def test_clear_errors(ft, capsys, args, message):
    code = ft.main(["--config", str(RECIPES / "smollm2-135m" / "bf16.yaml"), *args])
    err = capsys.readouterr().err
    assert code == 2
    assert message in err
    assert err.count("\n") == 1 and err.startswith("finetune.py: error: ")  # one line, no usage, no traceback


def test_unknown_key_in_yaml(ft, tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    bad.write_text("precision: bf16\nlearning_rat: 1.0e-4\nfoo: 1\n")
    assert ft.main(["--config", str(bad)]) == 2
    err = capsys.readouterr().err
    assert f"unknown key(s) in {bad}: 'foo', 'learning_rat' (did you mean 'learning_rate'?)" in err


@pytest.mark.slow
def test_help_and_unknown_key_through_the_script():
    help_text = subprocess.run([sys.executable, str(RECIPES / "finetune.py"), "--help"], capture_output=True,
                               text=True, timeout=300).stdout
    # TrainingArguments' own fields, the script's, LoRA's, the config file and the gnmr keys
    for flag in ("--learning_rate", "--per_device_train_batch_size", "--gradient_accumulation_steps",
                 "--resume_from_checkpoint", "--precision", "--lora_target_modules", "--config"):
        assert flag in help_text, flag
    assert "--gnmr.KEY value" in help_text and "max_active" in help_text and "init_fraction" in help_text

    proc = subprocess.run(
        [sys.executable, str(RECIPES / "finetune.py"), "--config", str(RECIPES / "smollm2-135m" / "int8.yaml"),
         "--learning-rat", "3"], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == (
        "finetune.py: error: unknown key(s) on the command line: 'learning-rat' (did you mean 'learning_rate'?)")
    assert "Traceback" not in proc.stderr


def test_quantization_config_per_precision(ft):
    import torch

    cfg = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "nf4.yaml")])
    q = ft.quantization_config(cfg.script)
    assert q.load_in_4bit and not q.load_in_8bit and q.bnb_4bit_quant_type == "nf4"
    assert q.bnb_4bit_compute_dtype == torch.bfloat16 and q.bnb_4bit_use_double_quant is False
    double = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "gnmr-nf4.yaml"),
                             "--bnb_4bit_use_double_quant", "true"])
    assert ft.quantization_config(double.script).bnb_4bit_use_double_quant is True
    int8 = ft.quantization_config(ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "gnmr.yaml")]).script)
    assert int8.load_in_8bit and not int8.load_in_4bit
    assert ft.quantization_config(ft.load_config(["--precision", "bf16"]).script) is None


def test_nf4_model_is_stock_qlora(ft, tiny_llama_dir, tmp_path):
    """precision nf4: every decoder projection a bitsandbytes NF4 Linear4bit under PEFT's own 4-bit LoRA layer."""
    import bitsandbytes as bnb
    import torch
    from peft.tuners.lora.bnb import Linear4bit as LoraLinear4bit

    cfg = ft.load_config(["--config", str(RECIPES / "smollm2-135m" / "nf4.yaml"), "--output_dir", str(tmp_path)])
    model = ft.load_model(cfg, str(tiny_llama_dir))
    layers = model.base_model.model.model.layers
    wrapped = [m for layer in layers for m in layer.modules() if isinstance(m, LoraLinear4bit)]
    assert len(wrapped) == 7 * len(layers)
    for m in wrapped:
        assert isinstance(m.base_layer, bnb.nn.Linear4bit) and m.base_layer.weight.quant_state.quant_type == "nf4"
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert trainable and all("lora_" in n for n in trainable)
    ids = torch.tensor([[1, 5, 9, 3]])
    loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    assert torch.isfinite(loss)
    # PEFT starts lora_B at zero, so the first gradient reaches lora_B (lora_A's is zero until B moves)
    grads = [p.grad for n, p in model.named_parameters() if "lora_B" in n]
    assert len(grads) == 7 * len(layers) and all(g is not None and torch.isfinite(g).all() for g in grads)
    assert all(float(g.abs().sum()) > 0 for g in grads)


@pytest.mark.parametrize("precision", ["gnmr", "gnmr-nf4", "bf16"])
def test_compute_dtype_sets_weights_4bit_compute_and_recovery(ft, tiny_llama_dir, tmp_path, precision):
    """compute_dtype float32: the unquantised weights, the 4-bit compute dtype and the recovery path are
    float32 (the shipped recipes keep bfloat16); an unknown dtype is a one-line error."""
    import torch

    from gnmr_hf.backends.base import DualPathModule

    args = ["--config", str(RECIPES / "smollm2-135m" / f"{precision}.yaml"), "--output_dir", str(tmp_path)]
    shipped = ft.load_config(args)
    assert shipped.script.compute_dtype == "bfloat16"
    cfg = ft.load_config([*args, "--compute_dtype", "float32"])
    assert cfg.script.compute_dtype == "float32"
    model = ft.load_model(cfg, str(tiny_llama_dir))
    assert model.get_input_embeddings().weight.dtype == torch.float32
    assert {p.dtype for n, p in model.named_parameters() if "lora_" in n} == {torch.float32}
    if precision != "bf16":
        duals = [m for m in model.modules() if isinstance(m, DualPathModule)]
        assert duals and all(m._gnmr_source.dtype == torch.float32 for m in duals)  # the recovery weights
        if precision == "gnmr-nf4":
            import bitsandbytes as bnb

            four = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
            assert four and all(m.compute_dtype == torch.float32 for m in four)
    ids = torch.tensor([[1, 5, 9, 3]])
    logits = model(input_ids=ids).logits
    assert logits.dtype == torch.float32
    bf16 = ft.load_model(shipped, str(tiny_llama_dir))
    assert bf16.get_input_embeddings().weight.dtype == torch.bfloat16


def test_compute_dtype_unknown_value_is_a_clear_error(ft, capsys):
    code = ft.main(["--config", str(RECIPES / "smollm2-135m" / "gnmr.yaml"), "--compute_dtype", "fp8"])
    err = capsys.readouterr().err
    assert code == 2 and "fp8" in err and "float32" in err and err.count("\n") == 1


@pytest.mark.slow
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
    ds = ft.tokenize_dataset(cfg.script, ft.load_records(cfg.script, str(tmp_path)), tok)
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
    ds = ft.tokenize_dataset(cfg.script, ft.load_records(cfg.script, str(tmp_path)), tok)
    assert len(ds) == 4
    text = tok.decode(ds[0]["input_ids"])
    assert text.startswith("<|im_start|>system\n") and "<|im_start|>user\nQuestion: " in text
    n_prompt = sum(1 for x in ds[0]["labels"] if x == -100)
    assert tok.decode(ds[0]["input_ids"][:n_prompt]).endswith("<|im_start|>assistant\n")
    assert text.endswith("<|im_end|>") and "#### " in tok.decode(ds[0]["input_ids"][n_prompt:])


def _trace_line(step, gnmr, active):
    return json.dumps({"step": step, "gnmr": gnmr, "delta": [1.0] * len(gnmr), "active": active}) + "\n"


@pytest.mark.slow
def test_plots_from_a_small_trace_and_log(tmp_path):
    from gnmr_hf.reporting import plots

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
