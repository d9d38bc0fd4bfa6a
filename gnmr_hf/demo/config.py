"""The demo's runs: which recipes each comparison trains, how big the demo is, where each adapter is served,
and the recipe overrides of one invocation (``--set``), checked before anything trains."""

from __future__ import annotations

from pathlib import Path

# gnmr_hf.recipe loads transformers, peft and bitsandbytes at its top: find_recipes and check_recipes import it
# inside, so `gnmr-hf demo --help` and `import gnmr_hf.demo` stay without them

# --compare: which comparison the demo runs. "ladder" (the default) is what a budget fine-tuner chooses between on
# an NF4 base: BF16 LoRA (the reference), NF4 QLoRA, the recommended planned recipe (the precision ladder at
# +10 % memory over NF4) and its calibrated adapter initialisation, both trained on one profile's plan, and the
# paper's controller on NF4 (gnmr-nf4). "int8" is the paper's INT8 trio (bf16, int8, gnmr); "nf4" the older
# NF4 trio with the BF16-only plan (bf16, nf4, planned-nf4), also spelt --low nf4.
COMPARISONS = {
    "ladder": ("bf16", "nf4", "planned-ladder-nf4", "planned-ladder-calibrated-nf4", "gnmr-nf4"),
    "int8": ("bf16", "int8", "gnmr"),
    "nf4": ("bf16", "nf4", "planned-nf4"),
}
CHOICES = {
    "ladder": ("bf16", "nf4", "planned-ladder-nf4", "planned-ladder-calibrated-nf4", "gnmr-nf4", "planned-nf4"),
    "int8": ("bf16", "int8", "gnmr"),
    "nf4": ("bf16", "nf4", "planned-nf4", "gnmr-nf4", "hybrid-nf4", "planned-loftq-nf4"),
}
# the older --low spelling: its two low paths and what they ran
LOW_PATHS = {"int8": COMPARISONS["int8"], "nf4": COMPARISONS["nf4"]}
LOW_CHOICES = {"int8": CHOICES["int8"], "nf4": CHOICES["nf4"]}
# each comparison's output names: the default's summary.md, the others' summary_int8.md / summary_nf4.md, so all
# three can share one --out folder (and their bf16 and nf4 runs)
SUFFIX = {"ladder": "", "int8": "_int8", "nf4": "_nf4"}
LOW_NAME = {"ladder": "NF4", "int8": "INT8", "nf4": "NF4"}
GNMR_PRECISIONS = ("gnmr", "gnmr-nf4")  # the paper's controller over decoder layers: a GNMR heat map
CALLBACK_RUNS = (*GNMR_PRECISIONS, "planned-nf4", "hybrid-nf4", "planned-loftq-nf4", "planned-ladder-nf4",
                 "planned-ladder-calibrated-nf4")  # runs that write gnmr_trace.jsonl
# the planned runs of one comparison train one plan: the first profiles (its recipe's own profile on the first
# training batches), the others read its profile.json (profile.plan) and profile nothing
PLAN_SOURCE = "planned-ladder-nf4"
PLAN_USERS = ("planned-ladder-calibrated-nf4",)
# the base each run's adapter is served on (its training base): the held-out loss and the memory are measured there
SERVED = {"bf16": ("bf16", False), "int8": ("int8", False), "gnmr": ("int8", False), "nf4": ("nf4", False),
          "gnmr-nf4": ("nf4", False), "hybrid-nf4": ("nf4", True), "planned-nf4": ("nf4", True),
          "planned-loftq-nf4": ("nf4", True), "planned-ladder-nf4": ("nf4", True),
          "planned-ladder-calibrated-nf4": ("nf4", True)}
EVAL_TASKS = "gsm8k,mmlu,hellaswag,wikitext"
DEMO_MODEL = "smollm2-135m-instruct"  # the recipes' `model:` (recipes/smollm2-135m/base.yaml), an offline alias
DTYPES = ("auto", "bfloat16", "float32", "float16")
# the demo's size (docs/recipes.md, "Measured"). The int8 / nf4 trios: 60 steps of 2 problems (the recipes' 60 of
# 4 halved) and 24 documents per eval task (three batches of 8). The default comparison trains five runs in the
# same 12 minutes: 24 steps of 2 problems, 8 documents per eval task (one batch), and the held-out loss on 32
# GSM8K test problems (disjoint from the training ones), which is where the runs differ
MAX_STEPS = {"ladder": 24, "int8": 60, "nf4": 60}
TRAIN_BATCH_SIZE = 2
EVAL_LIMIT = {"ladder": 8, "int8": 24, "nf4": 24}
EVAL_BATCH_SIZE = 8
HELDOUT = {"ladder": 32, "int8": 0, "nf4": 0}


class DemoError(Exception):
    """Something the user can fix (a missing package, no recipes folder); printed, exit code 2."""


def find_recipes(explicit: str | None = None) -> Path:
    """The recipes folder (:func:`gnmr_hf.recipe.recipes_folder`); a missing one is a :class:`DemoError`."""
    from gnmr_hf.recipe import RecipeError, recipes_folder

    try:
        return recipes_folder(explicit)
    except RecipeError as e:
        raise DemoError(str(e)) from None


def parse_sets(items: list[str], precisions: list[str]) -> dict[str, list[str]]:
    """``--set`` items as each recipe's extra command-line overrides: ``KEY=VALUE`` goes to every recipe,
    ``RECIPE:KEY=VALUE`` to that one (``DemoError`` for a malformed item or a recipe the demo does not run)."""
    out: dict[str, list[str]] = {p: [] for p in precisions}
    for item in items:
        key, eq, value = item.partition("=")
        target, colon, key = key.rpartition(":") if ":" in key else ("", "", key)
        if not eq or not key:
            raise DemoError(f"--set wants KEY=VALUE or RECIPE:KEY=VALUE, got {item!r}")
        if colon and target not in out:
            raise DemoError(f"--set {item}: recipe {target!r} is not one this demo runs ({', '.join(precisions)})")
        for p in [target] if colon else precisions:
            out[p] += [f"--{key}", value]
    return out


def check_recipes(recipes: Path, precisions: list[str], run_dirs: dict[str, Path], data_dir: Path,
                  overrides: dict[str, list[str]]) -> None:
    """Load and validate every recipe with its overrides, as ``recipes/finetune.py`` will, so that a bad
    ``--set`` ends the demo in one line (``DemoError``) before anything trains. Both read recipes through
    the one entry point, ``gnmr_hf.recipe.load_config`` + ``validate`` (the script re-exports them)."""
    from gnmr_hf.recipe import RecipeError, load_config, validate

    for p in precisions:
        argv = ["--config", str(recipes / "smollm2-135m" / f"{p}.yaml"), "--output_dir", str(run_dirs[p]),
                "--data_dir", str(data_dir), *overrides[p]]
        try:
            validate(load_config(argv))
        except RecipeError as e:
            raise DemoError(f"recipe {p}: {e}") from None

