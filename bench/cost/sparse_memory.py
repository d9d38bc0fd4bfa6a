"""Optimizer-state and gradient bytes of SparseAdamW (gnmr_hf.sparse) against dense AdamW on the same model.

The model is the sparse stress bench's (recipes/stress/configs/cpu_bench.yaml: a 4-layer, 128-wide LLaMA,
vocabulary 4096, float32); every linear inside the decoder layers is sparse at each density, unstructured
(block 1) and block-wise. After one training step of each optimizer it reads the bytes actually held:
``torch.optim.AdamW``'s state (two moments per weight and a step counter per tensor) and the dense
gradients, against SparseAdamW's state (moments for active blocks, an int32 age per block, step counters)
and the compact gradients. Figures are given for the whole model and for the sparse linears alone (the
embeddings and the LM head stay dense). Also the bytes of the masks (the int32 block index).

Usage:
    python bench/cost/sparse_memory.py [--densities 0.1 0.2 0.3 0.4] [--blocks 1 16] [--out bench/results/sparse/memory.json]
"""

from __future__ import annotations

import argparse
import copy
import json
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "recipes" / "stress"))


def _model(vocab: int):
    import pretrain

    cfg = pretrain.load_config(ROOT / "recipes" / "stress" / "configs" / "cpu_bench.yaml")
    return pretrain.build_model(cfg, vocab, torch.float32), cfg


def _tensor_bytes(tensors) -> int:
    return sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))


def _step(model, opt, vocab: int, seq: int) -> None:
    ids = torch.randint(0, vocab, (2, seq), generator=torch.Generator().manual_seed(0))
    opt.zero_grad(set_to_none=True)
    model(input_ids=ids, labels=ids).loss.backward()
    opt.step()


def measure(densities, blocks, vocab: int = 4096) -> dict:
    from gnmr_hf.sparse import SparseAdamW, prepare_sparse, sparse_linears

    base, cfg = _model(vocab)
    seq = cfg["data"]["seq_len"]
    dense = copy.deepcopy(base)
    names = {n for n, _ in sparse_linears(prepare_sparse(copy.deepcopy(base), 0.5))}
    opt = torch.optim.AdamW(dense.parameters(), lr=1e-3)
    _step(dense, opt, vocab, seq)
    params = dict(dense.named_parameters())
    lin_params = [params[f"{n}.weight"] for n in names]
    lin_ids = {id(p) for p in lin_params}
    rows = [{"method": "dense AdamW", "density": 1.0, "block_size": None,
             "state_bytes": _tensor_bytes(t for s in opt.state.values() for t in s.values()),
             "grad_bytes": _tensor_bytes(p.grad for p in dense.parameters()),
             "linears_state_bytes": _tensor_bytes(t for p in lin_params for t in opt.state[p].values()),
             "linears_grad_bytes": _tensor_bytes(p.grad for p in lin_params),
             "mask_bytes": 0}]
    assert len(lin_ids) == len(names)
    for b in blocks:
        for d in densities:
            model = prepare_sparse(copy.deepcopy(base), density=d, block_size=b, seed=0)
            layers = [m for _, m in sparse_linears(model)]
            sopt = SparseAdamW.from_model(model, lr=1e-3)
            _step(model, sopt, vocab, seq)
            vals = [m.values for m in layers]
            rows.append({"method": "SparseAdamW", "density": d, "block_size": b,
                         "realised_density": sum(m.k * b for m in layers) / sum(m.out_features * m.in_features
                                                                              for m in layers),
                         "state_bytes": sopt.state_bytes(), "grad_bytes": sopt.grad_bytes(),
                         "linears_state_bytes": _tensor_bytes(t for v in vals for t in sopt.state[v].values()),
                         "linears_grad_bytes": _tensor_bytes(v.grad for v in vals),
                         "mask_bytes": _tensor_bytes(m.index for m in layers)})
    ref = rows[0]
    for r in rows:
        r["state_plus_grad_vs_dense"] = (r["state_bytes"] + r["grad_bytes"]) / (ref["state_bytes"] + ref["grad_bytes"])
        r["linears_state_plus_grad_vs_dense"] = ((r["linears_state_bytes"] + r["linears_grad_bytes"])
                                                 / (ref["linears_state_bytes"] + ref["linears_grad_bytes"]))
    return {"model": cfg["model"], "vocab_size": vocab, "dtype": "float32", "rows": rows}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--densities", type=float, nargs="+", default=[0.1, 0.2, 0.3, 0.4])
    p.add_argument("--blocks", type=int, nargs="+", default=[1, 16])
    p.add_argument("--out")
    a = p.parse_args(argv)
    torch.set_num_threads(1)
    res = measure(a.densities, a.blocks)
    print(f"{'method':<12} {'d':>5} {'B':>3} {'state MB':>9} {'grad MB':>8} {'lin state+grad MB':>18} "
          f"{'x dense (model)':>15} {'x dense (linears)':>17} {'mask KB':>8}")
    for r in res["rows"]:
        print(f"{r['method']:<12} {r['density']:>5.2f} {r['block_size'] or '-':>3} {r['state_bytes'] / 2**20:>9.3f} "
              f"{r['grad_bytes'] / 2**20:>8.3f} {(r['linears_state_bytes'] + r['linears_grad_bytes']) / 2**20:>18.3f} "
              f"{r['state_plus_grad_vs_dense']:>15.3f} {r['linears_state_plus_grad_vs_dense']:>17.3f} "
              f"{r['mask_bytes'] / 1024:>8.1f}")
    if a.out:
        Path(a.out).parent.mkdir(parents=True, exist_ok=True)
        Path(a.out).write_text(json.dumps(res, indent=1) + "\n")


if __name__ == "__main__":
    main()
