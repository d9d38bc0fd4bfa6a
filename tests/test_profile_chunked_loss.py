"""The profile's loss (gnmr_hf.planning.passes._loss): the causal-LM loss computed from the decoder's hidden
states in checkpointed chunks of positions, so the full-vocabulary logits of a batch never exist at once.

Checked against the model's own ``model(**batch).loss`` and its gradients on tiny LLaMA and Gemma 3 models (one
with Gemma's final-logit softcapping, one PEFT-wrapped), with chunks small enough that every batch spans several;
and, in subprocesses, the peak memory of a forward + backward on a tiny model with a 65,536-word vocabulary
against the size of the batch's logits.
"""

from __future__ import annotations

import pytest
import torch

from gnmr_hf.planning import passes


def tiny_llama(vocab=96):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
                                        tie_word_embeddings=False)).float()


def tiny_gemma3(vocab=96, softcap=None):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    config = Gemma3TextConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                              num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64,
                              sliding_window=4, final_logit_softcapping=softcap)
    model = Gemma3ForCausalLM(config).float()
    with torch.no_grad():  # the final norm scales by 1 + weight: logits of a few units, so a softcap of 3 bends them
        model.model.norm.weight.fill_(40.0)
    return model


def batch(vocab=96, seed=0):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 11), generator=g)
    mask = torch.ones_like(ids)
    mask[1, -4:] = 0  # padding
    labels = ids.masked_fill(mask == 0, -100)
    labels[0, :5] = -100  # a prompt: no loss on it
    return {"input_ids": ids, "attention_mask": mask, "labels": labels, "use_cache": False}


MODELS = {"llama": lambda: tiny_llama(), "gemma3": lambda: tiny_gemma3(),
          "gemma3-softcap": lambda: tiny_gemma3(softcap=3.0)}


