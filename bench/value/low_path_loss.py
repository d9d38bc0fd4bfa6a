"""How far each low path is from BF16: SmolLM2-135M-Instruct's loss on a fixed text, per load precision.

The text is the first ``--chars`` characters (6,000 by default) of
``recipes/stress/corpus_sample/introduction.rst.txt``, scored in one forward (next-token cross-entropy,
mean over tokens). Rows: the BF16 model; the same checkpoint loaded in INT8 (LLM.int8()), NF4 and FP4
(bitsandbytes, BF16 compute); and the NF4 model prepared with :func:`gnmr_hf.prepare_dual_path` with
every decoder layer on its BF16 recovery path, which must give the BF16 loss (the embeddings and the
head are not quantised by a 4-bit load)::

    python bench/value/low_path_loss.py                  # CPU, 1 thread, the bundled SmolLM2 checkpoint
    python bench/value/low_path_loss.py --model /path/to/ckpt --chars 6000

Figures are printed, never asserted.
"""

from __future__ import annotations

import argparse
import logging
import time
from pathlib import Path

import torch

import gnmr_hf

TEXT = Path(__file__).resolve().parents[2] / "recipes" / "stress" / "corpus_sample" / "introduction.rst.txt"


def _load(path: str, precision: str, device: torch.device):
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kw = {"device_map": {"": device.index}} if device.type == "cuda" else {}
    if precision == "int8":
        kw["quantization_config"] = BitsAndBytesConfig(load_in_8bit=True)
    elif precision in ("nf4", "fp4"):
        kw["quantization_config"] = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type=precision, bnb_4bit_compute_dtype=torch.bfloat16
        )
    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, **kw).eval()


@torch.no_grad()
def _loss(model, ids: torch.Tensor) -> float:
    return model(ids, labels=ids).loss.float().item()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default=None, help="checkpoint folder or offline alias (default: smollm2-135m-instruct)")
    p.add_argument("--chars", type=int, default=6000, help="how many characters of the text to score")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads on CPU")
    p.add_argument("--cpu", action="store_true", help="stay on CPU even when CUDA is available")
    args = p.parse_args()
    # bitsandbytes logs "inputs will be cast ... to float16" at every INT8 forward of a BF16 input
    logging.getLogger("bitsandbytes.autograd._functions").setLevel(logging.ERROR)
    if args.chars < 2 or args.threads < 1:
        p.error("--chars must be at least 2 and --threads at least 1")
    torch.set_num_threads(args.threads)
    from transformers import AutoTokenizer

    from gnmr_hf.offline.gguf_models import resolve_model

    path = resolve_model(args.model or "smollm2-135m-instruct")
    device = torch.device("cuda", 0) if torch.cuda.is_available() and not args.cpu else torch.device("cpu")
    text = TEXT.read_text(encoding="utf-8")[: args.chars]
    ids = AutoTokenizer.from_pretrained(path)(text, return_tensors="pt").input_ids.to(device)
    print(f"model {path}, device {device}, torch {torch.__version__}, threads {torch.get_num_threads()}")
    print(f"text: first {len(text)} characters of {TEXT.relative_to(TEXT.parents[3])}, {ids.shape[1]} tokens")
    print(f"{'precision':34} {'loss':>7} {'- BF16':>8} {'seconds':>8}")
    rows = [("bf16", "bf16", False), ("int8", "int8", False), ("nf4", "nf4", False), ("fp4", "fp4", False),
            ("nf4, all layers on recovery path", "nf4", True)]
    bf16 = None
    for label, precision, recovered in rows:
        t0 = time.perf_counter()
        model = _load(path, precision, device)
        if recovered:
            gnmr_hf.prepare_dual_path(model, path, storage="device")
            gnmr_hf.set_active_units(model, range(len(gnmr_hf.find_decoder_layers(model))))
        loss = _loss(model, ids)
        bf16 = loss if bf16 is None else bf16
        print(f"{label:34} {loss:7.4f} {loss - bf16:+8.4f} {time.perf_counter() - t0:8.1f}", flush=True)
        del model


if __name__ == "__main__":
    main()
