"""``gnmr-hf eval --skip-modules``: the mixed base a planned adapter trained on, loaded the stock way.

A plan's ``skip_modules`` list, given to the evaluation's loader, keeps exactly those linears unquantised
(their checkpoint weights), and the model computes what the dual-path model computes with the same linears
on its BF16 recovery path: the base a planned adapter trained on is the base it is scored on.
"""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import make_tiny_llama

PLANNED = ["model.layers.0.self_attn.v_proj", "model.layers.2.mlp.down_proj", "model.layers.1.self_attn.k_proj"]


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory, smollm2_dir):
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_skip") / "m", num_layers=3, seed=3)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)  # the loader wants one; ids stay < 128 here
    return path


def test_skip_modules_load_exactly_the_named_linears_unquantised(tiny3):
    import bitsandbytes as bnb
    from safetensors.torch import load_file

    from gnmr_hf.evaluation.evaluate import load_model

    model, _ = load_model(str(tiny3), "nf4", compute_dtype="float32", skip_modules=["lm_head", *PLANNED])
    kinds = {n: m for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)}
    plain = sorted(n for n, m in kinds.items() if not isinstance(m, bnb.nn.Linear4bit))
    assert plain == sorted(["lm_head", *PLANNED])
    assert sum(isinstance(m, bnb.nn.Linear4bit) for m in kinds.values()) == 3 * 7 - 3
    weights = load_file(str(tiny3 / "model.safetensors"))
    for name in PLANNED:  # the checkpoint's BF16 values, upcast exactly
        assert torch.equal(kinds[name].weight, weights[f"{name}.weight"].float())
    # without the list: every decoder linear 4-bit (the stock default keeps lm_head only)
    stock, _ = load_model(str(tiny3), "nf4", compute_dtype="float32")
    assert all(isinstance(m, bnb.nn.Linear4bit) for n, m in stock.named_modules()
               if isinstance(m, torch.nn.Linear) and n != "lm_head")


def test_mixed_base_computes_what_the_dual_path_model_computes(tiny3, bnb_cpu):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    import gnmr_hf
    from gnmr_hf.backends.base import set_active_units
    from gnmr_hf.evaluation.evaluate import load_model
    from gnmr_hf.units import resolve_units

    ids = torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(0))
    mixed, _ = load_model(str(tiny3), "nf4", compute_dtype="float32", skip_modules=["lm_head", *PLANNED])
    quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32)
    dual = AutoModelForCausalLM.from_pretrained(tiny3, dtype=torch.float32, quantization_config=quant)
    # the recovery weights in the compute dtype, as the checkpoint is loaded on the mixed base
    dual = gnmr_hf.prepare_dual_path(dual, recovery_source=str(tiny3), units="linears", dtype=torch.float32)
    dual.eval()
    units = resolve_units(dual)
    names = [n for n, _ in units]
    with torch.no_grad():
        set_active_units(dual, [], units)
        all_low = dual(ids).logits
        set_active_units(dual, [names.index(n) for n in PLANNED], units)
        planned = dual(ids).logits
        got = mixed(ids).logits
    assert not torch.allclose(all_low, planned)  # the set changes the output ...
    torch.testing.assert_close(got, planned, rtol=1e-5, atol=1e-5)  # ... and the stock load is that set


def _write_profile(path, skip_modules):
    """A profile as gnmr-hf profile writes one (SensitivityProfile.to_json), with its skip list: the file
    read_skip_modules reads through Plan.load."""
    from gnmr_hf.planning.results import SensitivityProfile, UnitScore

    units = [UnitScore(index=i, name=n.removeprefix("model."), modules=[n], bytes=64, layer=int(n.split(".")[2]),
                       op=n.split(".")[-1], scores={"first_order": 1.0}) for i, n in enumerate(PLANNED)]
    profile = SensitivityProfile(units=units, criteria=["first_order"], losses={"low": 2.0, "high": 1.5}, costs={},
                                 batches=1, tokens=8, keep_modules=["lm_head"])
    return profile.to_json(path, skip_modules=skip_modules)


def test_read_skip_modules_from_a_list_or_a_profile_json(tmp_path):
    from gnmr_hf.evaluation.evaluate import EvalError, read_skip_modules

    assert read_skip_modules(None) is None and read_skip_modules("") is None
    assert read_skip_modules("lm_head, model.layers.0.self_attn.v_proj") == ["lm_head", "model.layers.0.self_attn.v_proj"]
    prof = _write_profile(tmp_path / "profile.json", ["lm_head", *PLANNED])
    assert read_skip_modules(str(prof)) == ["lm_head", *PLANNED]
    bad = tmp_path / "other.json"
    bad.write_text(json.dumps({"units": []}))
    with pytest.raises(EvalError, match="no 'skip_modules' list"):
        read_skip_modules(str(bad))
    with pytest.raises(EvalError, match="no such file"):
        read_skip_modules(str(tmp_path / "missing.json"))


