"""What a byte of BF16 buys a QLoRA adapter: operator-level plans against random, GNMR and LoftQ.

Every run fine-tunes the model the ``nf4`` recipe of the folder's model builds (``--model``:
SmolLM2-135M-Instruct, the default, or Gemma 3 270M; bitsandbytes NF4 base, LoRA r=8 on all seven
projections, the recipe's optimizer and clipping) on the folder's task (``--task``: ``generated``, the
recipe's arithmetic problems, or ``pydocs``, the Python docs' sources as 256-token blocks with the loss on
every token and every 20th file held out), computing in FP32 on this CPU (as bench/value/nf4_bench.py, for the
same reason: BF16 matmuls are ~10x slower here), with a BF16 recovery path on every linear
(``prepare_dual_path(..., units="linears")``: 7 units a layer, 210 on SmolLM2, 126 on Gemma 3). The
first ``plan`` writes the folder's setting.json; a later one with another setting is refused. Methods differ only in which linears run their checkpoint weight instead of NF4, at a budget of
extra BF16 bytes given as a share of the quantised weights' BF16 bytes (``-B`` in a name: B %):

======================  ==========================================================================================
method                  linears on the BF16 path
======================  ==========================================================================================
``nf4``                 none (plain QLoRA)
``bf16``                all (BF16 LoRA)
``loftq``               none; LoRA initialised by LoftQ (PEFT's own, gnmr_hf.loftq), 0 extra bytes
``prof-op-B``           the profiled plan: greedy by first-order gain per byte (gnmr_hf.planning), fixed
``prof-layer-B``        the same profile summed per decoder layer, whole layers greedy per byte, fixed
``rand-op-B``           a seeded random set of linears filling B, fixed for the run
``rand-step-B``         a random set of linears filling B, drawn again every step
``edge-B``              whole first and last decoder layers (0, 29, 1, 28, ...) filling B, fixed
``gnmr-layer-B``        GNMR at decoder-layer grain, max_active = the layers B buys (the paper's controller)
``gnmr-op-B``           GNMR at operator grain with the byte budget B (GNMRConfig.max_active_bytes)
``hybrid-B``            the profiled plan at 3/4 of B on BF16 always, GNMR over the other linears with the
                        remaining 1/4 (gnmr_hf.HybridPolicy)
``loftq+prof-op-B``     the profiled plan at B, LoftQ on the linears that stay NF4
``werr-op-B``           data-free: greedy by weight error per byte, ``||W_bf16 - W_nf4||_F^2 / bytes``
                        (the planner's ``weight_error`` criterion, profile_dataless.json), fixed
``out-op-B``            label-free: greedy by output error per byte, ``||(W_nf4 - W_bf16) x||`` on the
                        profile batches' inputs (the ``output`` criterion), fixed
``heur-op-B``           a fixed rule of the kind practitioners ship: the down_proj of layers 0-1, then
                        every layer's v_proj, then the other down_proj in layer order, filling B
``late-op-B``           the profile taken at a trained point (``profile_late.json``: ``bench/value/late_profile.py`` with a
                        trained ``nf4`` adapter in place), greedy by its first-order gain per byte, fixed from step 1
``lad-M``               the precision ladder (gnmr_hf.planning.ladder): each linear on NF4, INT8 or BF16, chosen
                        by the first-order gain of each rung per byte (``rung_gains``, a multiple-choice
                        knapsack, ``choose_rungs``) under a budget of **M % memory over the NF4 model** (weights
                        and quant states as bitsandbytes stores them, profile_ladder.json); trained on the dual
                        path with those rungs (``prepare_dual_path(..., rungs=...)``), fixed
``lad-int8-M``          the same knapsack with the INT8 rung only
``lad-bf16-M``          the same knapsack with the BF16 rung only (today's plan, priced in memory over NF4)
``lad-grp-M``           the ladder over whole vLLM serving groups (q/k/v and gate/up of a layer on one rung, the
                        group's price and gain the sums of its members': ``choose_rungs(..., groups=...)``)
``cal``                 none; LoRA initialised in closed form to each linear's least output error on the
                        profile_ladder.json batches (gnmr_hf.calibrated_init, CLoQ / QERA), 0 extra bytes
``cal+lad-M``           the ladder at M, the calibrated init on the linears that stay NF4 (not in METHODS:
                        name it, e.g. ``--methods nf4,bf16,lad-10,cal,cal+lad-10``)
======================  ==========================================================================================

Two currencies: ``-B`` is a share of the quantised weights' BF16 bytes (the first methods); ``-M`` (the
ladder's) is memory over the whole NF4 model, what a user compares against (+10 % BF16 bytes is about
+16 % memory over NF4 on SmolLM2). Every result records ``memory_over_nf4`` and the run's peak RSS.

After training, the adapter's held-out loss (mean per response token over ``--eval-problems``
generated test problems, disjoint from the training problems) is measured on two bases:

- ``served``: the base it trained on, as a user serves it: for a fixed set, NF4 plus that set in BF16
  (what ``llm_int8_skip_modules`` gives with stock transformers; a ladder plan's INT8 rungs computed by
  ``Linear8bitLt``, what ``gnmr_hf.load_planned`` loads); for ``hybrid``, NF4 plus its planned
  set (GNMR's transient part is gone at serving); for the dynamic methods the all-NF4 base;
- ``merged``: the original BF16 base (the adapter merged into, or served on, the original weights).

Gap closed on a route = ``(L_nf4 - L) / (L_nf4 - L_bf16)`` per seed, with the same seed's ``nf4`` run on
that route and its ``bf16`` run.

Commands::

    python bench/value/qlora_budget.py plan --out bench/results/qlora_budget --workers 2   # resumable
    python bench/value/qlora_budget.py plan --out bench/results/qlora_gemma_pydocs --model gemma3-270m --task pydocs \
        --methods nf4,bf16,lad-10,lad-bf16-10 --seeds 0 --oracle-every 0
    python bench/value/qlora_budget.py report --out bench/results/qlora_budget --plot-ladder docs/qlora_ladder.png
    python bench/value/qlora_budget.py report --out bench/results/qlora_budget --plot docs/qlora_budget.png
    python bench/value/qlora_budget.py run --method prof-op-10 --seed 0 --out /tmp/x    # one run

One torch thread per run. A finished run has ``result.json``; ``plan`` skips it, claims a run by a lock
file (a dead owner's lock is reclaimed), runs it in a subprocess with its log beside the result, and
runs the profile first (``profile.json``, shared by every seed): bench/runner.py, the run loop the
resumable benches share.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # bench/: the shared runner.py
sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/value/: nf4_bench.py
sys.path.insert(0, str(ROOT / "recipes"))  # recipes/finetune.py: the recipes' loader, which every run builds from
import nf4_bench  # noqa: E402  (bench/ is scripts: the held-out loss and the gap probe live there)
import runner  # noqa: E402  (the run loop: claim, subprocess, log, resume, failed set)

# the recipes: recipes/<model>/nf4.yaml (plain QLoRA; the dual path is added here) and its gnmr-nf4.yaml (the
# gnmr block: thresholds, locks, window). The setting of a results folder (setting.json, written by the first plan): the model's recipes and the task.
# generated: the recipe's own data (generated arithmetic problems, the loss on the response); pydocs: the
# Python 3.11 documentation's sources (Debian's python3.11-doc: 497 files, 12 MB), 256-token blocks, the loss
# on every token, every 20th file held out (gnmr_hf.offline.text_data, the recipes' text task; the tutorial
# alone has 17 files, so every-20th would hold none out)
MODELS = ("smollm2-135m", "gemma3-270m")
PYDOCS = "/usr/share/doc/python3.11/html/_sources"
TASKS = {"generated": [], "pydocs": ["--dataset", f"text:{PYDOCS}", "--max_seq_len", "256"]}
DEFAULT_SETTING = {"model": "smollm2-135m", "task": "generated"}


def setting_path(out_root: Path) -> Path:
    return out_root / "setting.json"


def read_setting(out_root: Path) -> dict[str, str]:
    """The folder's model and task (the default, SmolLM2 on its generated problems, when it has none)."""
    path = setting_path(out_root)
    return {**DEFAULT_SETTING, **json.loads(path.read_text())} if path.is_file() else dict(DEFAULT_SETTING)


def check_setting(setting: dict[str, str]) -> dict[str, str]:
    if setting["model"] not in MODELS:
        raise SystemExit(f"unknown model {setting['model']!r} (known: {', '.join(MODELS)})")
    if setting["task"] not in TASKS:
        raise SystemExit(f"unknown task {setting['task']!r} (known: {', '.join(TASKS)})")
    return setting


def recipe_of(setting: dict[str, str], name: str = "nf4") -> Path:
    return ROOT / "recipes" / setting["model"] / f"{name}.yaml"
BUDGETS = (5, 10, 25)
# the first tier: every reference and the 10 % column; then the price curve; then the rest
TIER1 = ("bf16", "nf4", "prof-op-10", "rand-op-10", "gnmr-op-10", "hybrid-10", "loftq")
# loftq+prof-op-10 leads the second tier: LoftQ alone at 0 bytes closes more than the plan alone
TIER2 = ("loftq+prof-op-10", "prof-op-5", "prof-op-25", "rand-op-5", "rand-op-25", "hybrid-5", "hybrid-25")
TIER3 = ("prof-layer-10", "rand-step-10", "edge-10", "gnmr-layer-10")
# the data-free (or label-free) rankings at equal bytes: weight error per byte, output error, a fixed heuristic
BASELINES = ("werr-op-10", "out-op-10", "heur-op-10")
# the precision ladder at equal memory over NF4: the ladder, INT8 only, BF16 only (10 % first)
LADDER = {"lad": ("int8", "bf16"), "lad-int8": ("int8",), "lad-bf16": ("bf16",), "lad-fill": ("int8", "bf16"),
          "lad-grp": ("int8", "bf16"), "cal+lad": ("int8", "bf16")}
