"""No output that reads like an error where nothing is wrong (issue 52, item 10): the ladder table's all-BF16
reference no longer makes transformers log "no linear modules were found", and ``prepare_for_training`` uses
transformers' current checkpointing API (no FutureWarning). Each test also shows the noise with the old call,
so the capture is known to see it."""

from __future__ import annotations

import logging
import warnings

import pytest
import torch

from tests.conftest import make_tiny_llama

NO_LINEARS = "no linear modules were found"


class _Records(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.lines: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(record.getMessage())


@pytest.fixture
def transformers_log():
    """Every message transformers logs (its loggers propagate to ``transformers``), at warning level."""
    from transformers.utils import logging as hf_logging

    logger = logging.getLogger("transformers")
    handler, level = _Records(), hf_logging.get_verbosity()
    hf_logging.set_verbosity_warning()
    logger.addHandler(handler)
    yield handler.lines
    logger.removeHandler(handler)
    hf_logging.set_verbosity(level)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_noise"), num_layers=2, hidden=32)


def test_the_ladder_table_logs_no_eetq_line(tiny, transformers_log):
    from transformers import AutoModelForCausalLM

    from gnmr_hf.planning import ladder

    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 16))
    batch = {"input_ids": ids, "labels": ids}
    # the old reference load (every decoder linear skipped by a 4-bit quantiser) logs the line: the capture sees it
    linears = ladder.decoder_low_linears(ladder._stock_low(tiny, "nf4", torch.float32))
    old = ladder._stock_low(tiny, "nf4", torch.float32, skip=list(linears))
    assert any(NO_LINEARS in line for line in transformers_log)
    transformers_log.clear()

    table = ladder.ladder_table(tiny, [batch], "nf4", dtype=torch.float32, points=(0.10,), rung_sets=(("bf16",),),
                                progress=False)
    assert not any(NO_LINEARS in line for line in transformers_log), transformers_log
    # the reference is the same model: its loss equals the old load's and a plain BF16 load's
    with torch.no_grad():
        plain = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).eval()
        assert table["loss_high"] == float(plain(**batch).loss) == float(old(**batch).loss)
    assert table["loss_high"] != table["loss_low"]


def _checkpointing_futurewarnings(caught) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, FutureWarning) and "checkpointing" in str(w.message)]


@pytest.mark.parametrize("kwargs", [None, {"use_reentrant": False}])
def test_prepare_for_training_uses_the_current_checkpointing_api(tiny, kwargs):
    from transformers import AutoModelForCausalLM

    from gnmr_hf.training import prepare_for_training

    model = AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32)
    if not hasattr(model, "activation_checkpointing_enable"):
        pytest.skip("this transformers release has only gradient_checkpointing_enable (nothing deprecated to avoid)")
    # the deprecated call warns: the capture sees it
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        AutoModelForCausalLM.from_pretrained(tiny, dtype=torch.float32).gradient_checkpointing_enable()
    assert _checkpointing_futurewarnings(caught)

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        prepare_for_training(model, gradient_checkpointing_kwargs=kwargs)
    assert _checkpointing_futurewarnings(caught) == []
    assert model.is_activation_checkpointing and not any(p.requires_grad for p in model.parameters())
    # checkpointing is really on: the decoder layers recompute through torch.utils.checkpoint
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_prepare_for_training_falls_back_on_older_releases(tiny):
    """A model with only ``gradient_checkpointing_enable`` (transformers before the rename) still gets it."""
    from gnmr_hf.training import enable_checkpointing

    calls = []

    class Old:
        def gradient_checkpointing_enable(self, gradient_checkpointing_kwargs=None):
            calls.append(gradient_checkpointing_kwargs)

    enable_checkpointing(Old(), {"use_reentrant": False})
    assert calls == [{"use_reentrant": False}]
