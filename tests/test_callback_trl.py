"""GNMRCallback under trl's SFTTrainer (a Trainer subclass). Skipped when trl is not installed: it is not
a dependency of gnmr_hf."""

from __future__ import annotations

import math

import pytest

import gnmr_hf
from tests.test_callback import SWITCHY, build, dataset, one_thread, read_trace

trl = pytest.importorskip("trl")


@pytest.fixture(autouse=True)
def _one_thread():
    with one_thread():
        yield


@pytest.mark.slow
def test_sft_trainer_with_callback(tiny_llama_dir, smollm2_dir, tmp_path):
    from transformers import AutoTokenizer

    from gnmr_hf.trainer.callback import GNMRCallback

    tok = AutoTokenizer.from_pretrained(smollm2_dir)  # only its pad id is used: the data is pre-tokenised
    model = build(tiny_llama_dir)
    ds = dataset().remove_columns(["labels"])
    args = trl.SFTConfig(output_dir=str(tmp_path), max_steps=8, per_device_train_batch_size=4, learning_rate=1e-2,
                         lr_scheduler_type="constant", report_to="none", use_cpu=True, logging_steps=1,
                         save_strategy="no", disable_tqdm=True, seed=0, max_grad_norm=1.0)
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=ds, processing_class=tok,
                             callbacks=[GNMRCallback(SWITCHY)])
    trainer.train()
    trace = read_trace(tmp_path)
    assert [r["step"] for r in trace] == list(range(1, 9))
    assert any(r["active"] for r in trace) and all(len(r["active"]) <= 2 for r in trace)
    assert all(math.isfinite(x) for r in trace for x in r["norms"])
    assert gnmr_hf.active_units(trainer.model) == []  # the low-cost path after train() (docs/design.md)
    assert "gnmr/active" in trainer.state.log_history[0] and trainer.args.max_grad_norm == 1.0
