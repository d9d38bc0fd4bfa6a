"""Issue 52, the recipes' part: a pre-quantised model folder refused in one line (item 3), one budget currency
for the BF16-only and the ladder recipe (item 4), a ladder budget that buys nothing refused (item 5). Tiny
LLaMA, fast tier; the figures are worked out from the module shapes and checked against stock loads."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402

SMOL = ROOT / "recipes" / "smollm2-135m"

# conftest.make_tiny_llama: 4 layers, hidden 64, 2 KV heads of 16 (k/v 32 x 64), intermediate 128
SHAPES = {"self_attn.q_proj": (64, 64), "self_attn.k_proj": (32, 64), "self_attn.v_proj": (32, 64),
          "self_attn.o_proj": (64, 64), "mlp.gate_proj": (128, 64), "mlp.up_proj": (128, 64),
          "mlp.down_proj": (64, 128)}
LINEARS = {f"model.layers.{i}.{k}": v for i in range(4) for k, v in SHAPES.items()}


def _nf4(n: int) -> int:
    return n // 2 + 4 * (n // 64) + 64  # packed 4-bit weights, an FP32 absmax per block of 64, the code table


def _served(name: str, rung: str) -> int:
    """What one linear adds to the served model over NF4 on ``rung``: BF16 2 bytes a weight; INT8 1 byte a weight
    and an FP32 scale a row (bitsandbytes' Linear8bitLt)."""
    rows, cols = LINEARS[name]
    n = rows * cols
    return (2 * n if rung == "bf16" else n + 4 * rows) - _nf4(n)


def _held(name: str, rung: str, dtype_bytes: int) -> int:
    """What its recovery path holds while training: the BF16 rung in the compute dtype, the INT8 rung as stored."""
    rows, cols = LINEARS[name]
    return rows * cols * dtype_bytes if rung == "bf16" else rows * cols + 4 * rows


def _rows(n: int = 4, bs: int = 2, seq: int = 12):
    import torch

    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": [1] * seq, "labels": ids}
            for ids in torch.randint(0, 128, (n * bs, seq), generator=g).tolist()]


def _plan(tiny_llama_dir, smollm2_dir, out, recipe: str, budget: str, dtype: str = "float32", *extra: str):
    from transformers import AutoTokenizer

    r = finetune.validate(finetune.load_config([
        "--config", str(SMOL / f"{recipe}.yaml"), "--profile.budget", budget, "--output_dir", str(out),
        "--compute_dtype", dtype, "--per_device_train_batch_size", "2", "--disable_tqdm", "true", *extra]))
    model = finetune.load_model(r, str(tiny_llama_dir))
    policy, record = finetune.planned_policy(r, model, _rows(), AutoTokenizer.from_pretrained(smollm2_dir),
                                             str(tiny_llama_dir))
    return model, policy, record


def _stock_bytes(path, skip=()):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.memory import model_bytes

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                           llm_int8_skip_modules=["lm_head", *skip])
    return model_bytes(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q))["total"]


# ---------------------------------------------------------------------------------------------- item 3

@pytest.fixture(scope="module")
def prequantised_dir(tiny_llama_dir, tmp_path_factory):
    """The tiny LLaMA saved by bitsandbytes in NF4: config.json carries its quantization_config, the safetensors
    hold packed 4-bit weights (what a gnmr-hf export folder holds)."""
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    out = tmp_path_factory.mktemp("tiny_nf4")
    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16)
    AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16, quantization_config=q).save_pretrained(out)
    assert json.loads((out / "config.json").read_text())["quantization_config"]["bnb_4bit_quant_type"] == "nf4"
    return out


