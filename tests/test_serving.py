"""Serving targets (gnmr_hf.serving): which server serves which rung, and the export's refusal of a plan its
target cannot load, with the price of what would load instead (issue 60, item 1)."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from gnmr_hf.export import ExportError  # noqa: E402
from gnmr_hf.export import main as export_main  # noqa: E402
from gnmr_hf.export_ct import ct_shapes, ct_tensor_bytes, export_compressed_tensors  # noqa: E402
from gnmr_hf.planning.groups import decoder_linears  # noqa: E402
from gnmr_hf.serving import TARGETS, ServeError, check_plan, serve_target, unserved  # noqa: E402

L0 = "model.layers.0."
LAYER0 = [L0 + n for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
                           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")]


@pytest.fixture(scope="module")
def llama(tmp_path_factory):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(vocab_size=128, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    path = tmp_path_factory.mktemp("llama") / "base"
    transformers.LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    return path


def test_the_targets_say_what_they_serve_and_where_that_was_seen():
    assert serve_target("vllm") is serve_target("vllm-gpu")  # the export's older name
    assert serve_target("vllm-cpu").rungs == ("bf16",) and serve_target("vllm-gpu").rungs == ("int8", "bf16")
    assert all(t.groups == "vllm" for n, t in TARGETS.items() if n.startswith("vllm"))
    assert all(t.evidence.startswith(("run here", "read, not run")) for t in TARGETS.values())
    with pytest.raises(ServeError, match="one of vllm-gpu, vllm-cpu, transformers, gguf, bitsandbytes"):
        serve_target("tgi")
    assert unserved({"a": "int8", "b": "bf16", "c": "int8"}, serve_target("vllm-cpu")) == {"int8": 2}
    check_plan({"a": "bf16"}, "int4", serve_target("vllm-cpu"))  # served: no error
    with pytest.raises(ServeError, match=r"2 linear\(s\) on int8, which vllm-cpu does not serve"):
        check_plan({"a": "int8", "b": "int8"}, "int4", serve_target("vllm-cpu"))
    with pytest.raises(ServeError, match="over nf4, which vllm-cpu does not serve"):
        check_plan({}, "nf4", serve_target("vllm-cpu"))


def test_an_int8_plan_for_vllm_cpu_is_refused_with_the_price_of_what_would_load(llama, tmp_path):
    plan = dict.fromkeys(LAYER0, "int8")
    out = tmp_path / "cpu"
    with pytest.raises(ExportError) as e:
        export_compressed_tensors(llama, plan, out, group_size=32, target="vllm-cpu")
    msg = str(e.value)
    assert "\n" not in msg and not out.exists()  # one line, nothing written
    # the two prices, worked out from the shapes: 7 linears of 128/256 wide, INT8 against BF16
    model = transformers.AutoModelForCausalLM.from_pretrained(llama)
    linears = decoder_linears(model)
    shapes, other = ct_shapes(model, linears)
    w4 = ct_tensor_bytes(shapes, {}, other, 32)
    as_int8 = ct_tensor_bytes(shapes, plan, other, 32)
    as_bf16 = ct_tensor_bytes(shapes, dict.fromkeys(LAYER0, "bf16"), other, 32)
    assert as_bf16 > as_int8 > w4  # the BF16 alternative really costs more
    assert f"+{100 * (as_int8 / w4 - 1):.1f} % over uniform W4A16" in msg
    assert f"on vllm-cpu at +{100 * (as_bf16 / w4 - 1):.1f} %" in msg
    assert "mixed_precision/cpu.py" in msg and "7 linear(s) on INT8" in msg
    # the same plan loads for the CUDA target, and its BF16 form for the CPU one
    s_gpu = export_compressed_tensors(llama, plan, tmp_path / "gpu", group_size=32, target="vllm-gpu")
    s_cpu = export_compressed_tensors(llama, dict.fromkeys(LAYER0, "bf16"), out, group_size=32, target="vllm-cpu")
    assert s_gpu["schemes"] == {"W4A16": 7, "W8A16": 7, "BF16": 0}
    assert s_cpu["schemes"] == {"W4A16": 7, "W8A16": 0, "BF16": 7} and s_cpu["target"] == "vllm-cpu"
    assert s_cpu["tensor_bytes"] == as_bf16 and s_gpu["tensor_bytes"] == as_int8
    assert "vLLM's CPU build" in (out / "README.md").read_text()
    cfg = json.loads((out / "config.json").read_text())["quantization_config"]
    assert not any("W8A16" in json.dumps(g) or g.get("weights", {}).get("num_bits") == 8
                   for g in cfg["config_groups"].values())


def test_the_cpu_target_keeps_vllm_s_fused_groups(llama, tmp_path):
    with pytest.raises(ExportError, match="splits 1 serving group"):
        export_compressed_tensors(llama, {L0 + "self_attn.q_proj": "bf16"}, tmp_path / "x", group_size=32,
                                  target="vllm-cpu")


def test_the_cli_takes_the_cpu_target_and_refuses_it_for_bitsandbytes(llama, tmp_path, capsys):
    plan = tmp_path / "plan.json"
    plan.write_text(json.dumps({"rungs": dict.fromkeys(LAYER0, "int8")}))
    rc = export_main(["--model", str(llama), "--plan", str(plan), "--output", str(tmp_path / "o"),
                      "--format", "compressed-tensors", "--group-size", "32", "--target", "vllm-cpu"])
    err = capsys.readouterr().err
    assert rc != 0 and "no W8A16 kernel" in err and not (tmp_path / "o").exists()
    rc = export_main(["--model", str(llama), "--plan", str(plan), "--output", str(tmp_path / "b"),
                      "--target", "vllm-cpu"])
    err = capsys.readouterr().err
    assert rc != 0 and "--target vllm-cpu is a compressed-tensors target" in err and not (tmp_path / "b").exists()


# ------------------------------------------------------------------ gnmr-hf profile --serve: the plan for its server

import random  # noqa: E402

from gnmr_hf.planning.plan import Plan, PlanError  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_profile_faults_r3 import WORDS, tiny_tokenizer  # noqa: E402
from tests.test_profile_int4 import GS, _base, _profile  # noqa: E402


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("serve") / "model", num_layers=2, hidden=64)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    r = random.Random(0)
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text("\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(4)))
    return path


def test_a_plan_records_its_target_and_refuses_what_the_target_cannot_load(tmp_path):
    p = Plan({"model.layers.0.mlp.down_proj": "bf16"}, low="int4", group_size=64, groups="vllm", serve="vllm-cpu")
    assert Plan.load(p.save(tmp_path / "p.json")).serve == "vllm-cpu"
    with pytest.raises(PlanError, match="1 linear\\(s\\) on int8, which vllm-cpu does not serve"):
        Plan({"x": "int8"}, low="int4", group_size=64, groups="vllm", rung_set=("int8", "bf16"), serve="vllm-cpu")
    with pytest.raises(PlanError, match="fuses serving groups, but the plan is free"):
        Plan({"x": "bf16"}, low="int4", group_size=64, groups=None, serve="vllm-cpu")
    with pytest.raises(PlanError, match="serving target 'tgi'"):
        Plan({}, low="nf4", serve="tgi")


def test_profile_serve_vllm_cpu_buys_only_bf16_groups_and_the_export_follows_the_plan(model_dir, docs, tmp_path,
                                                                                     capsys):
    cpu, gpu = tmp_path / "cpu", tmp_path / "gpu"
    for out, serve in ((cpu, "vllm-cpu"), (gpu, "vllm-gpu")):
        rc, stdout, err = _profile(*_base(model_dir, docs, out), "--group-size", GS, "--budget", "+25%int4",
                                   "--serve", serve)
        assert rc == 0, err
    plan, ladder = Plan.load(cpu), Plan.load(gpu)
    assert (plan.serve, plan.rung_set, plan.groups, plan.low) == ("vllm-cpu", ("bf16",), "vllm", "int4")
    assert plan.rungs and set(plan.rungs.values()) == {"bf16"}
    assert ladder.serve == "vllm-gpu" and "int8" in ladder.rungs.values()  # the same budget buys INT8 on CUDA
    assert "target vllm-cpu read from the plan" in stdout or "target vllm-gpu read from the plan" in stdout
    # the export takes the plan's target when --target is not given, and refuses the CUDA plan for the CPU
    assert export_main(["--model", str(model_dir), "--plan", str(cpu), "--format", "compressed-tensors",
                        "--output", str(tmp_path / "f")]) == 0
    assert "vLLM's CPU build" in (tmp_path / "f" / "README.md").read_text()
    capsys.readouterr()
    assert export_main(["--model", str(model_dir), "--plan", str(gpu), "--format", "compressed-tensors",
                        "--output", str(tmp_path / "g"), "--target", "vllm-cpu"]) != 0
    assert "no W8A16 kernel" in capsys.readouterr().err and not (tmp_path / "g").exists()


@pytest.mark.parametrize("extra, want", [
    (["--serve", "vllm-cpu", "--low", "nf4"], "--serve vllm-cpu serves int4, int4-asym low formats, not --low nf4"),
    (["--serve", "vllm-cpu", "--low", "int4", "--groups", "none"], "--groups none plans that it cannot load"),
    (["--serve", "gguf", "--low", "nf4"], "--serve gguf plans over a GGUF type (q4_0, q4_1, q5_0, q5_1), not --low nf4"),
])
def test_bad_serve_requests_are_one_line(model_dir, tmp_path, extra, want):
    rc, _, err = _profile("--model", model_dir, "--output", tmp_path / "p", *extra)
    assert rc == 2 and len(err) == 1 and want in err[0], err
    assert not (tmp_path / "p").exists()


def test_profile_serve_bitsandbytes_records_its_target_on_the_bf16_plan(model_dir, docs, tmp_path):
    out = tmp_path / "bnb"
    rc, _, err = _profile("--model", model_dir, "--serve", "bitsandbytes", "--data", docs, "--max-seq-len", 16,
                          "--batch-size", 2, "--batches", 2, "--budget", "25%", "--no-ladder", "--no-plot", "--quiet",
                          "--output", out)
    assert rc == 0, err
    plan = Plan.load(out)
    assert (plan.serve, plan.low, plan.rung_set) == ("bitsandbytes", "nf4", ("bf16",)) and plan.rungs
    assert plan.skip_modules()[0] == "lm_head"  # a stock bitsandbytes load reads it


def test_the_uniform_w4a16_baseline_is_one_flag_and_equals_an_empty_plan(llama, tmp_path, capsys):
    assert export_main(["--model", str(llama), "--format", "compressed-tensors", "--uniform", "w4a16",
                        "--group-size", "32", "--output", str(tmp_path / "u")]) == 0
    s = export_compressed_tensors(llama, {}, tmp_path / "e", group_size=32)
    a = (tmp_path / "u" / "model.safetensors").read_bytes()
    assert a == (tmp_path / "e" / "model.safetensors").read_bytes() and s["schemes"]["W4A16"] == 14
    capsys.readouterr()
    assert export_main(["--model", str(llama), "--format", "compressed-tensors", "--uniform", "q4_0",
                        "--output", str(tmp_path / "q")]) == 2
    assert "writes its low linears as W4A16 or W4A16_ASYM" in capsys.readouterr().err and not (tmp_path / "q").exists()


def test_profile_low_int4_takes_a_registered_criterion_for_its_rungs(model_dir, docs, tmp_path):
    # issue 59: a criterion of the registry chooses INT4 plans too (weight_error: no forward pass, so it is cheap)
    out = tmp_path / "we"
    rc, stdout, err = _profile(*_base(model_dir, docs, out), "--group-size", GS, "--budget", "+25%int4",
                               "--criterion", "weight_error")
    assert rc == 0, err
    plan = Plan.load(out)
    assert plan.chosen_by["criterion"] == "weight_error" and plan.rungs and "rung gains (weight_error)" in stdout
