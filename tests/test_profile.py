"""The sensitivity profile and the BF16 plan (gnmr_hf.planning), on a tiny random LLaMA in NF4 (FP32 compute).

Every criterion is checked against values worked out independently: the loss gains against hand-run
forwards, the output error against the linear's weights applied to its captured inputs, the first-order
estimate against autograd's weight gradient in a plain FP32 model holding the de-quantised weights, the
LoRA gradient gap against two hand-run backwards. Then: a unit whose recovery weight equals its
de-quantised weight scores 0; one whose quantisation error is scaled up 10x ranks first; the planner,
the skip list against transformers' own module matching (and a real 4-bit load), JSON, the CLI.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest
import torch

import gnmr_hf
from gnmr_hf.planning import (
    PrecisionPlan,
    SensitivityProfile,
    UnitScore,
    format_price_table,
    greedy_select,
    measure_plan,
    parse_budget,
    plan,
    profile_sensitivity,
    random_sets,
    skip_modules,
)
from tests.conftest import make_tiny_llama
from tests.test_dual_path import load

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

import bitsandbytes.functional as BF  # noqa: E402

from gnmr_hf.backends.base import dual_path_modules  # noqa: E402

NUM_LAYERS = 4
UNITS = 7 * NUM_LAYERS


def dual(path, low="nf4"):
    model = load(path, low)
    return gnmr_hf.prepare_dual_path(model, path, units="linears", dtype=torch.float32)


def modules_of(model):
    return list(dual_path_modules(model))


def dequant(m):
    return BF.dequantize_4bit(m.weight.data, m.weight.quant_state).float()


def make_batches(n=2, seed=0, width=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, width), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0  # some padding, so token weighting and masks matter
        labels = ids.masked_fill(mask == 0, -100)
        out.append({"input_ids": ids, "attention_mask": mask, "labels": labels})
    return out


def hand_loss(model, batches, active):
    """Mean loss per target token over the batches with ``active`` units on BF16 (plain forwards)."""
    gnmr_hf.set_active_units(model, active)
    total = count = 0.0
    with torch.no_grad():
        for b in batches:
            n = int((b["labels"][:, 1:] != -100).sum())
            total += float(model(**b).loss) * n
            count += n
    gnmr_hf.set_active_units(model, [])
    return total / count


@pytest.fixture()
def model(tiny_llama_dir):
    return dual(tiny_llama_dir).eval()


@pytest.fixture(scope="module")
def batches():
    return make_batches()


# ------------------------------------------------------------------------------------------- criteria


def test_loss_criterion_equals_hand_run_forwards(model, batches):
    prof = profile_sensitivity(model, batches, criteria=("loss",))
    low = hand_loss(model, batches, [])
    assert prof.losses["low"] == pytest.approx(low, abs=1e-6)
    assert prof.losses["high"] == pytest.approx(hand_loss(model, batches, range(UNITS)), abs=1e-6)
    assert prof.tokens == sum(int((b["labels"][:, 1:] != -100).sum()) for b in batches)
    # first layer (nothing skipped), middle, last layer (three layers' outputs taken from the cache)
    for u in (0, 9, 16, 27):
        assert prof.units[u].scores["loss"] == pytest.approx(low - hand_loss(model, batches, [u]), abs=1e-6), u
    assert [u.name for u in prof.units[:8]] == [
        "layers.0.self_attn.q_proj", "layers.0.self_attn.k_proj", "layers.0.self_attn.v_proj",
        "layers.0.self_attn.o_proj", "layers.0.mlp.gate_proj", "layers.0.mlp.up_proj", "layers.0.mlp.down_proj",
        "layers.1.self_attn.q_proj"]
    u = prof.units[9]
    assert (u.layer, u.op, u.modules) == (1, "v_proj", ["model.layers.1.self_attn.v_proj"])
    m = modules_of(model)[9]
    assert u.bytes == m.in_features * m.out_features * 2
    assert prof.total_bytes == sum(mm.in_features * mm.out_features * 2 for mm in modules_of(model))
    # the model is left as it was found
    assert gnmr_hf.active_units(model) == [] and not model.training


def test_output_criterion_equals_weights_on_captured_inputs(model, batches):
    prof = profile_sensitivity(model, batches, criteria=("output",))
    mods = modules_of(model)
    seen = {k: [] for k in (2, 13, 27)}
    handles = [mods[k].register_forward_hook(lambda mod, inp, out, k=k: seen[k].append(inp[0].detach()))
               for k in seen]
    with torch.no_grad():
        for b in batches:
            model(**b)
    for h in handles:
        h.remove()
    for k, xs in seen.items():
        dw = mods[k]._gnmr_source.stored.float() - dequant(mods[k])
        err = ref = 0.0
        for x, b in zip(xs, batches):
            keep = b["attention_mask"].unsqueeze(-1).float()
            err += float(((x @ dw.T) * keep).double().square().sum())
            ref += float(((x @ mods[k]._gnmr_source.stored.float().T) * keep).double().square().sum())
        assert prof.units[k].scores["output"] == pytest.approx(math.sqrt(err), rel=1e-4)
        assert prof.units[k].scores["output_rel"] == pytest.approx(err / ref, rel=1e-4)


def test_first_order_equals_weight_gradient_of_the_dequantised_model(model, batches, tiny_llama_dir):
    """-<dL/dW_u, W_high - W_low> from autograd on a plain FP32 model holding the de-quantised weights."""
    flags = [p.requires_grad for p in model.parameters()]
    prof = profile_sensitivity(model, batches, criteria=("first_order", "loss"))
    plain = load(tiny_llama_dir, None)
    high, low = {}, {}
    for name, m in model.named_modules():
        if m in modules_of(model):
            high[name], low[name] = m._gnmr_source.stored.float(), dequant(m)
    params = dict(plain.named_parameters())
    with torch.no_grad():
        for name, w in low.items():
            params[name + ".weight"].copy_(w)
    n = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    plain.zero_grad()
    for b, k in zip(batches, n):
        (plain(**b).loss * k / sum(n)).backward()
    names = list(low)
    for u in range(UNITS):
        g = params[names[u] + ".weight"].grad
        expected = -float((g.double() * (high[names[u]] - low[names[u]]).double()).sum())
        assert prof.units[u].scores["first_order"] == pytest.approx(expected, rel=1e-3, abs=1e-7), names[u]
    # a first-order estimate of the loss gains: close on this tiny model
    fo, lo = torch.tensor(prof.scores("first_order")), torch.tensor(prof.scores("loss"))
    assert torch.corrcoef(torch.stack([fo, lo]))[0, 1] > 0.95
    # no weight gradient was formed, and requires_grad is as it was
    assert [p.requires_grad for p in model.parameters()] == flags
    assert all(p.grad is None for p in model.parameters())


def test_lora_grad_equals_two_hand_run_backwards(tiny_llama_dir, batches):
    from tests.test_dual_path import wrap

    pm = wrap(dual(tiny_llama_dir)).eval()
    prof = profile_sensitivity(pm, batches, criteria=("lora_grad",))
    units = gnmr_hf.units.resolve_units(pm)
    n = [int((b["labels"][:, 1:] != -100).sum()) for b in batches]
    grads = []
    for active in ([], range(UNITS)):
        gnmr_hf.set_active_units(pm, active)
        pm.zero_grad()
        for b, k in zip(batches, n):
            (pm(**b).loss * k / sum(n)).backward()
        grads.append([[p.grad.clone() for p in unit.parameters() if p.requires_grad] for _, unit in units])
    gnmr_hf.set_active_units(pm, [])
    from gnmr_hf.core.oracle import recovery_gap

    rel = recovery_gap(grads[0], grads[1])
    for u in (0, 11, 27):
        diff = math.sqrt(sum(float((a - b).double().square().sum()) for a, b in zip(grads[0][u], grads[1][u])))
        assert prof.units[u].scores["lora_grad"] == pytest.approx(diff, rel=1e-4)
        assert prof.units[u].scores["lora_grad_rel"] == pytest.approx(float(rel[u]), rel=1e-4)


def test_lora_grad_without_lora_is_skipped_with_a_message(model, batches):
    with pytest.warns(UserWarning, match="lora_grad skipped: lora_grad needs a LoRA-wrapped model"):
        prof = profile_sensitivity(model, batches, criteria=("first_order", "lora_grad"))
    assert "lora_grad" in prof.skipped and prof.criteria == ["first_order"]
    assert prof.score_names == ["first_order"]


def test_a_unit_whose_low_weight_equals_its_high_weight_scores_zero(model, batches):
    k = 11  # layers.1.mlp.gate_proj
    m = modules_of(model)[k]
    m._gnmr_source.stored = dequant(m)
    prof = profile_sensitivity(model, batches, criteria=("loss", "first_order", "output"))
    for name in ("loss", "first_order", "output", "output_rel"):
        assert prof.units[k].scores[name] == 0.0, name
    assert all(prof.units[u].scores["output"] > 0 for u in range(UNITS) if u != k)


def test_lora_grad_is_zero_when_every_low_weight_equals_its_high_weight(tiny_llama_dir, batches):
    """The oracle's quantity compares all-low with all-high gradients: it is a property of the whole
    quantised network at the unit, so it vanishes only when no unit has a quantisation error (a single
    exact unit still sees the others' errors in its gradient)."""
    from tests.test_dual_path import wrap

    pm = wrap(dual(tiny_llama_dir)).eval()
    for m in modules_of(pm):
        m._gnmr_source.stored = dequant(m)
    prof = profile_sensitivity(pm, batches, criteria="all")
    for name in ("loss", "first_order", "output", "output_rel", "lora_grad", "lora_grad_rel"):
        assert prof.scores(name) == [0.0] * UNITS, name
    assert prof.losses["low"] == prof.losses["high"]


def test_a_unit_with_a_scaled_up_quantisation_error_ranks_first(model):
    k = 16  # layers.2.self_attn.v_proj
    m = modules_of(model)[k]
    deq = dequant(m)
    m._gnmr_source.stored = deq + 10 * (m._gnmr_source.stored.float() - deq)
    # targets the BF16 model predicts, so that the high weights are the good ones (a random model has no
    # good weights to recover)
    g = torch.Generator().manual_seed(3)
    ids = [torch.randint(0, 128, (2, 12), generator=g) for _ in range(2)]
    gnmr_hf.set_active_units(model, range(UNITS))
    with torch.no_grad():
        targets = [torch.cat([i[:, :1], model(input_ids=i).logits.argmax(-1)[:, :-1]], 1) for i in ids]
    gnmr_hf.set_active_units(model, [])
    data = [{"input_ids": i, "labels": t} for i, t in zip(ids, targets)]
    prof = profile_sensitivity(model, data, criteria=("loss", "first_order", "output"))
    for name in ("loss", "first_order", "output", "output_rel"):
        assert prof.ranking(name)[0] == k, name
    assert prof.units[k].scores["loss"] > 0


# ------------------------------------------------------------------------------------------- planning


def fake_profile(scores, sizes, low=2.0, high=1.0):
    units = [UnitScore(index=i, name=f"layers.{i}.mlp.up_proj", modules=[f"model.layers.{i}.mlp.up_proj"],
                       bytes=b, layer=i, op="up_proj", scores={"loss": s, "output": abs(s) + 1})
             for i, (s, b) in enumerate(zip(scores, sizes))]
    return SensitivityProfile(units=units, criteria=["loss", "output"], losses={"low": low, "high": high},
                              costs={}, batches=1, tokens=10, keep_modules=["lm_head"])


def test_greedy_by_score_per_byte_never_takes_non_positive_scores():
    # per byte: 0 -> 1.0, 1 -> 0.5, 2 -> 3.0, 3 -> -1, 4 -> 0, 5 -> 0.8
    scores, sizes = [10.0, 10.0, 3.0, -5.0, 0.0, 8.0], [10, 20, 1, 5, 1, 10]
    assert greedy_select(scores, sizes, 100) == [0, 1, 2, 5]  # everything positive fits
    assert greedy_select(scores, sizes, 11) == [0, 2]  # 2 (1 B), 0 (10 B); 5 no longer fits
    assert greedy_select(scores, sizes, 12) == [0, 2]
    assert greedy_select(scores, sizes, 21) == [0, 2, 5]
    assert greedy_select(scores, sizes, 9) == [2]
    assert greedy_select(scores, sizes, 0) == []
    assert greedy_select([math.nan, 1.0], [1, 1], 5) == [1]


def test_plan_budget_prediction_and_skip_list():
    prof = fake_profile([0.4, 0.3, -0.1, 0.2], [100, 100, 50, 50])
    p = plan(prof, budget_fraction=0.5, criterion="loss")  # 150 of 300 bytes
    assert p.indices == [0, 3] and p.bytes == 150 and p.budget_bytes == 150
    assert p.predicted_gain == pytest.approx(0.6) and p.predicted_gap_closed == pytest.approx(0.6)
    assert p.names == ["layers.0.mlp.up_proj", "layers.3.mlp.up_proj"]
    assert skip_modules(p) == ["lm_head", "model.layers.0.mlp.up_proj", "model.layers.3.mlp.up_proj"]
    assert skip_modules(p, keep=[]) == ["model.layers.0.mlp.up_proj", "model.layers.3.mlp.up_proj"]
    assert plan(prof, 200, criterion="loss").indices == [0, 3]  # 0 and 3 tie per byte; 1 no longer fits
    assert plan(prof, 250, criterion="loss").indices == [0, 1, 3]
    # a criterion without loss units predicts with the profile's loss gains
    q = plan(prof, budget_fraction=1.0, criterion="output")
    assert q.indices == [0, 1, 2, 3] and q.gain_score == "loss" and q.predicted_gain == pytest.approx(0.8)
    with pytest.raises(ValueError, match="exactly one of budget_bytes and budget_fraction"):
        plan(prof, 10, budget_fraction=0.1)
    with pytest.raises(ValueError, match="budget_fraction must be in"):
        plan(prof, budget_fraction=1.5)
    with pytest.raises(ValueError, match="no scores for 'first_order'"):
        plan(prof, budget_fraction=0.1, criterion="first_order")
    assert "| 50 % | loss | 0.600 |" in format_price_table([p])


@pytest.mark.parametrize("text,expected", [
    ("10%", (None, 0.1)), ("2.5 %", (None, 0.025)), ("0.25", (None, 0.25)), ("1", (None, 1.0)),
    ("300MB", (300_000_000, None)), ("2GiB", (2 * 2**30, None)), ("123456B", (123456, None)), ("1.5mib", (1572864, None)),
])
def test_parse_budget(text, expected):
    assert parse_budget(text) == expected


# a bare number above 1 is ambiguous (issue 26 item 5: "123456" and "2" used to mean bytes)
@pytest.mark.parametrize("text", ["ten", "10x", "-5%", "150%", "", "5 parsecs", "123456", "2", "0%", "1e99"])
def test_parse_budget_refuses(text):
    with pytest.raises(ValueError, match="budget"):
        parse_budget(text)


def test_measured_plan_equals_a_hand_run_forward(model, batches):
    prof = profile_sensitivity(model, batches, criteria=("first_order",))
    p = plan(prof, budget_fraction=0.1, model=model, batches=batches, heldout=make_batches(seed=5))
    assert p.criterion == "first_order" and p.indices
    assert p.bytes <= 0.1 * prof.total_bytes
    m = p.measured["profile"]
    assert m["loss_plan"] == pytest.approx(hand_loss(model, batches, p.indices), abs=1e-6)
    assert m["gap_closed"] == pytest.approx((m["loss_low"] - m["loss_plan"]) / prof.gap)
    held = make_batches(seed=5)
    h = p.measured["heldout"]
    assert h["loss_low"] == pytest.approx(hand_loss(model, held, []), abs=1e-6)
    assert h["loss_high"] == pytest.approx(hand_loss(model, held, range(UNITS)), abs=1e-6)
    assert h["loss_plan"] == pytest.approx(hand_loss(model, held, p.indices), abs=1e-6)
    assert measure_plan(model, p, held)["loss_plan"] == pytest.approx(h["loss_plan"], abs=1e-9)
    assert gnmr_hf.active_units(model) == []


def test_random_sets_fit_the_budget():
    sizes = [5, 10, 20, 40, 80]
    sets = random_sets(sizes, 50, draws=20, seed=1)
    assert all(sum(sizes[i] for i in s) <= 50 for s in sets)
    assert len({tuple(s) for s in sets}) > 1


def test_json_round_trip_and_table(model, batches, tmp_path):
    prof = profile_sensitivity(model, batches, criteria=("first_order", "output"))
    path = prof.to_json(tmp_path / "p.json", extra_key=[1, 2])
    again = SensitivityProfile.from_json(path)
    assert again.to_dict() == prof.to_dict()
    assert json.loads(path.read_text())["extra_key"] == [1, 2]
    text = prof.table("output", top=3)
    assert text.count("\n") == 5 and "layers." in text and "ranked by output" in text
    assert set(prof.costs) == {"reference", "first_order", "output"}
    assert prof.costs["first_order"]["forwards"] == 2 and prof.costs["first_order"]["backwards"] == 2
    # L_low came from first_order's own forward: the reference ran L_high only
    assert prof.costs["reference"]["forwards"] == 2
    assert prof.losses["low"] == pytest.approx(hand_loss(model, batches, []), abs=1e-6)
    assert prof.keep_modules and "lm_head" in prof.keep_modules


def test_unprepared_model_and_bad_input_are_refused(tiny_llama_dir, model, batches):
    with pytest.raises(ValueError, match="holds no dual-path layer.*prepare_dual_path"):
        profile_sensitivity(load(tiny_llama_dir, "nf4"), batches)
    with pytest.raises(ValueError, match="unknown criterion 'grad'"):
        profile_sensitivity(model, batches, criteria=("grad",))
    with pytest.raises(ValueError, match="batches is empty"):
        profile_sensitivity(model, [])
    with pytest.raises(ValueError, match="no target token"):
        profile_sensitivity(model, [{"input_ids": torch.ones(1, 4, dtype=torch.long),
                                     "labels": torch.full((1, 4), -100)}])


def test_layer_grain_profiles_whole_decoder_layers(tiny_llama_dir, batches):
    m = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), tiny_llama_dir, dtype=torch.float32).eval()
    prof = profile_sensitivity(m, batches, criteria=("loss", "first_order"))
    assert [u.name for u in prof.units] == [f"model.layers.{i}" for i in range(NUM_LAYERS)] or \
        [u.name for u in prof.units] == [f"layers.{i}" for i in range(NUM_LAYERS)]
    assert all(len(u.modules) == 7 and u.op == "layer" for u in prof.units)
    low = hand_loss(m, batches, [])
    assert prof.units[2].scores["loss"] == pytest.approx(low - hand_loss(m, batches, [2]), abs=1e-6)