FILLED = ("lad-fill",)  # the ladder with its unspent bytes spent on INT8 -> BF16 upgrades (choose_rungs(fill=True))
GROUPED = ("lad-grp",)  # the ladder over whole vLLM serving groups (q/k/v and gate/up of a layer on one rung)
CALIBRATED = ("cal", "cal+lad")  # LoRA from gnmr_hf.calibrated_init (issue 61), named explicitly: not in METHODS
# lad-fill only at 25 %: at 5 and 10 % the knapsack spends the budget and its plan is lad's on both models;
# lad-grp at 10 %: the trained price of serving groups (bench/value/group_price.py prices them forward only)
LADDER_METHODS = tuple(f"{k}-{m}" for m in (10, 5, 25) for k in LADDER if k not in (*FILLED, *GROUPED, *CALIBRATED)) + (
    "lad-fill-25", "lad-grp-10")
METHODS = TIER1 + TIER2 + TIER3 + BASELINES + LADDER_METHODS
# which file holds a kind's scores: profile.json (the product's first-order criterion, from labelled
# batches) or profile_dataless.json (weight error needs no data; the output error needs inputs, no labels)
PROFILED = ("prof-op", "prof-layer", "hybrid", "loftq+prof-op")
DATALESS = {"werr-op": "weight_error", "out-op": "output"}
HEURISTIC_EARLY_LAYERS = 2  # heur-op: down_proj of the first two layers, then every v_proj, then more down_proj
DYNAMIC = ("rand-step", "gnmr-layer", "gnmr-op")  # no fixed set: served on the all-NF4 base
STATIC = ("prof-op", "prof-layer", "rand-op", "edge", "loftq+prof-op", "werr-op", "out-op", "heur-op",
          "late-op")  # fixed sets
OPS_PER_LAYER = 7


# ------------------------------------------------------------------------------------------ method sets


def parse_method(method: str) -> tuple[str, int]:
    """``"prof-op-10"`` -> ``("prof-op", 10)``; references have budget 0 (``bf16``: 100)."""
    if method in ("nf4", "loftq", "cal"):
        return method, 0
    if method == "bf16":
        return method, 100
    kind, _, pct = method.rpartition("-")
    if kind not in (*STATIC, *DYNAMIC, "hybrid", *LADDER) or not pct.isdigit() or not 0 < int(pct) < 100:
        raise SystemExit(f"unknown method {method!r} (known: {', '.join(METHODS)}, or another budget in %)")
    return kind, int(pct)


def greedy_fill(order: list[int], unit_bytes: list[int], budget: int) -> list[int]:
    """Walk ``order`` and keep each unit that still fits in ``budget`` bytes (sorted result)."""
    from gnmr_hf.planning import fill_in_order

    return fill_in_order(order, unit_bytes, budget)


def layer_units(layers: list[int], ops: int = OPS_PER_LAYER) -> list[int]:
    return sorted(u for b in layers for u in range(b * ops, (b + 1) * ops))


def heuristic_order(names: list[str], early: int = HEURISTIC_EARLY_LAYERS) -> list[int]:
    """The order a practitioner's fixed rule keeps linears in: the ``down_proj`` of the first ``early``
    layers, then the attention ``v_proj`` of every layer, then the other layers' ``down_proj`` (layer order).
    ``names`` are the units' names (``layers.3.mlp.down_proj``); other linears never enter."""
    import re

    parsed = []
    for i, name in enumerate(names):
        m = re.search(r"layers\.(\d+)\..*?(\w+)$", name)
        if m:
            parsed.append((int(m.group(1)), m.group(2), i))
    down = sorted((layer, i) for layer, op, i in parsed if op == "down_proj")
    v = sorted((layer, i) for layer, op, i in parsed if op == "v_proj")
    return [i for layer, i in down if layer < early] + [i for _, i in v] + [i for layer, i in down if layer >= early]


