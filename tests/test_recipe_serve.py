"""The recipes' ``profile.serve`` (issue 60): the serving target decides the rungs a planned run buys and the groups
it keeps, the plan records it, and ``gnmr-hf export --plan RUN`` writes that target's format without being told
(another format is refused in one line that says what would load and at what price)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytest.importorskip("transformers")

from gnmr_hf.planning.groups import serving_groups, split_groups  # noqa: E402
from gnmr_hf.planning.plan import Plan  # noqa: E402
from gnmr_hf.recipe_plan import check_saved_plan  # noqa: E402
from gnmr_hf.serving import serve_target  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
SMOL = ROOT / "recipes" / "smollm2-135m"
sys.path.insert(0, str(ROOT / "recipes"))
import finetune  # noqa: E402


def _recipe(name: str, *argv: str):
    return finetune.validate(finetune.load_config(["--config", str(SMOL / name), *argv]))


@pytest.mark.parametrize("recipe, serve, rungs, groups", [
    ("planned-nf4.yaml", "vllm-cpu", ("bf16",), "vllm"),
    ("planned-nf4.yaml", "vllm-gpu", ("bf16",), "vllm"),  # the recipe's BF16-only plan, grouped
    ("planned-ladder-nf4.yaml", "vllm-cpu", ("bf16",), "vllm"),  # the ladder narrowed to what the CPU build serves
    ("planned-ladder-nf4.yaml", "bitsandbytes", ("bf16",), None),
    ("planned-ladder-nf4.yaml", "vllm", ("int8", "bf16"), "vllm"),  # the export's older name for vllm-gpu
    ("planned-ladder-nf4.yaml", "gguf", ("int8", "bf16"), None),
    ("planned-ladder-nf4.yaml", "transformers", ("int8", "bf16"), None),
])
def test_the_target_decides_the_rungs_and_the_groups(recipe, serve, rungs, groups):
    r = _recipe(recipe, "--profile.budget", "+10%nf4", "--profile.serve", serve)
    assert (r.profile.serve, r.profile.rungs, r.profile.groups) == (serve_target(serve).name, rungs, groups)
    assert r.profile.to_dict()["serve"] == serve_target(serve).name
    assert r.profile.ladder == (rungs != ("bf16",))
    assert _recipe("planned-nf4.yaml").profile.serve is None  # no target unless asked


@pytest.mark.parametrize("recipe, argv, message", [
    ("planned-nf4.yaml", ["--profile.serve", "tgi"], r"profile\.serve: serving target 'tgi': one of vllm-gpu, "
                                                     r"vllm-cpu, transformers, gguf, bitsandbytes"),
    ("planned-ladder-nf4.yaml", ["--profile.serve", "vllm-cpu", "--profile.rungs", "int8,bf16"],
     r"profile\.rungs \[int8, bf16\]: vllm-cpu does not serve int8 \(its rungs: bf16; run here: "),
    ("planned-ladder-nf4.yaml", ["--profile.serve", "bitsandbytes", "--profile.rungs", "int8"],
     r"profile\.rungs \[int8\]: bitsandbytes does not serve int8"),
    ("planned-nf4.yaml", ["--profile.serve", "vllm-gpu", "--profile.groups", "null"],
     r"profile\.groups null: vllm-gpu fuses q/k/v and gate/up"),
    ("planned-nf4.yaml", ["--profile.serve", "bitsandbytes", "--profile.policy", "hybrid"],
     r"profile\.serve bitsandbytes .* needs profile\.policy static, got hybrid"),
    ("planned-ladder-nf4.yaml", ["--profile.serve", "gguf", "--profile.budget", "10%"],
     r"profile\.rungs \[int8, bf16\] plans under memory over the NF4 model: write profile\.budget as \+N%nf4"),
])
def test_bad_serve_keys_are_one_line(recipe, argv, message):
    with pytest.raises(finetune.RecipeError, match=message) as e:
        _recipe(recipe, *argv)
    assert "\n" not in str(e.value)


def test_a_training_plan_may_name_a_server_of_another_low_but_not_a_rung_it_cannot_load():
    from gnmr_hf.planning.plan import PlanError
    from gnmr_hf.serving import ServeError, check_plan

    # an NF4 training plan made for vLLM's CPU build (the export plans its low anew, or re-types it as INT4)
    assert Plan({"x": "bf16"}, low="nf4", groups="vllm", serve="vllm-cpu").serve == "vllm-cpu"
    with pytest.raises(PlanError, match=r"1 linear\(s\) on int8, which vllm-cpu does not serve"):
        Plan({"x": "int8"}, low="nf4", groups="vllm", rung_set=("int8", "bf16"), serve="vllm-cpu")
    with pytest.raises(PlanError, match="fuses serving groups, but the plan is free"):
        Plan({"x": "bf16"}, low="nf4", serve="vllm-gpu")
    with pytest.raises(ServeError, match="over nf4, which vllm-cpu does not serve"):  # as a served form: refused
        check_plan({}, "nf4", serve_target("vllm-cpu"))
    with pytest.raises(PlanError, match="over q4_0, which vllm-cpu does not serve"):  # a served low is checked
        Plan({}, low="q4_0", groups="vllm", serve="vllm-cpu")


def _rows(n: int = 4, seq: int = 12):
    g = torch.Generator().manual_seed(0)
    return [{"input_ids": ids, "attention_mask": [1] * seq, "labels": ids}
            for ids in torch.randint(3, 120, (n, seq), generator=g).tolist()]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tests.conftest import make_tiny_llama
    from tests.test_profile_faults_r3 import tiny_tokenizer

    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_serve"))
    tiny_tokenizer().save_pretrained(path)
    return path


def _planned_run(tiny, out, recipe, serve, budget="+25%nf4"):
    from transformers import AutoTokenizer

    r = _recipe(recipe, "--profile.budget", budget, "--profile.serve", serve, "--output_dir", str(out),
                "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true")
    model = finetune.load_model(r, str(tiny))
    _, record = finetune.planned_policy(r, model, _rows(), AutoTokenizer.from_pretrained(tiny), str(tiny))
    return record


@pytest.fixture(scope="module")
def runs(tiny, tmp_path_factory):
    pytest.importorskip("bitsandbytes")
    base = tmp_path_factory.mktemp("serve_runs")
    return {serve: (base / serve, _planned_run(tiny, base / serve, recipe, serve))
            for serve, recipe in (("vllm-gpu", "planned-ladder-nf4.yaml"), ("vllm-cpu", "planned-nf4.yaml"))}


def test_the_planned_run_buys_what_its_server_loads_and_records_it(tiny, runs):
    layout = serving_groups("LlamaForCausalLM", [f"model.layers.{i}.{m}" for i in range(4) for m in (
        "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
        "mlp.up_proj", "mlp.down_proj")])
    for serve, (out, record) in runs.items():
        plan = Plan.load(out / "profile.json")
        assert (plan.serve, record["serve"], plan.groups, plan.low) == (serve, serve, "vllm", "nf4")
        assert json.loads((out / "profile.json").read_text())["plan"]["serve"] == serve
        assert plan.rungs and split_groups(plan.rungs, layout) == []  # whole fused groups only
        assert set(plan.rungs.values()) <= set(serve_target(serve).rungs)
    # the same +25 % buys INT8 groups for CUDA's vLLM; the CPU build's plan holds none
    assert "int8" in Plan.load(runs["vllm-gpu"][0] / "profile.json").rungs.values()
    assert set(Plan.load(runs["vllm-cpu"][0] / "profile.json").rungs.values()) == {"bf16"}


def test_a_saved_plan_for_another_server_is_refused_before_training(tiny, runs, tmp_path):
    out, _ = runs["vllm-cpu"]
    r = _recipe("planned-nf4.yaml", "--profile.plan", str(out), "--profile.serve", "bitsandbytes",
                "--output_dir", str(tmp_path / "o"))
    with pytest.raises(finetune.RecipeError, match=r"was planned grouped \(vllm\), not with profile\.groups null"):
        check_saved_plan(r, str(tiny))
    same = _recipe("planned-nf4.yaml", "--profile.plan", str(out), "--profile.serve", "vllm-gpu",
                   "--output_dir", str(tmp_path / "o"))
    with pytest.raises(finetune.RecipeError, match=r"was made for serve vllm-cpu, not profile\.serve vllm-gpu"):
        check_saved_plan(same, str(tiny))
    # the plan trained as saved keeps its target (and a run naming the same one takes it)
    again = _recipe("planned-nf4.yaml", "--profile.plan", str(out), "--profile.groups", "vllm",
                    "--output_dir", str(tmp_path / "o"))
    assert check_saved_plan(again, str(tiny)).serve == "vllm-cpu"


def test_the_export_writes_the_plan_s_server_format_and_refuses_another(tiny, runs, tmp_path, capsys):
    pytest.importorskip("compressed_tensors")
    from gnmr_hf.export import main as export_main

    out, record = runs["vllm-gpu"]
    assert export_main(["--model", str(tiny), "--plan", str(out), "--group-size", "32",
                        "--output", str(tmp_path / "ct")]) == 0  # no --format: compressed-tensors, for vllm-gpu
    marker = json.loads((tmp_path / "ct" / ".gnmr_export.json").read_text())
    config = json.loads((tmp_path / "ct" / "config.json").read_text())
    assert marker["format"] == "compressed-tensors"
    assert config["quantization_config"]["quant_method"] == "compressed-tensors"
    n8, n16 = (sum(r == x for r in record["rungs"].values()) for x in ("int8", "bf16"))
    said = capsys.readouterr().out
    # written for the plan's target, the plan's INT8 groups as planned
    assert f"(compressed-tensors, for vllm-gpu): W4A16 {28 - n8 - n16} / W8A16 {n8} / BF16 {n16} decoder" in said
    assert n8 > 0
    for fmt in ("bitsandbytes", "gguf"):
        assert export_main(["--model", str(tiny), "--plan", str(out), "--format", fmt,
                            "--output", str(tmp_path / fmt)]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and not (tmp_path / fmt).exists()
        assert f"was made for vllm-gpu, which loads --format compressed-tensors, not {fmt}" in err[0]
        assert f"(it adds {record['price_over_nf4_bytes'] / 2**20:.2f} MiB, " \
               f"+{100 * record['memory_over_nf4']:.1f} %, over the all-NF4 model)" in err[0]


def test_a_saved_plan_trained_with_profile_serve_records_the_server_in_the_run_s_plan(tiny, runs, tmp_path):
    from transformers import AutoTokenizer

    made = Plan.load(runs["vllm-cpu"][0] / "profile.json")
    bare = Plan(dict(made.rungs), low="nf4", groups="vllm", budget=made.budget, budget_bytes=made.budget_bytes,
                model_identity=made.model_identity).save(tmp_path / "bare.json")  # no server named on it
    assert Plan.load(bare).serve is None
    out = tmp_path / "run"
    r = _recipe("planned-nf4.yaml", "--profile.plan", str(bare), "--profile.serve", "vllm-cpu", "--output_dir",
                str(out), "--compute_dtype", "float32", "--per_device_train_batch_size", "2", "--disable_tqdm", "true")
    model = finetune.load_model(r, str(tiny))
    _, record = finetune.planned_policy(r, model, _rows(), AutoTokenizer.from_pretrained(tiny), str(tiny))
    saved = Plan.load(out / "profile.json")
    assert record["serve"] == saved.serve == "vllm-cpu" and saved.rungs == made.rungs