# ------------------------------------------------------------------------------------------- skip list


def test_skip_list_selects_exactly_the_planned_linears(tmp_path):
    """transformers' own matcher and a real 4-bit load: layers.1 and layers.11 differ."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig
    from transformers.quantizers.quantizers_utils import should_convert_module

    path = make_tiny_llama(tmp_path / "tiny12", num_layers=12)
    planned = ["model.layers.1.self_attn.v_proj", "model.layers.11.mlp.down_proj", "model.layers.10.mlp.up_proj"]
    p = PrecisionPlan(criterion="loss", budget_bytes=0, total_bytes=1, indices=[], names=[], modules=planned,
                      bytes=0, predicted_gain=None, predicted_gap_closed=None, keep_modules=["lm_head"])
    skips = skip_modules(p)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32, llm_int8_skip_modules=skips))
    linears = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    unquantised = sorted(n for n, t in linears.items() if t == "Linear")
    assert unquantised == sorted(planned + ["lm_head"])
    assert sum(t == "Linear4bit" for t in linears.values()) == 12 * 7 - 3
    assert [n for n in linears if not should_convert_module(n, skips)] == [n for n in linears if n in unquantised]
    # what a bare prefix would have done: "model.layers.1" skips layer 1 only under transformers 5's boundary
    # rule, but "layers.1.self_attn.v_proj" would catch layer 11 as a plain substring (transformers 4.x)
    assert "model.layers.1.self_attn.v_proj" not in "model.layers.11.self_attn.v_proj"


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_cli_refuses_bad_input_with_one_line(tmp_path):
    def run(*args):
        r = subprocess.run([sys.executable, "-m", "gnmr_hf.cli", "profile", "--output", str(tmp_path / "o"), *args],
                           capture_output=True, text=True, timeout=300)
        return r.returncode, r.stderr.strip().splitlines()

    code, err = run("--budget", "ten percent")
    assert code == 2 and len(err) == 1 and err[0].startswith("gnmr-hf profile: error: budget 'ten percent'")
    code, err = run("--data", str(tmp_path / "nope.jsonl"))
    assert code == 2 and err == [f"gnmr-hf profile: error: --data {tmp_path / 'nope.jsonl'}: no such file or folder"]
    code, err = run("--criterion", "loss,bogus")
    assert code == 2 and err[-1].startswith("gnmr-hf profile: error: unknown criterion 'bogus'")
    code, err = run("--model", str(tmp_path))
    assert code == 2 and err[-1] == f"gnmr-hf profile: error: --model {tmp_path}: not a model folder (no config.json)"
    out = subprocess.run([sys.executable, "-m", "gnmr_hf.cli", "--help"], capture_output=True, text=True).stdout
    assert "profile" in out


# ------------------------------------------------------------------------------------------- SmolLM2 (slow)


@pytest.mark.slow
def test_smollm2_skip_list_loads_exactly_the_planned_linears(smollm2_dir):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    planned = ["model.layers.1.self_attn.v_proj", "model.layers.1.mlp.down_proj", "model.layers.12.self_attn.k_proj",
               "model.layers.29.mlp.gate_proj"]
    p = PrecisionPlan(criterion="loss", budget_bytes=0, total_bytes=1, indices=[], names=[], modules=planned,
                      bytes=0, predicted_gain=None, predicted_gap_closed=None, keep_modules=["lm_head"])
    model = AutoModelForCausalLM.from_pretrained(
        smollm2_dir, dtype=torch.float32,
        quantization_config=BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                                               bnb_4bit_compute_dtype=torch.float32,
                                               llm_int8_skip_modules=skip_modules(p)))
    linears = {n: type(m).__name__ for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    assert sorted(n for n, t in linears.items() if t == "Linear") == sorted(planned + ["lm_head"])
    assert sum(t == "Linear4bit" for t in linears.values()) == 30 * 7 - 4
    # layers 10-19 (prefixed by "model.layers.1") stayed quantised
    assert linears["model.layers.11.self_attn.v_proj"] == "Linear4bit"
    assert linears["model.layers.10.mlp.down_proj"] == "Linear4bit"


@pytest.mark.slow
def test_cli_end_to_end_on_smollm2(smollm2_dir, tmp_path):
    out = tmp_path / "prof"
    # the ladder's table (one load per plan) is checked on a tiny model in-process, below
    cmd = [sys.executable, "-m", "gnmr_hf.cli", "profile", "--model", str(smollm2_dir), "--low", "nf4", "--budget",
           "10%", "--output", str(out), "--batches", "1", "--batch-size", "2", "--threads", "1", "--quiet",
           "--no-ladder"]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-3000:]
    assert "price table" in r.stdout and "| 5 % |" in r.stdout and "| 25 % |" in r.stdout
    data = json.loads((out / "profile.json").read_text())
    # first what transformers keeps by default (a given list replaces it), then the planned linears
    keep = data["keep_modules"]
    assert "lm_head" in keep and data["skip_modules"][:len(keep)] == keep
    planned = data["skip_modules"][len(keep):]
    assert planned and all(s.startswith("model.layers.") for s in planned)
    assert planned == data["plan"]["modules"]
    assert len(data["units"]) == 210
    assert {"name", "bytes", "score"} <= set(data["units"][0])
    assert data["units"][2]["name"] == "layers.0.self_attn.v_proj" and data["units"][2]["bytes"] == 576 * 192 * 2
    assert sum(u["bytes"] for u in data["units"]) == data["total_bytes"]
    # the one currency (make_plan): 10 % of what every quantised linear on BF16 adds over NF4 as served
    assert 0 < data["plan"]["price_over_nf4_bytes"] <= data["plan"]["budget_bytes"]
    budgets = [p["budget_bytes"] for p in data["price"]]
    assert len(budgets) == 3 and budgets == sorted(budgets) and budgets[1] == data["plan"]["budget_bytes"]
    assert (out / "profile.png").stat().st_size > 10_000
    assert "ladder price table" not in r.stdout and "ladder" not in data  # --no-ladder
    prof = SensitivityProfile.from_json(out / "profile.json")
    assert prof.score_names == ["first_order"]


def test_cli_prints_and_records_the_ladder_table(tmp_path, capsys):
    """The precision ladder's table beside the BF16-only one (3 budgets x BF16, INT8, the ladder), in stdout,
    profile.json and profile.png; a tiny LLaMA in-process (the SmolLM2 run above passes --no-ladder)."""
    from gnmr_hf.planning.cli import main
    from tests.test_profile_faults_r3 import tiny_tokenizer

    model = make_tiny_llama(tmp_path / "tiny")
    tiny_tokenizer().save_pretrained(model)
    out = tmp_path / "prof"
    assert main(["--model", str(model), "--low", "nf4", "--budget", "10%", "--output", str(out), "--batches", "1",
                 "--batch-size", "2", "--quiet"]) == 0
    stdout = capsys.readouterr().out
    assert "ladder price table" in stdout and "| +10 % | int8+bf16 |" in stdout
    data = json.loads((out / "profile.json").read_text())
    rows = data["ladder"]["rows"]
    assert [(x["memory_over_low"], x["rungs"]) for x in rows] == [
        (f, rs) for f in (0.05, 0.10, 0.25) for rs in ("bf16", "int8", "int8+bf16")]
    assert all(0 <= x["price_bytes"] <= x["budget_bytes"] for x in rows) and rows[-1]["price_bytes"] > 0
    assert all(math.isfinite(x["loss"]) for x in rows)
    assert (out / "profile.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
