"""Issue 52, items 2, 7 and 12: ``load_planned`` reproduces the trained dual path as a user calls it,
refuses bad input in one line before any load, checks that a plan file is the model's, and ``plan`` says
which bytes it prices (BF16, or what the model's recovery path holds).

Tiny random LLaMAs (BF16 checkpoints), real bitsandbytes, PEFT and transformers on CPU.
"""

from __future__ import annotations

import json

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes")
peft = pytest.importorskip("peft")

import gnmr_hf  # noqa: E402
from gnmr_hf.backends.base import recovery_device_bytes  # noqa: E402
from gnmr_hf.backends.bnb_4bit import is_repacked  # noqa: E402
from gnmr_hf.units import find_linear_units, short_name  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_dual_path import LINEARS  # noqa: E402
from tests.test_profile import make_batches  # noqa: E402

RUNGS = {"model.layers.0.self_attn.v_proj": "int8", "model.layers.1.mlp.down_proj": "bf16",
         "model.layers.2.self_attn.q_proj": "int8", "model.layers.3.mlp.up_proj": "bf16"}


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def other_seed_dir(tmp_path_factory):
    """A tiny LLaMA with the fixture's layer names and shapes and other weights (another seed)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_seed1"), seed=1)


@pytest.fixture
def repacking_cpu(monkeypatch):
    """bitsandbytes' CPU probe answering as on a CPU with AVX512-BF16, where a ``Linear4bit`` repacks its weight
    at the first eval-mode forward under no_grad unless told not to (``support_avx512bf16_for_cpu``, which
    ``Linear4bit.__init__`` sets from the probe): so the layout is tested on every CPU, this one included."""
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: True)


def _stock_4bit(path, dtype):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype)
    return AutoModelForCausalLM.from_pretrained(path, dtype=dtype, quantization_config=q)


def _unit_indices(model, names):
    units = [short_name(n) for n, _ in find_linear_units(model)]
    return [units.index(n.removeprefix("model.")) for n in names]


@torch.no_grad()
def _logits(model, ids):
    return model.eval()(ids).logits.float()


def _linear4bit(model):
    return [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]


def _no_load(monkeypatch):
    """Make any from_pretrained call fail the test (the refusals come before any load)."""
    from transformers import AutoModelForCausalLM

    def refuse(*a, **k):
        raise AssertionError("from_pretrained was called before the refusal")

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", refuse)


# ---------------------------------------------------------------------------------------- item 2


def _trained(path, dtype, adapter_dir, rungs=RUNGS):
    """The training-time model: the dual path with ``rungs`` active (and a LoRA adapter, saved to
    ``adapter_dir``, with random B so that it changes the output)."""
    dual = gnmr_hf.prepare_dual_path(_stock_4bit(path, dtype), recovery_source=path, units="linears", dtype=dtype,
                                     rungs=rungs)
    if adapter_dir is not None:
        torch.manual_seed(0)
        dual = peft.get_peft_model(dual, peft.LoraConfig(r=4, lora_alpha=8, target_modules=LINEARS,
                                                         init_lora_weights=False))
        dual.save_pretrained(adapter_dir)
    gnmr_hf.set_active_units(dual, _unit_indices(dual, rungs))
    return dual


@pytest.mark.parametrize("adapter", [False, True], ids=["base", "adapter"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_load_planned_as_called_reproduces_the_trained_dual_path(tiny_llama_dir, tmp_path, ids, repacking_cpu,
                                                                 dtype, adapter):
    """``load_planned(path, "profile.json")`` (plus ``PeftModel.from_pretrained`` for the adapter), nothing else
    called, computes the logits of the dual path it was trained on. Exact, except in BF16 with an adapter: there
    PEFT gives the served BF16 / INT8 rungs (a plain ``nn.Linear``, a ``Linear8bitLt`` on a 4-bit model) its
    generic LoRA layer, which adds the FP32 LoRA output to the BF16 base output and rounds once, while the
    training-time layer (PEFT's 4-bit LoRA layer over the dual path) rounds the LoRA output to BF16 before the
    add: one BF16 rounding per planned linear (0.008 on these logits of magnitude ~0.5). There every 4-bit linear
    is checked exactly on its captured inputs instead."""
    adapter_dir = tmp_path / "adapter" if adapter else None
    dual = _trained(tiny_llama_dir, dtype, adapter_dir)
    (tmp_path / "profile.json").write_text(json.dumps({"rungs": RUNGS}))

    served = gnmr_hf.load_planned(tiny_llama_dir, tmp_path / "profile.json", dtype=dtype)
    # the reference layout is kept: nothing left that bitsandbytes would repack, on any CPU
    assert _linear4bit(served) and not any(m.support_avx512bf16_for_cpu for m in _linear4bit(served))
    if adapter:
        served = peft.PeftModel.from_pretrained(served, adapter_dir)
    captured = {}

    def capture(m, inp, out):
        captured.setdefault(m, (inp[0].clone(), out.clone()))

    hooks = [m.register_forward_hook(capture) for m in _linear4bit(served)]
    got, want = _logits(served, ids), _logits(dual, ids)
    for h in hooks:
        h.remove()
    assert not any(is_repacked(m) for m in _linear4bit(served))  # after an eval-mode forward under no_grad
    if dtype == torch.bfloat16 and adapter:
        assert (got - want).abs().max() <= 0.03
        duals = {short_name(n): m for n, m in dual.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
        for n, m in served.named_modules():
            if m in captured:
                x, y = captured[m]
                with torch.no_grad():
                    assert torch.equal(duals[short_name(n)](x), y), n
        assert len(captured) == 4 * len(LINEARS) - len(RUNGS)
    else:
        assert torch.equal(got, want)
    # the comparison sees the plan: the all-low dual path computes other logits
    gnmr_hf.set_active_units(dual, [])
    assert not torch.equal(_logits(dual, ids), want)


# ---------------------------------------------------------------------------------------- item 7


def _profile_dir(path, out, budget_fraction=0.25):
    """A BF16-only plan written as the recipes and ``gnmr-hf profile`` write it (profile, plan, skip_modules)."""
    model = gnmr_hf.prepare_dual_path(_stock_4bit(path, torch.float32), recovery_source=path, units="linears",
                                      dtype=torch.float32)
    batches = make_batches()
    prof = gnmr_hf.profile_sensitivity(model, batches)
    p = gnmr_hf.plan(prof, budget_fraction=budget_fraction, model=model, batches=batches)
    prof.to_json(out / "profile.json", plan=p.to_dict(), skip_modules=p.skip_modules())
    return model, p


@pytest.fixture(scope="module")
def bf16_plan(tiny_llama_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("bf16_plan")
    model, p = _profile_dir(tiny_llama_dir, out)
    return out, model, p


def test_a_bf16_only_profile_and_its_folder_load_as_bf16_rungs(tiny_llama_dir, bf16_plan, ids):
    out, model, p = bf16_plan
    assert p.modules and "rungs" not in json.loads((out / "profile.json").read_text())
    for given in (out / "profile.json", out):  # the file, and the folder holding it (as export and eval take)
        served = gnmr_hf.load_planned(tiny_llama_dir, given, dtype=torch.float32)
        mods = dict(served.named_modules())
        assert sorted(n for n in mods if ".layers." in n and type(mods[n]) is torch.nn.Linear) == sorted(p.modules)
        assert len(_linear4bit(served)) == 4 * len(LINEARS) - len(p.modules)
        gnmr_hf.set_active_units(model, p.indices)
        try:
            assert torch.equal(_logits(served, ids), _logits(model, ids))
        finally:
            gnmr_hf.set_active_units(model, [])


def test_bad_low_is_refused_in_one_line_before_any_load(tiny_llama_dir, monkeypatch):
    _no_load(monkeypatch)
    with pytest.raises(ValueError, match=r"^low='q4' is not a low path load_planned loads: one of nf4, fp4, int8$"):
        gnmr_hf.load_planned(tiny_llama_dir, RUNGS, low="q4")


@pytest.mark.parametrize("rung", ["int8", "bf16"])
def test_a_rung_outside_the_decoder_layers_is_refused_before_any_load(tiny_llama_dir, monkeypatch, rung):
    from transformers import AutoConfig

    assert not AutoConfig.from_pretrained(tiny_llama_dir).tie_word_embeddings  # lm_head is its own linear
    _no_load(monkeypatch)
    with pytest.raises(ValueError, match=r"^lm_head \(" + rung + r"\) is not a linear inside the decoder layers"):
        gnmr_hf.load_planned(tiny_llama_dir, {"lm_head": rung, "model.layers.0.self_attn.v_proj": "int8"})
    with pytest.raises(ValueError, match="not linears of"):
        gnmr_hf.load_planned(tiny_llama_dir, {"model.layers.9.self_attn.v_proj": rung})


def test_a_plan_from_another_model_with_the_same_layer_names_is_refused(tiny_llama_dir, other_seed_dir, bf16_plan,
                                                                        tmp_path, monkeypatch):
    from gnmr_hf.planning.profiler import model_identity

    out, _, _ = bf16_plan
    data = json.loads((out / "profile.json").read_text())
    recorded = data["meta"]["model_identity"]
    assert recorded == model_identity(tiny_llama_dir)
    here, there = model_identity(tiny_llama_dir), model_identity(other_seed_dir)
    assert here["config"] == there["config"] and here["weights"] != there["weights"]  # same config, other weights
    _no_load(monkeypatch)
    with pytest.raises(ValueError, match=r"was made for another model than .*: its weights' fingerprint is "
                                         + recorded["weights"]):
        gnmr_hf.load_planned(other_seed_dir, out / "profile.json")
    # a ladder plan file that records the identity (top level) is checked the same way
    (tmp_path / "ladder.json").write_text(json.dumps({"rungs": RUNGS, "model_identity": recorded}))
    with pytest.raises(ValueError, match="was made for another model"):
        gnmr_hf.load_planned(other_seed_dir, tmp_path / "ladder.json")


def test_older_plan_files_are_checked_by_shapes(tiny_llama_dir, bf16_plan, tmp_path, monkeypatch):
    """Files written before identities were recorded: a model whose planned or profiled linears have other
    shapes is refused; one of the same shapes cannot be told apart (documented)."""
    out, _, _ = bf16_plan
    wide = make_tiny_llama(tmp_path / "wide", hidden=96)  # the same names, other shapes
    old = json.loads((out / "profile.json").read_text())
    del old["meta"]["model_identity"]
    (tmp_path / "old.json").write_text(json.dumps(old))
    ladder_units = [{"name": n, "numel": 32 * 64 if "v_proj" in n else 128 * 64, "rows": 32 if "v_proj" in n else 128}
                    for n in RUNGS if "v_proj" in n or "up_proj" in n]
    (tmp_path / "ladder.json").write_text(json.dumps({"rungs": RUNGS, "units": ladder_units}))
    with monkeypatch.context() as m:
        _no_load(m)
        with pytest.raises(ValueError, match=r"another model .*: unit layers\.0\.self_attn\.q_proj is 8192 B \(BF16\) "
                                             r"in the plan, 18432 B in the model"):
            gnmr_hf.load_planned(wide, tmp_path / "old.json")
        with pytest.raises(ValueError, match=r"another model .*: model\.layers\.0\.self_attn\.v_proj has 2048 weights "
                                             r"in 32 rows in the plan, 4608 in 48 rows in the model"):
            gnmr_hf.load_planned(wide, tmp_path / "ladder.json")
    assert isinstance(gnmr_hf.load_planned(tiny_llama_dir, tmp_path / "ladder.json"), torch.nn.Module)


def test_plan_file_errors_are_one_line(tiny_llama_dir, tmp_path):
    with pytest.raises(ValueError, match="a folder without profile.json"):
        gnmr_hf.load_planned(tiny_llama_dir, tmp_path)
    with pytest.raises(ValueError, match="no such plan file"):
        gnmr_hf.load_planned(tiny_llama_dir, tmp_path / "missing.json")
    (tmp_path / "p.json").write_text(json.dumps({"units": [], "losses": {}}))
    with pytest.raises(ValueError, match=r"neither a ladder plan \(no 'rungs'\) nor a profile"):
        gnmr_hf.load_planned(tiny_llama_dir, tmp_path / "p.json")


# --------------------------------------------------------------------------------------- item 12


@pytest.fixture(scope="module")
def fp32_dual(tiny_llama_dir):
    """FP32 storage (the CPU default compute dtype): the recovery path holds 4 bytes a weight."""
    model = gnmr_hf.prepare_dual_path(_stock_4bit(tiny_llama_dir, torch.float32), recovery_source=tiny_llama_dir,
                                      units="linears", dtype=torch.float32)
    return model, gnmr_hf.profile_sensitivity(model, make_batches())


def _held(model, indices):
    gnmr_hf.set_active_units(model, indices)
    try:
        return recovery_device_bytes(model)
    finally:
        gnmr_hf.set_active_units(model, [])


def test_a_plan_says_what_it_prices_and_what_it_holds_under_fp32_storage(fp32_dual):
    from gnmr_hf.planning import greedy_select

    model, prof = fp32_dual
    bf16 = [u.bytes for u in prof.units]
    # the default is unchanged: BF16 bytes, the greedy fill over them, with or without the model
    for p in (gnmr_hf.plan(prof, budget_fraction=0.25), gnmr_hf.plan(prof, budget_fraction=0.25, model=model)):
        assert p.priced_in == "bf16" and p.budget_bytes == int(0.25 * sum(bf16)) and p.total_bytes == sum(bf16)
        assert p.indices == greedy_select(prof.scores("first_order"), bf16, p.budget_bytes)
        assert p.bytes == sum(bf16[i] for i in p.indices) <= p.budget_bytes
        # ...and it records what the set holds on this model's recovery path: twice its BF16 bytes
        assert p.held_bytes == _held(model, p.indices) == 2 * p.bytes > p.budget_bytes
        assert p.to_dict()["priced_in"] == "bf16" and p.to_dict()["held_bytes"] == p.held_bytes
        assert "held on the model's recovery path" in p.summary()
    # priced in what the model holds: the plan holds at most its budget
    for kw in ({"budget_fraction": 0.25}, {"budget_bytes": int(0.25 * sum(bf16))}):
        for source in ({"model": model}, {}):  # the model, or the held bytes the profile recorded
            h = gnmr_hf.plan(prof, priced_in="held", **kw, **source)
            assert h.priced_in == "held" and h.bytes == h.held_bytes == _held(model, h.indices) <= h.budget_bytes
            assert h.total_bytes == 2 * sum(bf16)
    same = gnmr_hf.plan(prof, budget_fraction=0.25, model=model, priced_in="held")
    assert same.indices == gnmr_hf.plan(prof, budget_fraction=0.25).indices  # a fraction buys the same set
    tight = gnmr_hf.plan(prof, budget_bytes=int(0.25 * sum(bf16)), model=model, priced_in="held")
    assert tight.bytes <= int(0.25 * sum(bf16)) < same.bytes  # a byte budget buys half the weights


def test_priced_in_held_needs_to_know_the_held_bytes(fp32_dual):
    from gnmr_hf.planning import SensitivityProfile

    _, prof = fp32_dual
    older = SensitivityProfile.from_dict({**prof.to_dict(), "meta": {}})
    assert gnmr_hf.plan(older, budget_fraction=0.25).held_bytes is None
    with pytest.raises(ValueError, match=r"priced_in='held' prices the bytes the model's recovery path holds"):
        gnmr_hf.plan(older, budget_fraction=0.25, priced_in="held")
    with pytest.raises(ValueError, match=r"priced_in='fp32': one of \('bf16', 'held'\)"):
        gnmr_hf.plan(prof, budget_fraction=0.25, priced_in="fp32")
