"""``gnmr-hf export --format compressed-tensors`` and ``--merge`` with a ladder plan (gnmr_hf.export's CLI): the
format reaches :func:`gnmr_hf.export_ct.export_compressed_tensors` with its group size, target and adapter; a
ladder plan (INT8 rungs) is written by the compressed-tensors format and merged by ``--merge``; the bad inputs
(a plan of the wrong kind for the format, options of the other format, the extra missing, an existing
non-empty output, a group size that does not divide) are one line each, exit 2, nothing written. Also
:func:`gnmr_hf.export_ct.ct_rung_gains`, the profile against the export's own INT4 quantiser."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")
peft = pytest.importorskip("peft")

from gnmr_hf.export import main  # noqa: E402
from gnmr_hf.export_ct import (  # noqa: E402
    ct_rung_gains,
    ct_rung_prices,
    ct_tensor_bytes,
    fake_quantize_model,
    int4_fake_quant,
    int8_fake_quant,
)

L0, L1 = "model.layers.0.", "model.layers.1."
# a grouped ladder plan (q/k/v and gate/up each on one rung): 4 INT8 linears, 3 BF16
LADDER = {L0 + "self_attn.q_proj": "int8", L0 + "self_attn.k_proj": "int8", L0 + "self_attn.v_proj": "int8",
          L0 + "mlp.gate_proj": "bf16", L0 + "mlp.up_proj": "bf16", L1 + "self_attn.o_proj": "int8",
          L1 + "mlp.down_proj": "bf16"}


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    # hidden 128, intermediate 192: group 64 divides every input, 128 does not divide down_proj's 192
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    path = tmp_path_factory.mktemp("llama") / "base"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "down_proj"]))
    path = tmp_path_factory.mktemp("adapter") / "lora"
    lora.save_pretrained(path)
    return path


@pytest.fixture()
def ladder_plan(tmp_path):
    folder = tmp_path / "prof"
    folder.mkdir()
    (folder / "profile.json").write_text(json.dumps({"rungs": LADDER}))
    return folder / "profile.json"


def _run(capsys, *argv):
    rc = main(list(map(str, argv)))
    out, err = capsys.readouterr()
    return rc, out, err


def _merged(llama, adapter):
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    return peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload().eval()


def test_compressed_tensors_format_writes_the_ladder_with_the_adapter_merged(llama, adapter, ladder_plan, tmp_path,
                                                                              capsys):
    out = tmp_path / "ct"
    rc, stdout, err = _run(capsys, "--model", llama, "--plan", ladder_plan, "--output", out, "--format",
                           "compressed-tensors", "--group-size", 64, "--adapter", adapter)
    assert rc == 0, err
    assert "W4A16 7 / W8A16 4 / BF16 3 decoder linears, INT4 group 64" in stdout
    stock = transformers.AutoModelForCausalLM.from_pretrained(out)  # no arguments
    modules = dict(stock.named_modules())
    for name in [n for n in modules if ".layers." in n and n.endswith("_proj")]:
        scheme = getattr(modules[name], "quantization_scheme", None)
        rung = LADDER.get(name, "low")
        got = None if scheme is None else (scheme.weights.num_bits, scheme.weights.group_size)
        assert got == {"low": (4, 64), "int8": (8, None), "bf16": None}[rung], name
    # the served weights are the merged model's, quantised at the plan's rungs with group 64
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    merged = _merged(llama, adapter)
    ref = fake_quantize_model(copy.deepcopy(merged), LADDER, 64)
    with torch.no_grad():
        stock(ids)  # decompresses
    sd, rd = stock.state_dict(), ref.state_dict()
    assert all(torch.equal(sd[k], rd[k]) for k in rd)
    v = L0 + "self_attn.v_proj.weight"  # the adapter reached the export: its INT8 weight is the merged one's
    plain = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16).state_dict()[v]
    assert torch.equal(sd[v], int8_fake_quant(merged.state_dict()[v])) and not torch.equal(sd[v], int8_fake_quant(plain))


def test_compressed_tensors_format_takes_a_bf16_plan(llama, tmp_path, capsys):
    prof = tmp_path / "profile.json"
    prof.write_text(json.dumps({"skip_modules": ["lm_head", L1 + "self_attn.o_proj"]}))
    rc, stdout, err = _run(capsys, "--model", llama, "--plan", prof, "--output", tmp_path / "ct", "--format",
                           "compressed-tensors", "--group-size", "64")
    assert rc == 0, err
    assert "W4A16 13 / W8A16 0 / BF16 1 decoder linears" in stdout


def test_merge_takes_a_ladder_plan(llama, adapter, ladder_plan, tmp_path, capsys):
    out = tmp_path / "merged"
    rc, stdout, err = _run(capsys, "--model", llama, "--plan", ladder_plan, "--output", out, "--merge", "--adapter",
                           adapter)
    assert rc == 0, err
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.bfloat16)
    assert getattr(loaded.config, "quantization_config", None) is None
    want = _merged(llama, adapter).state_dict()
    got = loaded.state_dict()
    assert all(torch.equal(got[k], want[k]) for k in want)
    # a ladder plan for another model is still refused by --merge
    other = tmp_path / "other.json"
    other.write_text(json.dumps({"rungs": {"model.layers.7.mlp.down_proj": "int8"}}))
    rc, _, err = _run(capsys, "--model", llama, "--plan", other, "--output", tmp_path / "m2", "--merge", "--adapter",
                      adapter)
    assert rc == 2 and "not a module of" in err and not (tmp_path / "m2").exists()


def _refused(capsys, tmp_path, out, *argv):
    before = sorted(p.name for p in tmp_path.rglob("*"))
    rc, stdout, err = _run(capsys, *argv)
    assert rc == 2, (stdout, err)
    assert err.startswith("gnmr-hf export: error: ") and err.count("\n") == 1, err
    assert sorted(p.name for p in tmp_path.rglob("*")) == before  # nothing written
    return err


def test_wrong_kind_of_plan_or_options_for_the_format(llama, adapter, ladder_plan, tmp_path, capsys):
    out = tmp_path / "out"
    base = ["--model", llama, "--output", out]
    err = _refused(capsys, tmp_path, out, *base, "--plan", ladder_plan)  # a ladder plan, bitsandbytes format
    assert "precision-ladder plan with 4 INT8 linears" in err and "--format compressed-tensors" in err
    assert "--merge --adapter DIR" in err
    ct = [*base, "--plan", ladder_plan, "--format", "compressed-tensors"]
    assert "--quant int8 is bitsandbytes'" in _refused(capsys, tmp_path, out, *ct, "--quant", "int8")
    assert "--double-quant is bitsandbytes'" in _refused(capsys, tmp_path, out, *ct, "--double-quant")
    assert "--merge writes the merged BF16" in _refused(capsys, tmp_path, out, *ct, "--merge", "--adapter", adapter)
    assert "does not divide" in _refused(capsys, tmp_path, out, *ct)  # group 128 against down_proj's 192 inputs
    assert "use group_size=64" in _refused(capsys, tmp_path, out, *ct)
    err = _refused(capsys, tmp_path, out, *base, "--plan", ladder_plan, "--group-size", "64")
    assert "--group-size is the compressed-tensors INT4 group" in err
    empty = tmp_path / "empty.json"
    empty.write_text(json.dumps({"units": []}))
    err = _refused(capsys, tmp_path, out, *base, "--plan", empty, "--format", "compressed-tensors", "--group-size", "64")
    assert "holds no plan" in err


def test_split_group_refused_for_vllm_and_written_for_transformers(llama, tmp_path, capsys):
    prof = tmp_path / "split.json"
    prof.write_text(json.dumps({"rungs": {L0 + "self_attn.v_proj": "int8"}}))
    argv = ["--model", llama, "--plan", prof, "--format", "compressed-tensors", "--group-size", "64"]
    err = _refused(capsys, tmp_path, tmp_path / "o", *argv, "--output", tmp_path / "o")
    assert "splits 1 serving group" in err
    rc, stdout, err = _run(capsys, *argv, "--output", tmp_path / "t", "--target", "transformers")
    assert rc == 0 and "for transformers" in stdout


def test_existing_output_and_missing_extra(llama, ladder_plan, tmp_path, capsys, monkeypatch):
    out = tmp_path / "taken"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    ct = ["--model", llama, "--plan", ladder_plan, "--output", out, "--format", "compressed-tensors",
          "--group-size", "64"]
    assert "not empty" in _refused(capsys, tmp_path, out, *ct)
    assert (out / "notes.txt").read_text() == "mine"
    monkeypatch.setitem(sys.modules, "compressed_tensors", None)  # the serve extra not installed
    err = _refused(capsys, tmp_path, tmp_path / "new", *ct[:5], tmp_path / "new", *ct[6:])
    assert "pip install 'gnmr_hf[serve]'" in err and not (tmp_path / "new").exists()


# ------------------------------------------------------------------------- gains against the export's INT4


def test_ct_rung_gains_against_the_export_int4(llama):
    model = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.float32)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": (ids := torch.randint(0, 128, (2, 16), generator=g)), "labels": ids} for _ in range(2)]
    units = ct_rung_gains(model, batches, group_size=64)
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # restored
    assert len(units) == 14 and units[0].name == L0 + "self_attn.q_proj"
    # independently: dL/dy at the uniform W4A16 point (the export's weights) by hooks, -<dL/dy, x (W_r - W_low)^T>
    ref = fake_quantize_model(transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16),
                              {}, 64).float().eval()
    bf16 = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    mods, src = dict(ref.named_modules()), dict(bf16.named_modules())
    want = {u.name: {"int8": 0.0, "bf16": 0.0} for u in units}
    low_w = {n: mods[n].weight.detach().clone() for n in want}
    assert all(torch.equal(low_w[n], int4_fake_quant(src[n].weight, 64).float()) for n in want)

    def hook(name):
        def fn(mod, inp, out):
            x = inp[0].detach()
            w = src[name].weight
            deltas = {"int8": x @ (int8_fake_quant(w).float() - low_w[name]).T,
                      "bf16": x @ (w.float() - low_w[name]).T}

            def on_grad(grad):
                for r, d in deltas.items():
                    want[name][r] -= float((grad.double() * d.double()).sum())
            out.register_hook(on_grad)
        return fn

    for n in want:
        mods[n].register_forward_hook(hook(n))
    for p in ref.parameters():
        p.requires_grad_(False)
    ref.get_input_embeddings().register_forward_hook(lambda m, i, o: o.requires_grad_(True))
    for b in batches:
        ref(**b).loss.backward()
    for u in units:
        for r in ("int8", "bf16"):
            assert u.gains[r] == pytest.approx(want[u.name][r], rel=1e-3, abs=1e-7), (u.name, r)
    assert max(abs(u.gains["bf16"]) for u in units) > 1e-4  # the gains are not all zero: the check can fail
    # prices: the folder's bytes of each rung over W4A16, as the export's own accounting
    out_f, in_f = 192, 128
    shape = {"x": (out_f, in_f, False)}
    low = ct_tensor_bytes(shape, {}, 0, 64)
    assert ct_rung_prices(out_f, in_f, 64) == {"int8": ct_tensor_bytes(shape, {"x": "int8"}, 0, 64) - low,
                                               "bf16": 2 * out_f * in_f - low}
    assert low == 4 * out_f * in_f * 4 // 32 + 2 * out_f * 2 + 16  # packed INT4 codes, a BF16 scale per group, shape
