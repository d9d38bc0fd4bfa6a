"""What preparing a mixed NF4 model for training does to its memory: peft.prepare_model_for_kbit_training
against gnmr_hf.prepare_for_training, on a stock-loaded model whose kept linears stay BF16.

    python bench/cost/kbit_prep_memory.py --model smollm2-135m-instruct --keep v_proj
    python bench/cost/kbit_prep_memory.py --model gemma3-270m --keep v_proj

Prints the weights' bytes (gnmr_hf.memory.model_bytes: parameters, buffers and bitsandbytes' quant
states) and the kept linears' bytes after loading, after PEFT's preparation and after ours.
"""

from __future__ import annotations

import argparse


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", default="smollm2-135m-instruct", help="a model folder or an offline alias")
    p.add_argument("--keep", default="v_proj", help="keep every decoder linear whose name ends with this on BF16")
    args = p.parse_args(argv)

    import peft
    import torch
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from gnmr_hf.memory import model_bytes
    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.training import linear_weight_bytes, prepare_for_training

    path = resolve_model(args.model)
    meta = AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16)
    kept = [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear) and n.endswith(args.keep)
            and ".layers." in n]
    del meta

    def load(skip):
        q = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.bfloat16,
                               llm_int8_skip_modules=skip)
        return AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16, quantization_config=q)

    mib = 2**20
    nf4 = model_bytes(load(["lm_head"]))["total"]
    rows = []
    for label, prep in (("as loaded", None), ("peft.prepare_model_for_kbit_training", peft.prepare_model_for_kbit_training),
                        ("gnmr_hf.prepare_for_training", prepare_for_training)):
        model = load(kept + ["lm_head"])
        if prep is not None:
            prep(model)
        rows.append((label, model_bytes(model)["total"], sum(linear_weight_bytes(model, kept).values())))
        del model
    print(f"{args.model}: {len(kept)} kept linears (*{args.keep}); all-NF4 model {nf4 / mib:.1f} MiB")
    print(f"{'':40s} {'weights MiB':>12s} {'over NF4':>9s} {'kept linears MiB':>17s}")
    for label, total, kept_bytes in rows:
        print(f"{label:40s} {total / mib:12.1f} {100 * (total / nf4 - 1):8.1f}% {kept_bytes / mib:17.2f}")


if __name__ == "__main__":
    main()
