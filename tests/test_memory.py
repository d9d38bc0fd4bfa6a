"""Memory in the user's currency: the predicted bytes of a mixed model against what a stock
transformers + bitsandbytes load holds (get_memory_footprint() and the quant states), NF4 with and
without double quantisation, FP4 and INT8; and the +N%nf4 budget strings."""

from __future__ import annotations

import pytest
import torch

from gnmr_hf import memory

KEPT = ["model.layers.0.self_attn.v_proj", "model.layers.2.mlp.down_proj"]


def _stock(path, fmt, double_quant, skip):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    if fmt == "int8":
        q = BitsAndBytesConfig(load_in_8bit=True, llm_int8_skip_modules=skip)
    else:
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=fmt, bnb_4bit_use_double_quant=double_quant,
                               bnb_4bit_compute_dtype=torch.bfloat16, llm_int8_skip_modules=skip)
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q)


def _decoder_linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


@pytest.mark.parametrize("fmt,double_quant", [("nf4", False), ("nf4", True), ("fp4", False), ("int8", False)])
def test_predicted_bytes_equal_the_stock_loaded_mixed_model(tiny_llama_dir, fmt, double_quant):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    bf16 = AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16)
    quantized = [n for n in _decoder_linears(bf16) if n not in KEPT]
    predicted = memory.predict_model_bytes(bf16, quantized, fmt, double_quant=double_quant)
    stock = _stock(tiny_llama_dir, fmt, double_quant, KEPT + ["lm_head"])
    low_type = bnb.nn.Linear8bitLt if fmt == "int8" else bnb.nn.Linear4bit
    assert sorted(n for n, m in stock.named_modules() if isinstance(m, low_type)) == sorted(quantized)
    held = memory.model_bytes(stock)
    assert held["footprint"] == stock.get_memory_footprint()
    assert abs(predicted["footprint"] - stock.get_memory_footprint()) <= 0.01 * stock.get_memory_footprint()
    assert predicted == held  # exact on this layout
    # and the quantisation changed what is held (the comparison can fail)
    assert held["total"] < memory.model_bytes(bf16)["total"] and held["quant_state"] > 0


def test_weight_bytes_by_hand():
    # 4096 weights, 64 rows: NF4 2048 B packed + 64 blocks x 4 B absmax + 16 x 4 B code
    assert memory.weight_bytes(4096, 64, "nf4") == memory.LinearBytes(2048, 64 * 4 + 64)
    # double quant: 64 B absmax + 4 B offset + 1 x 4 B second absmax + 1024 B + 64 B code tables
    assert memory.weight_bytes(4096, 64, "nf4", double_quant=True) == memory.LinearBytes(2048, 64 + 4 + 4 + 1024 + 64)
    assert memory.weight_bytes(4096, 64, "int8") == memory.LinearBytes(4096, 256)
    assert memory.weight_bytes(4096, 64, "bf16") == memory.LinearBytes(8192, 0)
    # keeping a large linear on BF16 costs ~1.44 B a weight over NF4, on INT8 ~0.44
    n = 576 * 1536
    assert memory.extra_bytes_over_low(n, 576, "nf4") / n == pytest.approx(1.4375, abs=1e-3)
    assert (memory.weight_bytes(n, 576, "int8").total - memory.weight_bytes(n, 576, "nf4").total) / n == pytest.approx(1 + 4 / 1536 - 0.5625, abs=1e-4)
    with pytest.raises(ValueError, match="unknown weight format"):
        memory.weight_bytes(10, 1, "int3")


def test_memory_budget_strings():
    assert memory.parse_memory_budget("+10%nf4") == (pytest.approx(0.10), "nf4")
    assert memory.parse_memory_budget("25 % NF4") == (pytest.approx(0.25), "nf4")
    assert memory.parse_memory_budget("+5%int8") == (pytest.approx(0.05), "int8")
    assert memory.parse_memory_budget("10%") is None  # the BF16-bytes currency: another parser's
    assert memory.parse_memory_budget("5MB") is None
    for bad in ("+0%nf4", "-10%nf4", "+2000%nf4", "abc%nf4"):
        with pytest.raises(ValueError, match="memory over the low model"):
            memory.parse_memory_budget(bad)
