"""The recipe's ``profile:`` block: parse and refusals (fast), and a 3-step planned / hybrid recipe run (slow)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402

SMOL = ROOT / "recipes" / "smollm2-135m"


def test_planned_and_hybrid_recipes_parse_and_merge_the_block_key_by_key():
    planned = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml")]))
    assert planned.script.precision == "gnmr-nf4"
    assert (planned.profile.enabled, planned.profile.budget, planned.profile.batches, planned.profile.policy) == \
        (True, "10%", 2, "static")
    hybrid = finetune.load_config(["--config", str(SMOL / "hybrid-nf4.yaml"), "--profile.budget", "5%"])
    # policy from hybrid-nf4.yaml, batches from the file it includes, budget from the command line
    assert (hybrid.profile.policy, hybrid.profile.batches, hybrid.profile.budget) == ("hybrid", 2, "5%")
    assert hybrid.profile.given["budget"] == "on the command line"
    assert hybrid.profile.given["batches"] == f"in {SMOL / 'planned-nf4.yaml'}"
    assert not finetune.load_config(["--config", str(SMOL / "gnmr-nf4.yaml")]).profile.enabled
    llama = finetune.validate(finetune.load_config(["--config", str(ROOT / "recipes/llama2-13b/planned-nf4.yaml")]))
    assert llama.profile.enabled and llama.script.precision == "gnmr-nf4"


def test_policy_gnmr_is_the_papers_controller_one_line_away():
    # planned-nf4.yaml with policy: gnmr is gnmr-nf4.yaml: no profile, the same gnmr block, decoder layers
    planned = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"),
                                                      "--profile.policy", "gnmr", "--output_dir", "x"]))
    paper = finetune.validate(finetune.load_config(["--config", str(SMOL / "gnmr-nf4.yaml"), "--output_dir", "x"]))
    assert not planned.profile.enabled and planned.profile.policy == "gnmr"
    assert planned.script == paper.script and planned.lora == paper.lora
    assert planned.gnmr.to_dict() == paper.gnmr.to_dict()
    assert planned.training.to_dict() == paper.training.to_dict()
    static = finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml")])
    assert static.profile.enabled and static.profile.policy == "static"  # the shipped default


def test_lora_init_loftq_parses_and_needs_a_4bit_base():
    r = finetune.validate(finetune.load_config(["--config", str(SMOL / "planned-loftq-nf4.yaml")]))
    assert (r.lora.lora_init, r.profile.enabled, r.script.precision) == ("loftq", True, "gnmr-nf4")
    assert finetune.validate(finetune.load_config(["--config", str(SMOL / "nf4.yaml"), "--lora_init", "loftq"]))
    assert finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml")]).lora.lora_init == "default"
    for precision in ("bf16", "int8", "gnmr"):
        with pytest.raises(finetune.RecipeError, match=f"lora_init: loftq .*needs a 4-bit base .*not {precision}"):
            finetune.validate(finetune.load_config(["--config", str(SMOL / f"{precision}.yaml"), "--lora_init", "loftq"]))
    with pytest.raises(finetune.RecipeError, match="lora_init must be one of default, loftq, calibrated, got 'pissa'"):
        finetune.validate(finetune.load_config(["--config", str(SMOL / "nf4.yaml"), "--lora_init", "pissa"]))


@pytest.mark.parametrize("argv, message", [
    (["--profile.budget", "lots"], r"profile\.budget 'lots' is not a percentage"),
    (["--profile.policy", "dynamic"], r"profile\.policy must be static, hybrid or gnmr, got 'dynamic'"),
    (["--profile.batches", "0"], r"profile\.batches must be an integer >= 1, got 0"),
    (["--profile.gnmr_share", "1.5"], r"profile\.gnmr_share must be a number in \(0, 1\)"),
    (["--profile.criterion", "magic"], r"profile\.criterion must be one of .*first_order"),
    (["--profile.steps", "3"], r"profile\.steps"),
])
def test_bad_profile_values_are_one_line_errors(argv, message):
    with pytest.raises(finetune.RecipeError, match=message) as e:
        finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), *argv])
    assert "\n" not in str(e.value)


@pytest.mark.parametrize("precision", ["bf16", "int8", "nf4"])
def test_profile_needs_a_recovery_path(precision):
    recipe = finetune.load_config(["--config", str(SMOL / f"{precision}.yaml"), "--profile.budget", "5%"])
    with pytest.raises(finetune.RecipeError, match=f"profile .*no effect with precision {precision}"):
        finetune.validate(recipe)


@pytest.mark.slow
# planned-nf4 itself runs end to end on the real SmolLM2 in the demo's test (tests/test_recipes_e2e.py) and as the
# one-process reference of tests/test_sharded_planned.py; planned-loftq-nf4 is planned-nf4.yaml plus LoftQ and gets
# every planned-nf4 assertion below. The recipes run here on a tiny LLaMA with SmolLM2's tokenizer (--model): the
# profile block's plumbing through accelerate launch, not the real model's figures (a launch is mostly imports)
@pytest.mark.parametrize("recipe", ["hybrid-nf4", "planned-loftq-nf4"])
def test_profile_block_three_steps(tmp_path, recipe, tiny_tok):
    from tests.test_recipes_e2e import _launch, _trace

    out = tmp_path / recipe
    proc = _launch("cpu.yaml", recipe, out, "--profile.budget", "25%", "--model", str(tiny_tok), "--logging_steps", "1")
    record = json.loads((out / "run.json").read_text())
    # the logged metrics (tests/test_faults_r5_noise.py): a static plan (planned-loftq-nf4) logs no per-step gnmr/*
    # counts, which would repeat the same plan at every step; hybrid's GNMR part moves and logs them; both log
    # gnmr/summary/* once at the end, and neither prints bitsandbytes' failed Hub-kernel lookup
    history = json.loads((out / "trainer_state.json").read_text())["log_history"]
    steps = [h for h in history if "loss" in h]
    per_step = [sorted(k for k in h if k.startswith("gnmr/") and not k.startswith("gnmr/summary/")) for h in steps]
    assert len(steps) == 3
    if recipe == "planned-loftq-nf4":
        assert per_step == [[]] * 3
    else:
        assert all({"gnmr/active", "gnmr/promoted", "gnmr/over_gnmr"} <= set(k) for k in per_step)
    assert any(k.startswith("gnmr/summary/") for h in history if "train_runtime" in h for k in h)
    assert "kernels-community" not in proc.stdout + proc.stderr
    if recipe == "planned-loftq-nf4":  # LoftQ after the plan, on every linear the plan left on NF4
        assert record["config"]["lora"]["lora_init"] == "loftq"
        assert record["loftq"]["kept_default"] == len(record["profile"]["plan"]["modules"]) > 0
        assert "lora_init: loftq" in proc.stdout
    else:
        assert "loftq" not in record
    assert record["status"] == "complete" and record["global_step"] == 3
    plan = record["profile"]["plan"]
    # the one currency: 25 % of what every linear on BF16 adds over NF4; the plan's served price within it
    assert 0 < plan["price_over_nf4_bytes"] <= plan["budget_bytes"] and plan["indices"]
    assert record["model"] == Path(tiny_tok).name  # the model by its name, not the folder (run.json travels)
    saved = json.loads((out / "profile.json").read_text())
    assert len(saved["units"]) == 14 and saved["plan"]["indices"] == plan["indices"]
    assert saved["skip_modules"] == plan["skip_modules"]
    lines = _trace(out)
    assert [x["step"] for x in lines] == [1, 2, 3]
    cap = plan["held_bytes"] + plan.get("gnmr_max_active_bytes", 0)  # what the run may hold, in held bytes
    for x in lines:
        assert set(plan["indices"]) <= set(x["active"])  # the planned set is on BF16 at every step
        assert x["active_bytes"] <= cap
    if recipe in ("planned-nf4", "planned-loftq-nf4"):
        assert all(sorted(x["active"]) == sorted(plan["indices"]) for x in lines)
        assert all(x["active_bytes"] == plan["held_bytes"] for x in lines)
    else:  # the plan takes 3/4 of the budget, GNMR the rest (as a held-bytes cap)
        assert plan["price_over_nf4_bytes"] <= int(0.75 * plan["budget_bytes"])
        assert all(x["budget_bytes"] == plan["gnmr_max_active_bytes"] for x in lines)
    assert all(x["recovery_bytes"] <= cap for x in lines)  # what is held, within what the plan allows


# issue 26 item 2: the budget is what the recovery path holds, in the dtype it stores
def _planned(tiny_llama_dir, smollm2_dir, tmp_path, dtype, policy="static", budget="10%"):
    import torch
    from transformers import AutoTokenizer

    recipe = finetune.validate(finetune.load_config([
        "--config", str(SMOL / f"{'planned' if policy == 'static' else 'hybrid'}-nf4.yaml"),
        "--profile.budget", budget, "--output_dir", str(tmp_path / dtype), "--compute_dtype", dtype,
        "--per_device_train_batch_size", "2", "--disable_tqdm", "true"]))
    model = finetune.load_model(recipe, str(tiny_llama_dir))
    g = torch.Generator().manual_seed(0)
    ds = [{"input_ids": ids, "attention_mask": [1] * 12, "labels": ids}
          for ids in torch.randint(0, 128, (8, 12), generator=g).tolist()]
    policy, record = finetune.planned_policy(recipe, model, ds, AutoTokenizer.from_pretrained(smollm2_dir),
                                             str(tiny_llama_dir))
    return model, policy, record


# issue 52 item 4: the budget is the plan as served (BF16 bytes less the NF4 bytes they replace), whatever
# the dtype the recovery path holds it in; what that path holds is recorded beside it
def _tiny_numel() -> dict[str, int]:
    """Every tiny LLaMA linear's weight count (conftest.make_tiny_llama: hidden 64, kv 32, intermediate 128)."""
    shapes = {"self_attn.q_proj": 64 * 64, "self_attn.k_proj": 32 * 64, "self_attn.v_proj": 32 * 64,
              "self_attn.o_proj": 64 * 64, "mlp.gate_proj": 128 * 64, "mlp.up_proj": 128 * 64, "mlp.down_proj": 64 * 128}
    return {f"model.layers.{i}.{k}": v for i in range(4) for k, v in shapes.items()}


