"""Choosing the 4-bit (NF4 / FP4) backend. The checks shared with INT8 (all promoted = the BF16 model,
none promoted = stock PEFT over stock 4-bit, a mix, gradients on both paths, bytes per storage mode,
adapter round trip, merge and DoRA refused, BF16 compute with double quantisation) run for every low
path in tests/test_dual_path.py."""

from __future__ import annotations

import pytest

from tests.test_dual_path import load

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")


def test_dispatch_picks_the_backend_from_the_layers(tiny_llama_dir):
    from gnmr_hf.backends import bnb_4bit, bnb_int8
    from gnmr_hf.backends.dispatch import find_backend

    m4 = load(tiny_llama_dir, "fp4")
    assert find_backend(m4).module == "gnmr_hf.backends.bnb_4bit"
    assert find_backend(load(tiny_llama_dir, "int8")).module == "gnmr_hf.backends.bnb_int8"
    with pytest.raises(ValueError, match=r"no bitsandbytes Linear8bitLt .*\['Linear', 'Linear4bit'\]"):
        bnb_int8.prepare_dual_path(m4, tiny_llama_dir)
    with pytest.raises(ValueError, match=r"no bitsandbytes Linear4bit .*load_in_4bit=True"):
        bnb_4bit.prepare_dual_path(load(tiny_llama_dir, None), tiny_llama_dir)
