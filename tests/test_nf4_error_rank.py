"""bench/value/nf4_error_rank.py: the share of a linear's NF4 error energy in its top singular directions."""

from __future__ import annotations

import pytest

from tests.conftest import load_bench


def test_shares_are_the_error_spectrum_of_bitsandbytes_nf4(tiny_llama_dir):
    import bitsandbytes.functional as F
    import torch
    from safetensors.torch import load_file

    bench = load_bench("nf4_error_rank")
    one, four, full = (bench.error_shares(tiny_llama_dir, r) for r in (1, 4, 64))
    assert len(one) == 4 * 7 and set(one) == set(full)
    # all of a linear's error lies in its min(rows, cols) <= 64 singular directions, and more directions hold more
    assert all(v == pytest.approx(1.0) for v in full.values())
    assert all(0 < one[n] < four[n] < 1 for n in one)
    # worked out independently for one linear: the largest squared singular value over the sum of all of them
    w = load_file(f"{tiny_llama_dir}/model.safetensors")["model.layers.2.mlp.down_proj.weight"]
    q, state = F.quantize_4bit(w, blocksize=64, quant_type="nf4")
    e = (w.float() - F.dequantize_4bit(q, state).float()).double()
    s = torch.linalg.svdvals(e) ** 2
    assert one["layers.2.mlp.down_proj"] == pytest.approx(float(s[0] / s.sum()), rel=1e-4)
    # noise-like: far below 1 with one direction of a 64-wide matrix, above the uniform 1/64
    assert 1 / 64 < one["layers.2.mlp.down_proj"] < 0.5
