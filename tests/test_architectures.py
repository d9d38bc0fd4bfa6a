"""Every decoder-only architecture a user brings: tiny random configs (built offline from their config
classes) of Llama, Mistral, Qwen2, Qwen3, Gemma2, Gemma3, Phi3 (fused qkv_proj / gate_up_proj) and OLMo2
through the dual path (both grains), the profile, the planner, the skip list under stock loading and the
callback in a real Trainer."""

from __future__ import annotations

import pytest
import torch

from tests.test_dual_path import load, logits

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")
transformers = pytest.importorskip("transformers")

import gnmr_hf  # noqa: E402
from gnmr_hf.units import find_linear_units, short_name  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
# (config class, model class, extra config, the linears of one decoder layer in module order)
ARCHS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64},
                ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}, ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16},
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 64},
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 64},
               ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}, ["o_proj", "qkv_proj", "gate_up_proj", "down_proj"]),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0},
              ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]),
}


def _build(arch: str, path):
    cfg_cls, model_cls, extra, _ = ARCHS[arch]
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request, tmp_path_factory):
    return request.param, _build(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


def _layer_ops(model) -> list[list[str]]:
    by_layer: dict[str, list[str]] = {}
    for name, _ in find_linear_units(model):
        layer = ".".join(short_name(name).split(".")[:2])
        by_layer.setdefault(layer, []).append(short_name(name).rsplit(".", 1)[-1])
    return list(by_layer.values())


@pytest.mark.parametrize("grain", [None, "linears"])
def test_dual_path_ends_are_the_stock_models(arch, ids, grain):
    name, path = arch
    stock_low = logits(load(path, "nf4"), ids)
    stock_high = logits(load(path, None), ids)
    assert not torch.equal(stock_low, stock_high)  # NF4 changed the outputs: the comparison can fail
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units=grain, dtype=torch.float32)
    units = gnmr_hf.recoverable_units(model) if grain is None else None
    n = len(units) if units is not None else len(find_linear_units(model))
    assert n == (COMMON["num_hidden_layers"] if grain is None else COMMON["num_hidden_layers"] * len(ARCHS[name][3]))
    gnmr_hf.set_active_units(model, [])
    assert torch.equal(logits(model, ids), stock_low)
    gnmr_hf.set_active_units(model, list(range(n)))
    assert torch.allclose(logits(model, ids), stock_high, atol=1e-5, rtol=0)


def test_units_are_named_by_their_real_modules(arch):
    name, path = arch
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    assert _layer_ops(model) == [ARCHS[name][3]] * COMMON["num_hidden_layers"]


def test_profile_plan_and_skip_list_select_exactly_the_plan(arch, ids):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    name, path = arch
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    batches = [{"input_ids": ids, "labels": ids}]
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    p = gnmr_hf.plan(prof, budget_fraction=0.3, model=model, batches=batches)
    assert p.indices
    skip = p.skip_modules()
    stock = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, quantization_config=BitsAndBytesConfig(
        load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skip))
    kept = sorted(short_name(n) for n, m in stock.named_modules()
                  if isinstance(m, torch.nn.Linear) and not isinstance(m, bnb.nn.Linear4bit) and ".layers." in n)
    planned = sorted(short_name(prof.units[i].name) for i in p.indices)
    assert kept == planned
    assert not isinstance(stock.lm_head, bnb.nn.Linear4bit)  # the head stays unquantised (tied or not)


def test_a_three_step_trainer_run_with_a_planned_policy(arch, ids, tmp_path):
    import datasets
    from transformers import Trainer, TrainingArguments

    name, path = arch
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=sorted(set(ARCHS[name][3])),
                                                       task_type="CAUSAL_LM"))
    model.train()
    n = len(find_linear_units(model))
    planned = [0, n - 1]
    callback = gnmr_hf.GNMRCallback(policy=gnmr_hf.StaticPolicy(n, planned))
    rows = [{"input_ids": r, "labels": r} for r in ids.tolist()] * 3
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, per_device_train_batch_size=2, report_to="none",
                             logging_steps=1, save_strategy="no", use_cpu=True, disable_tqdm=True)
    before = {k: v.detach().clone() for k, v in model.named_parameters() if v.requires_grad}
    trainer = Trainer(model=model, args=args, train_dataset=datasets.Dataset.from_list(rows), callbacks=[callback])
    trainer.train()
    assert trainer.state.global_step == 3
    assert all(torch.isfinite(torch.tensor(e["loss"])) for e in trainer.state.log_history if "loss" in e)
    assert any(not torch.equal(v, before[k]) for k, v in model.named_parameters() if v.requires_grad)
    import json

    trace = [json.loads(line) for line in (tmp_path / "gnmr_trace.jsonl").read_text().splitlines()]
    assert [t["step"] for t in trace] == [1, 2, 3]
    assert all(sorted(t["active"]) == planned for t in trace)  # the planned set ran on BF16 at every step


def test_an_unknown_layout_is_refused_naming_what_it_found():
    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.conv = torch.nn.Conv1d(4, 4, 1)

    class Odd(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([Block(), Block()])

    with pytest.raises(ValueError, match="no linear layer inside the decoder layers of Odd.*Conv1d"):
        find_linear_units(Odd())


def test_loftq_brings_each_architecture_closer_to_bf16(arch, ids):
    # the bench's loftq rows on Gemma 3 and the recipes' lora_init: loftq on every layout: PEFT's LoftQ on
    # the CPU (gnmr_hf.loftq) finds every targeted linear's checkpoint weight (fused Phi-3 ones included)
    # and its adapter removes part of each linear's NF4 residual: ||W - (W_nf4 + s B A)|| below ||W - W_nf4||
    import bitsandbytes as bnb
    from safetensors import safe_open

    from gnmr_hf import loftq

    name, path = arch
    reference = logits(load(path, None), ids)

    def qlora():
        return peft.get_peft_model(load(path, "nf4"), peft.LoraConfig(r=8, lora_alpha=8,
                                                                       target_modules=sorted(set(ARCHS[name][3]))))

    plain_err = (logits(qlora(), ids) - reference).pow(2).mean()
    model = loftq.replace_lora_weights_loftq(qlora(), path, progress=False)
    layers = [(n, m) for n, m in model.named_modules() if isinstance(m, peft.tuners.lora.LoraLayer)]
    assert len(layers) == COMMON["num_hidden_layers"] * len(ARCHS[name][3])
    with safe_open(str(path / "model.safetensors"), framework="pt") as f:
        for n, m in layers:
            w = f.get_tensor(n.removeprefix("base_model.model.") + ".weight").float()
            q = bnb.functional.dequantize_4bit(m.base_layer.weight.data, m.base_layer.weight.quant_state).float()
            delta = m.scaling["default"] * m.lora_B["default"].weight @ m.lora_A["default"].weight
            before, after = (w - q).norm(), (w - q - delta).norm()
            assert after < 0.97 * before, (n, float(after), float(before))
    assert (logits(model, ids) - reference).pow(2).mean() < plain_err