def grads(model, loss):
    model.zero_grad(set_to_none=True)
    loss.backward()
    return {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_loss_and_gradients_equal_the_models_own(name, monkeypatch):
    model = MODELS[name]()
    b = batch()
    assert passes._head_parts(model) is not None  # the chunked route is the one taken
    monkeypatch.setattr(passes, "LOSS_CHUNK_ROWS", 4)  # 23 target positions: six chunks
    own = model(**b).loss
    g_own = grads(model, own)
    calls = []
    real = passes._chunk_nll
    monkeypatch.setattr(passes, "_chunk_nll", lambda *a: calls.append(a[2].shape[0]) or real(*a))
    ours = passes._loss(model, b)
    g_ours = grads(model, ours)
    targets = int((b["labels"][:, 1:] != -100).sum())
    assert sum(calls) >= targets and max(calls) == 4  # every target position (recomputed too), 4 at a time
    assert torch.isfinite(ours) and ours.dtype == torch.float32
    torch.testing.assert_close(ours, own, rtol=1e-6, atol=1e-6)
    assert set(g_ours) == set(g_own) and len(g_own) > 10
    for k in g_own:
        scale = float(g_own[k].abs().max())
        assert scale > 0, k  # the gradient compared is not trivially zero
        # summation order differs (chunks of rows against one product): FP32 rounding, relative to the tensor
        assert float((g_ours[k] - g_own[k]).abs().max()) <= 1e-5 * scale, k


def test_softcap_changes_the_loss():
    """The softcapped model's loss differs from the uncapped one's (so the softcap test above tests something)."""
    b = batch()
    plain, capped = tiny_gemma3(), tiny_gemma3(softcap=3.0)
    capped.load_state_dict(plain.state_dict())
    with torch.no_grad():
        a, c = passes._loss(plain, b), passes._loss(capped, b)
    assert abs(float(a) - float(c)) > 1e-3
    torch.testing.assert_close(c, capped(**b).loss, rtol=1e-6, atol=1e-6)


def test_peft_wrapped_and_input_gradient(monkeypatch):
    """A LoRA-wrapped model (as the recipes profile it), with the first-order criterion's setting: every
    parameter frozen and the embeddings' output requiring grad, so the backward reaches every layer's output."""
    peft = pytest.importorskip("peft")
    model = peft.get_peft_model(tiny_llama(), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with torch.no_grad():  # B = 0 at init: make LoRA count
        for n, p in model.named_parameters():
            if "lora_B" in n:
                p.normal_(0, 0.1)
    monkeypatch.setattr(passes, "LOSS_CHUNK_ROWS", 5)
    b = batch()
    seen = {}

    def run(loss_fn):
        with passes._input_grad(model):
            emb = model.get_base_model().get_input_embeddings()
            h = emb.register_forward_hook(lambda m, i, o: seen.__setitem__("x", o))
            try:
                loss = loss_fn()
                loss.backward()
            finally:
                h.remove()
        return loss.detach(), seen["x"].grad.clone()

    own, g_own = run(lambda: model(**b).loss)
    ours, g_ours = run(lambda: passes._loss(model, b))
    assert passes._head_parts(model) is not None
    torch.testing.assert_close(ours, own, rtol=1e-6, atol=1e-6)
    scale = float(g_own.abs().max())
    assert scale > 0
    assert float((g_ours - g_own).abs().max()) <= 1e-5 * scale


def test_other_models_keep_their_own_loss():
    """A model whose loss is not the stock causal-LM loss, or whose head carries a hook, is not chunked."""
    model = tiny_llama()
    model.loss_function = lambda logits, labels, vocab_size, **kw: logits.float().mean()
    assert passes._head_parts(model) is None
    b = batch()
    torch.testing.assert_close(passes._loss(model, b), model(**b).loss)
    other = tiny_llama()
    handle = other.lm_head.register_forward_hook(lambda m, i, o: None)
    assert passes._head_parts(other) is None
    handle.remove()
    assert passes._head_parts(other) is not None


def test_no_target_is_an_error():
    b = batch()
    b["labels"] = torch.full_like(b["labels"], -100)
    b["labels"][:, 0] = 1  # the first position is never a target
    with pytest.raises(ValueError, match="no target"):
        passes._loss(tiny_llama(), b)


def test_no_tensor_as_large_as_the_logits_exists(monkeypatch):
    """65,536 words x 1,024 positions: the batch's FP32 logits are 64 Mi elements (256 MiB). The model's own loss
    forms them (and their log-softmax and gradient); the chunked loss never forms a tensor larger than one chunk's
    logits (LOSS_CHUNK_ELEMENTS, here 4 Mi = 64 positions). Every tensor any op produces, forward and backward,
    is seen through a dispatch mode: a count of elements, independent of the allocator and of the machine's load
    (a resident-set measurement of the same, 63 MB chunked against 808 MB, is in docs/reference.md)."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig, LlamaForCausalLM

    class Largest(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.numel = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    self.numel = max(self.numel, t.numel())
            return out

    vocab, seq = 65536, 1024
    monkeypatch.setattr(passes, "LOSS_CHUNK_ELEMENTS", 2**22)
    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=seq,
                                         tie_word_embeddings=True)).float()
    ids = torch.randint(0, vocab, (1, seq))
    b = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone(), "use_cache": False}
    assert passes._head_parts(model) is not None  # passes._loss takes the chunked path for this model
    seen = {}
    for mode in ("chunked", "model"):
        with Largest() as largest:
            loss = passes._loss(model, b) if mode == "chunked" else model(**b).loss
            loss.backward()
        seen[mode] = (largest.numel, float(loss))
        model.zero_grad(set_to_none=True)
    (ours, l_ours), (own, l_own) = seen["chunked"], seen["model"]
    assert abs(l_ours - l_own) < 1e-5 * l_own
    assert own >= vocab * (seq - 1)  # the count sees the full logits where they exist
    chunk = passes.LOSS_CHUNK_ELEMENTS
    assert chunk <= vocab * seq // 16  # the premise: at least sixteen chunks
    assert ours <= max(chunk, vocab * model.config.hidden_size), seen  # one chunk's logits, or the tied embedding
