"""The recovery-source check of prepare_dual_path (docs/design.md, section 4): a checkpoint of the same
shapes but other weights is refused before anything is converted, the checkpoint the model was loaded
from is accepted, check_source=False skips the check.

The witness is the layer's de-quantised low-cost weight: ||W_low - W_rec|| / ||W_rec||. The figures
measured on the tiny random LLaMA of tests/conftest.py (seed 0, every one of its 28 projections) are
pinned below, so a change in the de-quantisation shows up here; the SmolLM2-135M figures are in
docs/design.md.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch

import gnmr_hf
from tests.conftest import make_tiny_llama
from tests.test_dual_path import DUAL_TYPES, NUM_LAYERS, load, logits

peft = pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

from gnmr_hf.backends import bnb_4bit, bnb_int8  # noqa: E402
from gnmr_hf.backends.base import DualPathModule  # noqa: E402
from gnmr_hf.backends.checkpoint import CheckpointIndex  # noqa: E402

# (min, max) over the 28 projections of the tiny LLaMA (seed 0), measured: INT8 0.0058-0.0068,
# NF4 0.0904-0.0951, FP4 0.1177-0.1239; another seed of the same config: 1.38-1.44 on every low path
RIGHT = {"int8": (0.0055, 0.0070), "nf4": (0.088, 0.097), "fp4": (0.115, 0.126)}
THRESHOLD = {"int8": 0.1, "nf4": 0.4, "fp4": 0.4}
FIRST = "model.layers.0.self_attn.q_proj"


@pytest.fixture(scope="module")
def ids():
    return torch.randint(0, 128, (2, 12), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def other_dir(tmp_path_factory):
    """The tiny LLaMA of the same config as tiny_llama_dir with another seed: same names and shapes."""
    return make_tiny_llama(tmp_path_factory.mktemp("tiny_llama_seed1"), num_layers=NUM_LAYERS, seed=1)


def dual_modules(model):
    return [m for m in model.modules() if isinstance(m, DualPathModule)]


def errors(model, source):
    """{module name: relative error of its low-cost weight against ``source``} for every dual-path layer."""
    from gnmr_hf.backends.recovery import relative_error

    index = CheckpointIndex(source)
    out = {}
    for name, m in model.named_modules():
        if isinstance(m, DualPathModule):
            low_path, low = type(m).low_weight(m)
            out[name] = (low_path, relative_error(low, index.read(m.recovery_key, torch.float32)))
    return out


@pytest.mark.parametrize("low", ["int8", "nf4", "fp4"])
def test_the_checkpoint_the_model_was_loaded_from_is_accepted(tiny_llama_dir, other_dir, low):
    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low, torch.bfloat16), tiny_llama_dir)
    assert len(dual_modules(model)) == NUM_LAYERS * 7
    right = errors(model, tiny_llama_dir)
    assert {p for p, _ in right.values()} == {low}
    lo, hi = RIGHT[low]
    assert lo <= min(e for _, e in right.values()) and max(e for _, e in right.values()) <= hi, right
    wrong = errors(model, other_dir)
    assert min(e for _, e in wrong.values()) > 1.3, wrong
    # the threshold sits well between the two: at least 3x above the right figures, 3x below the wrong ones
    assert 3 * hi <= THRESHOLD[low] <= min(e for _, e in wrong.values()) / 3


@pytest.mark.parametrize(("low", "storage"), [("int8", "host"), ("int8", "disk"), ("nf4", "device"), ("nf4", "disk")])
def test_another_checkpoint_of_the_same_shapes_is_refused_before_any_change(tiny_llama_dir, other_dir, ids, low, storage):
    model = load(tiny_llama_dir, low, torch.bfloat16)
    before = logits(model, ids)
    tolerance = THRESHOLD[low]
    with pytest.raises(ValueError) as err:
        gnmr_hf.prepare_dual_path(model, other_dir, storage=storage)
    msg = str(err.value)
    assert "\n" not in msg
    m = re.search(
        rf"'{re.escape(FIRST)}\.weight' of {re.escape(FIRST)} differs from the layer's {low.upper()} low-cost "
        rf"weight by a relative error \|\|W_low - W_rec\|\| / \|\|W_rec\|\| = ([\d.]+), above the {low.upper()} "
        rf"threshold {tolerance:g} ",
        msg,
    )
    assert m, msg
    assert 1.3 < float(m.group(1)) < 1.5
    assert str(other_dir) in msg and "check_source=False" in msg
    assert dual_modules(model) == []  # nothing converted
    assert torch.equal(logits(model, ids), before)
    # check_source=False: accepted, and the "recovery" path then runs the other checkpoint's weights
    gnmr_hf.prepare_dual_path(model, other_dir, storage=storage, check_source=False)
    assert len(dual_modules(model)) == NUM_LAYERS * 7
    assert all(isinstance(d, DUAL_TYPES[low]) for d in dual_modules(model))
    assert model.model.layers[0].self_attn.q_proj._gnmr_source.index.source == str(other_dir)


@pytest.mark.parametrize("low", ["int8", "nf4"])
def test_a_second_preparation_is_checked_too(tiny_llama_dir, other_dir, ids, low):
    """Preparing an already dual-path model again (here after a training forward, which moves bitsandbytes'
    INT8 row scales from the weight into the layer's state) checks the new source the same way, and a
    refused call leaves the first preparation in place, promoted layers included."""
    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, low, torch.bfloat16), tiny_llama_dir)
    model.train()
    model(ids).logits.sum().backward()
    model.eval()
    if low == "int8":
        q = model.model.layers[0].self_attn.q_proj
        assert q.weight.SCB is None and q.state.SCB is not None
    gnmr_hf.set_active_units(model, [1])
    on_first = logits(model, ids)
    with pytest.raises(ValueError, match=rf"of {re.escape(FIRST)} differs .* = 1\.4\d*, above the {low.upper()} threshold"):
        gnmr_hf.prepare_dual_path(model, other_dir)
    assert gnmr_hf.active_units(model) == [1]
    assert {d._gnmr_source.index.source for d in dual_modules(model)} == {str(tiny_llama_dir)}
    assert torch.equal(logits(model, ids), on_first)
    gnmr_hf.set_active_units(model, [])
    gnmr_hf.prepare_dual_path(model, tiny_llama_dir, storage="disk")  # the right one again: accepted
    assert {d._gnmr_source.storage for d in dual_modules(model)} == {"disk"}


def test_a_peft_wrapped_model_is_checked_under_its_plain_names(tiny_llama_dir, other_dir):
    model = peft.get_peft_model(load(tiny_llama_dir, "nf4"), peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"]))
    with pytest.raises(ValueError, match=rf"'{re.escape(FIRST)}\.weight' of {re.escape(FIRST)} differs"):
        gnmr_hf.prepare_dual_path(model, other_dir)
    assert dual_modules(model) == []


def test_the_thresholds_are_those_documented():
    assert bnb_int8.INT8_SOURCE_TOLERANCE == THRESHOLD["int8"]
    assert bnb_4bit.NF4_SOURCE_TOLERANCE == THRESHOLD["nf4"]
    assert bnb_4bit.FP4_SOURCE_TOLERANCE == THRESHOLD["fp4"]
    assert bnb_int8.DualPathLinear8bitLt.source_tolerances == {"int8": THRESHOLD["int8"]}
    assert bnb_4bit.DualPathLinear4bit.source_tolerances == {"nf4": THRESHOLD["nf4"], "fp4": THRESHOLD["fp4"]}
    design = (Path(__file__).resolve().parents[1] / "docs" / "design.md").read_text()
    rows = dict(re.findall(r"^ *\| (INT8|NF4|FP4) \| ([\d.]+) \(`", design, flags=re.M))
    assert {k.lower(): float(v) for k, v in rows.items()} == THRESHOLD


def _perturbed(src, dst, p, seed=0):
    """``src``'s checkpoint with each weight moved by ``p * ||W||`` in a random Gaussian direction."""
    import shutil

    from safetensors.torch import load_file, save_file

    shutil.copytree(src, dst)
    g = torch.Generator().manual_seed(seed)
    for f in Path(dst).glob("*.safetensors"):
        tensors = load_file(str(f))
        for k, w in tensors.items():
            if k.endswith("proj.weight"):
                d = torch.randn(w.shape, generator=g)
                tensors[k] = (w.float() + d / d.norm() * p * w.float().norm()).to(w.dtype)
        save_file(tensors, str(f), metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("p, caught", [(0.37, False), (0.5, True)])
def test_the_source_checks_margin(tiny_llama_dir, tmp_path, p, caught):
    # docs/design.md: a difference D adds to NF4's own error (0.09) in quadrature, so the 0.4 threshold
    # catches ||D|| / ||W|| from about 0.42 on; 0.37 (4x NF4's error) passes, as the docs now say
    source = _perturbed(tiny_llama_dir, tmp_path / f"p{p}", p)
    worst = max(e for _, e in errors(gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"),
                                                               recovery_source=tiny_llama_dir), source).values())
    assert (worst > THRESHOLD["nf4"]) == caught, worst
    model = load(tiny_llama_dir, "nf4")
    if caught:
        with pytest.raises(ValueError, match="does not match the model"):
            gnmr_hf.prepare_dual_path(model, recovery_source=source)
    else:
        gnmr_hf.prepare_dual_path(model, recovery_source=source)
