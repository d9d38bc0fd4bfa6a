"""GGUF exports scored by llama.cpp (``llama-cpp-python``) and by transformers' GGUF loader, on the same tokens.

Three steps, each its own sub-command:

``build-venv``  makes a venv (default ``~/.cache/gnmr_hf/venvs/llama-cpp-python``) with ``numpy`` and
                ``llama-cpp-python`` from the package index, and prints how long the install took. The index
                holds only its source (``pip download llama-cpp-python`` gives ``llama_cpp_python-*.tar.gz``), so
                this compiles llama.cpp (``--jobs`` parallel compile steps).
``export``      writes the files to compare with ``gnmr_hf.export_gguf``: uniform ``--uniform`` types (default
                Q4_0 and Q8_0) and uniform BF16, and a plan file's export (``--plan``) where given.
``score``       scores each file on the same held-out tokens: ``--heldout-blocks`` blocks of ``--block`` tokens
                of the held-out files of Debian's python3.11-doc sources (``gnmr_hf.offline.text_data.text_task``,
                every 20th file, as bench/value/serve_bench.py), mean next-token NLL over every target, by
                transformers (``from_pretrained(folder, gguf_file=...)``, FP32, one thread) and, where the venv
                holds ``llama_cpp``, by llama.cpp (``Llama(..., logits_all=True)``, the same token ids fed with
                ``eval``, one thread), in a subprocess of the venv's Python; rows go to ``--out`` (JSON) as they
                finish.

    python bench/serve/gguf_llamacpp.py build-venv --jobs 1
    python bench/serve/gguf_llamacpp.py export --model smollm2-135m-instruct --work /tmp/gguf_bench
    python bench/serve/gguf_llamacpp.py score --model smollm2-135m-instruct --work /tmp/gguf_bench \
        --out bench/results/gguf/smollm2.json
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = Path.home() / ".cache" / "gnmr_hf" / "venvs" / "llama-cpp-python"
PYDOCS = "/usr/share/doc/python3.11/html/_sources"


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_venv(venv: Path, jobs: int) -> int:
    """Create the venv and install llama-cpp-python into it (a compile from source); print the time it took."""
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    env = {**os.environ, "CMAKE_BUILD_PARALLEL_LEVEL": str(jobs)}
    start = time.time()
    rc = subprocess.run([str(venv / "bin" / "pip"), "install", "numpy", "llama-cpp-python"], env=env).returncode
    log(f"pip install llama-cpp-python: rc {rc}, {time.time() - start:.0f} s with {jobs} compile job(s)")
    return rc


def has_llama_cpp(venv: Path) -> bool:
    py = venv / "bin" / "python"
    return py.is_file() and subprocess.run([str(py), "-c", "import llama_cpp"], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------ llama.cpp side (the venv)


def llamacpp_worker(gguf_file: str, ids_file: str, threads: int) -> None:
    """Runs in the venv (numpy and llama_cpp only): the NLL of each block of ``ids_file`` (JSON list of lists)."""
    import numpy as np
    from llama_cpp import Llama

    blocks = json.loads(Path(ids_file).read_text())
    llm = Llama(model_path=gguf_file, n_ctx=max(len(b) for b in blocks), logits_all=True, n_threads=threads,
                n_batch=max(len(b) for b in blocks), verbose=False)
    total, count, start = 0.0, 0, time.time()
    for ids in blocks:
        llm.reset()
        llm.eval(ids)
        logits = np.asarray(llm.scores[: len(ids)], dtype=np.float64)  # (tokens, vocab)
        logz = np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1)) + logits.max(-1)
        total += float((logz[:-1] - logits[np.arange(len(ids) - 1), ids[1:]]).sum())
        count += len(ids) - 1
    print(json.dumps({"nll": total / count, "tokens": count, "seconds": time.time() - start}))


def llamacpp_nll(venv: Path, gguf_file: Path, ids_file: Path, threads: int) -> dict[str, Any]:
    out = subprocess.run([str(venv / "bin" / "python"), __file__, "_worker", str(gguf_file), str(ids_file),
                          str(threads)], capture_output=True, text=True)
    if out.returncode:
        raise RuntimeError(f"llama.cpp on {gguf_file}: {out.stderr.strip().splitlines()[-1:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


# ------------------------------------------------------------------------------------ transformers side


def transformers_nll(gguf_file: Path, blocks: list[list[int]]) -> dict[str, Any]:
    """The NLL of ``blocks`` by transformers: a GGUF file through its GGUF loader, or a model folder as it is."""
    import torch
    from transformers import AutoModelForCausalLM

    from gnmr_hf.export_score import nll

    if gguf_file.is_dir():
        model = AutoModelForCausalLM.from_pretrained(gguf_file, dtype=torch.float32)
    else:
        model = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name, dtype=torch.float32)
    start = time.time()
    mean, count = nll(model.eval(), blocks)
    return {"nll": mean, "tokens": count, "seconds": time.time() - start}


def heldout_blocks(model: str, n: int, block: int, source: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from gnmr_hf.offline.gguf_models import resolve_model
    from gnmr_hf.offline.text_data import text_task

    tok = AutoTokenizer.from_pretrained(resolve_model(model))
    _, held, _ = text_task(source, tok, block)
    step = max(1, len(held) // n)
    return [list(b["input_ids"]) for b in held[::step][:n]]


# ------------------------------------------------------------------------------------ the steps


def export(args) -> None:
    from gnmr_hf.export_gguf import export_gguf

    work = Path(args.work)
    work.mkdir(parents=True, exist_ok=True)
    name = Path(args.model).name
    jobs = [(f"{name}-{t.lower()}.gguf", dict(plan=None, uniform=t)) for t in [*args.uniform, "BF16"]]
    if args.plan:
        jobs.append((f"{name}-plan-{args.low_type.lower()}.gguf", dict(plan=args.plan, low_type=args.low_type)))
    if args.serve_plans:  # bench/value/serve_bench.py's plans (chosen against its INT4): each non-empty one
        rungs = json.loads(Path(args.serve_plans).read_text())["rungs"]
        jobs += [(f"{name}-{tag}-{args.low_type.lower()}.gguf", dict(plan=r, low_type=args.low_type))
                 for tag, r in rungs.items() if r]
    for file, kw in jobs:
        if (work / file).is_file():
            log(f"{file}: there already")
            continue
        s = export_gguf(args.model, output=work / file, **kw)
        log(f"{file}: {s['bytes']:,} bytes, linears {s['linears_by_type']}")


def score(args) -> None:
    import torch

    torch.set_num_threads(args.threads)
    work, out = Path(args.work), Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    doc["setting"] = {"model": args.model, "heldout_blocks": args.heldout_blocks, "block": args.block,
                      "source": args.source, "threads": args.threads}
    doc["command"] = "python " + " ".join(sys.argv)
    blocks = heldout_blocks(args.model, args.heldout_blocks, args.block, args.source)
    ids_file = work / "heldout_ids.json"
    ids_file.write_text(json.dumps(blocks))
    use_llamacpp = has_llama_cpp(Path(args.venv))
    if not use_llamacpp:
        log(f"{args.venv} has no llama_cpp (build-venv makes it): transformers' scores only")
    if "checkpoint" not in doc["rows"]:  # the BF16 model folder the files were exported from, as it is
        from gnmr_hf.offline.gguf_models import resolve_model

        doc["rows"]["checkpoint"] = {"transformers": transformers_nll(Path(resolve_model(args.model)), blocks)}
        log(f"checkpoint: NLL {doc['rows']['checkpoint']['transformers']['nll']:.4f}")
    for f in sorted(work.glob("*.gguf")):
        row = doc["rows"].get(f.name, {})
        row["bytes"] = f.stat().st_size
        if "transformers" not in row:
            row["transformers"] = transformers_nll(f, blocks)
        if use_llamacpp and "llama_cpp" not in row:
            row["llama_cpp"] = llamacpp_nll(Path(args.venv), f, ids_file, args.threads)
        doc["rows"][f.name] = row
        out.write_text(json.dumps(doc, indent=1) + "\n")
        got = {k: round(v["nll"], 4) for k, v in row.items() if isinstance(v, dict)}
        log(f"{f.name}: {row['bytes']:,} bytes, NLL {got}")


def compare(args) -> None:
    """What differs between an export and a GGUF llama.cpp's converter wrote (metadata keys and values besides the
    token arrays, tensor names and shapes)."""
    import gguf

    if args.reference is None:
        from gnmr_hf.offline.gguf_models import gguf_path

        args.reference = str(gguf_path(args.model, args.workdir))
    a, b = gguf.GGUFReader(args.file), gguf.GGUFReader(args.reference)
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.merges", "tokenizer.ggml.token_type", "tokenizer.ggml.scores")
    print(f"{args.file} against {args.reference}")
    print("  keys only in the export:", sorted(set(a.fields) - set(b.fields)))
    print("  keys only in the reference:", sorted(set(b.fields) - set(a.fields)))
    for k in sorted(set(a.fields) & set(b.fields)):
        same = (a.fields[k].contents() == b.fields[k].contents()) if k not in skip else \
            (len(a.fields[k].data) == len(b.fields[k].data) and a.fields[k].contents() == b.fields[k].contents())
        if not k.startswith("GGUF.") and not same:
            print(f"  {k}: {str(a.fields[k].contents())[:60]!r} | {str(b.fields[k].contents())[:60]!r}")
    ta = {t.name: [int(x) for x in t.shape] for t in a.tensors}
    tb = {t.name: [int(x) for x in t.shape] for t in b.tensors}
    print(f"  tensors: {len(ta)} / {len(tb)}, same names {set(ta) == set(tb)}, same shapes {ta == tb}")


def table(args) -> None:
    """The rows of a ``score`` file as a Markdown table: bytes, both NLLs, their difference, the gap closed."""
    doc = json.loads(Path(args.file).read_text())
    rows = {k: v for k, v in doc["rows"].items() if k != "checkpoint"}
    low = next(v for k, v in rows.items() if k.endswith("-q4_0.gguf") and "-planned-" not in k and "-random-" not in k)
    high = next(v for k, v in rows.items() if k.endswith("-bf16.gguf"))
    lo, hi = low["transformers"]["nll"], high["transformers"]["nll"]
    print(f"`{doc['command']}`\n")
    print("| file | MiB | NLL transformers | gap closed | NLL llama.cpp | llama.cpp - transformers |")
    print("|---|---|---|---|---|---|")
    for name, row in rows.items():
        t = row["transformers"]["nll"]
        ll = row.get("llama_cpp")
        cell = f"{ll['nll']:.4f} | {ll['nll'] - t:+.4f}" if ll else "not run | "
        print(f"| {name} | {row['bytes'] / 2**20:.1f} | {t:.4f} | {(lo - t) / (lo - hi):.3f} | {cell} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        llamacpp_worker(argv[1], argv[2], int(argv[3]))
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build-venv", help="a venv with llama-cpp-python (compiled from its source)")
    b.add_argument("--venv", default=str(VENV))
    b.add_argument("--jobs", type=int, default=1)
    e = sub.add_parser("export", help="the GGUF files to compare")
    e.add_argument("--model", required=True)
    e.add_argument("--work", required=True)
    e.add_argument("--uniform", nargs="*", default=["Q4_0", "Q8_0"])
    e.add_argument("--plan", default=None, help="a plan file exported at --low-type (int8 -> Q8_0, bf16 -> BF16)")
    e.add_argument("--serve-plans", default=None,
                   help="a bench/value/serve_bench.py *_plans.json: export each of its plans (planned, random-N)")
    e.add_argument("--low-type", default="Q4_0")
    s = sub.add_parser("score", help="held-out NLL of every .gguf in --work")
    s.add_argument("--model", required=True, help="the model whose tokenizer makes the held-out tokens")
    s.add_argument("--work", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--venv", default=str(VENV))
    s.add_argument("--heldout-blocks", type=int, default=16)
    s.add_argument("--block", type=int, default=256)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--source", default=PYDOCS)
    c = sub.add_parser("compare", help="an export against the GGUF its offline model came from")
    c.add_argument("file")
    c.add_argument("--model", default=None, help="the offline alias whose source GGUF is the reference")
    c.add_argument("--reference", default=None, help="or the reference GGUF itself")
    c.add_argument("--workdir", default="/tmp", help="where a chunked source GGUF is assembled")
    t = sub.add_parser("table", help="a score file as a Markdown table")
    t.add_argument("file")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.step == "build-venv":
        return build_venv(Path(args.venv), args.jobs)
    {"export": export, "score": score, "compare": compare, "table": table}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