def test_skip_modules_on_a_bf16_base_is_refused_in_one_line(tiny3, capsys):
    from gnmr_hf.cli import main

    assert main(["eval", "--model", str(tiny3), "--skip-modules", "lm_head", "--tasks", "wikitext"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["gnmr-hf eval: error: --skip-modules names modules to keep unquantised; it needs "
                   "--precision int8 or nf4"]


# issue 26 item 3: the profile's folder, names that select nothing, a list without lm_head, an empty list
def test_a_profile_folder_means_its_profile_json(tmp_path):
    from gnmr_hf.evaluation.evaluate import EvalError, read_skip_modules

    _write_profile(tmp_path / "profile.json", ["lm_head", *PLANNED])
    # the folder was taken as one module name before, which matched nothing
    assert read_skip_modules(str(tmp_path)) == ["lm_head", *PLANNED]
    (tmp_path / "sub").mkdir()
    with pytest.raises(EvalError, match="a folder without profile.json"):
        read_skip_modules(str(tmp_path / "sub"))


def test_an_empty_skip_list_in_a_profile_is_refused(tmp_path):
    from gnmr_hf.evaluation.evaluate import EvalError, read_skip_modules

    _write_profile(tmp_path / "profile.json", [])
    with pytest.raises(EvalError, match="empty, which keeps nothing unquantised"):
        read_skip_modules(str(tmp_path / "profile.json"))


def test_names_that_keep_no_linear_are_refused(tiny3):
    from gnmr_hf.evaluation.evaluate import EvalError, load_model

    with pytest.raises(EvalError, match=r"1 name\(s\) keep no linear .* 'layers\.0\.self_attn\.vproj'"):
        load_model(str(tiny3), "nf4", compute_dtype="float32", skip_modules=["lm_head", "layers.0.self_attn.vproj"])


def test_the_eval_states_how_many_linears_it_kept(tiny3, capsys):
    import bitsandbytes as bnb

    from gnmr_hf.evaluation.evaluate import load_model

    load_model(str(tiny3), "nf4", compute_dtype="float32", skip_modules=["lm_head", *PLANNED])
    err = capsys.readouterr().err
    assert "--skip-modules keeps 4 of 22 linears unquantised" in err and "lm_head is not" not in err
    model, _ = load_model(str(tiny3), "nf4", compute_dtype="float32", skip_modules=PLANNED)
    err = capsys.readouterr().err
    assert "keeps 3 of 22 linears unquantised; lm_head is not among them, so it is quantised too" in err
    assert isinstance(model.lm_head, bnb.nn.Linear4bit)  # what the warning says really happened


def test_eval_cli_with_the_profile_folder(tiny3, tmp_path, capsys):
    from gnmr_hf.cli import main

    _write_profile(tmp_path / "profile.json", ["lm_head", "nothing.here"])
    assert main(["eval", "--model", str(tiny3), "--precision", "nf4", "--skip-modules", str(tmp_path),
                 "--tasks", "wikitext"]) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if "gnmr-hf" in line]
    assert len(err) == 1 and "keep no linear" in err[0] and "'nothing.here'" in err[0]


def test_a_saved_plan_gives_its_skip_list_and_a_ladder_plan_none(tmp_path):
    # read_skip_modules reads plans through Plan.load: a file Plan.save wrote (schema 1) gives Plan.skip_modules()
    from gnmr_hf.evaluation.evaluate import EvalError, read_skip_modules
    from gnmr_hf.planning.plan import Plan

    bf16 = Plan(rungs=dict.fromkeys(PLANNED, "bf16"), keep_modules=["lm_head"])
    bf16.save(tmp_path / "bf16.json")
    assert read_skip_modules(str(tmp_path / "bf16.json")) == bf16.skip_modules() == ["lm_head", *PLANNED]
    ladder = Plan(rungs={PLANNED[0]: "int8", PLANNED[1]: "bf16"}, rung_set=("int8", "bf16"))
    ladder.save(tmp_path / "ladder.json")
    with pytest.raises(EvalError, match=rf"precision-ladder plan with 1 INT8 linears \(e\.g\. {PLANNED[0]}\)"):
        read_skip_modules(str(tmp_path / "ladder.json"))