def static_set(kind: str, pct: int, unit_bytes: list[int], scores: list[float] | None, seed: int,
               names: list[str] | None = None) -> list[int]:
    """The fixed set of a static method at ``pct`` % of the bytes (``names``: the units', for ``heur-op``)."""
    from gnmr_hf.planning import greedy_select  # the product's planner: greedy by score per byte

    total = sum(unit_bytes)
    budget = total * pct // 100
    U = len(unit_bytes)
    if kind in ("prof-op", "loftq+prof-op", "werr-op", "out-op", "late-op"):
        return greedy_select(scores, unit_bytes, budget)
    if kind == "heur-op":
        if names is None or len(names) != U:
            raise ValueError("heur-op needs the units' names")
        return greedy_fill(heuristic_order(names), unit_bytes, budget)
    if kind == "hybrid":  # the planned part: 3/4 of the budget
        return greedy_select(scores, unit_bytes, total * pct * 3 // 400)
    L = U // OPS_PER_LAYER
    layer_bytes = [sum(unit_bytes[b * OPS_PER_LAYER:(b + 1) * OPS_PER_LAYER]) for b in range(L)]
    if kind == "prof-layer":
        layer_scores = [sum(scores[b * OPS_PER_LAYER:(b + 1) * OPS_PER_LAYER]) for b in range(L)]
        return layer_units(greedy_select(layer_scores, layer_bytes, budget))
    if kind == "edge":
        order = [b for pair in zip(range(L), reversed(range(L))) for b in pair]
        return layer_units(greedy_fill(list(dict.fromkeys(order)), layer_bytes, budget))
    if kind == "rand-op":
        order = list(range(U))
        random.Random(1000 + seed).shuffle(order)
        return greedy_fill(order, unit_bytes, budget)
    raise ValueError(f"{kind} has no fixed set")


def ladder_plan(kind: str, pct: int, prof: dict[str, Any], architecture: str | None = None) -> dict[str, str]:
    """A ladder method's ``{linear: rung}`` from profile_ladder.json at ``pct`` % memory over the NF4 model.

    ``lad-grp`` buys whole vLLM serving groups (``choose_rungs(..., groups=serving_groups(architecture,
    linears))``): it needs the model's ``architecture`` (e.g. ``"Gemma3ForCausalLM"``, see :func:`architecture`)."""
    from gnmr_hf.planning.ladder import LadderUnit, choose_rungs

    units = [LadderUnit(u["name"], u["numel"], u["rows"], dict(u["gains"]), {r: int(b) for r, b in u["prices"].items()})
             for u in prof["units"]]
    groups = None
    if kind in GROUPED:
        from gnmr_hf.planning.groups import serving_groups

        if not architecture:
            raise ValueError(f"{kind} plans whole serving groups: give the model's architecture")
        groups = serving_groups(architecture, [u.name for u in units])
    return choose_rungs(units, prof["nf4_model_bytes"] * pct // 100, LADDER[kind], fill=kind in FILLED, groups=groups)


def architecture(setting: dict[str, str]) -> str:
    """The setting's model class as its config.json names it (``architectures[0]``), read without loading it."""
    import finetune
    from transformers import AutoConfig

    recipe = finetune.load_config(["--config", str(recipe_of(setting))])
    (arch,) = AutoConfig.from_pretrained(finetune.resolve_model_path(recipe.script.model)).architectures
    return arch


def served_units(kind: str, planned: list[int]) -> list[int]:
    """The units in BF16 on the *served* route: the fixed set (hybrid: its planned part); none for the
    dynamic methods, whose sets change every step."""
    return [] if kind in DYNAMIC else list(planned)


class RandomBytesPolicy:
    """A random set of units filling a byte budget, drawn again every step (seeded; a trigger policy)."""

    name = "random_bytes"
    needs_microbatch_norms = False

    def __init__(self, num_units: int, unit_bytes: list[int], budget: int, seed: int) -> None:
        self.num_units, self.unit_bytes, self.budget, self.seed = num_units, list(unit_bytes), int(budget), seed
        self.t = 0
        self.sets: list[list[int]] = []
        self.last_record: dict[str, Any] | None = None

    def _draw(self, t: int) -> list[int]:
        order = list(range(self.num_units))
        random.Random(self.seed * 100_003 + t).shuffle(order)
        return greedy_fill(order, self.unit_bytes, self.budget)

    def _mask(self, units: list[int]):
        import torch

        mask = torch.zeros(self.num_units, dtype=torch.bool)
        mask[units] = True
        return mask

    def initial_mask(self):
        return self._mask(self._draw(1))

    def step(self, norms):
        self.t += 1
        units = self._draw(self.t + 1)
        self.sets.append(units)
        self.last_record = {"step": self.t, "active": units,
                            "active_bytes": sum(self.unit_bytes[u] for u in units), "budget_bytes": self.budget}
        return self._mask(units)

    def summary(self) -> dict[str, Any]:
        used = [sum(self.unit_bytes[u] for u in s) for s in self.sets] or [0]
        return {"steps": self.t, "mean_active_bytes": statistics.mean(used), "peak_active_bytes": max(used)}

    def state_dict(self) -> dict[str, Any]:
        return {"t": self.t, "seed": self.seed, "budget": self.budget}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["seed"] != self.seed or state["budget"] != self.budget:
            raise ValueError(f"state is for seed {state['seed']} / budget {state['budget']}")
        self.t = int(state["t"])


# ---------------------------------------------------------------------------------------------- profile


def profile_path(out_root: Path) -> Path:
    return out_root / "profile.json"


def dataless_path(out_root: Path) -> Path:
    return out_root / "profile_dataless.json"


def late_path(out_root: Path) -> Path:
    """The profile at a trained point (``bench/value/late_profile.py --write-profile``), the ``late-op`` plans' scores."""
    return out_root / "profile_late.json"


def ladder_path(out_root: Path) -> Path:
    return out_root / "profile_ladder.json"


def make_ladder_profile(out_root: Path, batches: int, threads: int = 1) -> dict[str, Any]:
    """Every decoder linear's first-order gain on each rung (``gnmr_hf.planning.ladder.rung_gains``) on the
    same first ``batches`` training batches as profile.json, at the all-NF4 point of the stock-loaded model
    (LoRA starts at zero, so it is the runs' starting point), with each rung's price over NF4 and the NF4
    model's bytes as a stock load in BF16 holds them; written atomically to profile_ladder.json."""
    import torch

    torch.set_num_threads(threads)
    from gnmr_hf.planning import ladder
    from gnmr_hf.planning.budget import over_low_prices

    run_dir = out_root / "profile_ladder_run"
    recipe, tokenizer, model_path = load_recipe(run_dir, seed=0, steps=1, data_dir=out_root / "data",
                                                setting=read_setting(out_root))
    data = profile_batches(recipe, tokenizer, run_dir, batches)
    t0 = time.perf_counter()
    stock = ladder._stock_low(model_path, "nf4", torch.float32)  # FP32 compute, as the runs; reference layout
    units = ladder.rung_gains(stock, model_path, data)
    l_low = ladder._loss(stock, data)
    del stock
    nf4 = over_low_prices(model_path, [u.name for u in units], "nf4")["low_model_bytes"]  # as a stock load holds it
    result = {"batches": batches, "seconds": round(time.perf_counter() - t0, 1), "loss_low": l_low,
              "nf4_model_bytes": nf4, "rungs": list(ladder.RUNGS),
              "units": [{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                        for u in units]}
    tmp = ladder_path(out_root).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, ladder_path(out_root))
    return result


def make_profile(out_root: Path, batches: int, threads: int = 1, dataless: bool = False) -> dict[str, Any]:
    """Score every linear on the first ``batches`` training batches (the default criterion of
    :func:`gnmr_hf.profile_sensitivity`) and write ``profile.json`` (atomically); ``dataless``: the
    baselines' criteria (``weight_error``, no data; ``output``, inputs without labels) into
    ``profile_dataless.json`` instead, so that the product's profile and its rows never change."""
    import torch

    torch.set_num_threads(threads)
    import gnmr_hf

    model, tokenizer, recipe, model_path = build(out_root / "profile_run", seed=0, steps=1, data_dir=out_root / "data",
                                                 setting=read_setting(out_root))
    data = profile_batches(recipe, tokenizer, out_root / "profile_run", batches)
    from gnmr_hf.planning import DEFAULT_CRITERION

    t0 = time.perf_counter()
    if dataless:
        prof = gnmr_hf.profile_sensitivity(model, data, criteria=tuple(DATALESS.values()))
        result = {"criteria": list(DATALESS.values()), "batches": batches,
                  "seconds": round(time.perf_counter() - t0, 1),
                  "units": [{"name": u.name, "bytes": int(u.bytes), **{c: float(u.scores[c]) for c in DATALESS.values()}}
                            for u in prof.units]}
        tmp = dataless_path(out_root).with_suffix(".tmp")
        tmp.write_text(json.dumps(result, indent=1) + "\n")
        os.replace(tmp, dataless_path(out_root))
        return result
    prof = gnmr_hf.profile_sensitivity(model, data, criteria=(DEFAULT_CRITERION,))
    seconds = time.perf_counter() - t0
    prof.to_json(out_root / "profile_full.json")
    scores = prof.scores(DEFAULT_CRITERION)
    result = {"criterion": DEFAULT_CRITERION, "batches": batches, "seconds": round(seconds, 1),
              "losses": {k: prof.losses[k] for k in ("low", "high")},
              "units": [{"name": u.name, "bytes": int(u.bytes), "score": float(sc)}
                        for u, sc in zip(prof.units, scores)]}
    tmp = profile_path(out_root).with_suffix(".tmp")
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    os.replace(tmp, profile_path(out_root))
    return result


# -------------------------------------------------------------------------------------------- one run


def load_recipe(out: Path, seed: int, steps: int, data_dir: Path, compute_dtype: str = "float32",
                setting: dict[str, str] | None = None):
    """(recipe, tokenizer, model path) of the setting's ``nf4`` recipe with the bench's overrides; seeds."""
    import finetune
    from transformers import AutoTokenizer, set_seed

    setting = check_setting(setting or dict(DEFAULT_SETTING))
    recipe = finetune.load_config(["--config", str(recipe_of(setting)), "--output_dir", str(out), "--seed", str(seed),
                                   "--max_steps", str(steps), "--data_dir", str(data_dir), "--report_to", "none",
                                   "--disable_tqdm", "true", "--compute_dtype", compute_dtype, *TASKS[setting["task"]]])
    set_seed(seed)
    model_path = finetune.resolve_model_path(recipe.script.model)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return recipe, tokenizer, model_path


def profile_batches(recipe, tokenizer, run_dir: Path, batches: int) -> list[dict[str, Any]]:
    """The first ``batches`` training batches, collated as the Trainer collates them (the profiles' data)."""
    train_ds = _train_dataset(recipe, tokenizer, run_dir)
    collate = _collator(tokenizer)
    bs = recipe.training.per_device_train_batch_size
    return [dict(collate([train_ds[j] for j in range(i * bs, (i + 1) * bs)])) for i in range(batches)]


def build(out: Path, seed: int, steps: int, data_dir: Path, compute_dtype: str = "float32",
          rungs: dict[str, str] | None = None, setting: dict[str, str] | None = None):
    """The recipe's NF4 model with LoRA and a BF16 recovery path on every linear (``rungs``: the named
    linears' recovery path on that rung instead, ``prepare_dual_path``'s argument)."""
    import finetune
    import torch

    import gnmr_hf

    recipe, tokenizer, model_path = load_recipe(out, seed, steps, data_dir, compute_dtype, setting)
    model = finetune.load_model(recipe, model_path)  # NF4 + LoRA (PEFT), bitsandbytes' reference layout
    gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage="host", units="linears",
                              dtype=getattr(torch, compute_dtype), rungs=rungs)
    return model, tokenizer, recipe, model_path


def _train_dataset(recipe, tokenizer, out: Path):
    """The recipe's training rows, as recipes/finetune.py reads them (gnmr_hf.recipe.training_rows)."""
    from gnmr_hf.recipe import training_rows

    return training_rows(recipe.script, tokenizer, str(out))[0]


def heldout_set(recipe, tokenizer, data_dir: Path, n: int) -> list[dict[str, Any]]:
    """The first ``n`` held-out examples: generated test problems (disjoint from the training ones), or for a
    text task the held-out files' blocks (the split text_task makes)."""
    from gnmr_hf.recipe import TEXT

    script = recipe.script
    if script.dataset.startswith(TEXT):
        from gnmr_hf.offline.text_data import text_task

        held = text_task(script.dataset[len(TEXT):], tokenizer, script.max_seq_len)[1]
        if not held:
            raise SystemExit(f"{script.dataset} holds out no block (fewer than 20 files, or too short ones)")
        return held[:n]
    from gnmr_hf.offline.gsm8k import write_gsm8k_jsonl

    path = write_gsm8k_jsonl(data_dir, n_train=script.num_generated, seed=script.generated_seed) / "test.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()][:n]


def heldout_loss(model, tokenizer, held: list[dict[str, Any]], script, batch_size: int = 4) -> float:
    """Mean loss per target token: response tokens of generated problems (nf4_bench.heldout_loss), or
    every token of the held-out text blocks (their ``labels``)."""
    if not held or "input_ids" not in held[0]:
        return nf4_bench.heldout_loss(model, tokenizer, held, script)
    import torch

    def batches():
        for i in range(0, len(held), batch_size):
            ids = torch.tensor([r["input_ids"] for r in held[i:i + batch_size]])
            yield {"input_ids": ids, "attention_mask": torch.ones_like(ids),
                   "labels": torch.tensor([r["labels"] for r in held[i:i + batch_size]])}

    return nf4_bench.token_loss(model, batches())


def _collator(tokenizer):
    from transformers import DataCollatorForSeq2Seq

    return DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)


def unit_bytes_of(units) -> list[int]:
    """Each unit's BF16 bytes: what keeping its weight in BF16 costs."""
    from gnmr_hf.backends.base import dual_path_modules

    out = []
    for _, unit in units:
        out.append(sum(2 * m.in_features * m.out_features for m in dual_path_modules(unit)))
    return out


def _peak_rss() -> int:
    """The process's peak resident set size in bytes (Linux reports KiB)."""
    import resource

    return int(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) * 1024


def _meta_model(model):
    """The plain transformers model of ``model``'s config on the meta device (shapes only)."""
    import torch
    from transformers import AutoModelForCausalLM

    from gnmr_hf.units import unwrap_model

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(unwrap_model(model).config)


def _plain_names(meta, units) -> list[str]:
    """Every unit's linear as named in the plain transformers model ``meta``."""
    import torch

    linears = {n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear)}
    return [_plain_name(n, linears) for n, _ in units]


def served_weight_bytes(model, units, served_set: list[int], rungs: dict[str, str] | None = None) -> dict[str, Any]:
    """What the served model's weights take (gnmr_hf.memory: as a stock bitsandbytes NF4 load holds
    them, quant states included) with the served set on BF16 (``rungs``: plain linear name -> rung, for
    a ladder plan's INT8 rungs), and all-NF4, so that a row's price reads as memory over the NF4 model."""
    import gnmr_hf.memory

    meta = _meta_model(model)
    names = _plain_names(meta, units)
    kept = {names[u] for u in served_set}
    nf4 = gnmr_hf.memory.predict_model_bytes(meta, names, "nf4")["total"]
    served = gnmr_hf.memory.predict_model_bytes(meta, [n for n in names if n not in kept], "nf4")["total"]
    modules = dict(meta.named_modules())
    for name, rung in (rungs or {}).items():
        if rung != "bf16":  # a kept linear on INT8: its INT8 bytes, not its BF16 ones
            w = modules[name].weight
            served -= (gnmr_hf.memory.extra_bytes_over_low(w.numel(), w.shape[0], "nf4")
                       - gnmr_hf.memory.extra_bytes_over_low(w.numel(), w.shape[0], "nf4", high=rung))
    return {"served_weight_bytes": served, "nf4_weight_bytes": nf4, "memory_over_nf4": served / nf4 - 1}


