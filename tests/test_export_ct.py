"""The precision ladder as a compressed-tensors checkpoint (gnmr_hf.export_ct): the quantiser against the
library's, the round trip through stock ``from_pretrained`` on a tiny Llama (with a LoRA adapter merged) and a
tiny Gemma3 (tied embeddings, no adapter), the config vLLM reads, and bad input refused before anything is
written."""

from __future__ import annotations

import copy
import json
import sys

import pytest
import torch

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")
peft = pytest.importorskip("peft")

from compressed_tensors.quantization import QuantizationArgs, fake_quantize  # noqa: E402
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402
from safetensors import safe_open  # noqa: E402

from gnmr_hf.export import ExportError  # noqa: E402
from gnmr_hf.export_ct import (  # noqa: E402
    export_compressed_tensors,
    fake_quantize_model,
    int4_fake_quant,
    int8_fake_quant,
)
from gnmr_hf.export_folder import OutputFolderError  # noqa: E402
from gnmr_hf.planning.groups import VLLM_FUSED, serving_groups, vllm_ct_scheme  # noqa: E402

# hidden and intermediate sizes are multiples of 128: vLLM's W4A16 group size divides every input
COMMON = dict(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
L0, L1 = "model.layers.0.", "model.layers.1."
# a grouped ladder plan: q/k/v of layer 0 on INT8, its gate/up on BF16, layer 1's o_proj INT8 and down_proj BF16
RUNGS = {L0 + "self_attn.q_proj": "int8", L0 + "self_attn.k_proj": "int8", L0 + "self_attn.v_proj": "int8",
         L0 + "mlp.gate_proj": "bf16", L0 + "mlp.up_proj": "bf16", L1 + "self_attn.o_proj": "int8",
         L1 + "mlp.down_proj": "bf16"}
# the stock model computes in BF16, the reference in FP32 on the same (bit-equal) weights: BF16 rounding of
# activations over two layers of a 128-wide model stays well under this; the quantisation moves logits ~0.1-0.3
LOGIT_ATOL = 0.02


def _save(model_cls: str, cfg_cls: str, extra: dict, path):
    torch.manual_seed(0)
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    model = getattr(transformers, model_cls)(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    return _save("LlamaForCausalLM", "LlamaConfig", {}, tmp_path_factory.mktemp("llama") / "base")


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    return _save("Gemma3ForCausalLM", "Gemma3TextConfig", {"head_dim": 32, "sliding_window": 64},
                 tmp_path_factory.mktemp("gemma3") / "base")


@pytest.fixture(scope="module")
def adapter(llama, tmp_path_factory):
    torch.manual_seed(1)
    base = transformers.AutoModelForCausalLM.from_pretrained(llama, dtype=torch.bfloat16)
    lora = peft.get_peft_model(base, peft.LoraConfig(r=4, lora_alpha=8, init_lora_weights=False,
                                                     target_modules=["q_proj", "v_proj", "up_proj", "down_proj"]))
    path = tmp_path_factory.mktemp("adapter") / "lora"
    lora.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(3))


# ------------------------------------------------------------------------------------------ the quantiser


def test_int4_by_hand():
    # absmax 1.875 -> scale 1.875 / 7.5 = 0.25; codes 7.5 -> 7 (clamped), -1.5 -> -2 and 2.5 -> 2 (half to even)
    w = torch.tensor([[1.875, -0.375, 0.625, 0.0], [-1.875, 0.25, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]],
                     dtype=torch.bfloat16)
    out = int4_fake_quant(w, group_size=4)
    assert out.dtype == torch.bfloat16
    assert out[0].tolist() == [1.75, -0.5, 0.5, 0.0]
    assert out[1].tolist() == [-2.0, 0.25, 0.0, 0.0]  # -7.5 -> -8: the negative end reaches past the maximum
    assert out[2].tolist() == [0.0, 0.0, 0.0, 0.0]  # an all-zero group (scale eps) stays zero
    # per channel, 8 bits: absmax 1.875 -> scale 1.875 / 127.5
    row = int8_fake_quant(torch.tensor([[1.875, -1.875, 0.0]], dtype=torch.float32))
    scale = torch.tensor(1.875) / 127.5  # FP32, as the weight
    assert row[0].tolist() == (torch.tensor([127.0, -128.0, 0.0]) * scale).tolist()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("bits,group", [(4, 128), (4, 32), (8, None)])
def test_fake_quant_is_bit_exact_to_the_library(dtype, bits, group):
    g = torch.Generator().manual_seed(bits + (group or 0))
    w = (torch.randn(96, 256, generator=g) * torch.rand(96, 1, generator=g)).to(dtype)
    w[3, :128] = 0  # an all-zero group
    w[5, 7] = 40.0  # an outlier
    args = QuantizationArgs(num_bits=bits, type="int", symmetric=True, dynamic=False,
                            strategy="group" if group else "channel", group_size=group)
    x = w.unflatten(-1, (256 // group, group)) if group else w.unsqueeze(1)
    scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
    expected = fake_quantize(w, scale, zero, args)
    ours = int4_fake_quant(w, group) if bits == 4 else int8_fake_quant(w)
    assert ours.dtype == expected.dtype == dtype
    assert torch.equal(ours, expected)
    assert not torch.equal(ours, w)  # the quantiser changed the weight: the comparison can fail
    levels = (ours.unflatten(-1, (-1, group)) if group else ours.unsqueeze(1))[0, 0].unique().numel()
    assert levels <= 2**bits


# ------------------------------------------------------------------------------------------ round trips


def _reference(model_path, rungs, adapter=None):
    base = transformers.AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if adapter is not None:
        base = peft.PeftModel.from_pretrained(base, str(adapter)).merge_and_unload()
    return base.eval(), fake_quantize_model(copy.deepcopy(base), rungs, 128).eval()


def _tensor_bytes(folder) -> int:
    total = 0
    for f in folder.glob("*.safetensors"):
        with safe_open(str(f), "pt") as fh:
            for k in fh.keys():
                t = fh.get_tensor(k)
                total += t.numel() * t.element_size()
    return total


def _round_trip(model_path, out, ids, adapter=None):
    summary = export_compressed_tensors(model_path, RUNGS, out, adapter=adapter)
    # stock loading, no arguments, on the CPU
    stock = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert stock.device.type == "cpu" and stock.dtype == torch.bfloat16
    modules = dict(stock.named_modules())
    linears = [n for n, m in modules.items() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    assert len(linears) == 14
    # every linear's scheme as planned
    for n in linears:
        scheme = getattr(modules[n], "quantization_scheme", None)
        rung = RUNGS.get(n, "low")
        if rung == "bf16":
            assert scheme is None, n
        else:
            w = scheme.weights
            assert (w.num_bits, w.strategy, w.group_size, w.symmetric) == (
                (4, "group", 128, True) if rung == "low" else (8, "channel", None, True)), n
    assert getattr(modules["lm_head"], "quantization_scheme", None) is None
    assert summary["schemes"] == {"W4A16": 7, "W8A16": 4, "BF16": 3}
    # logits: the stock model against the package's reference of the same quantisation
    unquantised, ref = _reference(model_path, RUNGS, adapter)
    with torch.no_grad():
        got = stock(ids).logits
        # the first forward decompressed the weights: they are the reference's, bit for bit
        sd, rd = stock.state_dict(), ref.state_dict()
        assert all(torch.equal(sd[k], rd[k]) for k in rd), [k for k in rd if not torch.equal(sd[k], rd[k])]
        assert torch.equal(got, ref(ids).logits)  # the same weights and ops in BF16: equal
        want = ref.float()(ids).logits  # the reference in FP32
        full = unquantised.float()(ids).logits
    assert torch.isfinite(got).all()
    assert torch.allclose(got.float(), want, atol=LOGIT_ATOL, rtol=0)
    assert (want - full).abs().max() > 5 * LOGIT_ATOL  # the quantisation moved the logits: the check can fail
    # config.json: the scheme groups as vLLM reads them
    qc = json.loads((out / "config.json").read_text())["quantization_config"]
    assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
    assert "lm_head" in qc["ignore"] and all(n in qc["ignore"] for n, r in RUNGS.items() if r == "bf16")
    arch = type(stock).__name__
    fused = {k: list(v) for k, v in VLLM_FUSED[arch].items()}
    bits = {key: g["weights"]["num_bits"] for key, g in qc["config_groups"].items()}
    for group in serving_groups(stock):
        key = vllm_ct_scheme(group.name, qc["config_groups"], qc["ignore"], fused)
        homes = {next((k for k, g in qc["config_groups"].items() if m in g["targets"]), None) for m in group.members}
        assert len(homes) == 1  # q/k/v (and gate/up) in one scheme group, or all ignored
        rung = RUNGS.get(group.members[0], "low")
        assert (None if key is None else bits[key]) == {"low": 4, "int8": 8, "bf16": None}[rung], group
    # sizes: the summary's accounting is the folder's, between uniform W4A16 and BF16
    assert summary["tensor_bytes"] == _tensor_bytes(out)
    assert summary["w4a16_tensor_bytes"] < summary["tensor_bytes"] < summary["bf16_tensor_bytes"]
    card = (out / "README.md").read_text()
    assert "| W4A16: INT4 weight-only, group 128, symmetric | 7 |" in card and "| W8A16" in card
    return summary, stock


def test_llama_round_trip_with_a_merged_adapter(llama, adapter, ids, tmp_path):
    summary, stock = _round_trip(llama, tmp_path / "out", ids, adapter=adapter)
    assert summary["adapter"] == str(adapter)
    # the adapter mattered: without it the served weights differ
    _, no_adapter = _reference(llama, RUNGS)
    q = L0 + "self_attn.v_proj.weight"
    assert not torch.equal(stock.state_dict()[q], no_adapter.state_dict()[q])


def test_gemma3_round_trip_with_tied_embeddings(gemma3, ids, tmp_path):
    summary, stock = _round_trip(gemma3, tmp_path / "out", ids)
    assert stock.config.tie_word_embeddings
    assert stock.lm_head.weight.data_ptr() == stock.model.embed_tokens.weight.data_ptr()
    assert summary["adapter"] is None


def test_a_bf16_plan_file_and_a_transformers_only_folder(llama, tmp_path):
    plan = tmp_path / "prof" / "profile.json"
    plan.parent.mkdir()
    kept = [L1 + "self_attn.v_proj", L1 + "mlp.down_proj"]  # v_proj alone splits layer 1's q/k/v
    plan.write_text(json.dumps({"skip_modules": ["lm_head", "model.embed_tokens", *kept]}))
    with pytest.raises(ExportError, match=r"model.layers.1.self_attn.qkv_proj \(q_proj low, k_proj low, v_proj bf16\)"):
        export_compressed_tensors(llama, plan.parent, tmp_path / "out")
    s = export_compressed_tensors(llama, plan.parent, tmp_path / "out", target="transformers")
    assert s["schemes"] == {"W4A16": 12, "W8A16": 0, "BF16": 2}
    assert "**For transformers only**" in (tmp_path / "out" / "README.md").read_text()
    stock = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out")
    assert getattr(stock.model.layers[1].self_attn.v_proj, "quantization_scheme", None) is None
    assert stock.model.layers[1].self_attn.q_proj.quantization_scheme.weights.num_bits == 4


# ------------------------------------------------------------------------------------------ bad input


def _refused(exc, match, call, out):
    with pytest.raises(exc) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg and match in msg, msg
    assert not out.exists()
    assert not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}-")]  # no staging left
    return msg


def test_bad_input_is_refused_in_one_line_before_anything_is_written(llama, tmp_path, monkeypatch):
    out = tmp_path / "out"
    _refused(ExportError, "'model.layers.5.self_attn.q_proj', which is not a module of",
             lambda: export_compressed_tensors(llama, {"model.layers.5.self_attn.q_proj": "int8"}, out), out)
    _refused(ExportError, "splits 1 serving group(s) vLLM fuses: model.layers.0.mlp.gate_up_proj (gate_proj int8, "
             "up_proj low)", lambda: export_compressed_tensors(llama, {L0 + "mlp.gate_proj": "int8"}, out), out)
    _refused(ExportError, "each rung is one of int8, bf16",
             lambda: export_compressed_tensors(llama, {L0 + "mlp.down_proj": "nf4"}, out), out)
    _refused(ExportError, "group_size 96 does not divide the input size of model.layers.0.self_attn.q_proj (128): "
             "use group_size=64", lambda: export_compressed_tensors(llama, {}, out, group_size=96), out)
    wrong = tmp_path / "wrong.json"
    wrong.write_text(json.dumps({"criterion": "first_order"}))
    _refused(ExportError, "holds no plan", lambda: export_compressed_tensors(llama, wrong, out), out)
    units = tmp_path / "units.json"
    units.write_text(json.dumps({"rungs": {}, "units": [{"name": f"u{i}"} for i in range(30)]}))
    _refused(ExportError, "the profile has 30 units", lambda: export_compressed_tensors(llama, units, out), out)
    with monkeypatch.context() as m:
        m.setitem(sys.modules, "compressed_tensors", None)  # the serve extra missing
        _refused(ImportError, "pip install 'gnmr_hf[serve]'", lambda: export_compressed_tensors(llama, {}, out), out)
    # an existing, non-empty folder the export did not write
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutputFolderError, match="exists and is not empty") as e:
        export_compressed_tensors(llama, {}, out)
    assert "\n" not in str(e.value) and [p.name for p in out.iterdir()] == ["notes.txt"]
    # an earlier export is replaced with force, and only then
    again = tmp_path / "again"
    export_compressed_tensors(llama, {}, again)
    with pytest.raises(OutputFolderError, match="exists and is not empty"):
        export_compressed_tensors(llama, {}, again)
    assert export_compressed_tensors(llama, {L1 + "mlp.down_proj": "int8"}, again, force=True)["schemes"]["W8A16"] == 1
