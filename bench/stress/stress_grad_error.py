"""How much does saved-activation quantisation perturb the weight gradients? (diagnostic, prints figures)

For a model (a stress-bench checkpoint saved by recipes/stress/pretrain.py in ``<run>/final``, or a
fresh one from a config) and a few validation batches it prints, per projection type (mean over
layers):

- the relative error of the weight gradient with 8-bit and 4-bit saved activations,
  ``||g_q - g|| / ||g||``, against the exact gradient on the same batch;
- for scale, the mini-batch noise ``||g_A - g_B|| / ||g_A||`` between two disjoint batches of the
  same size (what SGD already lives with);
- the activation's absmax/RMS per token and the share of its entries that round to 0 at 4 bits
  (outliers make the per-token scale coarse and zero out the small entries).

Usage:
    python bench/stress/stress_grad_error.py --config recipes/stress/configs/cpu_bench.yaml \
        [--checkpoint runs/stress/bench/fixed4/final] [--batches 2]
"""

from __future__ import annotations

import argparse
import importlib.util
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]


def _pretrain():
    spec = importlib.util.spec_from_file_location("stress_pretrain", ROOT / "recipes" / "stress" / "pretrain.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _grads(model, batch, units) -> list[torch.Tensor]:
    model.zero_grad(set_to_none=True)
    model(input_ids=batch, labels=batch).loss.backward()
    return [m.weight.grad.detach().clone() for _, m in units]


def main(argv: list[str] | None = None) -> None:
    from transformers import LlamaForCausalLM

    from gnmr_hf.backends.act_quant import prepare_act_quant

    p = argparse.ArgumentParser()
    p.add_argument("--config", required=True)
    p.add_argument("--checkpoint", help="a saved model folder; default: the config's fresh initialisation")
    p.add_argument("--batches", type=int, default=2)
    p.add_argument("--batch_size", type=int, default=8)
    p.add_argument("overrides", nargs="*")
    a = p.parse_args(argv)
    pre = _pretrain()
    cfg = pre.load_config(a.config, a.overrides)
    torch.set_num_threads(int(cfg["train"].get("threads", torch.get_num_threads())))
    cache = Path(cfg["data"].get("cache_dir") or ROOT / "runs" / "stress" / ".cache")
    tok, _, val, _ = pre.build_data(cfg, cache)
    # float32 so that what we measure is the quantisation, not BF16 rounding of the gradients
    if a.checkpoint:
        model = LlamaForCausalLM.from_pretrained(a.checkpoint, dtype=torch.float32)
    else:
        model = pre.build_model(cfg, len(tok), torch.float32)
    units = prepare_act_quant(model, low_bits=None, high_bits=8)
    stats: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(list))
    bs = a.batch_size
    for i in range(a.batches):
        A = val.blocks[2 * i * bs : (2 * i + 1) * bs]
        B = val.blocks[(2 * i + 1) * bs : (2 * i + 2) * bs]
        if B.shape[0] < bs:
            break
        for _, m in units:
            m.low_bits = None
        exact = _grads(model, A, units)
        other = _grads(model, B, units)
        inputs: dict[int, torch.Tensor] = {}
        hooks = [m.register_forward_hook(lambda mod, inp, out, k=k, store=inputs: store.__setitem__(k, inp[0].detach()))
                 for k, (_, m) in enumerate(units)]
        quant = {}
        for bits in (8, 4):
            for _, m in units:
                m.low_bits = bits
            quant[bits] = _grads(model, A, units)
        for h in hooks:
            h.remove()
        for k, (name, _) in enumerate(units):
            kind = name.rsplit(".", 1)[-1]
            n = exact[k].norm().item()
            if n == 0:
                continue
            s = stats[kind]
            s["err8"].append((quant[8][k] - exact[k]).norm().item() / n)
            s["err4"].append((quant[4][k] - exact[k]).norm().item() / n)
            s["noise"].append((other[k] - exact[k]).norm().item() / n)
            x = inputs[k].float().reshape(-1, inputs[k].shape[-1])
            absmax = x.abs().amax(-1)
            rms = x.pow(2).mean(-1).sqrt().clamp_min(1e-30)
            s["absmax_rms"].append((absmax / rms).mean().item())
            s["zero4"].append((x.abs() < absmax.unsqueeze(1) / 14).float().mean().item())
    print(f"model: {a.checkpoint or 'fresh initialisation'}; {a.batches} batch pair(s) of {bs} x {val.blocks.shape[1]} tokens")
    print("| projection | rel. err. 8-bit | rel. err. 4-bit | mini-batch noise | absmax/RMS | zeroed at 4-bit |")
    print("| --- | --- | --- | --- | --- | --- |")
    from gnmr_hf.backends.act_quant import PROJECTIONS

    for kind in PROJECTIONS:
        s = stats.get(kind)
        if not s:
            continue
        mean = {key: sum(v) / len(v) for key, v in s.items()}
        print(f"| {kind} | {mean['err8']:.4f} | {mean['err4']:.4f} | {mean['noise']:.3f} | {mean['absmax_rms']:.2f} | "
              f"{100 * mean['zero4']:.1f}% |")


if __name__ == "__main__":
    main()
