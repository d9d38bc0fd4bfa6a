"""bench/serve/int4_settings.py measures W4A16 at other groups and symmetries than the export writes: its byte count
must be a compressed folder's, and its fake-quantised weights the ones a stock load of that folder serves. Checked
on a tiny LLaMA compressed here with compressed-tensors' own steps, symmetric and asymmetric (group 32); the
weights through a stock load for the symmetric folder only: stock ``from_pretrained`` refuses the asymmetric one
(its zero points are stored packed, ``(out / 8, groups)``, and the model expects ``(out, groups)``)."""

from __future__ import annotations

import pytest
import torch

transformers = pytest.importorskip("transformers")
ct = pytest.importorskip("compressed_tensors")

from compressed_tensors.compressors import ModelCompressor  # noqa: E402
from compressed_tensors.offload import update_offload_parameter  # noqa: E402
from compressed_tensors.quantization import (  # noqa: E402
    QuantizationArgs,
    QuantizationConfig,
    QuantizationScheme,
    apply_quantization_config,
)
from compressed_tensors.quantization.utils import calculate_qparams  # noqa: E402

from gnmr_hf.export_ct import _safetensors_bytes  # noqa: E402
from tests.conftest import load_bench, make_tiny_llama  # noqa: E402

settings = load_bench("int4_settings")
GROUP = 32


def _linears(model):
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]


def _compressed(src, out, symmetric: bool):
    """The tiny model as a pack-quantized W4A16 folder (every decoder linear), the export's steps."""
    model = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.bfloat16)
    lin = _linears(model)
    args = QuantizationArgs(num_bits=4, type="int", symmetric=symmetric, strategy="group", group_size=GROUP)
    apply_quantization_config(model, QuantizationConfig(config_groups={"g": QuantizationScheme(targets=lin, weights=args)},
                                                        format="pack-quantized"))
    mods = dict(model.named_modules())
    with torch.no_grad():
        for n in lin:
            m = mods[n]
            x = m.weight.unflatten(-1, (m.weight.shape[-1] // GROUP, GROUP))
            scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
            update_offload_parameter(m, "weight_scale", scale.reshape(m.weight_scale.shape))
            if hasattr(m, "weight_zero_point"):
                update_offload_parameter(m, "weight_zero_point", zero.reshape(m.weight_zero_point.shape))
    compressor = ModelCompressor.from_pretrained_model(model)
    compressor.compress_model(model)
    model.save_pretrained(out)
    compressor.update_config(str(out))
    return out


@pytest.mark.parametrize("symmetric", [True, False])
def test_bytes_and_weights_are_the_compressed_folders(tmp_path, symmetric):
    src = make_tiny_llama(tmp_path / "m", num_layers=2, hidden=64)
    folder = _compressed(src, tmp_path / "c", symmetric)
    base = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    lin = _linears(base)
    mods = dict(base.named_modules())
    other = sum(p.numel() for n, p in base.named_parameters() if n.rsplit(".", 1)[0] not in set(lin))
    predicted = 2 * other + sum(settings.linear_bytes(mods[n].out_features, mods[n].in_features, GROUP, symmetric)
                                for n in lin)
    assert _safetensors_bytes(folder) == predicted
    if not symmetric:
        return  # stock from_pretrained refuses this folder (docs/serving.md): its packed zero points are not loaded
    # the bench's fake quantisation gives the stock-loaded folder's logits (FP32 both)
    ids = torch.randint(0, base.config.vocab_size, (1, 12), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        before = base(ids).logits
    originals = {n: mods[n].weight.detach().to(torch.bfloat16).clone() for n in lin}
    settings.fake_quantize_linears(base, lin, originals, GROUP, symmetric)
    served = transformers.AutoModelForCausalLM.from_pretrained(folder)
    with torch.no_grad():
        served(ids)  # decompresses its weights at the first forward
        ref = transformers.AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
        smods = dict(served.named_modules())
        rmods = dict(ref.named_modules())
        for n in lin:
            rmods[n].weight.copy_(smods[n].weight.float())
        want, got = ref(ids).logits, base(ids).logits
    assert torch.allclose(got, want, atol=1e-4), (got - want).abs().max()
    assert (got - before).abs().max() > 1e-3  # the quantisation moved them
