"""Step time and peak device memory of the three recipes on a LLaMA-2-13B-shaped model (GPU check).

Runs ``recipes/finetune.py``'s own machinery (config, model loading, dual path, LoRA, dataset, Trainer,
GNMRCallback) for ``precision`` = bf16, int8 and gnmr on a model with LLaMA-2 13B's layer shape
(hidden 5120, MLP 13824, 40 heads, vocab 32000) but only ``--layers`` (default 8) of its 40 decoder
layers and random weights, so nothing is downloaded: the model is built from a ``LlamaConfig``, saved
as a BF16 safetensors checkpoint in a temporary folder and loaded from there (in INT8 for int8/gnmr),
with a small byte-level BPE tokenizer trained on the project's generated problems. ``gnmr`` keeps the
paper's budget ratio: max_active = round(10/40 * layers).

    python bench/gpu/gpu_13b_shape.py                 # on one GPU (bench/gpu/gpu_check.sh runs it with --layers 4 --steps 6)
    python bench/gpu/gpu_13b_shape.py --dry-run       # tiny shape on the CPU: checks the machinery only

Prints one line per precision (median step time after the warm-up steps, peak
``torch.cuda.max_memory_allocated`` during training, final loss) and, with ``--json``, writes them.
Figures only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import gc
import importlib.util
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
PRECISIONS = ("bf16", "int8", "gnmr")
# also accepted by --precisions: the 4-bit variants of the recipe (QLoRA's NF4 base, and GNMR over it)
ALL_PRECISIONS = PRECISIONS + ("nf4", "gnmr-nf4")
# LLaMA-2 13B (meta-llama/Llama-2-13b-hf config.json)
SHAPE_13B = dict(hidden_size=5120, intermediate_size=13824, num_attention_heads=40, num_key_value_heads=40,
                 vocab_size=32000, max_position_embeddings=4096, rms_norm_eps=1e-5)
SHAPE_TINY = dict(hidden_size=64, intermediate_size=128, num_attention_heads=4, num_key_value_heads=4,
                  vocab_size=512, max_position_embeddings=512, rms_norm_eps=1e-5)


def load_recipe():
    spec = importlib.util.spec_from_file_location("finetune_recipe", ROOT / "recipes" / "finetune.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def build_checkpoint(folder: Path, layers: int, shape: dict, device: str) -> Path:
    """Save a random LLaMA of ``shape`` with ``layers`` decoder layers (BF16) plus a BPE tokenizer."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from gnmr_hf.offline.gsm8k import arithmetic_problems

    config = LlamaConfig(num_hidden_layers=layers, bos_token_id=1, eos_token_id=2, pad_token_id=2,
                         tie_word_embeddings=False, **shape)
    torch.manual_seed(0)
    with torch.device(device):  # initialising 3B parameters on the GPU takes seconds, on a CPU minutes
        model = LlamaForCausalLM(config).to(torch.bfloat16)
    model.save_pretrained(folder)
    del model
    gc.collect()

    # a tokenizer without a download: byte-level BPE trained on the generated problems
    text = [r["question"] + "\n" + r["answer"] for r in arithmetic_problems(2000, seed=123)]
    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    vocab = min(shape["vocab_size"], 1000)
    tok.train_from_iterator(text, trainers.BpeTrainer(vocab_size=vocab, special_tokens=["<unk>", "<s>", "</s>"],
                                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", bos_token="<s>", eos_token="</s>",
                                   pad_token="</s>")
    fast.save_pretrained(folder)
    return folder


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8, help="decoder layers of the 40 (default 8)")
    p.add_argument("--steps", type=int, default=8, help="optimizer steps per precision (default 8)")
    p.add_argument("--warmup", type=int, default=3, help="steps left out of the median (default 3)")
    p.add_argument("--batch-size", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=512, help="max_seq_len of the recipe (default 512)")
    p.add_argument("--precisions", default=",".join(PRECISIONS), help=f"comma-separated, of {ALL_PRECISIONS}")
    p.add_argument("--storage", default="host", choices=("host", "device", "disk"), help="gnmr.storage of the recipe (default host)")
    p.add_argument("--dry-run", action="store_true",
                   help="tiny shape (2 layers, hidden 64) on the CPU, 2 steps: checks the machinery, no GPU")
    p.add_argument("--workdir", default=None, help="where the checkpoint and runs go (default: a temp folder)")
    p.add_argument("--json", default=None, help="also write the figures to this JSON file")
    args = p.parse_args(argv)
    precisions = [x.strip() for x in args.precisions.split(",") if x.strip()]
    bad = [x for x in precisions if x not in ALL_PRECISIONS]
    if bad:
        p.error(f"unknown precision(s) {bad}; choose from {ALL_PRECISIONS}")

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    import torch

    on_gpu = torch.cuda.is_available()
    if args.dry_run:
        shape, layers, steps, warmup, seq_len = SHAPE_TINY, 2, 2, 0, 64
    else:
        if not on_gpu:
            print("no CUDA device: this check needs a GPU (use --dry-run to check the machinery on the CPU)",
                  file=sys.stderr)
            return 2
        shape, layers, steps, warmup, seq_len = SHAPE_13B, args.layers, args.steps, args.warmup, args.seq_len
    from transformers import TrainerCallback  # after the GPU check: a refusal pays torch's import only
    max_active = max(1, round(10 / 40 * layers))
    ft = load_recipe()

    class StepTimer(TrainerCallback):
        """Wall time of each optimizer step (synchronised on the GPU)."""

        def __init__(self) -> None:
            self.times: list[float] = []

        def on_step_begin(self, args, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            self._t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            if on_gpu:
                torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self._t)

    tmp = tempfile.TemporaryDirectory(prefix="gnmr_13b_shape_") if args.workdir is None else None
    work = Path(args.workdir or tmp.name)
    t0 = time.time()
    ckpt = build_checkpoint(work / "model", layers, shape, "cuda" if on_gpu else "cpu")
    size = sum(f.stat().st_size for f in ckpt.glob("*.safetensors"))
    print(f"checkpoint: {layers} layers of LLaMA-2 13B shape, {size / 2**30:.2f} GiB BF16, built in "
          f"{time.time() - t0:.0f} s ({ckpt})", flush=True)

    results = []
    for precision in precisions:
        overrides = [
            "--config", str(ROOT / "recipes" / "llama2-13b" / f"{precision}.yaml"),
            "--model", str(ckpt), "--output_dir", str(work / precision),
            # offline data instead of the hub's GSM8K, same record schema and templates
            "--dataset", "generated-arithmetic", "--data_dir", str(work / "data"),
            "--num_generated", str(max(64, steps * args.batch_size * 2)),
            "--max_steps", str(steps), "--per_device_train_batch_size", str(args.batch_size),
            "--gradient_accumulation_steps", "1", "--max_seq_len", str(seq_len),
            "--logging_steps", "1", "--save_strategy", "no",
        ]
        if precision.startswith("gnmr"):  # the recipe refuses gnmr keys its precision would ignore
            overrides += ["--gnmr.max_active", str(max_active), "--gnmr.storage", args.storage]
        if args.dry_run:  # CPU: no BF16 autocast, no checkpointing (nothing to save on a tiny model)
            overrides += ["--bf16", "false", "--activation_checkpointing", "false"]
        cfg = ft.load_config(overrides)
        timer = StepTimer()
        t1 = time.time()
        record = ft.run(cfg, extra_callbacks=[timer])
        timed = timer.times[warmup:] or timer.times
        row = {
            "precision": precision,
            "steps": len(timer.times),
            "median_step_s": statistics.median(timed),
            "peak_memory_gib": record["peak_memory_bytes"] / 2**30,
            "peak_memory_kind": record["peak_memory_kind"],
            "final_loss": record["final_loss"],
            "total_s": time.time() - t1,
            "promotion_ratio": ((record.get("gnmr_summary") or {}).get("summary") or {}).get("promotion_ratio"),
        }
        results.append(row)
        print(f"{precision:>5}: median step {row['median_step_s']:.3f} s (after {warmup} warm-up steps), peak "
              f"{row['peak_memory_gib']:.2f} GiB ({row['peak_memory_kind']}), final loss {row['final_loss']:.4f}, "
              f"run {row['total_s']:.0f} s"
              + ("" if row["promotion_ratio"] is None else f", promotion ratio {row['promotion_ratio']:.3f}"),
              flush=True)
        del record
        gc.collect()
        if on_gpu:
            torch.cuda.empty_cache()
    header = {"layers": layers, "shape": shape, "batch_size": args.batch_size, "seq_len": seq_len,
              "max_active": max_active, "storage": args.storage, "dry_run": args.dry_run,
              "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    print(json.dumps({**header, "results": results}))
    if args.json:
        Path(args.json).write_text(json.dumps({**header, "results": results}, indent=2) + "\n")
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