def test_the_recipe_refuses_a_prequantised_model_folder_in_one_line(prequantised_dir, tmp_path):
    r = finetune.load_config(["--config", str(SMOL / "planned-nf4.yaml"), "--model", str(prequantised_dir),
                              "--output_dir", str(tmp_path / "o"), "--max_steps", "1"])
    with pytest.raises(finetune.RecipeError, match=r"model .*tiny_nf4.* is a pre-quantised model folder \(its "
                                                   r"config\.json has a quantization_config: bitsandbytes nf4\).*give "
                                                   r"the original BF16 model folder") as e:
        finetune.run(r)
    assert "\n" not in str(e.value)
    assert finetune.main(["--config", str(SMOL / "planned-nf4.yaml"), "--model", str(prequantised_dir),
                          "--output_dir", str(tmp_path / "o")]) == 2  # one line and exit code 2, no traceback
    assert not (tmp_path / "o" / "run.json").exists()


def test_prepare_dual_path_refuses_a_prequantised_recovery_source(tiny_llama_dir, prequantised_dir):
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import gnmr_hf

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    model = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.float32, quantization_config=q)
    with pytest.raises(ValueError, match=r"recovery_source .*tiny_nf4.* is a pre-quantised model folder .*give the "
                                         r"original BF16 model folder") as e:
        gnmr_hf.prepare_dual_path(model, recovery_source=prequantised_dir)
    assert "\n" not in str(e.value)
    # its safetensors file alone is refused too (the config beside it says what it is); the BF16 folder is fine
    with pytest.raises(ValueError, match="pre-quantised"):
        gnmr_hf.prepare_dual_path(model, recovery_source=next(prequantised_dir.glob("*.safetensors")))
    from gnmr_hf.backends.dispatch import prequantised

    assert prequantised(tiny_llama_dir) is None and prequantised(prequantised_dir) == "bitsandbytes nf4"
    gnmr_hf.prepare_dual_path(model, recovery_source=tiny_llama_dir)
    assert len(list(gnmr_hf.backends.base.dual_path_modules(model))) == 28


# ---------------------------------------------------------------------------------------------- item 4

def test_one_budget_currency_for_both_recipes_at_fp32(tiny_llama_dir, smollm2_dir, tmp_path):
    """+25%nf4 with FP32 compute: both recipes' budget is 25 % of the all-NF4 model as served, their price the
    plan's served bytes over NF4 (a stock load of each plan holds exactly that), and what the recovery path holds
    in FP32 is recorded beside it, not mistaken for the budget."""
    import torch

    import gnmr_hf
    from gnmr_hf.planning.ladder import load_planned

    stock = _stock_bytes(tiny_llama_dir)
    budget = int(0.25 * stock)
    keys = ("budget_bytes", "price_over_nf4_bytes", "memory_over_nf4", "nf4_model_bytes", "held_bytes",
            "held_over_nf4")
    records = {}
    for recipe in ("planned-nf4", "planned-ladder-nf4"):
        model, policy, record = _plan(tiny_llama_dir, smollm2_dir, tmp_path / recipe, recipe, "+25%nf4")
        records[recipe] = record
        assert all(k in record for k in keys), recipe
        rungs = record.get("rungs") or {m: "bf16" for m in record["modules"]}
        assert rungs and set(rungs) <= set(LINEARS)
        price = sum(_served(m, r) for m, r in rungs.items())
        held = sum(_held(m, r, 4) for m, r in rungs.items())
        assert (record["nf4_model_bytes"], record["budget_bytes"]) == (stock, budget), recipe
        assert record["price_over_nf4_bytes"] == price <= budget, recipe
        assert record["memory_over_nf4"] == pytest.approx(price / stock)
        assert record["held_bytes"] == held and record["held_over_nf4"] == pytest.approx(held / stock)
        # held is what the dual path really holds with the plan active; price is what a stock load serves
        gnmr_hf.set_active_units(model, record["indices"])
        assert gnmr_hf.recovery_device_bytes(model) == held == policy.set_bytes
        if "rungs" in record:
            from gnmr_hf.memory import model_bytes

            served = model_bytes(load_planned(tiny_llama_dir, rungs, dtype=torch.bfloat16))["total"]
        else:
            served = _stock_bytes(tiny_llama_dir, skip=sorted(rungs))
        assert served - stock == price, recipe
        # run.json's plan record is this one (profile.json carries it too)
        assert json.loads((tmp_path / recipe / "profile.json").read_text())["plan"]["budget_bytes"] == budget
    ladder = records["planned-ladder-nf4"]
    assert set(ladder["rungs"].values()) == {"int8", "bf16"}  # both rungs bought: the INT8 price is exercised
    # FP32 holds a BF16 rung at twice its BF16 bytes: more than the budget, and recorded as such
    assert ladder["held_bytes"] > ladder["price_over_nf4_bytes"]