def _tiny_prices() -> dict[str, int]:
    """Every linear's price over NF4: its BF16 weight against packed NF4 + FP32 absmax per 64 + code table."""
    return {m: 2 * n - (n // 2 + 4 * (n // 64) + 64) for m, n in _tiny_numel().items()}


@pytest.mark.parametrize("dtype, scale", [("float32", 2.0), ("bfloat16", 1.0)])
def test_the_planned_budget_is_the_plan_as_served_whatever_the_dtype(tiny_llama_dir, smollm2_dir, tmp_path, dtype,
                                                                     scale):
    import gnmr_hf

    model, policy, record = _planned(tiny_llama_dir, smollm2_dir, tmp_path, dtype)
    prices = _tiny_prices()
    # 10 %: a tenth of what keeping every quantised linear on BF16 adds over NF4, in both dtypes
    assert record["budget_bytes"] == int(0.1 * sum(prices.values()))
    assert record["price_over_nf4_bytes"] == sum(prices[m] for m in record["modules"]) <= record["budget_bytes"]
    assert record["stored_bytes_per_bf16_byte"] == scale
    gnmr_hf.set_active_units(model, record["indices"])
    held = gnmr_hf.recovery_device_bytes(model)  # what the dual path really holds with the plan active
    assert held == record["held_bytes"] == scale * record["bytes"] > 0
    # what the trace reports (the policy's active_bytes) is what is held
    assert policy.set_bytes == held


def test_hybrid_record_keeps_the_runs_budget(tiny_llama_dir, smollm2_dir, tmp_path):
    _, policy, record = _planned(tiny_llama_dir, smollm2_dir, tmp_path, "float32", policy="hybrid")
    prices = _tiny_prices()
    budget = int(0.1 * sum(prices.values()))
    assert record["policy"] == "hybrid" and record["budget_bytes"] == budget
    price = sum(prices[m] for m in record["modules"])
    assert record["price_over_nf4_bytes"] == price <= int(budget * 0.75)  # the plan's share
    # GNMR gets the rest of the budget, counted in held bytes (FP32: 4 a weight) at the smallest held-per-price
    # ratio of any linear, so whatever it holds fits the rest as served
    assert record["gnmr_budget_bytes"] == budget - price
    held_per_price = min(4 * n / prices[m] for m, n in _tiny_numel().items())
    assert record["gnmr_max_active_bytes"] == int((budget - price) * held_per_price)
    assert policy.controller.config.max_active_bytes == record["gnmr_max_active_bytes"]


# issue 26 item 6: keys the profile's policy would ignore are refused in one line, before anything loads
@pytest.mark.parametrize("recipe, argv, message", [
    ("planned-nf4", ["--gnmr.max_active", "3"], r"gnmr\.max_active \(set on the command line\) has no effect with "
                                                r"profile\.policy static"),
    ("planned-nf4", ["--gnmr.alpha", "2.0"], r"gnmr\.alpha .* profile\.policy static"),
    ("planned-nf4", ["--profile.gnmr_share", "0.5"], r"profile\.gnmr_share .* profile\.policy static"),
    ("hybrid-nf4", ["--gnmr.max_active", "3"], r"gnmr\.max_active .* profile\.policy hybrid: GNMR's count and bytes"),
    ("hybrid-nf4", ["--gnmr.max_active_bytes", "1000"], r"gnmr\.max_active_bytes .* profile\.policy hybrid"),
    ("planned-nf4", ["--profile.policy", "gnmr", "--profile.budget", "5%"],
     r"profile\.budget \(set on the command line\) has no effect with profile\.policy gnmr"),
    ("planned-nf4", ["--profile.policy", "gnmr", "--profile.criterion", "output"], r"profile\.criterion .* gnmr"),
])
def test_keys_the_policy_ignores_are_refused(recipe, argv, message):
    with pytest.raises(finetune.RecipeError, match=message) as e:
        finetune.validate(finetune.load_config(["--config", str(SMOL / f"{recipe}.yaml"), *argv]))
    assert "\n" not in str(e.value)


def test_keys_the_policy_reads_still_pass():
    # inherited gnmr keys (gnmr-nf4.yaml under planned-nf4.yaml) are not the user's and pass; hybrid reads
    # GNMR's thresholds; every shipped recipe validates
    hybrid = finetune.validate(finetune.load_config(["--config", str(SMOL / "hybrid-nf4.yaml"), "--gnmr.alpha", "2.0"]))
    assert hybrid.gnmr.config.alpha == 2.0
    for path in sorted((ROOT / "recipes").glob("*/*.yaml")):
        if path.parent.name == "accelerate":
            continue
        finetune.validate(finetune.load_config(["--config", str(path)]))


@pytest.mark.slow  # reads the real SmolLM2's tokenizer (a GGUF conversion on a fresh machine)
def test_profile_batches_beyond_the_data_is_refused_before_the_model_loads(tmp_path, monkeypatch):
    def no_load(*a, **k):
        raise AssertionError("the model was loaded before the data check")

    monkeypatch.setattr(finetune, "load_model", no_load)
    recipe = finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.batches", "1000",
                                   "--output_dir", str(tmp_path / "o"), "--data_dir", str(tmp_path / "d"),
                                   "--max_steps", "1", "--max_train_examples", "16"])
    with pytest.raises(finetune.RecipeError, match=r"profile\.batches 1000 \(set on the command line\) x batch size "
                                                   r"\d+ is more than the 16 training examples"):
        finetune.run(recipe)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_budget_in_memory_over_nf4(tiny_llama_dir, smollm2_dir, tmp_path, dtype):
    # +25%nf4: the plan adds at most 25 % to the all-NF4 model as served (BF16 rungs), worked out from shapes:
    # the tiny LLaMA's 28 linears (64x64 q/o, 32x64 k/v, 128x64 gate/up, 64x128 down) cost 1.4375 bytes a weight
    # over NF4; the rest (embeddings, head, norms) stays BF16
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.memory import model_bytes

    _, _, record = _planned(tiny_llama_dir, smollm2_dir, tmp_path, dtype, budget="+25%nf4")
    linear_numel = 4 * (64 * 64 * 2 + 32 * 64 * 2 + 128 * 64 * 3)
    rest = 2 * (128 * 64 * 2 + 64 * (2 * 4 + 1))  # embed + lm_head, the RMSNorm weights, in BF16
    nf4 = linear_numel // 2 + (linear_numel // 64) * 4  # packed weights + FP32 absmax per block of 64
    stock = model_bytes(_stock_nf4(tiny_llama_dir))["total"]
    code = 28 * 16 * 4  # each linear's quant state holds the 16-entry FP32 NF4 code table
    rotary = 2 * 8 * 4  # inv_freq and original_inv_freq (head_dim 16), FP32 buffers
    assert record["nf4_model_bytes"] == stock == rest + nf4 + code + rotary
    assert record["budget_bytes"] == int(0.25 * stock)  # whatever the dtype
    # what is served: a stock load with the plan's linears unquantised holds exactly its price over NF4
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                           llm_int8_skip_modules=["lm_head"] + record["modules"])
    served = model_bytes(AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16,
                                                              quantization_config=q))["total"]
    assert 0 < served - stock == record["price_over_nf4_bytes"] <= record["budget_bytes"]
    assert record["memory_over_nf4"] == pytest.approx((served - stock) / stock)


def _stock_nf4(path):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q)


def test_a_memory_budget_over_another_low_path_is_refused():
    with pytest.raises(finetune.RecipeError, match=r"profile\.budget '\+10%int8' is memory over the int8 model"):
        finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--profile.budget", "+10%int8"])
