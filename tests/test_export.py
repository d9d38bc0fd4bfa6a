"""gnmr-hf export: the planned mixed model as a folder stock transformers loads with no arguments, its
logits against the dual-path model with the plan active, --merge, the model card, the serving names under
both matching rules, and the bad inputs. The fixtures' plans are free (they split the q/k/v and gate/up groups
vLLM fuses), so they are exported with target="transformers"; tests/test_export_vllm.py has the vLLM target."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_architectures import _build
from tests.test_dual_path import load, logits

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")

import gnmr_hf  # noqa: E402
from gnmr_hf import export  # noqa: E402
from gnmr_hf.units import short_name  # noqa: E402


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(4))


@pytest.fixture(scope="module", params=["llama", "gemma3"])
def planned(request, tmp_path_factory, ids):
    """A tiny model (Llama; Gemma3 with tied embeddings), its profile.json with a plan, and the plan."""
    root = tmp_path_factory.mktemp(f"export_{request.param}")
    path = _build(request.param, root / "base")
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    batches = [{"input_ids": ids, "labels": ids}]
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    p = gnmr_hf.plan(prof, budget_fraction=0.3, model=model, batches=batches)
    prof.to_json(root / "prof" / "profile.json", skip_modules=p.skip_modules(), plan=p.to_dict())
    return request.param, path, root / "prof", p, prof


def _kept(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and not isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)))


@pytest.mark.parametrize("quant", ["nf4", "int8"])
def test_round_trip_loads_with_no_arguments_as_the_planned_model(planned, tmp_path, ids, quant):
    from transformers import AutoModelForCausalLM

    arch, path, prof_dir, p, prof = planned
    out = tmp_path / "exported"
    summary = export.export_planned(path, prof_dir, out, quant=quant, target="transformers")
    loaded = AutoModelForCausalLM.from_pretrained(out)  # no arguments
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert cfg["load_in_4bit" if quant != "int8" else "load_in_8bit"] is True
    planned_names = sorted(p.modules)
    # the plan's linears and what transformers keeps by default (lm_head; with tied embeddings the embedding)
    assert sorted(cfg["llm_int8_skip_modules"]) == sorted(planned_names + list(p.keep_modules))
    assert "lm_head" in p.keep_modules
    assert [n for n in _kept(loaded) if n != "lm_head"] == planned_names
    low_type = bnb.nn.Linear8bitLt if quant == "int8" else bnb.nn.Linear4bit
    quantised = [n for n, m in loaded.named_modules() if isinstance(m, low_type)]
    assert "lm_head" in _kept(loaded) and quantised and not set(quantised) & set(planned_names)
    assert summary["bytes_on_disk"] < summary["bf16_checkpoint_bytes"] + 2**20
    card = (out / "README.md").read_text()
    assert all(f"`{m}`" in card for m in planned_names)
    # the price in the user's currency: the held weights against the predicted all-low load
    over = summary["weights_held_bytes"] / summary["all_low_weights_bytes"] - 1
    assert over > 0 and f"**{100 * over:+.1f} %**" in card
    if quant == "nf4":
        # the stock load equals the dual-path model with the plan active, bit for bit (CPU, FP32 compute)
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout

        stock = AutoModelForCausalLM.from_pretrained(out)
        # computed in FP32 as the dual path here is (a pre-quantised load keeps the config's BF16, whatever
        # dtype= says): the BF16 tensors upcast exactly, the 4-bit ones de-quantised to FP32
        for prm in stock.parameters():
            if not isinstance(prm, bnb.nn.Params4bit):
                prm.data = prm.data.float()
        for m in stock.modules():
            if isinstance(m, bnb.nn.Linear4bit):
                m.compute_dtype = torch.float32
                m.weight.quant_state.dtype = torch.float32  # de-quantise to FP32, as the FP32 dual path does
        keep_reference_layout(stock)
        dual = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
        gnmr_hf.set_active_units(dual, list(p.indices))
        a, b = logits(stock.eval(), ids), logits(dual, ids)
        assert torch.equal(a, b), (a - b).abs().max()
        gnmr_hf.set_active_units(dual, [])
        assert not torch.equal(logits(dual, ids), a)  # the plan changed the logits: the comparison can fail


def test_merge_equals_merging_by_hand(planned, tmp_path, ids):
    from transformers import AutoModelForCausalLM

    arch, path, prof_dir, p, prof = planned
    base = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    targets = sorted({short_name(n).rsplit(".", 1)[-1] for n in p.modules})
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, target_modules=targets, init_lora_weights=False))
    lora.save_pretrained(tmp_path / "adapter")
    out = tmp_path / "merged"
    export.export_planned(path, prof_dir, out, adapter=tmp_path / "adapter", merge=True)
    got = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
    assert not hasattr(got.config, "quantization_config")
    by_hand = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                                             str(tmp_path / "adapter")).merge_and_unload().float()
    plain = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert torch.equal(logits(got, ids), logits(by_hand, ids))
    assert not torch.equal(logits(got, ids), logits(plain, ids))


def test_adapter_is_copied_beside_the_model(planned, tmp_path):
    arch, path, prof_dir, p, prof = planned
    from transformers import AutoModelForCausalLM

    lora = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path), peft.LoraConfig(r=2, target_modules=["q_proj"]))
    lora.save_pretrained(tmp_path / "ad")
    export.export_planned(path, prof_dir, tmp_path / "out", adapter=tmp_path / "ad", target="transformers")
    assert (tmp_path / "out" / "adapter" / "adapter_config.json").is_file()
    assert "adapter/" in (tmp_path / "out" / "README.md").read_text()


def test_serving_names_select_exactly_their_module_under_both_rules():
    names = ["model.layers.1", "model.layers.1.mlp", "model.layers.1.mlp.down_proj", "model.layers.11",
             "model.layers.11.mlp", "model.layers.11.mlp.down_proj", "model.layers.1.self_attn.v_proj",
             "model.layers.11.self_attn.v_proj", "lm_head"]
    for entry in ("model.layers.1.mlp.down_proj", "model.layers.1.self_attn.v_proj", "model.layers.11.mlp.down_proj",
                  "lm_head"):
        assert export.selected_by(entry, names) == {"transformers": [entry], "vllm": [entry]}
    # a short entry is what goes wrong: "layers.1.mlp.down_proj" as a suffix also hits no 11, but
    # "1.mlp.down_proj" does, and a layer prefix takes every module inside it
    assert export.selected_by("1.mlp.down_proj", names)["transformers"] == ["model.layers.1.mlp.down_proj",
                                                                           "model.layers.11.mlp.down_proj"]
    assert len(export.selected_by("model.layers.1", names)["vllm"]) == 4
    # the rule is transformers' own
    from transformers.quantizers.quantizers_utils import should_convert_module

    for entry in ("model.layers.1.mlp.down_proj", "1.mlp.down_proj", "model.layers.1", "lm_head"):
        assert [n for n in names if not should_convert_module(n, [entry])] == export.selected_by(entry, names)["transformers"]


def test_every_exported_entry_selects_only_itself_in_the_real_model(planned, tmp_path):
    arch, path, prof_dir, p, prof = planned
    from transformers import AutoModelForCausalLM

    export.export_planned(path, prof_dir, tmp_path / "o", target="transformers")
    skips = json.loads((tmp_path / "o" / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    names = [n for n, _ in AutoModelForCausalLM.from_pretrained(path).named_modules() if n]
    for entry in skips:
        assert export.selected_by(entry, names) == {"transformers": [entry], "vllm": [entry]}


def test_bad_inputs_are_refused_before_anything_is_written(planned, tmp_path, tiny_llama_dir):
    arch, path, prof_dir, p, prof = planned
    out = tmp_path / "out"
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(export.ExportError, match="exists and is not empty.*--force"):
        export.export_planned(path, prof_dir, tmp_path / "full", target="transformers")
    no_st = tmp_path / "nost"
    no_st.mkdir()
    (no_st / "config.json").write_text((path / "config.json").read_text())
    with pytest.raises(export.ExportError, match="no .safetensors"):
        export.export_planned(no_st, prof_dir, out, target="transformers")
    quantised = tmp_path / "q"
    export.export_planned(path, prof_dir, quantised, target="transformers")
    with pytest.raises(export.ExportError, match="quantised already"):
        export.export_planned(quantised, prof_dir, out, target="transformers")
    # a plan of another model: tiny_llama_dir has 4 layers; a plan naming layer 9 does not exist there
    other = json.loads((prof_dir / "profile.json").read_text())
    other["skip_modules"] = ["lm_head", "model.layers.9.self_attn.v_proj"]
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "profile.json").write_text(json.dumps(other))
    with pytest.raises(export.ExportError, match="not a module of"):
        export.export_planned(path, tmp_path / "other", out, target="transformers")
    if arch == "llama":  # the profile of a 2-layer model against a 4-layer one: names exist, counts differ
        with pytest.raises(export.ExportError, match="profile of another model"):
            export.export_planned(tiny_llama_dir, prof_dir, out, target="transformers")
    with pytest.raises(export.ExportError, match="no such profile.json"):
        export.export_planned(path, tmp_path / "nowhere", out, target="transformers")
    assert not out.exists()
    # --force replaces only an earlier export (tests/test_export_faults_r4.py has the whole contract)
    with pytest.raises(export.ExportError, match="not a folder an earlier export wrote"):
        export.export_planned(path, prof_dir, tmp_path / "full", force=True, target="transformers")
    assert (tmp_path / "full" / "x").read_text() == "x" and not (tmp_path / "full" / "config.json").exists()
    export.export_planned(path, prof_dir, quantised, force=True, target="transformers")
    assert (quantised / "config.json").is_file()


def test_an_interrupted_export_leaves_no_folder(planned, tmp_path, monkeypatch):
    arch, path, prof_dir, p, prof = planned
    import transformers

    def boom(*a, **k):
        raise KeyboardInterrupt

    monkeypatch.setattr(transformers.PreTrainedModel, "save_pretrained", boom)
    with pytest.raises(KeyboardInterrupt):
        export.export_planned(path, prof_dir, tmp_path / "x", target="transformers")
    assert list(tmp_path.iterdir()) == []


def test_cli_one_line_error_and_summary(planned, tmp_path, capsys):
    arch, path, prof_dir, p, prof = planned
    from gnmr_hf.cli import main

    assert main(["export", "--model", str(path), "--plan", str(tmp_path / "none"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gnmr-hf export: error:")
    assert main(["export", "--model", str(path), "--plan", str(prof_dir), "--output", str(tmp_path / "o"),
                 "--target", "transformers"]) == 0
    assert "MiB on disk" in capsys.readouterr().out


def test_model_card_price_table_in_both_currencies(tmp_path):
    from gnmr_hf.export import model_card

    mib = 2**20
    summary = {"kind": "NF4 + plan", "quant": "nf4", "kept": ["model.layers.0.self_attn.v_proj"],
               "bytes_on_disk": 129 * mib, "bf16_checkpoint_bytes": 256 * mib, "all_low_weights_bytes": 100 * mib,
               "weights_held_bytes": 116 * mib, "plan": {},
               "price": [{"budget_fraction": 0.1, "indices": [1, 2, 3], "bytes": 23 * mib,
                          "measured": {"profile": {"gap_closed": 0.5}}}]}
    card = model_card(summary, tmp_path / "m", has_adapter=False, merge=False)
    assert "**+16.0 %**" in card
    # 23 MiB of BF16 weights cost 23 x 1.4375 / 2 = 16.53 MiB over NF4: +16.5 % of the 100 MiB all-NF4 model
    assert "| 10 % | 3 | 23.0 | +16.5 % | in-sample 0.500 |" in card
