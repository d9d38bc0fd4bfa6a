"""GNMR under FSDP2 (issue 21): per-unit norms from sharded gradients, the clip, the low paths that shard, sharded
checkpoints across a SIGKILL, and the bitsandbytes dual paths refused.

The multi-process tests run ``tests/fsdp2_worker.py`` in two CPU processes (gloo) under ``torchrun
--nproc_per_node 2``; accelerate applies FSDP on GPUs only, so the worker lets its FSDP plugin take effect
on the CPU (``recipes/stress/pretrain.accelerate_fsdp_on_cpu``) and every run goes through the Trainer's own
FSDP2 path (``fully_shard`` per decoder layer and on the root, sharded gradients and checkpoints).
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]


def torchrun(*args: str, timeout: int = 420) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
           str(REPO / "tests" / "fsdp2_worker.py"), *args]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO), HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def ranks(folder: Path) -> list[dict]:
    return [json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1)]


def trace(folder: Path) -> list[dict]:
    with open(folder / "gnmr_trace.jsonl", encoding="utf-8") as f:
        return [json.loads(line) for line in f]


# ------------------------------------------------------------------------------------------ in one process


@pytest.fixture
def one_rank_group():
    created = not torch.distributed.is_initialized()
    if created:
        torch.distributed.init_process_group("gloo", store=torch.distributed.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        if created:
            torch.distributed.destroy_process_group()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_clip_on_dtensor_shards_matches_torch(one_rank_group, dtype):
    """UnitGradNorms.clip_ on FSDP2 DTensor gradients: the clipped shards and the total are torch's bits, the
    per-unit norms those of the gradients (a one-rank mesh here; two ranks in the slow test)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor

    from gnmr_hf.trainer.grad_norms import UnitGradNorms

    mesh = init_device_mesh("cpu", (1,))

    def model():
        torch.manual_seed(0)
        m = torch.nn.Sequential(*[torch.nn.Sequential(torch.nn.Linear(13, 7), torch.nn.Linear(7, 13)) for _ in range(3)])
        m = m.to(dtype)
        for layer in m:
            fully_shard(layer, mesh=mesh)
        fully_shard(m, mesh=mesh)
        m(torch.randn(5, 13, generator=torch.Generator().manual_seed(1)).to(dtype)).square().sum().backward()
        return m

    ours, ref = model(), model()
    assert all(isinstance(p.grad, DTensor) for p in ours.parameters())
    expect = [math.sqrt(sum(float(p.grad.to_local().float().square().sum()) for p in layer.parameters())) for layer in ours]
    norms = UnitGradNorms([(str(i), layer) for i, layer in enumerate(ours)])
    total, sq = norms.clip_(ours.parameters(), 0.5)
    torch_total = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.5)
    assert isinstance(total, DTensor) and total.placements == torch_total.placements
    assert torch.equal(total.to_local(), torch_total.to_local())
    for a, b in zip(ours.parameters(), ref.parameters()):
        assert torch.equal(a.grad.to_local(), b.grad.to_local())
    assert sq.sqrt().tolist() == pytest.approx(expect, rel=1e-6)
    assert float(total.to_local()) > 0.5  # the clip did scale


@pytest.mark.parametrize("quant", ["int8", "nf4"])
def test_bnb_dual_path_under_fsdp_refused(tiny_llama_dir, tmp_path, quant):
    """FSDP + a bitsandbytes dual path: refused with the upstream issue and the DDP launch in the message."""
    pytest.importorskip("bitsandbytes")
    peft = pytest.importorskip("peft")
    from transformers import TrainerControl, TrainerState

    import gnmr_hf
    from gnmr_hf.trainer.callback import GNMRCallback
    from tests.test_callback import targs
    from tests.test_dual_path import load

    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, quant), recovery_source=tiny_llama_dir, storage="host")
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj"]))
    args = targs(tmp_path, max_steps=1)
    args.fsdp = True  # as TrainingArguments(fsdp=...) or an accelerate FSDP config would have it
    cb = GNMRCallback({"max_active": 1})
    with pytest.raises(ValueError, match=r"bitsandbytes dual-path layers .*#3983.*#3987.*--multi_gpu"):
        cb.on_train_begin(args, TrainerState(), TrainerControl(), model=model)
    assert cb.controller is None


# -------------------------------------------------------------------------------------- two processes


