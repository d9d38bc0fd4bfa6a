"""``gnmr-hf profile --low int4``: a precision-ladder plan profiled against the compressed-tensors export's own
INT4 quantiser, and what the exports and ``load_planned`` do with it.

On a tiny LLaMA (2 layers, hidden 64, down_proj input 128) and a few short text documents: the CLI's rungs are
``choose_rungs(ct_rung_gains(...))`` computed here on batches built here from the same text; its price is the
rungs' ``ct_rung_prices`` summed, within the budget; the exported folder's tensor bytes over a uniform W4A16
export of the same model are that price exactly (safetensors data bytes; the files' JSON headers, a few hundred
bytes of tensor names and offsets, are not part of the price); the grouped plan never splits a vLLM group (and
the free plan at the same budget does, so the constraint is exercised); the bad inputs are one line each.
"""

from __future__ import annotations

import contextlib
import io
import json
import random

import pytest
import torch

transformers = pytest.importorskip("transformers")
pytest.importorskip("compressed_tensors")

from gnmr_hf.export_ct import (  # noqa: E402
    _safetensors_bytes,
    ct_rung_gains,
    ct_rung_prices,
    export_compressed_tensors,
)
from gnmr_hf.planning.cli import main as profile_main  # noqa: E402
from gnmr_hf.planning.groups import serving_groups, split_groups  # noqa: E402
from gnmr_hf.planning.ladder import choose_rungs  # noqa: E402
from gnmr_hf.planning.profiler import model_identity  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_profile_faults_r3 import WORDS, tiny_tokenizer  # noqa: E402

GS, SEQ, BS, NB = 64, 16, 2, 2
INT4_LINE = "profiled against the compressed-tensors INT4 export: export it with --format compressed-tensors"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("int4") / "model", num_layers=2, hidden=64)
    tiny_tokenizer().save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def docs(tmp_path_factory):
    r = random.Random(0)
    text = "\n".join(" ".join(r.choice(WORDS) for _ in range(40)) for _ in range(4))  # four short documents
    path = tmp_path_factory.mktemp("docs") / "docs.txt"
    path.write_text(text)
    return path


def _profile(*argv):
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        rc = profile_main([str(a) for a in argv])
    return rc, out.getvalue(), err.getvalue().strip().splitlines()


def _base(model_dir, docs, output):
    return ["--model", model_dir, "--low", "int4", "--data", docs, "--max-seq-len", SEQ, "--batch-size", BS,
            "--batches", NB, "--quiet", "--output", output]


@pytest.fixture(scope="module")
def grouped(model_dir, docs, tmp_path_factory):
    out = tmp_path_factory.mktemp("prof") / "g"
    rc, stdout, err = _profile(*_base(model_dir, docs, out), "--group-size", GS, "--budget", "+10%int4")
    assert rc == 0, err
    return out, json.loads((out / "profile.json").read_text()), stdout