def _plain_name(unit_name: str, linears: set[str]) -> str:
    """A unit's linear as named in the plain transformers model (PEFT's prefixes and wrappers dropped)."""
    from gnmr_hf.units import short_name

    short = short_name(unit_name)
    for cand in (short, "model." + short):
        if cand in linears:
            return cand
    hits = [n for n in linears if n.endswith("." + short)]
    if len(hits) != 1:
        raise ValueError(f"unit {unit_name} is not one linear of the plain model ({len(hits)} matches)")
    return hits[0]


def run_one(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    torch.set_num_threads(args.threads)
    from transformers import Trainer, TrainerCallback

    import gnmr_hf
    import gnmr_hf.memory
    from gnmr_hf.backends.base import active_units, recovery_device_bytes, set_active_units
    from gnmr_hf.core.controller import GNMRConfig, GNMRController
    from gnmr_hf.core.policies import HybridPolicy, StaticSetPolicy
    from gnmr_hf.reporting.stored import compress
    from gnmr_hf.trainer.trace import TRACE_NAME
    from gnmr_hf.units import find_decoder_layers, resolve_units

    kind, pct = parse_method(args.method)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    out_root = Path(args.root) if getattr(args, "root", None) else out.parent.parent  # profile.json, data/
    data_dir = Path(args.data_dir) if args.data_dir else out_root / "data"
    scores_file = (profile_path(out_root) if kind in PROFILED else late_path(out_root) if kind == "late-op"
                   else dataless_path(out_root) if kind in DATALESS else None)  # the plan's per-linear scores
    needed = scores_file or (ladder_path(out_root) if kind in LADDER else None)
    if needed is not None and not needed.is_file():  # before the model loads
        raise SystemExit(f"{args.method} needs {needed} (" + ("late-op: run bench/value/late_profile.py --write-profile first"
                         if kind == "late-op" else "the plan subcommand writes it before the runs") + ")")
    setting = read_setting(out_root)
    rungs = (ladder_plan(kind, pct, json.loads(ladder_path(out_root).read_text()),
                         architecture(setting) if kind in GROUPED else None) if kind in LADDER else None)
    model, tokenizer, recipe, model_path = build(out, args.seed, args.steps, data_dir, rungs=rungs, setting=setting)
    units = resolve_units(model)  # the linears (recorded by prepare_dual_path)
    U = len(units)
    ub = unit_bytes_of(units)
    total = sum(ub)
    budget = total * pct // 100
    scores = None
    names = [gnmr_hf.units.short_name(n) for n, _ in units]
    if scores_file is not None:
        prof = json.loads(scores_file.read_text())
        if [u["name"] for u in prof["units"]] != names:
            raise SystemExit(f"{scores_file.name} names other units than this model's")
        scores = [u[DATALESS[kind]] if kind in DATALESS else u["score"] for u in prof["units"]]

    import finetune

    gnmr_cfg = finetune.load_config(["--config", str(recipe_of(setting, "gnmr-nf4"))]).gnmr.config  # thresholds, ...
    callback_units = None
    planned: list[int] = []
    if kind == "bf16":
        planned = list(range(U))
    elif kind in ("nf4", "loftq", "cal"):
        planned = []
    elif kind in STATIC:
        planned = static_set(kind, pct, ub, scores, args.seed, names)
    elif kind in LADDER:  # the linears the plan keeps off NF4, each on its rung (set by build)
        plain = _plain_names(_meta_model(model), units)
        planned = [i for i, n in enumerate(plain) if n in rungs]
        if len(planned) != len(rungs):
            raise SystemExit("profile_ladder.json names linears this model's units do not hold")
    if kind in ("bf16", "nf4", "loftq", "cal", *STATIC, *LADDER):
        policy = StaticSetPolicy(U, planned, max_active=max(1, len(planned)), unit_bytes=ub)
    elif kind == "rand-step":
        policy = RandomBytesPolicy(U, ub, budget, seed=1000 + args.seed)
    elif kind == "gnmr-op":
        policy = GNMRController(U, GNMRConfig(**{**gnmr_cfg.to_dict(), "max_active": U, "max_active_bytes": budget}),
                                unit_bytes=ub)
    elif kind == "hybrid":
        planned = static_set(kind, pct, ub, scores, args.seed)
        rest = budget - sum(ub[u] for u in planned)
        policy = HybridPolicy(U, planned, GNMRConfig(**{**gnmr_cfg.to_dict(), "max_active": U, "max_active_bytes": rest}),
                              unit_bytes=ub)
    elif kind == "gnmr-layer":
        layers = find_decoder_layers(model)
        layer_bytes = total // len(layers)
        k = max(1, budget // layer_bytes)
        callback_units = [n for n, _ in layers]
        policy = GNMRController(len(layers), GNMRConfig(**{**gnmr_cfg.to_dict(), "max_active": k}))
    if kind.startswith("loftq"):
        from gnmr_hf.loftq import replace_lora_weights_loftq

        t0 = time.perf_counter()
        # LoftQ on the linears that stay NF4; one on BF16 keeps the stock init (no quantisation error there)
        replace_lora_weights_loftq(model, model_path, skip=[units[u][0] for u in planned])
        loftq_s = time.perf_counter() - t0
    elif kind in CALIBRATED:
        from gnmr_hf.calibrated_init import calibrated_lora_init

        t0 = time.perf_counter()
        # calibrated on the profile_ladder.json batches (the ladder's own), the planned linears on their rungs
        n_calib = json.loads(ladder_path(out_root).read_text())["batches"] if ladder_path(out_root).is_file() else 2
        set_active_units(model, planned, units)
        calibrated_lora_init(model, profile_batches(recipe, tokenizer, out, n_calib), model_path,
                             skip=[units[u][0] for u in planned], compare_loftq=False)
        set_active_units(model, [], units)
        loftq_s = time.perf_counter() - t0
    else:
        loftq_s = 0.0

    callback = gnmr_hf.GNMRCallback(policy=policy, units=callback_units)
    every = getattr(args, "oracle_every", 0) or 0
    if every and recipe.training.gradient_accumulation_steps != 1:
        raise SystemExit("--oracle-every needs gradient_accumulation_steps 1 (the probe clears the gradients)")
    probe = nf4_bench.GapProbe(model, units) if every else None
    oracle_rows: list[dict[str, Any]] = []
    step_times: list[float] = []
    recovery_bytes: list[int] = []
    active_per_step: list[list[int]] = []

    class Bench(TrainerCallback):
        def on_step_begin(self, a, state, control, **kw):
            self.t0, self.probe0 = time.perf_counter(), probe.seconds if probe else 0.0
            active_per_step.append(active_units(model, units))
            recovery_bytes.append(recovery_device_bytes(model))

        def on_step_end(self, a, state, control, **kw):
            step_times.append(time.perf_counter() - self.t0 - ((probe.seconds if probe else 0.0) - self.probe0))

    eval_every = getattr(args, "eval_every", 0) or 0
    script = recipe.script
    test = heldout_set(recipe, tokenizer, data_dir, args.eval_problems)
    curve: list[dict[str, Any]] = []

    int8_rungs = {n: r for n, r in (rungs or {}).items() if r == "int8"}

    def recovery_rungs(on: dict[str, str] | None) -> None:
        """The recovery paths on ``on``'s rungs (None: every linear on BF16), prepare_dual_path again."""
        gnmr_hf.prepare_dual_path(model, recovery_source=model_path, storage="host", units="linears",
                                  dtype=torch.float32, rungs=on)

    def both_routes() -> tuple[float, float]:
        """Held-out loss served (the run's fixed set, on its rungs) and merged (all BF16); restores the
        active set (and a ladder plan's INT8 rungs)."""
        was_training, before = model.training, active_units(model, units)
        set_active_units(model, served_units(kind, planned), units)
        served = heldout_loss(model, tokenizer, test, script)
        if int8_rungs:
            recovery_rungs(None)
        set_active_units(model, list(range(U)), units)
        merged = heldout_loss(model, tokenizer, test, script)
        if int8_rungs:
            recovery_rungs(rungs)
        set_active_units(model, before, units)
        model.train(was_training)
        return served, merged

    class Curve(TrainerCallback):
        """Every ``--eval-every`` steps: both routes' held-out loss, written to curve.json at once."""

        def on_step_end(self, a, state, control, **kw):
            if eval_every and state.global_step % eval_every == 0 and state.global_step < args.steps:
                served, merged = both_routes()
                curve.append({"step": state.global_step, "heldout_loss_served": served, "heldout_loss_merged": merged,
                              "peak_rss_bytes": _peak_rss()})
                tmp = out / ".curve.json.tmp"
                tmp.write_text(json.dumps(curve) + "\n")
                os.replace(tmp, out / "curve.json")

    class BenchTrainer(Trainer):
        def training_step(self, model_, inputs, num_items_in_batch=None):
            step = self.state.global_step + 1
            if probe is not None and (step - 1) % every == 0 and not (oracle_rows and oracle_rows[-1]["step"] == step):
                # every unit's recovery gap on this step's batch (LoRA gradients all-NF4 vs all-BF16,
                # dropout off), before the step runs; the set it runs is recorded at its start
                oracle_rows.append({"step": step, "gaps": [float(g) for g in
                                                           probe.measure(self._prepare_inputs(dict(inputs)))]})
            return super().training_step(model_, inputs, num_items_in_batch)

    train_ds = _train_dataset(recipe, tokenizer, out)
    trainer = BenchTrainer(model=model, args=recipe.training, train_dataset=train_ds, data_collator=_collator(tokenizer),
                      callbacks=[Bench(), Curve(), callback])
    start = time.time()
    trainer.train()
    train_s = time.time() - start

    served_set = served_units(kind, planned)
    loss_served, loss_merged = both_routes()
    curve.append({"step": args.steps, "heldout_loss_served": loss_served, "heldout_loss_merged": loss_merged,
                  "peak_rss_bytes": _peak_rss()})
    set_active_units(model, [], units)
    weights = served_weight_bytes(model, units, served_set, rungs)
    if getattr(args, "save_adapter", None):
        model.save_pretrained(args.save_adapter)  # the LoRA adapter alone (plain PEFT files)
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    used = [sum(ub[u] for u in a) for a in active_per_step]
    result: dict[str, Any] = {
        "method": args.method, "kind": kind, "budget_pct": pct, "seed": args.seed, "steps": args.steps, **setting,
        "num_units": U, "total_bf16_bytes": total, "budget_bytes": budget,
        "planned": [gnmr_hf.units.short_name(units[u][0]) for u in planned], "served_set_size": len(served_set),
        "served_set_bytes": sum(ub[u] for u in served_set),
        "train_losses": losses, "heldout_loss_served": loss_served, "heldout_loss_merged": loss_merged,
        "eval_problems": len(test), "mean_active_bytes": statistics.mean(used), "peak_active_bytes": max(used),
        "mean_active": statistics.mean(len(a) for a in active_per_step),
        "active_per_step": active_per_step, "peak_recovery_bytes": max(recovery_bytes),
        "step_s_median": statistics.median(step_times), "step_s": step_times, "train_wall_s": round(train_s, 1),
        "loftq_s": round(loftq_s, 1), "summary": json.loads((out / "gnmr_summary.json").read_text()),
        "threads": torch.get_num_threads(), "rungs": rungs,
        "int8_linears": sum(r == "int8" for r in (rungs or {}).values()),
        "bf16_linears": sum(r == "bf16" for r in (rungs or {}).values()) if rungs is not None else len(served_set),
        "curve": curve, "eval_every": eval_every, "peak_rss_bytes": _peak_rss(),
        "trained_model_bytes": gnmr_hf.memory.model_bytes(model)["total"] + recovery_device_bytes(model),
        **weights,
    }
    if probe is not None:
        for row in oracle_rows:
            row["active"] = active_per_step[row["step"] - 1]
        result.update(oracle_rows=oracle_rows, oracle_every=every, gap_probe_s=round(probe.seconds, 1),
                      unit_names=[gnmr_hf.units.short_name(n) for n, _ in units], unit_bytes=ub)
    compress(out / TRACE_NAME)  # results stay light: the trace as gnmr_trace.jsonl.gz, before the run counts as done
    tmp = out / ".result.json.tmp"
    tmp.write_text(json.dumps(result) + "\n")
    os.replace(tmp, out / "result.json")
    print(f"{args.method} seed {args.seed}: held-out loss served {loss_served:.4f}, merged {loss_merged:.4f}, "
          f"served weights +{100 * weights['memory_over_nf4']:.1f} % over NF4, peak RSS "
          f"{result['peak_rss_bytes'] / 2**30:.2f} GiB, step {result['step_s_median']:.2f} s")
    return result


# -------------------------------------------------------------------------------------------- oracle

ORACLE_METHOD = "gnmr-op-10"  # the run whose steps the oracle diagnostic measures (seed 0)
RANDOM_DRAWS = 20


def oracle_set(gaps: list[float], unit_bytes: list[int], budget: int) -> list[int]:
    """The oracle at operator grain under a byte budget: greedy by recovery gap per byte (ties to the lower
    index), units with a zero gap left out (nothing to recover)."""
    order = sorted((b for b in range(len(gaps)) if gaps[b] > 0), key=lambda b: (-gaps[b] / unit_bytes[b], b))
    return greedy_fill(order, unit_bytes, budget)


def oracle_scores(gaps: list[float], chosen: list[int], unit_bytes: list[int], budget: int) -> dict[str, float]:
    """One step: a chosen set against the oracle set at the same byte budget.

    precision = |C & O| / |C|, recall = |C & O| / |O|, bytes_recall = bytes(C & O) / bytes(O),
    captured = sum of gaps over C / sum over all units, oracle_captured = the same for O.
    """
    import math

    oracle, picked = set(oracle_set(gaps, unit_bytes, budget)), set(chosen)
    hits = picked & oracle
    total = sum(gaps)
    return {
        "precision": len(hits) / len(picked) if picked else math.nan,
        "recall": len(hits) / len(oracle) if oracle else math.nan,
        "bytes_recall": sum(unit_bytes[b] for b in hits) / sum(unit_bytes[b] for b in oracle) if oracle else math.nan,
        "captured": sum(gaps[b] for b in picked) / total if total > 0 else math.nan,
        "oracle_captured": sum(gaps[b] for b in oracle) / total if total > 0 else math.nan,
    }


def oracle_choices(result: dict[str, Any], scores: list[float] | None) -> dict[str, list[list[int]]]:
    """Per measured step, the set each trigger runs (or would run) at the run's byte budget."""
    rows, ub, pct = result["oracle_rows"], result["unit_bytes"], result["budget_pct"]
    budget = sum(ub) * pct // 100
    choices: dict[str, list[list[int]]] = {f"{result['method']} (as run)": [r["active"] for r in rows]}
    if scores is not None:
        planned = static_set("prof-op", pct, ub, scores, 0)
        choices[f"profile plan (prof-op-{pct})"] = [planned] * len(rows)
    for d in range(RANDOM_DRAWS):  # fixed random sets, one per draw; their mean is the row
        choices[f"random operators #{d}"] = [static_set("rand-op", pct, ub, None, d)] * len(rows)
    # hindsight: the previous measured step's oracle set (how stable the oracle is from step to step)
    choices["previous measured step's oracle"] = [[]] + [oracle_set(r["gaps"], ub, budget) for r in rows[:-1]]
    return choices


def oracle_table(result: dict[str, Any], scores: list[float] | None) -> list[dict[str, Any]]:
    """Mean over the measured steps of each trigger's scores (the random draws averaged into one row)."""
    rows, ub, pct = result["oracle_rows"], result["unit_bytes"], result["budget_pct"]
    budget = sum(ub) * pct // 100
    table: dict[str, list[dict[str, float]]] = {}
    for name, sets in oracle_choices(result, scores).items():
        key = f"random operators (mean of {RANDOM_DRAWS} fixed sets)" if name.startswith("random operators #") else name
        first = 1 if name.startswith("previous") else 0
        table.setdefault(key, []).extend(oracle_scores(r["gaps"], c, ub, budget)
                                         for r, c in list(zip(rows, sets))[first:])
    out = []
    for name, per_step in table.items():
        row = {"trigger": name, "steps": len(per_step)}
        for k in ("precision", "recall", "bytes_recall", "captured", "oracle_captured"):
            vals = [v[k] for v in per_step if v[k] == v[k]]
            row[k] = statistics.mean(vals) if vals else float("nan")
        out.append(row)
    return out


def oracle_dir(out: Path, seed: int = 0) -> Path:
    return out / "oracle" / ORACLE_METHOD / f"seed{seed}"


# ------------------------------------------------------------------------------------ bundled eval

BUNDLED_METHODS = ("bf16", "nf4", "gnmr-op-10", "prof-op-10", "loftq+prof-op-10")  # the best at 10 % last
BUNDLED_TASKS = "gsm8k,wikitext"


def bundled_routes(kind: str, served_modules: list[str]) -> dict[str, tuple[str, list[str] | None]]:
    """Route -> (precision, skip_modules) of the base the adapter is scored on with the bundled eval:
    served = NF4 with the served set unquantised (stock ``llm_int8_skip_modules``), merged = BF16."""
    from gnmr_hf.planning import skip_modules

    if kind == "bf16":
        return {"merged": ("bf16", None)}  # served on BF16 is the same base
    served = ("nf4", skip_modules(served_modules)) if served_modules else ("nf4", None)
    return {"served": served, "merged": ("bf16", None)}


def bundled(args: argparse.Namespace) -> None:
    """Train ``--methods`` once more at ``--seed`` keeping the adapters, and score them with the bundled
    lm-eval script on the offline eval set (GSM8K-style EM, WikiText word perplexity) on both routes."""
    import finetune

    from gnmr_hf.evaluation.evaluate import evaluate
    from gnmr_hf.offline.eval_data import write_eval_data

    out = Path(args.out)
    data_dir = out / "eval_data"
    if not (data_dir / "gsm8k" / "test.jsonl").is_file():
        write_eval_data(data_dir)
    model_path = finetune.resolve_model_path(
        finetune.load_config(["--config", str(recipe_of(read_setting(out)))]).script.model)
    prof = json.loads((out / "profile_full.json").read_text()) if (out / "profile_full.json").is_file() else None
    full_names = {u["name"]: u["modules"] for u in prof["units"]} if prof else {}
    for method in args.methods.split(","):
        kind, _ = parse_method(method)
        run_dir = out / "bundled" / method / f"seed{args.seed}"
        if not (run_dir / "result.json").is_file():
            if not runner.claim(run_dir):
                print(f"{method}: another process holds {run_dir}; skipped", flush=True)
                continue
            print(f"[{time.strftime('%H:%M:%S')}] training {method} seed {args.seed} (adapter kept)", flush=True)
            cmd = [sys.executable, __file__, "run", "--method", method, "--seed", str(args.seed), "--out", str(run_dir),
                   "--steps", str(args.steps), "--eval-problems", str(args.eval_problems),
                   "--data-dir", str(out / "data"), "--save-adapter", str(run_dir / "adapter"), "--root", str(out)]
            if not runner.run_claimed(run_dir, cmd, method):
                continue
        result = json.loads((run_dir / "result.json").read_text())
        served_names = [] if kind == "bf16" else served_units(kind, result["planned"])  # bf16: one route
        if served_names and not full_names:
            raise SystemExit("profile_full.json is missing: run the profile first")
        served = [m for name in served_names for m in full_names[name]]
        for route, (precision, skips) in bundled_routes(kind, served).items():
            target = run_dir / f"eval_{route}.json"
            if target.is_file():
                continue
            print(f"[{time.strftime('%H:%M:%S')}] eval {method} {route}: {precision}"
                  + (f" + {len(skips) - 1} linears unquantised" if skips else ""), flush=True)
            evaluate(str(model_path), BUNDLED_TASKS, adapter=run_dir / "adapter", precision=precision,
                     skip_modules=skips, data_dir=data_dir, limit=args.limit, num_fewshot=0, batch_size=8,
                     max_gen_toks=128, compute_dtype="float32", resume_dir=run_dir / "eval" / route,
                     output=target, method=f"{method} {route}", bootstrap_iters=0)


def bundled_table(out: Path) -> list[str]:
    """The bundled-eval rows, one per (method, route) scored."""
    lines = []
    for path in sorted((out / "bundled").glob("*/seed*/eval_*.json")):
        s = json.loads(path.read_text())["summary"]
        result = json.loads((path.parent / "result.json").read_text())
        plan_r = out / result["method"] / f"seed{result['seed']}" / "result.json"
        same = ""
        if plan_r.is_file():
            ref = json.loads(plan_r.read_text())
            same = f"{abs(ref['heldout_loss_merged'] - result['heldout_loss_merged']):.1e}"
        route = path.stem.removeprefix("eval_")
        em, ppl = s.get("gsm8k_em"), s.get("wikitext_word_ppl")
        lines.append(f"| {result['method']} | {route} | {'-' if em is None else f'{100 * em:.1f}'} | "
                     f"{'-' if ppl is None else f'{ppl:.2f}'} | "
                     f"{result['heldout_loss_' + ('served' if route == 'served' else 'merged')]:.4f} | {same} |")
    return lines


# ---------------------------------------------------------------------------------------------- plan


def plan_runs(seeds: list[int], methods: tuple[str, ...] = METHODS) -> list[tuple[str, int]]:
    """Tier by tier (each tier over every seed), so that an interrupted table is complete column-wise; the
    methods asked for that no tier names (another budget, say) come last, in the order given."""
    runs = []
    tiers = (TIER1, TIER2, TIER3, BASELINES, LADDER_METHODS)
    others = tuple(m for m in dict.fromkeys(methods) if not any(m in t for t in tiers))
    for tier in (*tiers, others):
        for s in seeds:
            runs += [(m, s) for m in tier if m in methods]
    return runs


def _run_dir(out: Path, method: str, seed: int) -> Path:
    if method.startswith("oracle:"):
        return oracle_dir(out, seed)
    return out / method / f"seed{seed}"


def needs_profile(method: str) -> bool:
    if method.startswith("oracle:"):
        return False
    return parse_method(method)[0] in PROFILED


def needs_dataless(method: str) -> bool:
    return not method.startswith("oracle:") and parse_method(method)[0] in DATALESS


def needs_ladder(method: str) -> bool:
    return not method.startswith("oracle:") and parse_method(method)[0] in LADDER


def profile_needs(method: str) -> tuple[str, ...]:
    """The profile job a run waits for (none for the references, random sets and triggers)."""
    return (("profile",) if needs_profile(method) else ("profile-dataless",) if needs_dataless(method)
            else ("profile-ladder",) if needs_ladder(method) else ())


def claim_setting(out: Path, model: str | None, task: str | None) -> dict[str, str]:
    """The folder's setting: the one it was started with (a different ``model``/``task`` is refused, so
    that one folder never mixes two), else ``model``/``task`` (or the default), written to setting.json."""
    asked = check_setting({k: v or DEFAULT_SETTING[k] for k, v in (("model", model), ("task", task))})
    if setting_path(out).is_file() or any(out.glob("*/seed*/result.json")):
        have = read_setting(out)
        wrong = {k: v for k, v in (("model", model), ("task", task)) if v is not None and have[k] != v}
        if wrong:
            raise SystemExit(f"{out} holds {have['model']} on {have['task']}: asked for "
                             f"{', '.join(f'{k} {v}' for k, v in wrong.items())}; use another --out")
        return have
    out.mkdir(parents=True, exist_ok=True)
    setting_path(out).write_text(json.dumps(asked) + "\n")
    return asked


def plan(args: argparse.Namespace) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    claim_setting(Path(args.out), getattr(args, "model", None), getattr(args, "task", None))
    methods = tuple(args.methods.split(",")) if args.methods else METHODS
    for m in methods:
        parse_method(m)
    runs = plan_runs(seeds, methods)
    if args.oracle_every:  # last: the oracle diagnostic on one GNMR run (its probes double the run's cost)
        runs.append(("oracle:" + ORACLE_METHOD, 0))
    out = Path(args.out)
    if args.workers > 1 and not args.worker:
        runner.fan_out(args.workers)
    jobs = []
    if any(needs_profile(m) for m, _ in runs):
        jobs.append(runner.Job("profile", out / "profile_run",
                               [sys.executable, __file__, "profile", "--out", str(out),
                                "--batches", str(args.profile_batches)],
                               profile_path(out), label="profile"))
    if any(needs_dataless(m) for m, _ in runs):
        jobs.append(runner.Job("profile-dataless", out / "profile_dataless_run",
                               [sys.executable, __file__, "profile", "--out", str(out), "--dataless",
                                "--batches", str(args.profile_batches)],
                               dataless_path(out), label="data-free profile"))
    if any(needs_ladder(m) for m, _ in runs):
        jobs.append(runner.Job("profile-ladder", out / "profile_ladder_run",
                               [sys.executable, __file__, "profile", "--out", str(out), "--ladder",
                                "--batches", str(args.profile_batches)],
                               ladder_path(out), label="ladder profile"))
    for method, seed in runs:
        run_dir = _run_dir(out, method, seed)
        cmd = [sys.executable, __file__, "run", "--method", method.removeprefix("oracle:"), "--seed", str(seed),
               "--out", str(run_dir), "--steps", str(args.steps), "--eval-problems", str(args.eval_problems),
               "--data-dir", str(out / "data"), "--eval-every", str(args.eval_every)]
        if method.startswith("oracle:"):
            cmd += ["--oracle-every", str(args.oracle_every), "--root", str(out)]
        elif getattr(args, "save_adapters", False):  # the adapter beside its result (serving a fine-tune: bench/value/serve_bench.py)
            cmd += ["--save-adapter", str(run_dir / "adapter")]
        jobs.append(runner.Job((method, seed), run_dir, cmd, run_dir / "result.json",
                               needs=profile_needs(method), label=f"{method} seed {seed}"))
    runner.run_plan(jobs)


# ---------------------------------------------------------------------------------------------- report


def collect(out: Path) -> dict[str, dict[int, dict[str, Any]]]:
    runs: dict[str, dict[int, dict[str, Any]]] = {}
    for path in sorted(out.glob("*/seed*/result.json")):
        r = json.loads(path.read_text())
        runs.setdefault(r["method"], {})[r["seed"]] = r
    return runs


def gap_closed(runs, method: str, route: str) -> list[float]:
    """Per seed ``(L_nf4 - L) / (L_nf4 - L_bf16)`` on ``route`` (``"served"`` or ``"merged"``), with that
    seed's ``nf4`` run on the same route and its ``bf16`` run (the same on both routes)."""
    key = f"heldout_loss_{route}"
    return [(lo[key] - r[key]) / (lo[key] - hi["heldout_loss_merged"]) for r, lo, hi in _with_references(runs, method)
            if lo[key] != hi["heldout_loss_merged"]]


def _with_references(runs, method: str):
    """``(run, nf4 run, bf16 run)`` of every seed of ``method`` that has both references, by seed."""
    for seed, r in sorted(runs.get(method, {}).items()):
        lo, hi = runs.get("nf4", {}).get(seed), runs.get("bf16", {}).get(seed)
        if lo is not None and hi is not None:
            yield r, lo, hi


def _method_order(runs, skip: tuple[str, ...] = ()) -> list[str]:
    """The methods of ``runs`` in the plan's order, unknown ones after it, less ``skip``."""
    return [m for m in METHODS if m in runs and m not in skip] + sorted(set(runs) - set(METHODS))


REFERENCES = ("bf16", "nf4")  # their gap closed is 1 and 0 by definition


def curve_gap_closed(runs, method: str, route: str) -> dict[int, list[float]]:
    """Gap closed on ``route`` at every evaluated step of a length curve (``--eval-every``): per seed, the run's
    held-out loss at that step against the same seed's ``nf4`` run on that route and its ``bf16`` run at the
    same step. Steps are the ones all three runs evaluated; runs without a curve give nothing."""
    key = f"heldout_loss_{route}"
    out: dict[int, list[float]] = {}
    for r, lo, hi in _with_references(runs, method):
        lo_at = {p["step"]: p[key] for p in lo.get("curve") or []}
        hi_at = {p["step"]: p["heldout_loss_merged"] for p in hi.get("curve") or []}
        for point in r.get("curve") or []:
            step = point["step"]
            if step in lo_at and step in hi_at and lo_at[step] != hi_at[step]:
                out.setdefault(step, []).append((lo_at[step] - point[key]) / (lo_at[step] - hi_at[step]))
    return dict(sorted(out.items()))


def _peak_gib(rs, stat=max) -> str:
    """``stat`` (the largest by default) of the training peaks (RSS) of a method's runs, in GiB; "-" where no
    run recorded one."""
    peaks = [r["peak_rss_bytes"] / 2**30 for r in rs if r.get("peak_rss_bytes")]
    return f"{stat(peaks):.2f}" if peaks else "-"


def curve_table(runs) -> list[str]:
    """Gap closed along the run, both routes (median [min, max] over seeds) at every step the curves share,
    and BF16 LoRA's own held-out loss there: empty where no run has a curve."""
    bf16_at: dict[int, list[float]] = {}
    for r in runs.get("bf16", {}).values():
        for point in r.get("curve") or []:
            bf16_at.setdefault(point["step"], []).append(point["heldout_loss_merged"])
    if not bf16_at:
        return []
    steps = sorted(bf16_at)
    med = nf4_bench._med_range
    lines = ["| method | route | " + " | ".join(f"step {s}" for s in steps) + " |",
             "|---|---|" + "---|" * len(steps),
             "| bf16 | held-out loss | " + " | ".join(med(bf16_at[s]) for s in steps) + " |"]
    for m in _method_order(runs, skip=REFERENCES):
        for route in ("served", "merged"):
            at = curve_gap_closed(runs, m, route)
            if at:
                lines.append(f"| {m} | {route} | " + " | ".join(med(at[s], ".2f") if s in at else "-" for s in steps)
                             + " |")
    return lines


def train_window_gap_closed(runs, method: str, width: int = 30) -> dict[tuple[int, int], list[float]]:
    """Gap closed on the *training* loss (the base each run trains on: the served route), window by window:
    per seed ``(mean L_nf4 - mean L) / (mean L_nf4 - mean L_bf16)`` over steps ``[a, a + width)`` of that seed's
    own nf4 and bf16 runs (the same data order). Only whole windows that every one of the three runs reached."""
    out: dict[tuple[int, int], list[float]] = {}
    for r, lo, hi in _with_references(runs, method):
        n = min(len(r.get("train_losses") or []), len(lo.get("train_losses") or []), len(hi.get("train_losses") or []))
        for a in range(0, n - width + 1, width):
            mean = [statistics.mean(x["train_losses"][a:a + width]) for x in (r, lo, hi)]
            if mean[1] != mean[2]:
                out.setdefault((a + 1, a + width), []).append((mean[1] - mean[0]) / (mean[1] - mean[2]))
    return out


def train_window_table(runs, width: int = 30) -> list[str]:
    """The training-loss gap closed window by window (median [min, max] over seeds): empty unless the runs
    hold at least two windows (a run of ``2 * width`` steps or more)."""
    rows = {m: train_window_gap_closed(runs, m, width) for m in _method_order(runs, skip=REFERENCES)}
    windows = sorted({w for at in rows.values() for w in at})
    if len(windows) < 2:
        return []
    med = nf4_bench._med_range
    lines = ["| method | " + " | ".join(f"steps {a}-{b}" for a, b in windows) + " |", "|---|" + "---|" * len(windows)]
    for m, at in rows.items():
        if at:
            lines.append(f"| {m} | " + " | ".join(med(at[w], ".2f") if w in at else "-" for w in windows) + " |")
    return lines


def _gap_axes(ax, xlabel: str, title: str) -> None:
    """One panel of a gap-closed plot: the 0 (NF4) and 1 (BF16) lines, its labels."""
    ax.axhline(0, color="grey", lw=0.5)
    ax.axhline(1, color="grey", lw=0.5)
    ax.set_xlabel(xlabel)
    ax.set_title(title)


def _finish_gap_figure(fig, axes, path: str, legend_size: int = 8) -> None:
    """One key beside the data, the shared y label, titles wrapped to fit, then saved."""
    from gnmr_hf.reporting.plots import save_figure

    axes[1].legend(fontsize=legend_size, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    axes[0].set_ylabel("NF4-to-BF16 gap closed (held-out loss)")
    save_figure(fig, path, dpi=120)
    print(f"wrote {path}")


def plot_length(runs, path: str) -> None:
    """Gap closed against the training step, both routes: every method with a curve (median over seeds, the
    range as a band)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.5), sharey=True)
    for ax, route in zip(axes, ("served", "merged")):
        for m in _method_order(runs, skip=REFERENCES):
            at = curve_gap_closed(runs, m, route)
            if not at:
                continue
            xs = list(at)
            n = max(len(v) for v in at.values())
            (line,) = ax.plot(xs, [statistics.median(v) for v in at.values()], "o-", ms=3,
                              label=f"{m} ({n} seed{'' if n == 1 else 's'})")
            ax.fill_between(xs, [min(v) for v in at.values()], [max(v) for v in at.values()],
                            color=line.get_color(), alpha=0.15)
        _gap_axes(ax, "optimizer step", f"gap closed along the run, {route} route (median, range over seeds)")
    _finish_gap_figure(fig, axes, path)


def report(args: argparse.Namespace) -> str:
    out = Path(args.out)
    runs = collect(out)
    if not runs:
        return f"no finished run under {out}"
    med = nf4_bench._med_range
    any_run = next(iter(next(iter(runs.values())).values()))
    setting = read_setting(out)
    held = (f"per token ({any_run['eval_problems']} held-out blocks of the Python docs' sources)"
            if setting["task"] == "pydocs" else f"per response token ({any_run['eval_problems']} generated test problems)")
    lines = [f"{setting['model']}, task {setting['task']}. Held-out loss {held}, "
             f"{any_run['steps']} steps, median [min, max] over seeds; gap closed = (L_nf4 - L) / (L_nf4 - L_bf16) "
             "per seed and route. served: the base the adapter trained on (NF4 + the fixed set in BF16; all-NF4 "
             "for dynamic methods); merged: the original BF16 base. Extra bytes: BF16 bytes on the recovery path "
             "as a share of the quantised weights' BF16 bytes (served set, a linear on an INT8 rung counted at its "
             "BF16 bytes; mean and peak during training); memory over NF4: what the served model's weights cost "
             "over the all-NF4 model's, in the ladder table's currency; training peak: the largest peak RSS of the "
             "method's runs (FP32 compute, every linear's BF16 recovery weight held on the host).", "",
             "| method | seeds | served bytes | memory over NF4 | mean / peak training bytes | training peak (GiB, max) "
             "| loss served | gap closed served | loss merged | gap closed merged | step s |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    prof = read_ladder_profile(out)
    for m in _method_order(runs):
        rs = list(runs[m].values())
        total = rs[0]["total_bf16_bytes"]
        mem = spent_over_nf4(rs, prof)
        lines.append("| " + " | ".join([
            m, str(len(rs)), f"{statistics.median(r['served_set_bytes'] for r in rs) / total:.3f}",
            "-" if mem is None else f"+{100 * mem:.1f} %",
            f"{statistics.median(r['mean_active_bytes'] for r in rs) / total:.3f} / "
            f"{max(r['peak_active_bytes'] for r in rs) / total:.3f}", _peak_gib(rs),
            med([r["heldout_loss_served"] for r in rs]), med(gap_closed(runs, m, "served"), ".2f"),
            med([r["heldout_loss_merged"] for r in rs]), med(gap_closed(runs, m, "merged"), ".2f"),
            med([r["step_s_median"] for r in rs], ".2f"),
        ]) + " |")
    if (oracle_dir(out) / "result.json").is_file():
        r = json.loads((oracle_dir(out) / "result.json").read_text())
        scores = ([u["score"] for u in json.loads(profile_path(out).read_text())["units"]]
                  if profile_path(out).is_file() else None)
        lines += ["", f"Oracle at operator grain ({r['method']} seed {r['seed']}, {len(r['oracle_rows'])} measured steps, "
                  f"every {r['oracle_every']}): per step, every linear's recovery gap (LoRA gradient all-NF4 vs "
                  f"all-BF16, relative); the oracle set fills the {r['budget_pct']} % byte budget greedily by gap "
                  "per byte. Means over the measured steps.", "",
                  "| trigger | steps | precision | recall | bytes recall | gap captured | oracle captures |",
                  "|---|---|---|---|---|---|---|"]
        for row in oracle_table(r, scores):
            lines.append(f"| {row['trigger']} | {row['steps']} | {row['precision']:.3f} | {row['recall']:.3f} | "
                         f"{row['bytes_recall']:.3f} | {row['captured']:.3f} | {row['oracle_captured']:.3f} |")
    curve_rows = curve_table(runs)
    if curve_rows:
        lines += ["", "Along the run (`--eval-every`): gap closed per route at every evaluated step, each seed against "
                  "its own nf4 and bf16 runs at the same step (one learning-rate schedule over the whole run, so a "
                  "point is not a shorter run's end); median [min, max] over seeds.", "", *curve_rows]
    window_rows = train_window_table(runs)
    if window_rows:
        lines += ["", "On the training loss (the base each run trains on, so the served route; the stream of training "
                  "batches, not held out): gap closed in windows of 30 steps, each seed against the mean losses of its "
                  "own nf4 and bf16 runs over the same steps (the same data order); median [min, max] over seeds.", "",
                  *window_rows]
    bundled_rows = bundled_table(out)
    if bundled_rows:
        lines += ["", f"Bundled eval (gnmr_hf.evaluation on the offline set: {BUNDLED_TASKS}; zero-shot, 24 documents, "
                  "FP32, batches of 8), seed 0 retrained with its adapter kept; the held-out loss of that run, and "
                  "how far it is from the table's run of the same seed (merged route).", "",
                  "| method | route | GSM8K EM (%) | WikiText word PPL | held-out loss | vs table run |",
                  "|---|---|---|---|---|---|", *bundled_rows]
    ladder_rows = ladder_table(out, runs)
    if ladder_rows:
        lines += ["", "Precision ladder at equal memory over the NF4 model (served weights and quant states as "
                  "bitsandbytes stores them, over the all-NF4 model's): each linear on NF4, INT8 or BF16 by the "
                  "first-order gain per byte of each rung (profile_ladder.json), against the same knapsack with one "
                  "rung; the profiled BF16 plans of the first table (budgets in BF16 bytes) at what they cost in "
                  "this currency. Training peak: the median over seeds of the runs' peak RSS (FP32 compute, every linear's BF16 recovery "
                  "weight held on the host).", "",
                  "| method | seeds | INT8 / BF16 linears | memory over NF4 | training peak (GiB, median) | gap closed served "
                  "| gap closed merged |", "|---|---|---|---|---|---|---|", *ladder_rows]
    text = "\n".join(lines)
    if args.plot:
        plot(runs, args.plot)
    if getattr(args, "plot_ladder", None):
        plot_ladder(runs, args.plot_ladder, out)
    if getattr(args, "plot_length", None):
        plot_length(runs, args.plot_length)
    return text


LADDER_REFERENCES = tuple(f"prof-op-{b}" for b in BUDGETS)  # today's plans, priced in memory over NF4


def memory_over_nf4(result: dict[str, Any], prof: dict[str, Any] | None) -> float | None:
    """A run's served weights over the all-NF4 model's: recorded by the run, or (older runs) the served
    set's BF16 prices from profile_ladder.json; ``None`` when neither is there."""
    if "memory_over_nf4" in result:
        return result["memory_over_nf4"]
    if prof is None:
        return None
    price = {u["name"].removeprefix("model."): u["prices"]["bf16"] for u in prof["units"]}
    served = served_units(result.get("kind") or parse_method(result["method"])[0], result.get("planned", []))
    return sum(price[n.removeprefix("model.")] for n in served) / prof["nf4_model_bytes"]


def read_ladder_profile(out: Path) -> dict[str, Any] | None:
    """The folder's profile_ladder.json (every linear's rung prices), or ``None`` before the ladder profile ran."""
    return json.loads(ladder_path(out).read_text()) if ladder_path(out).is_file() else None


def spent_over_nf4(results, prof: dict[str, Any] | None) -> float | None:
    """The median memory over NF4 of a method's runs (those whose price is known), ``None`` if none is."""
    mem = [v for v in (memory_over_nf4(r, prof) for r in results) if v is not None]
    return statistics.median(mem) if mem else None


def ladder_table(out: Path, runs) -> list[str]:
    """The ladder's rows (and the profiled BF16 plans'), budget by budget: memory over NF4, training peak,
    gap closed on both routes."""
    prof = read_ladder_profile(out)
    med = nf4_bench._med_range
    lines = []
    order = [f"{k}-{b}" for b in BUDGETS for k in LADDER] + list(LADDER_REFERENCES)
    if not any(m in runs for m in order if m not in LADDER_REFERENCES):
        return []
    for m in order:
        if m not in runs:
            continue
        rs = list(runs[m].values())
        mem = spent_over_nf4(rs, prof)
        counts = (f"{statistics.median(r.get('int8_linears', 0) for r in rs):g} / "
                  f"{statistics.median(r.get('bf16_linears', r['served_set_size']) for r in rs):g}")
        lines.append("| " + " | ".join([
            m, str(len(rs)), counts, "-" if mem is None else f"+{100 * mem:.1f} %",
            _peak_gib(rs, statistics.median),
            med(gap_closed(runs, m, "served"), ".2f"), med(gap_closed(runs, m, "merged"), ".2f")]) + " |")
    return lines


def plot_ladder(runs, path: str, out: Path) -> None:
    """Gap closed against memory over the NF4 model, both routes: the ladder, INT8 only, BF16 only (median
    and range over seeds), and the profiled BF16 plans of the first table at their price."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    prof = read_ladder_profile(out)
    labels = {"lad": "ladder (INT8 + BF16)", "lad-int8": "INT8 only", "lad-bf16": "BF16 only",
              "lad-fill": "ladder, unspent bytes on INT8 -> BF16 upgrades", "lad-grp": "ladder, whole vLLM groups"}

    def spent(method: str) -> float | None:  # a plan's memory over NF4, in %: it may stop short of its budget
        mem = spent_over_nf4(runs.get(method, {}).values(), prof)
        return None if mem is None else 100 * mem

    fig, axes = plt.subplots(1, 2, figsize=(12.5, 4.5), sharey=True)
    for ax, route in zip(axes, ("served", "merged")):
        for kind, label in labels.items():
            _family_curve(ax, runs, kind, route, label, x_of=spent)
        for m in LADDER_REFERENCES:
            g = gap_closed(runs, m, route)
            mem = [memory_over_nf4(r, prof) for r in runs.get(m, {}).values()]
            if g and all(v is not None for v in mem):
                ax.scatter([100 * statistics.median(mem)] * len(g), g, marker="x", color="grey", zorder=3,
                           label="profiled BF16 plan, first table" if m == LADDER_REFERENCES[0] else None)
        _gap_axes(ax, "served weights, % over the NF4 model", f"gap closed, {route} route (median, range over seeds)")
    _finish_gap_figure(fig, axes, path)


def _family_curve(ax, runs, kind: str, route: str, label: str, x_of=None) -> None:
    """One method family's gap closed on ``route`` against its budget (or ``x_of(method)``, what the plan
    spent, where a plan can stop short of its budget): median, range over seeds."""
    points = []
    for pct in BUDGETS:
        g = gap_closed(runs, f"{kind}-{pct}", route)
        if g:
            x = x_of(f"{kind}-{pct}") if x_of else None
            points.append((pct if x is None else x, statistics.median(g), min(g), max(g)))
    points.sort()
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    lo, hi = [p[1] - p[2] for p in points], [p[3] - p[1] for p in points]
    if xs:
        ax.errorbar(xs, ys, yerr=[lo, hi], fmt="o-", capsize=3, label=label)


def plot(runs, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(14.5, 4.5), sharey=True)
    families = {"profiled operators": "prof-op", "random operators (fixed)": "rand-op", "hybrid": "hybrid"}
    singles = ("prof-layer-10", "rand-step-10", "edge-10", "gnmr-layer-10", "gnmr-op-10", "loftq", "loftq+prof-op-10",
               *BASELINES)
    for ax, route in zip(axes, ("served", "merged")):
        for label, kind in families.items():
            _family_curve(ax, runs, kind, route, label)
        for m in singles:
            g = gap_closed(runs, m, route)
            if g:
                x = parse_method(m)[1]
                ax.scatter([x] * len(g), g, s=25, label=m, zorder=3)
        _gap_axes(ax, "extra BF16 bytes, % of the quantised weights", f"gap closed, {route} route (median, range over seeds)")
    _finish_gap_figure(fig, axes, path, legend_size=7)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    r = sub.add_parser("run", help="one run")
    r.add_argument("--method", required=True)
    r.add_argument("--seed", type=int, default=0)
    r.add_argument("--out", required=True)
    r.add_argument("--data-dir", default=None)
    r.add_argument("--threads", type=int, default=1)
    r.add_argument("--save-adapter", default=None, help="save the trained LoRA adapter (PEFT files) here")
    r.add_argument("--root", default=None, help="the bench folder with profile.json (default: --out's grandparent)")
    r.add_argument("--eval-every", type=int, default=0,
                   help="also measure both routes' held-out loss every K steps (curve.json, the length curve)")
    r.add_argument("--oracle-every", type=int, default=0,
                   help="measure every unit's recovery gap on every K-th step's batch (the oracle diagnostic)")
    pl = sub.add_parser("plan", help="every run, resumable")
    for q in (r, pl):
        q.add_argument("--steps", type=int, default=30)
        q.add_argument("--eval-problems", type=int, default=48)
    pl.add_argument("--out", required=True)
    pl.add_argument("--seeds", default="0,1,2")
    pl.add_argument("--model", default=None, choices=MODELS,
                    help=f"a new folder's model (default {DEFAULT_SETTING['model']}; kept in its setting.json)")
    pl.add_argument("--task", default=None, choices=tuple(TASKS),
                    help="a new folder's task: generated (the recipe's problems) or pydocs (the Python docs' sources)")
    pl.add_argument("--methods", default=None, help="comma-separated subset (default: all, tier by tier)")
    pl.add_argument("--profile-batches", type=int, default=2)
    pl.add_argument("--eval-every", type=int, default=0, help="passed to every run: the length curve")
    pl.add_argument("--workers", type=int, default=1)
    pl.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    pl.add_argument("--save-adapters", action="store_true",
                    help="keep every run's trained LoRA adapter in <run>/adapter (PEFT files), e.g. to serve it merged")
    pl.add_argument("--oracle-every", type=int, default=2,
                    help=f"after the table: {ORACLE_METHOD} seed 0 with the oracle probe every K steps (0: none)")
    bd = sub.add_parser("bundled", help="retrain --methods with the adapter kept and score them with the bundled eval")
    bd.add_argument("--out", required=True)
    bd.add_argument("--methods", default=",".join(BUNDLED_METHODS))
    bd.add_argument("--seed", type=int, default=0)
    bd.add_argument("--limit", type=int, default=24)
    bd.add_argument("--steps", type=int, default=30)
    bd.add_argument("--eval-problems", type=int, default=48)
    pf = sub.add_parser("profile", help="the sensitivity profile the planned methods use")
    pf.add_argument("--out", required=True)
    pf.add_argument("--batches", type=int, default=2)
    pf.add_argument("--dataless", action="store_true",
                    help="the baselines' criteria (weight_error, output) into profile_dataless.json")
    pf.add_argument("--ladder", action="store_true",
                    help="every linear's gain and price per rung (the ladder methods) into profile_ladder.json")
    rp = sub.add_parser("report", help="the table (and a plot)")
    rp.add_argument("--out", required=True)
    rp.add_argument("--plot", default=None)
    rp.add_argument("--plot-ladder", default=None, help="the ladder's gap closed against memory over NF4")
    rp.add_argument("--plot-length", default=None, help="gap closed against the training step (runs with a curve)")
    args = p.parse_args(argv)
    if args.cmd == "run":
        run_one(args)
    elif args.cmd == "plan":
        plan(args)
    elif args.cmd == "profile" and args.ladder:
        make_ladder_profile(Path(args.out), args.batches)
    elif args.cmd == "profile":
        make_profile(Path(args.out), args.batches, dataless=args.dataless)
    elif args.cmd == "bundled":
        bundled(args)
    else:
        print(report(args))
    return 0


if __name__ == "__main__":
    sys.exit(main())