@pytest.mark.slow
def test_fsdp2_norms_decisions_and_clip_match(tmp_path):
    """Two FSDP2 ranks: per-unit norms equal to a one-process run's on the same global batches (relative 1e-6),
    the same decisions on both ranks and as the one-process run; a monitor-only run clips as the Trainer does
    without the callback (bit-identical grad norms and trained weights); a bnb dual path is refused at
    Trainer(...)."""
    from tests import fsdp2_worker

    proc = torchrun("--mode", "trainer", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    r0, r1 = ranks(tmp_path)
    for r in (r0, r1):
        assert r["world_size"] == 2 and r["fsdp2"] and r["sharded"]
    assert r0["trace_written"] and not r1["trace_written"]

    # decisions: identical on both ranks (and the RankAgreement check ran), moving over the run
    assert [s["active"] for s in r0["steps"]] == [s["active"] for s in r1["steps"]]
    assert r0["steps"] == r1["steps"]  # the controller states too
    sharded = fsdp2_worker.trace_norms(str(tmp_path / "gnmr" / "gnmr_trace.jsonl"))
    assert [t["active"] for t in sharded] == [s["active"] for s in r0["steps"]]
    assert len({tuple(t["active"]) for t in sharded}) >= 3

    # the one-process reference on the same global batches
    with _threads(1):
        single = fsdp2_worker.single_process(str(tmp_path))["trace"]
    assert [t["step"] for t in sharded] == [t["step"] for t in single] == list(range(1, fsdp2_worker.STEPS + 1))
    for a, b in zip(sharded, single):
        assert a["norms"] == pytest.approx(b["norms"], rel=1e-6, abs=0), a["step"]
        assert a["active"] == b["active"], a["step"]

    # the clip: a monitor-only run is the Trainer's own FSDP2 run, bit for bit
    assert r0["monitor_grad_norms"] == r0["plain_grad_norms"] and len(r0["plain_grad_norms"]) == fsdp2_worker.STEPS
    assert max(r0["plain_grad_norms"]) > 0.5  # max_grad_norm 0.5: the clip scaled
    monitor, plain = torch.load(tmp_path / "monitor_weights.pt"), torch.load(tmp_path / "plain_weights.pt")
    assert monitor.keys() == plain.keys() and all(torch.equal(monitor[k], plain[k]) for k in plain)

    for r in (r0, r1):
        assert "#3983" in r["bnb_error"] and "accelerate launch --multi_gpu" in r["bnb_error"]


@pytest.mark.slow
def test_stress_recipe_low_paths_under_fsdp2(tmp_path):
    """The stress recipe under FSDP2, two processes: act-quant 4-bit with GNMR, MX FP4 with GNMR, and the BF16
    monitor (max_active 0)."""
    jobs = ["act4=gnmr:act", "mxfp4=gnmr:mxfp4", "bf16=bf16:act"]
    args = ["--mode", "stress", "--out", str(tmp_path)]
    for job in jobs:
        args += ["--job", job]
    proc = torchrun(*args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    for name in ("act4", "mxfp4", "bf16"):
        out = tmp_path / name
        r0, r1 = ranks(out)
        assert r0["world_size"] == 2 and r0["fsdp2"] and r0["sharded"] and r1["sharded"]
        assert r0["steps"] == r1["steps"] and len(r0["steps"]) == 4
        assert math.isfinite(r0["final_eval_loss"]) and r0["final_eval_loss"] == r1["final_eval_loss"]
        result = json.loads((out / "result.json").read_text())
        assert result["fsdp2"] and result["world_size"] == 2
        steps = trace(out)
        assert [t["step"] for t in steps] == [1, 2, 3, 4]
        assert all(math.isfinite(n) and n > 0 for t in steps for n in t["norms"])
        active = [t["active"] for t in steps]
        if name == "bf16":
            assert result["monitor_only"] and active == [[]] * 4
        else:
            assert any(active), name  # GNMR promoted units under FSDP2
    assert json.loads((tmp_path / "act4" / "result.json").read_text())["num_units"] == 14  # 7 operators x 2 layers
    assert json.loads((tmp_path / "mxfp4" / "result.json").read_text())["low"] == "mxfp4_e2m1"


@pytest.mark.slow
def test_sigkill_under_fsdp2_then_resume_equals_uninterrupted(tmp_path):
    """An FSDP2 run killed with SIGKILL after step 5 resumes from its sharded checkpoint-4: every rank restores
    the GNMR state, and the trace (norms and decisions) equals the uninterrupted run's, bit for bit."""
    first = torchrun("--mode", "stress", "--out", str(tmp_path), "--job", "straight=gnmr:act:8",
                     "--job", "killed=gnmr:act:8", "--kill-at", "5")
    assert first.returncode != 0  # the second run was killed
    straight, killed = tmp_path / "straight", tmp_path / "killed"
    reference = trace(straight)
    assert [t["step"] for t in reference] == list(range(1, 9))
    assert len({tuple(t["active"]) for t in reference}) >= 3
    assert [t["step"] for t in trace(killed)] == [1, 2, 3, 4, 5]
    assert sorted(p.name for p in killed.glob("checkpoint-*")) == ["checkpoint-4"]
    assert (killed / "checkpoint-4" / "pytorch_model_fsdp_0").is_dir()  # the sharded model state dict

    resumed = torchrun("--mode", "stress", "--out", str(tmp_path), "--job", "killed=gnmr:act:8", "--resume")
    assert resumed.returncode == 0, resumed.stdout[-3000:] + resumed.stderr[-6000:]
    assert trace(killed) == reference  # every step once, the same norms and decisions
    ref_ranks = ranks(straight)
    for r, (ref, got) in enumerate(zip(ref_ranks, ranks(killed))):
        assert got["begin"] == {**ref["steps"][3], "step": 4}, r  # the GNMR state of step 4, on every rank
        assert got["steps"] == ref["steps"][4:], r
        assert got["final_eval_loss"] == ref["final_eval_loss"]


class _threads:
    def __init__(self, n: int) -> None:
        self.n = n

    def __enter__(self):
        self.old = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.old)
