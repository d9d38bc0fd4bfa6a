"""Calibrated LoRA init (gnmr_hf.calibrated_init): the closed form against a numerical minimiser, the output
error against LoftQ's and zero's, the saved adapter through stock PEFT, and the recipe key."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from tests.test_dual_path import LINEARS, load, logits

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

from gnmr_hf import calibrated_init as ci  # noqa: E402
from gnmr_hf import loftq  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


def _qlora(path, rank=4, alpha=None):
    model = load(path, "nf4")  # FP32 compute, bitsandbytes' reference layout
    cfg = peft.LoraConfig(r=rank, lora_alpha=alpha or rank, target_modules=LINEARS, lora_dropout=0.0)
    return peft.get_peft_model(model, cfg)


def _ids(seed, n=4, t=24):
    return torch.randint(0, 128, (n, t), generator=torch.Generator().manual_seed(seed))


def _objective(e, h, b, a, scaling):
    d = e - scaling * b @ a
    return ((d @ h) * d).sum()


@pytest.mark.parametrize("scaling", [1.0, 2.0])
def test_closed_form_matches_a_numerical_minimiser(scaling):
    g = torch.Generator().manual_seed(0)
    out, inp, rank = 10, 8, 3
    e = torch.randn(out, inp, generator=g, dtype=torch.float64)
    mix = torch.randn(inp, inp, generator=g, dtype=torch.float64) * torch.logspace(0, -2, inp, dtype=torch.float64)
    x = torch.randn(400, inp, generator=g, dtype=torch.float64) @ mix.T  # correlated, badly scaled inputs
    h = x.T @ x / x.shape[0]
    damp = 1e-3
    hd = h + damp * h.diagonal().mean() * torch.eye(inp, dtype=torch.float64)  # the objective the form minimises
    b, a = ci.closed_form_pair(e, h, rank, scaling=scaling, damp=damp)
    assert b.shape == (out, rank) and a.shape == (rank, inp)
    closed = float(_objective(e, hd, b, a, scaling))
    # numerical minimiser from a random start: LBFGS on the same objective
    bb = torch.randn(out, rank, generator=g, dtype=torch.float64, requires_grad=True)
    aa = torch.randn(rank, inp, generator=g, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([bb, aa], max_iter=5000, tolerance_grad=1e-12, tolerance_change=1e-15,
                            line_search_fn="strong_wolfe")

    def closure():
        opt.zero_grad()
        loss = _objective(e, hd, bb, aa, scaling)
        loss.backward()
        return loss

    for _ in range(5):
        opt.step(closure)
    numerical = float(_objective(e, hd, bb.detach(), aa.detach(), scaling))
    assert closed <= numerical * (1 + 1e-6) + 1e-12, (closed, numerical)
    assert numerical <= closed * (1 + 1e-4), (closed, numerical)  # the minimiser found the same minimum
    torch.testing.assert_close(scaling * bb.detach() @ aa.detach(), scaling * b @ a, rtol=1e-3, atol=1e-4)
    # LoftQ's target (H = I) is worse on this objective
    u, s, vh = torch.linalg.svd(e, full_matrices=False)
    loftq_err = float(_objective(e, hd, u[:, :rank] * s[:rank], vh[:rank], 1.0))
    assert closed < loftq_err


def test_identity_second_moment_is_loftqs_svd():
    e = torch.randn(6, 5, generator=torch.Generator().manual_seed(3), dtype=torch.float64)
    b, a = ci.closed_form_pair(e, torch.eye(5, dtype=torch.float64), 2, damp=0.0)
    u, s, vh = torch.linalg.svd(e, full_matrices=False)
    torch.testing.assert_close(b @ a, (u[:, :2] * s[:2]) @ vh[:2])


def test_calibrated_init_beats_loftq_and_zero_on_held_out_output(tiny_llama_dir):
    calib, held = _ids(1, n=8, t=32), _ids(2)
    reference = logits(load(tiny_llama_dir, False), held)
    with torch.no_grad():
        zero = _qlora(tiny_llama_dir, rank=8)
        zero_err = float((logits(zero, held) - reference).pow(2).mean())
        lq = loftq.replace_lora_weights_loftq(_qlora(tiny_llama_dir, rank=8), tiny_llama_dir, progress=False)
        loftq_err = float((logits(lq, held) - reference).pow(2).mean())
    model = _qlora(tiny_llama_dir, rank=8)
    summary = ci.calibrated_lora_init(model, [{"input_ids": calib}], tiny_llama_dir)
    with torch.no_grad():
        cal_err = float((logits(model, held) - reference).pow(2).mean())
    assert summary["linears"] == 4 * 7 and summary["skipped"] == 0 and summary["tokens"] == calib.numel()
    err = summary["output_error"]
    assert err["calibrated"] < err["loftq"] < err["zero"]  # per-linear target, on the calibration data
    assert cal_err < loftq_err and cal_err < zero_err, (cal_err, loftq_err, zero_err)


def test_skip_and_padding(tiny_llama_dir):
    model = _qlora(tiny_llama_dir, rank=4, alpha=8)
    name = "model.layers.1.self_attn.v_proj"
    layer = model.base_model.model.model.layers[1].self_attn.v_proj
    before = layer.lora_A["default"].weight.detach().clone(), layer.lora_B["default"].weight.detach().clone()
    ids = _ids(4, n=2, t=10)
    mask = torch.ones_like(ids)
    mask[1, 6:] = 0
    summary = ci.calibrated_lora_init(model, {"input_ids": ids, "attention_mask": mask}, tiny_llama_dir, skip=[name])
    assert summary["skipped"] == 1 and summary["tokens"] == 16
    assert torch.equal(layer.lora_A["default"].weight, before[0]) and torch.equal(layer.lora_B["default"].weight, before[1])
    other = model.base_model.model.model.layers[1].self_attn.q_proj
    assert other.lora_B["default"].weight.abs().max() > 0


def test_saved_adapter_loads_with_stock_peft_and_reproduces_the_initialised_model(tiny_llama_dir, tmp_path):
    model = _qlora(tiny_llama_dir, rank=4, alpha=8)
    ci.calibrated_lora_init(model, [{"input_ids": _ids(5)}], tiny_llama_dir)
    held = _ids(6, n=2)
    model.eval()
    with torch.no_grad():
        want = logits(model, held)
    model.save_pretrained(tmp_path / "adapter")
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (tmp_path / "adapter").iterdir()}
    from peft import PeftModel

    fresh = PeftModel.from_pretrained(load(tiny_llama_dir, "nf4"), str(tmp_path / "adapter"))  # stock PEFT
    fresh.eval()
    with torch.no_grad():
        got = logits(fresh, held)
        plain = logits(load(tiny_llama_dir, "nf4"), held)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    assert (got - plain).abs().max() > 1e-4  # the adapter is not zero


def test_recipe_key_parses_and_needs_a_4bit_base():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    smol = ROOT / "recipes" / "smollm2-135m"
    r = finetune.validate(finetune.load_config(["--config", str(smol / "planned-nf4.yaml"), "--lora_init", "calibrated"]))
    assert r.lora.lora_init == "calibrated"
    with pytest.raises(finetune.RecipeError, match="lora_init: calibrated .*needs a 4-bit base .*not bf16"):
        finetune.validate(finetune.load_config(["--config", str(smol / "bf16.yaml"), "--lora_init", "calibrated"]))


@pytest.mark.parametrize("config, budget", [("planned-nf4", "25%"), ("planned-ladder-calibrated-nf4", "+0.4%nf4")])
def test_recipe_runs_two_steps_with_calibrated_init(tmp_path, tiny_tok, config, budget):
    """A BF16 plan and the ladder (INT8 / BF16 rungs) with lora_init: calibrated, in process on a tiny LLaMA
    (SmolLM2's tokenizer), 2 steps."""
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    out = tmp_path / "run"
    recipe = finetune.load_config([
        "--config", str(ROOT / "recipes" / "smollm2-135m" / f"{config}.yaml"), "--model", str(tiny_tok),
        "--output_dir", str(out), "--data_dir", str(tmp_path / "data"), "--max_steps", "2", "--report_to", "none",
        "--disable_tqdm", "true", "--lora_init", "calibrated", "--profile.budget", budget, "--compute_dtype", "float32",
        "--use_cpu", "true", "--logging_steps", "1", "--save_strategy", "no"])
    record = finetune.run(recipe)
    assert record["status"] == "complete" and record["global_step"] == 2
    cal = record["calibrated_init"]
    assert cal["skipped"] == len(record["profile"]["plan"]["modules"]) > 0
    assert cal["linears"] + cal["skipped"] == 14
    assert cal["output_error"]["calibrated"] < cal["output_error"]["loftq"] < cal["output_error"]["zero"]
    assert json.loads((out / "run.json").read_text())["config"]["lora"]["lora_init"] == "calibrated"
    assert (out / "adapter_config.json").is_file()


def test_allocate_ranks_by_hand_and_against_brute_force():
    import itertools

    spectra = {"a": torch.tensor([10.0, 5.0, 4.0, 1.0]), "b": torch.tensor([3.0, 2.0, 1.0, 0.5])}
    shapes = {"a": (4, 4), "b": (4, 4)}
    # 2 x rank 2 x 8 parameters = 32 = four rank-ones of 8: one each to start, then a's 5 (> b's 2), a's 4 (> 2)
    assert ci.allocate_ranks(spectra, shapes, rank=2) == {"a": 3, "b": 1}
    assert ci.allocate_ranks(spectra, shapes, rank=2, min_rank=2) == {"a": 2, "b": 2}  # nothing to move
    # unequal costs: the greedy's choice keeps the best residual error of every allocation within the parameters
    g = torch.Generator().manual_seed(0)
    shapes = {"q": (6, 4), "k": (2, 4), "o": (4, 6)}
    spectra = {n: torch.rand(min(s), generator=g).sort(descending=True).values * (i + 1)
               for i, (n, s) in enumerate(shapes.items())}
    got = ci.allocate_ranks(spectra, shapes, rank=1, min_rank=1, max_rank=4)
    cost = {n: sum(s) for n, s in shapes.items()}
    limit = sum(min(1, min(s)) * cost[n] for n, s in shapes.items())
    assert sum(got[n] * cost[n] for n in got) <= limit

    def residual(ks):
        return sum(float(spectra[n][k:].sum()) for n, k in ks.items())

    best = min(residual(dict(zip(shapes, ks))) for ks in itertools.product(*[range(1, min(4, min(s)) + 1)
               for s in shapes.values()]) if sum(k * cost[n] for n, k in zip(shapes, ks)) <= limit)
    assert residual(got) == pytest.approx(best)
    with pytest.raises(ValueError, match="min_rank"):
        ci.allocate_ranks(spectra, shapes, rank=2, min_rank=3)
    assert ci.peft_rank_pattern({"layers.1.mlp.up_proj": 3, "layers.0.mlp.up_proj": 2}, 2) == \
        {r"layers\.1\.mlp\.up_proj": 3}


def test_ranked_init_is_the_forward_of_a_peft_rank_pattern_adapter(tiny_llama_dir):
    calib, held = [{"input_ids": _ids(7, n=8, t=32)}], _ids(8)
    wide = _qlora(tiny_llama_dir, rank=8, alpha=8)  # twice the rank: the unused terms stay zero
    spec = ci.error_spectra(wide, calib, tiny_llama_dir)
    ranks = ci.allocate_ranks(spec["spectra"], spec["shapes"], rank=4, min_rank=1, max_rank=8)
    assert len(set(ranks.values())) > 1  # some rank did move
    assert sum(k * sum(spec["shapes"][n]) for n, k in ranks.items()) <= sum(4 * sum(s) for s in spec["shapes"].values())
    summary = ci.calibrated_lora_init(wide, calib, tiny_llama_dir, ranks=ranks)
    # the same adapter built by stock PEFT with that rank_pattern, initialised by the closed form at its own ranks
    cfg = peft.LoraConfig(r=4, lora_alpha=4, target_modules=LINEARS, lora_dropout=0.0,
                          rank_pattern=ci.peft_rank_pattern(ranks, 4), alpha_pattern=ci.peft_rank_pattern(ranks, 4))
    stock = peft.get_peft_model(load(tiny_llama_dir, "nf4"), cfg)
    got_ranks = {n: m.r["default"] for n, m in stock.named_modules() if hasattr(m, "lora_A") and "default" in m.r}
    from gnmr_hf.units import short_name

    assert {short_name(n): k for n, k in got_ranks.items()} == ranks
    ci.calibrated_lora_init(stock, calib, tiny_llama_dir)
    wide.eval()
    stock.eval()
    with torch.no_grad():
        torch.testing.assert_close(logits(wide, held), logits(stock, held), rtol=1e-4, atol=1e-4)
    # spending the same parameters where the error is leaves less output error than the uniform rank 4
    uniform = ci.calibrated_lora_init(_qlora(tiny_llama_dir, rank=4, alpha=4), calib, tiny_llama_dir)
    assert summary["output_error"]["calibrated"] < uniform["output_error"]["calibrated"]
