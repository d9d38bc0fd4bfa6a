"""What peft.prepare_model_for_kbit_training does to the linears a plan keeps on BF16 (measured: it
doubles them), and gnmr_hf.prepare_for_training keeping them at 2 bytes a weight while training."""

from __future__ import annotations

import pytest
import torch

KEPT = ["model.layers.0.self_attn.v_proj", "model.layers.3.mlp.down_proj"]


def _mixed(path):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                           llm_int8_skip_modules=KEPT + ["lm_head"])
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q)


def test_peft_prepare_doubles_the_kept_linears_and_ours_does_not(tiny_llama_dir):
    import peft

    from gnmr_hf.training import linear_weight_bytes, prepare_for_training

    numel = {n: m.weight.nelement() for n, m in _mixed(tiny_llama_dir).named_modules() if n in KEPT}
    theirs = _mixed(tiny_llama_dir)
    before = linear_weight_bytes(theirs, KEPT)
    assert before == {n: 2 * numel[n] for n in KEPT}
    peft.prepare_model_for_kbit_training(theirs)
    assert linear_weight_bytes(theirs, KEPT) == {n: 4 * numel[n] for n in KEPT}  # upcast to FP32
    assert theirs.model.embed_tokens.weight.dtype == torch.float32

    ours = prepare_for_training(_mixed(tiny_llama_dir))
    assert linear_weight_bytes(ours, KEPT) == before
    assert ours.model.embed_tokens.weight.dtype == torch.bfloat16
    assert not any(p.requires_grad for p in ours.parameters())
    assert ours.is_gradient_checkpointing


def test_a_model_prepared_our_way_trains_under_lora(tiny_llama_dir):
    import peft

    from gnmr_hf.training import prepare_for_training

    model = prepare_for_training(_mixed(tiny_llama_dir))
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["v_proj", "down_proj"],
                                                       task_type="CAUSAL_LM"))
    model.train()
    lora = {n: p.detach().clone() for n, p in model.named_parameters() if p.requires_grad}
    assert lora and all("lora_" in n for n in lora)
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-2)
    ids = torch.randint(0, 128, (2, 16))
    for _ in range(3):
        loss = model(input_ids=ids, labels=ids).loss
        assert torch.isfinite(loss)
        loss.backward()
        opt.step()
        opt.zero_grad()
    changed = [n for n, p in model.named_parameters() if p.requires_grad and not torch.equal(p, lora[n])]
    assert any("lora_A" in n for n in changed) and any("lora_B" in n for n in changed)
    kept = dict(model.named_modules())["base_model.model.model.layers.0.self_attn.v_proj"].base_layer
    assert kept.weight.dtype == torch.bfloat16 and type(kept) is torch.nn.Linear


@pytest.mark.parametrize("kwargs", [{}, {"use_reentrant": False}])
def test_checkpointing_kwargs_pass_through(tiny_llama_dir, kwargs):
    from gnmr_hf.training import prepare_for_training

    model = prepare_for_training(_mixed(tiny_llama_dir), gradient_checkpointing_kwargs=kwargs)
    assert model.is_gradient_checkpointing