def test_a_size_budget_is_bytes_over_nf4_in_both_recipes(tiny_llama_dir, smollm2_dir, tmp_path):
    """A size is the same currency: 20000B over NF4 whatever the dtype, never halved for FP32."""
    for dtype in ("float32", "bfloat16"):
        _, _, record = _plan(tiny_llama_dir, smollm2_dir, tmp_path / dtype, "planned-nf4", "20000B", dtype)
        assert record["budget_bytes"] == 20000
        price = sum(_served(m, "bf16") for m in record["modules"])
        assert record["price_over_nf4_bytes"] == price <= 20000
        # the greedy set fills the budget to within one unit (the smallest costs 2 * 2048 - 1216 = 2880 B)
        assert price > 20000 - _served("model.layers.0.mlp.down_proj", "bf16")


# ---------------------------------------------------------------------------------------------- item 5

@pytest.mark.parametrize("recipe", ["planned-ladder-nf4", "planned-nf4"])
def test_a_budget_that_buys_no_unit_is_refused_before_profiling(tiny_llama_dir, smollm2_dir, tmp_path, monkeypatch,
                                                                recipe):
    import gnmr_hf
    from gnmr_hf.planning import ladder

    def no_profile(*a, **k):
        raise AssertionError("profiled before the budget was checked")

    monkeypatch.setattr(ladder, "rung_gains", no_profile)
    monkeypatch.setattr(gnmr_hf, "profile_sensitivity", no_profile)
    # +0.0001%nf4 of the tiny model is 0 B; the cheapest rung (INT8 on a 32 x 64 k_proj: 2048 + 128 - 1216 B)
    cheapest = _served("model.layers.0.self_attn.k_proj", "int8" if "ladder" in recipe else "bf16")
    with pytest.raises(finetune.RecipeError, match=rf"profile\.budget \+0\.0001%nf4 = 0 B over the NF4 model buys no "
                                                   rf"unit: the cheapest is .*k_proj on (INT8|BF16) at {cheapest} B") as e:
        _plan(tiny_llama_dir, smollm2_dir, tmp_path, recipe, "+0.0001%nf4")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "profile.json").exists()


def test_a_ladder_budget_whose_units_all_lose_is_refused_right_after_profiling(tiny_llama_dir, smollm2_dir, tmp_path,
                                                                               monkeypatch):
    """A budget that buys a rung, on data where no rung has a positive first-order gain (every gain of the real
    profile negated): the ladder plans nothing and the run is refused, not trained as plain NF4 called planned."""
    from gnmr_hf.planning import ladder

    real = ladder.rung_gains

    def losing(*a, **k):
        units = real(*a, **k)
        assert any(g > 0 for u in units for g in u.gains.values())  # the real profile buys something
        for u in units:
            u.gains = {r: -abs(g) for r, g in u.gains.items()}
        return units

    monkeypatch.setattr(ladder, "rung_gains", losing)
    with pytest.raises(finetune.RecipeError, match=r"profile\.budget \+25%nf4 = \d+ B over the NF4 model buys nothing "
                                                   r"on the ladder \[int8, bf16\]: no linear that fits has a positive "
                                                   r"first-order gain") as e:
        _plan(tiny_llama_dir, smollm2_dir, tmp_path, "planned-ladder-nf4", "+25%nf4")
    assert "\n" not in str(e.value)
    assert not (tmp_path / "profile.json").exists()
