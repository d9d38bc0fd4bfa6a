"""Noise that drowns the useful lines (issue round 5, item 11): each message is said once, or not at all where it is
not ours to fix. The real entry points run in subprocesses on tiny models (a few steps) and their lines are counted:

- bitsandbytes' ``MatMul8bitLt: inputs will be cast ...`` (logged on every INT8 matmul outside training): at most once
  in a ``gnmr-hf profile`` run whose ladder table scores INT8 rungs;
- bitsandbytes' ``Failed to load CPU gemm_4bit_forward from kernels-community`` (an optional Hub kernel, logged at
  import): never;
- torchao's ``Failed to load ... .so`` and torch's ``_pytree`` deprecation notes: never on ``recipes/finetune.py --help``
  (a CPU machine; with CUDA torchao's messages are real and stay);
- ``fatal: not a git repository`` (lm_eval runs ``git describe`` for every task it scores): never, from an eval run
  outside a git folder;
- the per-step ``gnmr/*`` controller keys: not in a planned (static) run's logged metrics, where the controller never
  changes the plan; a GNMR run still logs them at every step, and both log ``gnmr/summary/*`` at the end.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from tests.conftest import make_tiny_llama
from tests.test_recipes_e2e import ROOT, _env

pytestmark = pytest.mark.slow  # subprocesses that import torch, transformers and bitsandbytes

MATMUL = "MatMul8bitLt: inputs will be cast"
KERNELS = "kernels-community"
GIT = "not a git repository"
# torchao's missing CUDA kernels ("Failed to load .../torchao/_C_mxfp8...so") and torch's pytree notes
IMPORT_NOISE = ("torchao", "_pytree", "Enum subclass", "Failed to load")


def _lines(text: str, needle: str) -> list[str]:
    return [line for line in text.splitlines() if needle in line]


def test_finetune_help_prints_no_import_noise():
    proc = subprocess.run([sys.executable, str(ROOT / "recipes" / "finetune.py"), "--help"], capture_output=True,
                          text=True, env=_env(), timeout=600)
    assert proc.returncode == 0 and "--precision" in proc.stdout, proc.stderr[-3000:]
    noise = IMPORT_NOISE if not torch.cuda.is_available() else ("_pytree", "Enum subclass", KERNELS)
    assert [line for line in proc.stderr.splitlines() if any(n in line for n in noise)] == []
    assert _lines(proc.stdout + proc.stderr, KERNELS) == []


# The per-step gnmr/* keys of a static plan (none) and of a moving controller (every step), and the bitsandbytes lines
# of training runs, are checked on the recipe runs the suite makes anyway: the profile block's planned-loftq-nf4 and
# hybrid-nf4 runs (tests/test_recipe_profile.py::test_profile_block_three_steps) and the SmolLM2 recipes
# (tests/test_recipes_e2e.py::test_smollm2_recipe_three_steps), rather than by two more training runs here.


def test_profile_says_the_int8_cast_once(tmp_path):
    """The ladder table scores INT8 rungs in eval mode, where bitsandbytes casts the inputs on every matmul."""
    from tests.test_profile_faults_r3 import tiny_tokenizer

    model = make_tiny_llama(tmp_path / "tiny", num_layers=2)
    tiny_tokenizer().save_pretrained(model)
    cmd = [sys.executable, "-m", "gnmr_hf.cli", "profile", "--model", str(model), "--low", "nf4", "--budget", "10%",
           "--output", str(tmp_path / "prof"), "--batches", "1", "--batch-size", "2", "--quiet"]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=_env(), timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "ladder price table" in proc.stdout  # the INT8 rungs ran
    assert len(_lines(proc.stdout + proc.stderr, MATMUL)) <= 1
    assert _lines(proc.stdout + proc.stderr, KERNELS) == []


def test_eval_outside_a_git_folder_prints_no_git_error(tmp_path, tiny_tok):
    from tests.test_eval import write_fixture_data

    data = write_fixture_data(tmp_path / "data")
    work = tmp_path / "work"
    work.mkdir()
    env = dict(_env(), GIT_CEILING_DIRECTORIES=str(tmp_path))  # no repository above the folder either
    assert subprocess.run(["git", "rev-parse"], cwd=work, capture_output=True, env=env).returncode != 0
    cmd = [sys.executable, "-m", "gnmr_hf.cli", "eval", "--model", str(tiny_tok), "--tasks", "wikitext,hellaswag",
           "--data-dir", str(data), "--limit", "1", "--compute-dtype", "float32", "--device", "cpu",
           "--output", str(work / "out.json")]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=work, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((work / "out.json").read_text())["results"]
    assert _lines(proc.stdout + proc.stderr, GIT) == []
    assert _lines(proc.stdout + proc.stderr, KERNELS) == []


def test_the_quiet_git_hash_is_lm_evals_inside_a_repository():
    """Inside a git folder the hash lm_eval records is the one its own call finds."""
    pytest.importorskip("lm_eval")
    import lm_eval.evaluator
    from lm_eval.loggers.utils import get_git_commit_hash as original

    from gnmr_hf._import_utils import quiet_lm_eval_git

    cwd = os.getcwd()
    try:
        os.chdir(ROOT)
        expected = original()
        quiet_lm_eval_git()
        assert lm_eval.evaluator.get_git_commit_hash() == expected
    finally:
        os.chdir(cwd)