@pytest.fixture(scope="module")
def folders(model_dir, tmp_path_factory):
    """Uniform W4A16 and all-BF16 exports of the model: the currency's two ends, measured on disk."""
    root = tmp_path_factory.mktemp("ref")
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir)
    linears = [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    export_compressed_tensors(model_dir, {}, root / "w4a16", group_size=GS)
    export_compressed_tensors(model_dir, dict.fromkeys(linears, "bf16"), root / "bf16", group_size=GS)
    return {"w4a16": root / "w4a16", "bf16": root / "bf16"}


def _batches(model_dir, docs):
    """The CLI's profile batches, built here: the text's tokens in pieces of SEQ, BS pieces a batch, padded."""
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    ids = tok(docs.read_text())["input_ids"]
    pieces = [ids[i:i + SEQ] for i in range(0, len(ids), SEQ)][: NB * BS]
    assert len(pieces) == NB * BS and all(len(p) == SEQ for p in pieces)
    out = []
    for i in range(0, len(pieces), BS):
        x = torch.tensor(pieces[i:i + BS])
        out.append({"input_ids": x, "attention_mask": torch.ones_like(x), "labels": x.clone()})
    return out


def _units(model_dir, docs):
    model = transformers.AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    return model, ct_rung_gains(model, _batches(model_dir, docs), GS)


def test_the_int4_profile_is_choose_rungs_of_ct_rung_gains_grouped(model_dir, docs, grouped, folders):
    _, saved, stdout = grouped
    model, units = _units(model_dir, docs)
    groups = serving_groups(model)
    budget = int(0.10 * _safetensors_bytes(folders["w4a16"]))  # +10 % of the uniform W4A16 folder, measured
    want = choose_rungs(units, budget, groups=groups)
    assert want and saved["rungs"] == want
    assert saved["low"] == "int4" and saved["group_size"] == GS and saved["groups"] == "vllm"
    assert saved["budget_bytes"] == budget and saved["plan"]["groups"] == "vllm"
    assert saved["model_identity"] == model_identity(model_dir)
    # its price: the rungs' ct_rung_prices summed, within the budget
    mods = dict(model.named_modules())
    price = sum(ct_rung_prices(mods[n].out_features, mods[n].in_features, GS)[r] for n, r in want.items())
    assert saved["price_bytes"] == price and 0 < price <= budget
    # the grouped plan never splits a vLLM group; the free plan at this budget does (the constraint bites here)
    assert split_groups(saved["rungs"], groups) == []
    assert split_groups(choose_rungs(units, budget), groups)
    # the printed table: free and grouped side by side at each budget
    rows = [ln for ln in stdout.splitlines() if ln.startswith("| +")]
    assert [r.split("|")[2].strip() for r in rows] == ["free", "grouped (vllm)"] * (len(rows) // 2) and rows
    assert "| memory over W4A16 | plan | INT8 linears | BF16 linears |" in stdout


def test_groups_none_and_a_share_budget(model_dir, docs, folders, tmp_path):
    rc, _, err = _profile(*_base(model_dir, docs, tmp_path / "f"), "--group-size", GS, "--budget", "10%",
                          "--groups", "none")
    assert rc == 0, err
    saved = json.loads((tmp_path / "f" / "profile.json").read_text())
    # a share is of what every decoder linear on BF16 costs over uniform W4A16, in the folder's bytes
    budget = int(0.10 * (_safetensors_bytes(folders["bf16"]) - _safetensors_bytes(folders["w4a16"])))
    _, units = _units(model_dir, docs)
    assert saved["budget_bytes"] == budget and saved["groups"] is None
    assert saved["rungs"] == choose_rungs(units, budget) and saved["rungs"]


def test_the_export_reads_the_plan_and_its_bytes_over_w4a16_are_the_price(model_dir, grouped, folders, tmp_path,
                                                                         capsys):
    from gnmr_hf.export import main as export_main

    prof, saved, _ = grouped
    out = tmp_path / "ct"
    assert export_main(["--model", str(model_dir), "--plan", str(prof), "--format", "compressed-tensors",
                        "--output", str(out)]) == 0, capsys.readouterr().err
    assert "INT4 group 64" in capsys.readouterr().out  # the plan's group size, no --group-size given
    config = json.loads((out / "config.json").read_text())["quantization_config"]
    sizes = {g["weights"]["group_size"] for g in config["config_groups"].values() if g["weights"]["num_bits"] == 4}
    assert sizes == {GS}
    # exact: safetensors data bytes of the two folders (headers aside)
    assert _safetensors_bytes(out) - _safetensors_bytes(folders["w4a16"]) == saved["price_bytes"] > 0
    card = (out / "README.md").read_text()
    assert "profiled against: this export's own INT4 quantiser (W4A16, group 64" in card
    # a plan profiled against NF4 (a trained ladder's) stays accepted, and the card says so
    nf4 = tmp_path / "nf4"
    nf4.mkdir()
    (nf4 / "profile.json").write_text(json.dumps({"low": "nf4", "rungs": saved["rungs"]}))
    assert export_main(["--model", str(model_dir), "--plan", str(nf4), "--format", "compressed-tensors",
                        "--group-size", str(GS), "--output", str(tmp_path / "ct_nf4")]) == 0
    assert "profiled against: bitsandbytes NF4" in (tmp_path / "ct_nf4" / "README.md").read_text()


def _one_line(capsys, rc):
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1, err
    return err[0]


def test_the_exports_and_load_planned_refuse_what_does_not_fit(model_dir, grouped, tmp_path, capsys):
    import gnmr_hf
    from gnmr_hf.export import main as export_main

    prof, _, _ = grouped
    ct = ["--model", str(model_dir), "--plan", str(prof), "--format", "compressed-tensors"]
    line = _one_line(capsys, export_main(ct + ["--group-size", "32", "--output", str(tmp_path / "a")]))
    assert "was profiled against INT4 with group 64" in line and not (tmp_path / "a").exists()
    line = _one_line(capsys, export_main(["--model", str(model_dir), "--plan", str(prof),
                                          "--output", str(tmp_path / "b")]))
    assert line.endswith(INT4_LINE) and not (tmp_path / "b").exists()
    with pytest.raises(ValueError, match=INT4_LINE):
        gnmr_hf.load_planned(model_dir, prof)
    # another model with the same names and shapes: refused by the identity the profile recorded (the one check
    # every export and load_planned make: gnmr_hf.export_folder.check_sources)
    other = make_tiny_llama(tmp_path / "other", num_layers=2, hidden=64, seed=1)
    capsys.readouterr()  # its save's progress bars
    line = _one_line(capsys, export_main(["--model", str(other), "--plan", str(prof), "--format", "compressed-tensors",
                                          "--output", str(tmp_path / "c")]))
    assert "was made for another model" in line and not (tmp_path / "c").exists()  # as load_planned says


@pytest.mark.parametrize("extra, want", [
    (["--budget", "+10%nf4"], "is memory over the nf4 model, but --low is int4"),
    (["--budget", "1B", "--group-size", "64"], "buys nothing"),
    (["--budget", "+900%int4", "--group-size", "64"], "is more than every decoder linear on BF16 costs"),
    (["--budget", "+10%int4"], "--group-size 128 does not divide the input size of model.layers.0.self_attn.q_proj "
                               "(64): use --group-size 64"),
    (["--criterion", "nope", "--group-size", "64"], "unknown criterion 'nope'"),
])
def test_bad_int4_profile_requests_are_one_line(model_dir, docs, tmp_path, extra, want):
    rc, _, err = _profile(*_base(model_dir, docs, tmp_path / "p"), *extra)
    assert rc == 2 and len(err) == 1 and want in err[0], err
    assert not (tmp_path / "p").exists()


@pytest.mark.parametrize("extra, want", [
    (["--budget", "+10%int4"], "is memory over the uniform W4A16 (int4) model, but --low is nf4"),
    (["--group-size", "64"], "--group-size is the INT4 group of --low int4"),
])
def test_int4_options_on_another_low_are_one_line(model_dir, tmp_path, extra, want):
    rc, _, err = _profile("--model", model_dir, "--low", "nf4", "--output", tmp_path / "p", *extra)
    assert rc == 2 and len(err) == 1 and want in err[0], err
