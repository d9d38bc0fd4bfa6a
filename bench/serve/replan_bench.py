"""A fine-tune exported as its server takes it, planned anew for the export (``gnmr-hf export --replan``) against
the uniform export and the training's own plan re-typed, each scored against the merged BF16 model.

For one LoRA adapter (a run trained over NF4, e.g. ``bench/value/qlora_budget.py plan ... --save-adapters``) and
the model it was trained on, each row is exported and scored on the same held-out text by
:func:`gnmr_hf.export_score.score_export` (merged BF16, the export, the uniform low form, and the share of the
uniform-to-merged gap the export keeps):

- ``gguf-uniform``: every decoder linear Q4_0; ``gguf-retyped``: the training's plan (``--train-plan``, chosen
  against NF4) written at Q4_0 / Q8_0 / BF16; ``gguf-replan``: :func:`gnmr_hf.export_replan.replan` at +10 % over
  uniform Q4_0 (the merged model profiled against Q4_0 / Q8_0 on the start of ``--train-text``);
- ``ct-uniform``: every decoder linear W4A16 (group ``--group-size``); ``ct-retyped``: the training's plan as a
  compressed-tensors folder for transformers; ``ct-replan-vllm``: replanned for vLLM on CUDA (INT8 and BF16
  groups), ``ct-replan-vllm-cpu``: for vLLM's CPU build (BF16 groups), both at +10 % over uniform W4A16.

The texts: ``--train-text`` (the run's own data, its first 2 x 4 x 512 tokens planned on) and ``--heldout-text``
(its last 16 x 256 tokens scored). ``make-text`` writes both from Debian's python3.11-doc sources as the Python-docs
runs split them (every 20th file held out; 60 training files drawn with seed 0). Rows go to ``--out`` as they
finish and are skipped on a rerun; exports are written under ``--work`` and removed after scoring.

    python bench/serve/replan_bench.py make-text --work /tmp/replan
    python bench/serve/replan_bench.py run --model smollm2-135m-instruct --adapter RUN/adapter \\
        --train-plan RUN/plan.json --group-size 64 --work /tmp/replan --out bench/results/replan/smollm2_lad10_seed0.json
"""

from __future__ import annotations

import argparse
import json
import random
import shutil
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))
PYDOCS = "/usr/share/doc/python3.11/html/_sources"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_text(args) -> None:
    from gnmr_hf.offline.text_data import scan_text_files, split_by_file

    files, _ = scan_text_files(args.source)
    train, held = split_by_file(files, 20)
    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    pick = random.Random(0).sample(train, min(60, len(train)))
    (work / "train.txt").write_text("\n\n".join(p.read_text(encoding="utf-8") for p in pick), encoding="utf-8")
    (work / "heldout.txt").write_text("\n\n".join(p.read_text(encoding="utf-8") for p in held), encoding="utf-8")
    log(f"{work}/train.txt: {len(pick)} training files; heldout.txt: {len(held)} held-out files")


def _export(name: str, args, work: Path, train: str, model_path: str):
    """Write row ``name``'s export; returns (path, fmt, summary)."""
    from gnmr_hf.export_ct import export_compressed_tensors
    from gnmr_hf.export_gguf import export_gguf
    from gnmr_hf.export_replan import replan

    fmt = "gguf" if name.startswith("gguf") else "compressed-tensors"
    out = work / (f"{name}.gguf" if fmt == "gguf" else name)
    plan_file = out.with_name(out.name + ".plan.json")
    for p in (out, plan_file):
        if p.is_dir():
            shutil.rmtree(p)
        elif p.exists():
            p.unlink()
    info: dict = {}
    asym = name.endswith("-asym")
    if name.endswith("replan") or "replan-" in name:
        target = None if fmt == "gguf" else name.removeprefix("ct-replan-").removesuffix("-asym")
        plan, _ = replan(model_path, args.adapter, fmt, train, out, group_size=_group(args, asym), target=target,
                         source="train.txt", low_type="W4A16_ASYM" if asym else None,
                         budget=f"{_asym_budget(model_path, args.group_size, _group(args, asym))}B" if asym else None)
        info = {"int8": len(plan.on("int8")), "bf16": len(plan.on("bf16")), "price_bytes": plan.price_bytes,
                "budget_bytes": plan.budget_bytes}
        plan_arg = plan_file
    elif name.endswith("retyped"):
        plan_arg = args.train_plan
    else:
        plan_arg = None
    if fmt == "gguf":
        s = export_gguf(model_path, plan_arg, out, adapter=args.adapter, uniform="Q4_0" if plan_arg is None else None)
        info.update(bytes=s["bytes"], linears=s["linears_by_type"])
    else:
        s = export_compressed_tensors(model_path, plan_arg or {}, out, adapter=args.adapter, group_size=_group(args, asym),
                                      target="transformers" if name.endswith("retyped") else None)
        info["low"] = s["low"]
        info.update(bytes=s["bytes_on_disk"], schemes=s.get("schemes"))
    return out, fmt, info


