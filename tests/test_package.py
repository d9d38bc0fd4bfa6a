"""The package surface: lazy imports, optional-dependency errors, the gnmr-hf dispatcher, unit discovery."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
from torch import nn


def _modules_after(code: str) -> list[str]:
    out = subprocess.run(
        [sys.executable, "-c", code + "\nimport sys\nprint(' '.join(m for m in "
         "('transformers', 'peft', 'bitsandbytes', 'lm_eval', 'accelerate', 'datasets') if m in sys.modules))"],
        check=True, capture_output=True, text=True,
    )
    return out.stdout.split()


def test_import_gnmr_hf_is_light():
    assert _modules_after("import gnmr_hf") == []
    # the controller is pure PyTorch: using it pulls in nothing else
    assert _modules_after("import gnmr_hf, torch\nc = gnmr_hf.GNMRController(3, gnmr_hf.GNMRConfig())\n"
                          "c.step(torch.ones(3))") == []


def test_callback_imports_nothing_beyond_transformers_own():
    # transformers' TrainerCallback module itself imports peft and bitsandbytes when they are installed;
    # the callback must add nothing to that (in particular not lm_eval)
    baseline = _modules_after("import transformers.trainer_callback")
    loaded = _modules_after("import gnmr_hf\ngnmr_hf.GNMRCallback")
    assert "transformers" in loaded  # the thing compared really was imported
    assert loaded == baseline and "lm_eval" not in loaded


def test_public_names_resolve_and_unknown_ones_raise():
    import gnmr_hf

    for name in gnmr_hf.__all__:
        assert getattr(gnmr_hf, name) is not None
    assert set(dir(gnmr_hf)) == set(gnmr_hf.__all__)
    with pytest.raises(AttributeError, match="no attribute 'GNMRConfgi'"):
        gnmr_hf.GNMRConfgi  # noqa: B018


def test_require_names_the_extra(monkeypatch):
    from gnmr_hf import _import_utils

    monkeypatch.setattr(_import_utils, "is_available", lambda module: False)
    with pytest.raises(ImportError, match=r"pip install 'gnmr_hf\[eval\]'"):
        _import_utils.require("lm_eval", "Evaluation")
    with pytest.raises(ImportError, match=r"gnmr_hf\[bnb\]"):
        _import_utils.require("bitsandbytes", "The dual path")


def test_cli_help_and_unknown_command(capsys):
    from gnmr_hf.cli import main

    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    assert "demo" in out and "eval" in out and "report" in out
    assert main(["trian"]) == 2
    assert "unknown command 'trian'" in capsys.readouterr().err


def test_entry_point_is_installed():
    out = subprocess.run(["gnmr-hf", "--help"], capture_output=True, text=True)
    if out.returncode == 127:  # pragma: no cover - not installed as a console script
        pytest.skip("gnmr-hf is not on PATH")
    assert out.returncode == 0 and "report" in out.stdout


def test_find_decoder_layers_plain_and_peft():
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from gnmr_hf.units import find_decoder_layers, resolve_units

    model = LlamaForCausalLM(LlamaConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=3,
                                         num_attention_heads=2, num_key_value_heads=1))
    names = [n for n, _ in find_decoder_layers(model)]
    assert names == ["model.layers.0", "model.layers.1", "model.layers.2"]
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj"]))
    units = find_decoder_layers(wrapped)
    assert [n for n, _ in units] == ["base_model.model." + n for n in names]
    assert units[1][1] is model.model.layers[1]
    # suffixes resolve through the PEFT prefix; an ambiguous one is an error naming the count
    assert [n for n, _ in resolve_units(wrapped, ["layers.2.mlp"])] == ["base_model.model.model.layers.2.mlp"]
    with pytest.raises(ValueError, match="matches 3 modules"):
        resolve_units(wrapped, ["mlp"])
    with pytest.raises(TypeError):
        resolve_units(wrapped, "model.layers.0")


def test_no_decoder_layers_is_a_clear_error():
    from gnmr_hf.units import find_decoder_layers

    with pytest.raises(ValueError, match="Pass the units explicitly"):
        find_decoder_layers(nn.Sequential(nn.Linear(2, 2)))


def test_set_active_units_checks_indices_and_recovery_paths():
    from gnmr_hf.backends.base import DualPathModule, active_units, recovery_device_bytes, set_active_units

    class Toy(nn.Linear, DualPathModule):
        def set_recovery(self, on: bool) -> None:
            self.recovery = on

        def recovery_device_bytes(self) -> int:
            return 10 if self.recovery else 0

    model = nn.Module()
    model.blocks = nn.ModuleList([nn.Sequential(Toy(2, 2), Toy(2, 2)), nn.Sequential(nn.Linear(2, 2))])
    units = [("blocks.0", model.blocks[0]), ("blocks.1", model.blocks[1])]
    set_active_units(model, [torch.tensor(0)], units)
    assert active_units(model, units) == [0] and recovery_device_bytes(model) == 20
    set_active_units(model, [], units)
    assert active_units(model, units) == [] and recovery_device_bytes(model) == 0
    with pytest.raises(IndexError, match="out of range for 2 units"):
        set_active_units(model, [2], units)
    with pytest.raises(ValueError, match="has no recovery path"):
        set_active_units(model, [1], units)
