"""Training memory in the user's currency: the weights and the training peak of LoRA on an all-NF4
model, on NF4 with a kept set on BF16 (a plan), and on BF16, each loaded the stock way
(``BitsAndBytesConfig(llm_int8_skip_modules=...)``) and prepared by ``gnmr_hf.prepare_for_training``
(or, with ``--peft-prepare``, by ``peft.prepare_model_for_kbit_training``, which upcasts to FP32).

    python bench/cost/train_memory.py --model smollm2-135m-instruct --keep v_proj
    python bench/cost/train_memory.py --model gemma3-270m --profile runs/profile/profile.json
    python bench/cost/train_memory.py --model gemma3-270m --keep v_proj --out bench/results/train_memory/gemma.json

Each configuration runs in its own process, so its peak is its own: on CUDA
``torch.cuda.max_memory_allocated`` (what the GPU check records), on CPU the process's peak RSS with
the RSS after the imports (interpreter, torch, transformers) given beside it. The weights' bytes are
``gnmr_hf.memory.model_bytes`` (parameters, buffers and bitsandbytes' quant states). The data are
random token ids (memory does not depend on their values); LoRA r 8 on every decoder projection,
AdamW, ``--steps`` steps of ``--batch`` x ``--seq`` tokens, gradient checkpointing on.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj", "gate_up_proj"]


def _rss() -> int:
    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def kept_names(model_path: str, keep: str | None, profile: str | None) -> list[str]:
    """The linears to keep on BF16: a profile's ``skip_modules`` (without ``lm_head``), else every decoder
    linear whose name ends with ``keep``."""
    if profile:
        data = json.loads(Path(profile).read_text())
        names = data.get("skip_modules") or data.get("plan", {}).get("modules")
        if not isinstance(names, list):
            raise SystemExit(f"{profile} has no skip_modules list")
        return [n for n in names if n != "lm_head"]
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    return [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n
            and n.endswith(keep or "v_proj")]


def one(args: argparse.Namespace) -> dict:
    import torch

    torch.set_num_threads(args.threads)
    import peft
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.memory import model_bytes
    from gnmr_hf.training import prepare_for_training

    cuda = torch.cuda.is_available()
    rss_imports = _rss()
    kept = json.loads(args.kept) if args.kept else []
    kwargs = {"dtype": torch.bfloat16}
    if args.config != "bf16":
        kwargs["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
            llm_int8_skip_modules=(kept if args.config == "plan" else []) + ["lm_head"])
    if cuda:
        kwargs["device_map"] = {"": 0}
    model = AutoModelForCausalLM.from_pretrained(args.model, **kwargs)
    weights = model_bytes(model)["total"]
    if args.peft_prepare:
        peft.prepare_model_for_kbit_training(model)
    else:
        prepare_for_training(model)
    prepared = model_bytes(model)["total"]
    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if ".layers." in n}
    lora = peft.LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0, task_type="CAUSAL_LM",
                           target_modules=[t for t in TARGETS if t in names])
    model = peft.get_peft_model(model, lora)
    model.train()
    opt = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    g = torch.Generator().manual_seed(0)
    vocab = model.config.get_text_config().vocab_size
    device = "cuda" if cuda else "cpu"
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(args.steps):
        ids = torch.randint(0, vocab, (args.batch, args.seq), generator=g).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    step_s = (time.perf_counter() - t0) / args.steps
    out = {"config": args.config, "kept": len(kept) if args.config == "plan" else 0, "weights_bytes": weights,
           "prepared_weights_bytes": prepared, "step_s": round(step_s, 2), "last_loss": float(loss),
           "prepare": "peft.prepare_model_for_kbit_training" if args.peft_prepare else "gnmr_hf.prepare_for_training"}
    if cuda:
        out.update(peak_bytes=int(torch.cuda.max_memory_allocated()), peak_kind="torch.cuda.max_memory_allocated")
    else:
        out.update(peak_bytes=_rss(), peak_kind="peak RSS (CPU)", rss_after_imports=rss_imports)
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                epilog=__doc__.split("\n\n", 1)[1], formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model folder or an offline alias")
    p.add_argument("--keep", default=None, help="the plan: every decoder linear ending with this (default v_proj)")
    p.add_argument("--profile", default=None, help="the plan: a profile.json's skip_modules")
    p.add_argument("--configs", default="nf4,plan,bf16")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--batch", type=int, default=4)
    p.add_argument("--seq", type=int, default=256)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--peft-prepare", action="store_true", help="prepare with PEFT's prepare_model_for_kbit_training")
    p.add_argument("--out", default=None, help="write the rows as JSON here (atomically)")
    p.add_argument("--config", default=None, help=argparse.SUPPRESS)  # one configuration (the child process)
    p.add_argument("--kept", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.config:
        print(json.dumps(one(args)))
        return 0

    from gnmr_hf.offline.gguf_models import resolve_model

    model = resolve_model(args.model)
    kept = kept_names(model, args.keep, args.profile)
    rows = []
    for config in args.configs.split(","):
        if config not in ("nf4", "plan", "bf16"):
            raise SystemExit(f"unknown configuration {config!r} (nf4, plan, bf16)")
        cmd = [sys.executable, __file__, "--model", model, "--config", config, "--kept", json.dumps(kept),
               "--steps", str(args.steps), "--batch", str(args.batch), "--seq", str(args.seq),
               "--threads", str(args.threads)] + (["--peft-prepare"] if args.peft_prepare else [])
        done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": str(args.threads)})
        if done.returncode != 0:
            raise SystemExit(f"{config} failed:\n{done.stderr[-3000:]}")
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"  {config}: done", file=sys.stderr, flush=True)
    nf4 = next((r["weights_bytes"] for r in rows if r["config"] == "nf4"), None)
    mib = 2**20
    print(f"{args.model}: plan keeps {len(kept)} linears on BF16; {args.steps} steps of {args.batch} x {args.seq} "
          f"tokens; {rows[0]['prepare']}; peak = {rows[0]['peak_kind']}")
    print(f"{'config':8s} {'weights MiB':>12s} {'over NF4':>9s} {'prepared MiB':>13s} {'peak MiB':>10s} {'step s':>7s}")
    for r in rows:
        over = f"{100 * (r['weights_bytes'] / nf4 - 1):8.1f}%" if nf4 else "        -"
        print(f"{r['config']:8s} {r['weights_bytes'] / mib:12.1f} {over} {r['prepared_weights_bytes'] / mib:13.1f} "
              f"{r['peak_bytes'] / mib:10.1f} {r['step_s']:7.2f}")
    if "rss_after_imports" in rows[0]:
        print(f"(CPU: RSS after the imports {rows[0]['rss_after_imports'] / mib:.0f} MiB, included in every peak)")
    if args.out:
        out = Path(args.out)
        out.parent.mkdir(parents=True, exist_ok=True)
        tmp = out.with_suffix(".tmp")
        tmp.write_text(json.dumps({"model": args.model, "kept": kept, "steps": args.steps, "batch": args.batch,
                                   "seq": args.seq, "rows": rows}, indent=1) + "\n")
        os.replace(tmp, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