def _group(args, asym: bool) -> int:
    """The INT4 group of a row: ``--asym-group-size`` for the W4A16_ASYM rows where given, else ``--group-size``."""
    return (args.asym_group_size or args.group_size) if asym else args.group_size


def _asym_budget(model_path: str, group_size: int, asym_group: int) -> int:
    """Bytes over uniform W4A16_ASYM (group ``asym_group``) that bring a folder to uniform W4A16's (group
    ``group_size``) tensor bytes + 10 %."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gnmr_hf.export_ct import ct_shapes, ct_tensor_bytes
    from gnmr_hf.planning.groups import decoder_linears

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    shapes, other = ct_shapes(meta, decoder_linears(meta))
    w4 = ct_tensor_bytes(shapes, {}, other, group_size)
    return int(1.1 * w4) - ct_tensor_bytes(shapes, {}, other, asym_group, "int4-asym")


def run(args) -> None:
    from gnmr_hf.export_score import score_export
    from gnmr_hf.offline.gguf_models import resolve_model

    work, out = Path(args.work), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    doc["setting"] = {"model": Path(args.model).name, "adapter": str(args.adapter), "train_plan": args.train_plan,
                      "group_size": args.group_size}
    doc["command"] = "python " + " ".join(sys.argv)
    model_path = resolve_model(args.model)
    train = (work / "train.txt").read_text(encoding="utf-8")
    held = (work / "heldout.txt").read_text(encoding="utf-8")
    # compressed-tensors first (the uniform W4A16 row before the rows measured against it), then GGUF
    rows = ["ct-uniform", *(["ct-replan-vllm-asym", "ct-replan-vllm-cpu-asym"] if args.asym else []),
            "ct-replan-vllm", "ct-replan-vllm-cpu", "gguf-uniform", "gguf-replan"]
    if args.train_plan:
        rows += ["ct-retyped", "gguf-retyped"]
    for name in rows:
        if name in doc["rows"]:
            continue
        t0 = time.time()
        path, fmt, info = _export(name, args, work, train, model_path)
        r = score_export(model_path, path, fmt, args.adapter, held, group_size=_group(args, name.endswith("-asym")),
                         low_type="Q4_0",
                         source="heldout.txt", planned=not name.endswith("uniform"), ct_low=info.get("low", "int4"))
        doc["rows"][name] = {**info, **{k: r[k] for k in ("merged", "export", "uniform", "kept", "tokens")},
                             "seconds": round(time.time() - t0)}
        if "ct-uniform" in doc["rows"] and fmt != "gguf":  # against uniform W4A16, as every compressed-tensors row
            w4 = doc["rows"]["ct-uniform"]["export"]
            doc["rows"][name]["kept_vs_w4a16"] = (w4 - r["export"]) / (w4 - r["merged"])
        out.write_text(json.dumps(doc, indent=1) + "\n")
        log(f"{name}: export {r['export']:.4f} (merged {r['merged']:.4f}, uniform {r['uniform']:.4f}), kept "
            f"{r['kept']:.3f}, {info}")
        if path.is_dir():
            shutil.rmtree(path)
        else:
            path.unlink()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make-text")
    m.add_argument("--work", required=True)
    m.add_argument("--source", default=PYDOCS)
    r = sub.add_parser("run")
    r.add_argument("--model", required=True)
    r.add_argument("--adapter", required=True)
    r.add_argument("--train-plan", default=None, help="the run's own plan (a rungs file), exported re-typed")
    r.add_argument("--group-size", type=int, default=128)
    r.add_argument("--work", required=True)
    r.add_argument("--out", required=True)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--asym", action="store_true", help="also the rows replanned over W4A16_ASYM (vLLM serves it)")
    r.add_argument("--asym-group-size", type=int, default=None, help="--asym: their INT4 group (default --group-size)")
    args = p.parse_args(argv)
    if args.cmd == "make-text":
        make_text(args)
        return 0
    import torch

    torch.set_num_threads(args.threads)
    run(args)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
