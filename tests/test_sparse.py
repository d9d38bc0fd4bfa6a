"""Dynamic sparse training and SMET (gnmr_hf.sparse): masks, the warm-up worked by hand, AdamW equality,
memory, and GNMR's decisions reaching the warm-up through GNMRCallback."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn

from gnmr_hf.sparse.layer import SparseLinear, prepare_sparse, realised_density, sparse_linears
from gnmr_hf.sparse.optim import SparseAdamW


def _tiny_llama(seed: int = 0):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                      num_attention_heads=2, num_key_value_heads=2, max_position_embeddings=32)
    return LlamaForCausalLM(cfg)


# ------------------------------------------------------------------------------------------- masks
@pytest.mark.parametrize("block_size", [1, 4])
@pytest.mark.parametrize("regrow", ["set", "rigl"])
def test_density_exact_and_counts_through_updates(block_size, regrow):
    torch.manual_seed(0)
    lin = SparseLinear.convert(nn.Linear(16, 8), density=0.3, block_size=block_size,
                               generator=torch.Generator().manual_seed(1))
    n_blocks = 8 * 16 // block_size
    k = round(0.3 * n_blocks)
    assert lin.k == k and lin.mask().sum() == k * block_size and lin.values.shape == (k, block_size)
    with torch.no_grad():
        lin.values.normal_()
    n = lin.num_drop(0.25)
    assert n == round(0.25 * k) > 0
    changed = 0
    for u in range(5):
        before = lin.block_mask().clone()
        mags = lin.values.detach().abs().sum(1)
        grad = torch.randn(8, 16)
        slots, dropped, grown = lin.update_topology(0.25, regrow, torch.Generator().manual_seed(u), grad)
        after = lin.block_mask()
        assert len(slots) == len(dropped) == len(grown) == n  # dropped == regrown
        assert int(after.sum()) == k and int(lin.mask().sum()) == k * block_size  # exact density
        assert before[dropped].all() and not after[dropped].any()  # dropped were active, are gone
        assert not before[grown].any() and after[grown].all()  # grown were inactive, are active
        assert int((before ^ after).sum()) == 2 * n
        # the dropped blocks are the n smallest in magnitude; regrown weights start at zero
        assert mags[slots].max() <= mags[[s for s in range(k) if s not in set(slots.tolist())]].min()
        assert torch.equal(lin.values[slots], torch.zeros(n, block_size))
        if regrow == "rigl":
            score = grad.abs().view(n_blocks, -1).sum(1)
            score[before] = -1
            assert set(grown.tolist()) == set(score.topk(n).indices.tolist())
        changed += int((before ^ after).sum())
        with torch.no_grad():
            lin.values.normal_()
    assert changed == 5 * 2 * n
    assert lin.density == k / n_blocks


def test_forward_backward_equal_dense_masked_linear():
    torch.manual_seed(0)
    dense = nn.Linear(12, 6)
    sparse = SparseLinear.convert(copy.deepcopy(dense), 0.4, 3, torch.Generator().manual_seed(0))
    mask = sparse.mask()
    assert 0 < mask.sum() < mask.numel()
    w = (dense.weight.detach() * mask).requires_grad_()
    x = torch.randn(2, 5, 12)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref = nn.functional.linear(x1, w, dense.bias)
    y = sparse(x2)
    torch.testing.assert_close(y, y_ref)
    y_ref.square().sum().backward()
    y.square().sum().backward()
    torch.testing.assert_close(x2.grad, x1.grad)
    torch.testing.assert_close(sparse.values.grad, w.grad.view(-1, 3)[sparse.index.long()])
    assert sparse.values.grad.shape == (sparse.k, 3)  # the gradient exists for active blocks only


def test_prepare_sparse_converts_decoder_linears_only():
    model = _tiny_llama()
    prepare_sparse(model, density=0.25, seed=3)
    names = [n for n, _ in sparse_linears(model)]
    assert len(names) == 14 and all(".layers." in n for n in names)
    assert type(model.lm_head) is nn.Linear
    assert realised_density(model) == pytest.approx(0.25, abs=1e-3)
    out = model(input_ids=torch.randint(0, 64, (2, 8)), labels=torch.randint(0, 64, (2, 8)))
    assert torch.isfinite(out.loss)


# ----------------------------------------------------------------------------- warm-up, by hand
def _layer_4x4():
    """A 4x4 layer at density 0.5, slots holding blocks 0..7 (rows 0 and 1), values 1..8."""
    lin = SparseLinear(4, 4, bias=False, density=0.5, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lin.index.copy_(torch.arange(8, dtype=torch.int32))
        lin.values.copy_(torch.arange(1.0, 9.0).view(8, 1))
    return lin


def test_regrown_weight_timestep_restarts_and_lr_ramps_by_hand():
    # lr 0.1, W = 4, eps 0, constant gradient 2 on every slot: with its own timestep a, Adam's bias-corrected
    # moments are exactly m^ = 2, v^ = 4, so an update is -lr * min(1, a/W) * sign(g)
    lin = _layer_4x4()
    opt = SparseAdamW(lin.parameters(), layers=[lin], lr=0.1, betas=(0.9, 0.999), eps=0.0, warmup_steps=4,
                      density_scaling=False)
    lin.set_recovery(True)
    for _ in range(3):
        lin.values.grad = torch.full((8, 1), 2.0)
        opt.step()
    st = opt.state[lin.values]
    assert st["age"].tolist() == [3] * 8 and float(st["step"]) == 3
    # slots never moved have a = t, so while t < W their ramp is t/W too: 0.1 * (1/4 + 2/4 + 3/4) = 0.15
    torch.testing.assert_close(lin.values.detach().view(-1), torch.arange(1.0, 9.0) - 0.1 * (0.25 + 0.5 + 0.75))
    # the update drops the two smallest-magnitude slots (values 1 - 0.15 and 2 - 0.15: slots 0 and 1) and
    # regrows blocks of rows 2-3
    slots, dropped, grown = lin.update_topology(0.25, "set", torch.Generator().manual_seed(0))
    assert slots.tolist() == [0, 1] and dropped.tolist() == [0, 1] and all(8 <= b < 16 for b in grown.tolist())
    opt.reset_slots(lin, slots)
    assert st["age"].tolist() == [0, 0] + [3] * 6
    assert st["exp_avg"][:2].abs().sum() == 0 and st["exp_avg_sq"][:2].abs().sum() == 0
    expected_regrown = 0.0
    for a in (1, 2, 3, 4, 5):
        lin.values.grad = torch.full((8, 1), 2.0)
        opt.step()
        assert st["age"][:2].tolist() == [a, a] and st["age"][2:].tolist() == [3 + a] * 6
        expected_regrown -= 0.1 * min(1.0, a / 4)  # 0.025, 0.05, 0.075, 0.1, 0.1
        torch.testing.assert_close(lin.values.detach()[:2].view(-1), torch.tensor([expected_regrown] * 2))
    assert expected_regrown == pytest.approx(-0.35)
    # mature slots took 3 more ramped updates (a = 4 .. 8, factor 1): 5 x 0.1 after the first 0.15
    torch.testing.assert_close(lin.values.detach()[2:].view(-1), torch.arange(3.0, 9.0) - 0.15 - 0.5)


def test_plain_path_uses_global_step_cold_start_by_hand():
    # the low-cost path: a regrown weight's zero moments are bias-corrected with the global step t
    lin = _layer_4x4()
    opt = SparseAdamW(lin.parameters(), layers=[lin], lr=0.1, betas=(0.9, 0.999), eps=0.0, warmup_steps=4,
                      density_scaling=False)
    for _ in range(3):
        lin.values.grad = torch.full((8, 1), 2.0)
        opt.step()
    slots, _, _ = lin.update_topology(0.25, "set", torch.Generator().manual_seed(0))
    opt.reset_slots(lin, slots)
    lin.values.grad = torch.full((8, 1), 2.0)
    opt.step()  # t = 4: m = 0.1 * 2, v = 0.001 * 4
    m_hat = 0.2 / (1 - 0.9**4)
    v_hat = 0.004 / (1 - 0.999**4)
    expected = -0.1 * m_hat / math.sqrt(v_hat)  # -0.1 * (0.2 / 0.3439) / sqrt(0.004 / 0.003994) = -0.1 * 0.58156 / 1.00075
    torch.testing.assert_close(lin.values.detach()[:2].view(-1), torch.tensor([expected] * 2))
    assert expected == pytest.approx(-0.058112, abs=1e-6)
    # and SMET's first regrown update would have been -0.1 * 1/4 = -0.025
    assert opt.last_step[id(lin)] == {"recovery": False, "min_factor": 1.0}


def test_density_scaling_multiplies_the_rate():
    lin = _layer_4x4()
    opt = SparseAdamW(lin.parameters(), layers=[lin], lr=0.1, eps=0.0, density_scaling=True)
    lin.values.grad = torch.full((8, 1), -1.0)
    opt.step()  # plain path, t = 1: update = +lr / sqrt(0.5)
    torch.testing.assert_close(lin.values.detach().view(-1), torch.arange(1.0, 9.0) + 0.1 / math.sqrt(0.5))


def test_age_survives_state_dict_round_trip_in_bf16():
    lin = _layer_4x4().to(torch.bfloat16)
    opt = SparseAdamW(lin.parameters(), layers=[lin], lr=0.1)
    for _ in range(301):
        lin.values.grad = torch.ones(8, 1, dtype=torch.bfloat16)
        opt.step()
    opt.state[lin.values]["age"][0] = 0
    opt2 = SparseAdamW(lin.parameters(), layers=[lin], lr=0.1)
    opt2.load_state_dict(copy.deepcopy(opt.state_dict()))
    age = opt2.state[lin.values]["age"]
    assert age.dtype == torch.int32 and age.tolist() == [0] + [301] * 7  # bf16 would round 301 to an even number


# ---------------------------------------------------------------------------- equal to AdamW
def test_sparse_adamw_equals_dense_adamw_on_active_weights():
    torch.manual_seed(0)
    model = _tiny_llama()
    prepare_sparse(model, density=0.3, seed=0)
    # the dense reference: the same model with plain linears holding the masked weights, gradients masked
    ref = _tiny_llama()
    masks = {}
    ref_modules = dict(ref.named_modules())
    for name, layer in sparse_linears(model):
        lin = ref_modules[name]
        with torch.no_grad():
            lin.weight.copy_(layer.weight)
        masks[name] = layer.mask()
        lin.weight.register_hook(lambda g, m=masks[name]: g * m)
    ref_index = {f"{name}.values": layer.index.long() for name, layer in sparse_linears(model)}
    with torch.no_grad():
        for (n1, p1), (_, p2) in zip(model.named_parameters(), ref.named_parameters()):
            if "values" not in n1:
                p2.copy_(p1)
    lr, d = 3e-3, 0.3
    opt = SparseAdamW.from_model(model, lr=lr, betas=(0.9, 0.95), weight_decay=0.1, density_scaling=True)
    # the density-aware rate: lr / sqrt(k / n_blocks) per layer (k = round(0.3 n_blocks))
    per_layer = [{"params": [ref_modules[n].weight], "lr": lr / math.sqrt(m.density)} for n, m in sparse_linears(model)]
    assert all(abs(m.density - d) < 2e-3 for _, m in sparse_linears(model))
    sparse_ids = {id(group["params"][0]) for group in per_layer}
    ref_opt = torch.optim.AdamW([{"params": [p for p in ref.parameters() if id(p) not in sparse_ids]}, *per_layer],
                                lr=lr, betas=(0.9, 0.95), weight_decay=0.1, foreach=False)
    start = {n: layer.weight.detach().clone() for n, layer in sparse_linears(model)}
    g = torch.Generator().manual_seed(0)
    pairs = list(zip(model.named_parameters(), ref.named_parameters()))
    for _ in range(6):
        ids = torch.randint(0, 64, (4, 16), generator=g)
        for m, o in ((model, opt), (ref, ref_opt)):
            o.zero_grad()
            m(input_ids=ids, labels=ids).loss.backward()
        # the sparse model's own gradients equal the reference's (up to GEMM order) ...
        for (n1, p1), (_, p2) in pairs:
            want = p2.grad.view(-1, 1)[ref_index[n1]] if n1.endswith(".values") else p2.grad
            torch.testing.assert_close(p1.grad, want, rtol=1e-3, atol=1e-5)
            p1.grad.copy_(want)  # ... and both optimizers then take the same gradient: Adam's 1/sqrt(v)
            # would otherwise amplify the GEMM-order differences of near-zero gradients step after step
        opt.step()
        ref_opt.step()
    for name, layer in sparse_linears(model):
        w_ref = ref_modules[name].weight.detach()
        assert torch.equal(w_ref * ~masks[name], torch.zeros_like(w_ref))  # the reference stayed sparse
        assert not torch.allclose(layer.weight.detach(), start[name])  # the weights did move
        torch.testing.assert_close(layer.weight.detach(), w_ref, rtol=1e-5, atol=1e-7)
    for (n1, p1), (_, p2) in zip(model.named_parameters(), ref.named_parameters()):
        if "values" not in n1:
            torch.testing.assert_close(p1.detach(), p2.detach(), rtol=1e-5, atol=1e-7)


def test_state_and_gradient_bytes_are_those_of_active_blocks():
    model = _tiny_llama()
    prepare_sparse(model, density=0.2, block_size=4, seed=0)
    opt = SparseAdamW.from_model(model, lr=1e-3)
    ids = torch.randint(0, 64, (2, 8))
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    layers = [m for _, m in sparse_linears(model)]
    dense_params = [p for n, p in model.named_parameters() if not n.endswith(".values")]
    n_dense = sum(p.numel() for p in dense_params)
    n_active = sum(m.k * 4 for m in layers)
    # moments: 2 x 4 bytes per trained weight; a 4-byte step per tensor; a 4-byte age per sparse slot
    expected_state = 8 * (n_dense + n_active) + 4 * (len(dense_params) + len(layers)) + 4 * sum(m.k for m in layers)
    assert opt.state_bytes() == expected_state
    assert opt.grad_bytes() == 4 * (n_dense + n_active)
    full = sum(m.out_features * m.in_features for m in layers)
    assert n_active == pytest.approx(0.2 * full, rel=0.01)
    # dense AdamW on the same model holds 8 bytes of moments per weight of every linear
    assert opt.state_bytes() < 8 * (n_dense + full)


# ------------------------------------------------------------------ GNMR in control of the warm-up
def test_controller_decisions_reach_the_warmup_of_exactly_the_chosen_units(tmp_path):
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from gnmr_hf.core.controller import GNMRConfig
    from gnmr_hf.sparse.callback import DSTCallback
    from gnmr_hf.trainer.callback import GNMRCallback

    model = _tiny_llama()
    prepare_sparse(model, density=0.25, seed=0)
    layers = sparse_linears(model)
    opt = SparseAdamW.from_model(model, lr=3e-3, warmup_steps=3)
    seen: list[dict] = []

    class Record(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            seen.append({"step": state.global_step,
                         "used": [opt.last_step[id(m)]["recovery"] for _, m in layers],
                         "factor": [opt.last_step[id(m)]["min_factor"] for _, m in layers]})

    g = torch.Generator().manual_seed(0)
    data = [{"input_ids": x, "labels": x} for x in torch.randint(0, 64, (64, 16), generator=g)]
    cfg = GNMRConfig(max_active=3, lock_steps=1, alpha=1.02, beta=1.02, window=3)
    gnmr = GNMRCallback(cfg, units="linears", trace=str(tmp_path / "trace.jsonl"))
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=16, per_device_train_batch_size=4,
                             learning_rate=3e-3, report_to="none", use_cpu=True, save_strategy="no",
                             logging_steps=100, disable_tqdm=True, seed=0)
    dst = DSTCallback(update_every=2, drop_fraction=0.3, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data, optimizers=(opt, None),
                      callbacks=[gnmr, dst, Record()])
    trainer.train()
    import json

    trace = [json.loads(line) for line in open(tmp_path / "trace.jsonl")]
    assert [r["step"] for r in trace] == list(range(1, 17)) and len(seen) == 16
    assert len(dst.updates) == 8
    chosen_any = 0
    for rec in seen:
        t = rec["step"]
        chosen = set(trace[t - 2]["active"]) if t >= 2 else set()
        used = {i for i, u in enumerate(rec["used"]) if u}
        assert used == chosen, (t, used, chosen)  # the decision after step t-1 ran update t
        chosen_any += len(chosen)
        for i, f in enumerate(rec["factor"]):
            if i not in chosen:
                assert f == 1.0
            elif t % 2 == 1 and t > 1:
                # the update of step t-1 moved slots of every layer: their first update is ramped to 1/W
                assert f == pytest.approx(1 / 3)
    assert chosen_any > 0  # the controller did choose units
    assert any(len(set(trace[t]["active"])) < 14 for t in range(16))  # and not all of them
