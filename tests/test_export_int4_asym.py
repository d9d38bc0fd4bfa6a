"""The asymmetric INT4 low (``int4-asym``: compressed-tensors W4A16_ASYM, a zero point per group; vLLM's ``uint4``):
its quantiser bit-exact to compressed-tensors' on the same BF16 weight and worked by hand on one group, its bytes
equal to the folder's, its plan profiled against it (``gnmr-hf profile --low int4-asym``), its export (planned,
uniform, replanned) read back through compressed-tensors' own decompression, and the refusals: transformers
does not load such a folder, a plan profiled against one INT4 low is not exported at the other."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from gnmr_hf.export import main as export_main  # noqa: E402
from gnmr_hf.export_ct import _safetensors_bytes, ct_shapes, ct_tensor_bytes  # noqa: E402
from gnmr_hf.export_score import ct_folder_fp32, stock_ct_fp32  # noqa: E402
from gnmr_hf.planning.groups import decoder_linears, serving_groups  # noqa: E402
from gnmr_hf.planning.int4 import ct_rung_gains, fake_quantize_model, int4_fake_quant  # noqa: E402
from gnmr_hf.planning.ladder import choose_rungs  # noqa: E402
from gnmr_hf.planning.plan import Plan  # noqa: E402
from gnmr_hf.rungs import get_rung  # noqa: E402
from tests.test_profile_int4 import GS, _base, _batches, _profile  # noqa: E402
from tests.test_serving import docs as _docs  # noqa: E402
from tests.test_serving import model_dir as _model_dir  # noqa: E402

# the serving tests' tiny LLaMA (2 layers, hidden 64, a tokenizer) and its short text, built once for this module
model_dir = pytest.fixture(scope="module")(_model_dir.__wrapped__)
docs = pytest.fixture(scope="module")(_docs.__wrapped__)


def test_the_quantiser_is_compressed_tensors_own_and_worked_by_hand():
    from compressed_tensors.quantization import QuantizationArgs, fake_quantize
    from compressed_tensors.quantization.utils import calculate_qparams

    # one group by hand: [0, 1.5] spans 0..1.5, so scale 1.5 / 15 = 0.1 and zero point -8 - 0 / 0.1 = -8; the
    # codes -8 and 7 give back 0 and 1.5 exactly, where the symmetric grid (scale 1.5 / 7.5) tops out at 7 x 0.2
    w = torch.tensor([[0.0, 1.5]])
    assert int4_fake_quant(w, 2, symmetric=False)[0].tolist() == pytest.approx([0.0, 1.5], abs=1e-6)
    assert int4_fake_quant(w, 2)[0].tolist() == pytest.approx([0.0, 1.4], abs=1e-6)
    g = torch.Generator().manual_seed(0)
    for shift, group in ((0.0, 32), (0.03, 64), (0.0, 128)):
        w = (torch.randn(48, 256, generator=g) * 0.05 + shift).to(torch.bfloat16)
        w[:3, :group] = 0  # all-zero groups take the library's eps path
        args = QuantizationArgs(num_bits=4, type="int", symmetric=False, strategy="group", group_size=group)
        x = w.reshape(48, 256 // group, group)
        scale, zero = calculate_qparams(x.amin(-1), x.amax(-1), args)
        ref = fake_quantize(w, scale, zero, args)
        mine = int4_fake_quant(w, group, symmetric=False)
        assert torch.equal(mine, ref)
        assert not torch.equal(mine, int4_fake_quant(w, group))  # the two lows differ


def test_its_bytes_are_the_folders_and_the_uniform_folder_reads_back_as_the_quantiser(model_dir, tmp_path, capsys):
    assert export_main(["--model", str(model_dir), "--format", "compressed-tensors", "--uniform", "W4A16_ASYM",
                        "--group-size", str(GS), "--target", "vllm-cpu", "--output", str(tmp_path / "u")]) == 0
    said = capsys.readouterr().out
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    linears = decoder_linears(model)
    shapes, other = ct_shapes(model, linears)
    # by hand: W4A16 + one int32 word per 8 rows for each group's zero points (the tiny LLaMA's rows are >= 8)
    zp = sum(4 * (o // 8) * (i // GS) for o, i, _ in shapes.values())
    assert ct_tensor_bytes(shapes, {}, other, GS, "int4-asym") == ct_tensor_bytes(shapes, {}, other, GS) + zp
    assert _safetensors_bytes(tmp_path / "u") == ct_tensor_bytes(shapes, {}, other, GS, "int4-asym")
    assert f"W4A16_ASYM {len(linears)} / W8A16 0 / BF16 0" in said
    assert json.loads((tmp_path / "u" / "config.json").read_text())["quantization_config"]["config_groups"][
        "group_0"]["weights"]["symmetric"] is False
    # compressed-tensors' decompression of the folder is the quantiser's weight, bit for bit
    served = ct_folder_fp32(tmp_path / "u", model_dir).state_dict()
    want = fake_quantize_model(model, {}, GS, low="int4-asym").float().state_dict()
    assert all(torch.equal(served[k], want[k]) for k in want)
    # and that reader gives the stock load's weights for a symmetric folder
    assert export_main(["--model", str(model_dir), "--format", "compressed-tensors", "--uniform", "W4A16",
                        "--group-size", str(GS), "--output", str(tmp_path / "s")]) == 0
    a, b = ct_folder_fp32(tmp_path / "s", model_dir).state_dict(), stock_ct_fp32(tmp_path / "s", model_dir,
                                                                                   [1, 2, 3]).state_dict()
    assert all(torch.equal(a[k], b[k]) for k in b)


def test_stock_transformers_refuses_the_folder_so_the_export_refuses_that_target(model_dir, tmp_path, capsys):
    assert export_main(["--model", str(model_dir), "--format", "compressed-tensors", "--uniform", "w4a16-asym",
                        "--group-size", str(GS), "--target", "transformers", "--output", str(tmp_path / "t")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "stock transformers does not load a W4A16_ASYM folder" in err[0]
    assert not (tmp_path / "t").exists()
    for argv, want in ((["--uniform", "W4A16_ASYM", "--low-type", "W4A16_ASYM"], "not both"),
                       (["--uniform", "Q4_0"], "--uniform Q4_0: a compressed-tensors export writes its low linears "
                                               "as W4A16 or W4A16_ASYM")):
        assert export_main(["--model", str(model_dir), "--format", "compressed-tensors", "--group-size", str(GS),
                            "--output", str(tmp_path / "x"), *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and want in err[0] and not (tmp_path / "x").exists()


@pytest.fixture(scope="module")
def asym_plan(model_dir, docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("asym") / "p"
    base = [a if a != "int4" else "int4-asym" for a in _base(model_dir, docs, out)]
    rc, stdout, err = _profile(*base, "--group-size", GS, "--budget", "+25%int4-asym", "--serve", "vllm-cpu")
    assert rc == 0, err
    return out, stdout


def test_profile_low_int4_asym_ranks_that_quantiser_s_gains(model_dir, docs, asym_plan):
    out, stdout = asym_plan
    plan = Plan.load(out)
    assert (plan.low, plan.group_size, plan.serve, plan.groups, plan.rung_set) == \
        ("int4-asym", GS, "vllm-cpu", "vllm", ("bf16",))
    assert plan.is_int4 and plan.chosen_by["currency"] == "compressed-tensors folder bytes over uniform W4A16_ASYM"
    # the plan is choose_rungs of the gains at the uniform W4A16_ASYM point, worked out here on the CLI's batches
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    units = ct_rung_gains(model, _batches(model_dir, docs), GS, low="int4-asym")
    sym = ct_rung_gains(model, _batches(model_dir, docs), GS)
    assert [u.gains for u in units] != [u.gains for u in sym]  # another low, other gains
    for u in units:
        u.gains = {"bf16": u.gains["bf16"]}
        u.prices = {"bf16": u.prices["bf16"]}
    want = choose_rungs(units, plan.budget_bytes, ("bf16",), groups=serving_groups(model))
    by = {u.name: u for u in units}
    assert want and plan.rungs == want and plan.price_bytes == sum(by[n].prices["bf16"] for n in want) <= \
        plan.budget_bytes
    # a bf16 rung over W4A16_ASYM costs what the registry says, less than over W4A16 by the zero points
    o, i = 64, 64
    assert units[0].prices["bf16"] == get_rung("bf16").bytes_in("compressed-tensors", o * i, o).total - \
        get_rung("int4-asym").bytes(o * i, o, group_size=GS).total < sym[0].prices["bf16"]


def test_the_asym_plan_exports_for_vllm_cpu_without_format_and_keeps_its_low(model_dir, asym_plan, tmp_path, capsys):
    out, _ = asym_plan
    plan = Plan.load(out)
    assert export_main(["--model", str(model_dir), "--plan", str(out), "--output", str(tmp_path / "f")]) == 0
    said = capsys.readouterr().out
    n = len(plan.rungs)
    assert f"(compressed-tensors, for vllm-cpu): W4A16_ASYM {14 - n} / W8A16 0 / BF16 {n}" in said
    config = json.loads((tmp_path / "f" / "config.json").read_text())["quantization_config"]
    assert sorted(config["ignore"]) == sorted(["lm_head", *plan.rungs])
    assert "asymmetric (a zero point per group)" in (tmp_path / "f" / "README.md").read_text()
    served = ct_folder_fp32(tmp_path / "f", model_dir).state_dict()
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    want = fake_quantize_model(model, plan.rungs, GS, low="int4-asym").float().state_dict()
    assert all(torch.equal(served[k], want[k]) for k in want)
    capsys.readouterr()
    # another INT4 low than the plan's, or the profile's plan for transformers: one line each, nothing written
    for extra, msg in ((["--low-type", "W4A16"], "was profiled against int4-asym (W4A16_ASYM)"),
                       (["--target", "transformers"], "stock transformers does not load a W4A16_ASYM folder")):
        assert export_main(["--model", str(model_dir), "--plan", str(out), "--output", str(tmp_path / "g"),
                            *extra]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0] and not (tmp_path / "g").exists()


@pytest.mark.parametrize("extra, want", [
    (["--serve", "transformers"], "--serve transformers serves int4, nf4, fp4, int8 low formats, not --low int4-asym"),
    (["--budget", "+10%int4"], "--budget +10%int4 is memory over the uniform W4A16 (int4) model, but --low is "
                               "int4-asym"),
])
def test_bad_asym_profile_requests_are_one_line(model_dir, docs, tmp_path, extra, want):
    base = [a if a != "int4" else "int4-asym" for a in _base(model_dir, docs, tmp_path / "o")]
    rc, _, err = _profile(*base, "--group-size", GS, *extra)
    assert rc == 2 and len(err) == 1 and want in err[0] and not (tmp_path / "o").exists()


def test_replan_takes_the_asymmetric_low_and_scores_the_folder(model_dir, docs, tmp_path, capsys):
    text = tmp_path / "train.txt"
    text.write_text((docs.read_text() + "\n") * 40)
    assert export_main(["--model", str(model_dir), "--format", "compressed-tensors", "--low-type", "W4A16_ASYM",
                        "--target", "vllm-cpu", "--group-size", str(GS), "--replan", str(text),
                        "--replan-batches", "1", "--score-block", "64", "--score-blocks", "2",
                        "--output", str(tmp_path / "r")]) == 0
    said = capsys.readouterr().out
    plan = Plan.load(tmp_path / "r.plan.json")
    assert (plan.low, plan.serve, plan.groups) == ("int4-asym", "vllm-cpu", "vllm")
    assert "W4A16_ASYM (group 64)" in said and "over uniform W4A16_ASYM" in said
    line = next(x for x in said.splitlines() if x.startswith("scored on"))
    assert "the export keeps" in line


def test_the_preflight_knows_every_low_the_profile_takes():
    from gnmr_hf import preflight
    from gnmr_hf.planning import cli

    assert preflight._PROFILE_LOWS == cli._LOW and "int4-asym" in cli._LOW
    assert preflight.check_command("profile", ["--low", "int4-asym", "--budget", "+10%int4-asym"]) is None
    assert "must be in (0, 1000]%" in preflight.check_command("profile", ["--budget", "+0%int4-asym"])


@pytest.mark.parametrize("serve, lows", [("vllm-cpu", {"int4", "int4-asym"}), (None, {"int4"})])
def test_choose_int4_plans_every_setting_the_server_takes_at_the_same_bytes(model_dir, docs, tmp_path, serve, lows):
    out = tmp_path / "c"
    base = [a for a in _base(model_dir, docs, out)]
    rc, stdout, err = _profile(*base, "--heldout-batches", 2, "--budget", "+25%int4", "--choose-int4",
                               *(["--serve", serve] if serve else []))
    assert rc == 0, err
    saved = json.loads((out / "profile.json").read_text())
    rows = saved["int4_settings"]["rows"]
    assert saved["int4_settings"]["requested_budget"] == "+25%int4"
    # the settings: every group of 128 / 64 / 32 dividing the tiny LLaMA's inputs (64 and 128 wide: 64 and 32), per
    # low the server takes (transformers, the default export's reader, takes no zero points)
    assert {(r["low"], r["group_size"]) for r in rows} == {(low, g) for low in lows for g in (64, 32)}
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16)
    shapes, other = ct_shapes(model, decoder_linears(model))
    total = ct_tensor_bytes(shapes, {}, other, 64) + int(0.25 * ct_tensor_bytes(shapes, {}, other, 64))
    for r in rows:  # each at the same folder bytes: its own uniform folder plus what is left of the total
        assert r["uniform_bytes"] == ct_tensor_bytes(shapes, {}, other, r["group_size"], r["low"])
        assert r["uniform_bytes"] + r["budget_bytes"] == total and r["price_bytes"] <= r["budget_bytes"]
    best = min(rows, key=lambda r: r["loss"]["heldout"])
    assert best["chosen"] and sum(r["chosen"] for r in rows) == 1
    plan = Plan.load(out)
    assert (plan.low, plan.group_size, plan.budget_bytes) == (best["low"], best["group_size"], best["budget_bytes"])
    assert (len(plan.on("int8")), len(plan.on("bf16")), plan.price_bytes) == (best["int8"], best["bf16"],
                                                                             best["price_bytes"])
    main = next(p for p in saved["plans"] if p["budget_bytes"] == best["budget_bytes"] and p["kind"] == "grouped")
    assert main["loss"]["heldout"] == pytest.approx(best["loss"]["heldout"], abs=1e-9)  # measured again, the same
    assert "**chosen**" in stdout and "INT4 settings at the same folder bytes" in stdout


@pytest.mark.parametrize("extra, want", [
    (["--low", "int4-asym"], "--choose-int4 chooses among the compressed-tensors INT4 settings"),
    (["--group-size", "64"], "--choose-int4 chooses the group size: give it or --group-size, not both"),
])
def test_bad_choose_int4_requests_are_one_line(model_dir, docs, tmp_path, extra, want):
    base = [a for a in _base(model_dir, docs, tmp_path / "o")]
    if extra[0] == "--low":
        base[base.index("--low") + 1] = extra[1]
        extra = []
    rc, _, err = _profile(*base, "--choose-int4", *extra)
    assert rc == 2 and len(err) == 1 and want in err[0] and not (tmp_path / "o").exists()
