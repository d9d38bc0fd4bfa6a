"""Loading files a user hands over: a pickle that would run code when read is refused, its code never runs.

Each test writes a crafted file whose unpickling calls ``os.system`` to create a marker file, hands it to
a loader of the project (the MX proxy's ``resume_from``, the stress recipe's token cache, eval's
``adapter_model.bin``), and checks the load is refused and the marker does not exist. A control loads the
same file with ``weights_only=False`` and sees the marker appear, so the file really is hostile.
"""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "recipes" / "stress"))

import mx_proxy  # noqa: E402
import pretrain  # noqa: E402


class _Payload:
    """Unpickling this runs ``touch <marker>``."""

    def __init__(self, marker: Path) -> None:
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _crafted(path: Path, marker: Path) -> Path:
    # the shape of a real checkpoint, with the payload inside
    torch.save({"step": 4, "student": {"w": torch.zeros(2)}, "payload": _Payload(marker)}, path)
    return path


def test_the_crafted_file_is_hostile(tmp_path):
    """The control: read without the safe unpickler, the file runs its command."""
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "evil.pt", marker)
    torch.load(path, weights_only=False)
    assert marker.exists()


def test_mx_proxy_resume_refuses_a_crafted_checkpoint(tmp_path):
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "step_4.pt", marker)
    cfg = mx_proxy.ProxyConfig(width=32, depth=4, batch=16, steps=6, val_batches=1, val_batch_size=32, val_every=3,
                               log_every=1, resume_from=str(path))
    with pytest.raises(mx_proxy.CheckpointError, match=r"step_4\.pt: refused, not a plain checkpoint"):
        mx_proxy.run(cfg)
    assert not marker.exists()


def test_mx_proxy_command_line_refuses_it_in_one_line(tmp_path):
    marker = tmp_path / "ran"
    path = _crafted(tmp_path / "step_4.pt", marker)
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "stress" / "mx_proxy.py"), "--width", "32",
                           "--depth", "4", "--steps", "6", "--resume_from", str(path)],
                          capture_output=True, text=True, cwd=tmp_path, env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 1, proc.stderr
    assert proc.stderr.strip().startswith("mx_proxy: resume_from") and "refused" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and "Traceback" not in proc.stderr
    assert not marker.exists()


def test_pretrain_token_cache_refuses_a_crafted_file(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.WordLevel(vocab={"<unk>": 0, "<eos>": 1, "a": 2}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    doc = tmp_path / "doc.txt"
    doc.write_text("a a a")
    cache = tmp_path / "cache"
    cache.mkdir()
    # the real cache round-trips: a first call writes it, a second reads it back
    first = pretrain.tokenize_files(tokenizer, [doc], cache, "train")
    cached = list(cache.glob("ids-train-*.pt"))
    assert len(cached) == 1 and first.tolist() == [2, 2, 2, 1]
    assert pretrain.tokenize_files(tokenizer, [doc], cache, "train").tolist() == [2, 2, 2, 1]
    # the same cache file replaced by a crafted one is refused
    marker = tmp_path / "ran"
    _crafted(cached[0], marker)
    with pytest.raises(pickle.UnpicklingError):
        pretrain.tokenize_files(tokenizer, [doc], cache, "train")
    assert not marker.exists()


def test_eval_adapter_bin_refuses_a_crafted_file(tmp_path):
    from gnmr_hf.evaluation.evaluate import _adapter_weights

    marker = tmp_path / "ran"
    _crafted(tmp_path / "adapter_model.bin", marker)
    with pytest.raises(pickle.UnpicklingError):
        _adapter_weights(tmp_path)
    assert not marker.exists()


def test_no_torch_load_in_the_project_reads_a_full_pickle():
    """Every ``torch.load`` in the package, the recipes and the bench scripts passes ``weights_only=True``."""
    import re

    offenders = []
    for folder in ("gnmr_hf", "recipes", "bench"):
        for path in (ROOT / folder).rglob("*.py"):
            text = path.read_text(encoding="utf-8")
            for m in re.finditer(r"\btorch\.load\(", text):
                depth, i = 1, m.end()
                while depth and i < len(text):
                    depth += {"(": 1, ")": -1}.get(text[i], 0)
                    i += 1
                if "weights_only=True" not in text[m.end():i]:
                    offenders.append(f"{path.relative_to(ROOT)}:{text[:m.start()].count(chr(10)) + 1}")
    assert offenders == []
