"""Faults of the planner, budget strings, profile.json and ``gnmr-hf profile`` (issue 26, round 3).

Each test reproduces one observed fault on a tiny random LLaMA (NF4, FP32 compute) or on a hand-built
profile, and checks the fix: collator / DataLoader batches accepted (4), budget strings with units and
bounds (5), a hand-edited profile.json validated on load (7), plan() checks its model and batches are the
profile's (8), short data reported and refused (10), one-line CLI errors (11), no negative zero and no
stray DIR/data folder (13).
"""

from __future__ import annotations

import copy
import json
import sys
from pathlib import Path

import pytest
import torch

import gnmr_hf
from gnmr_hf.planning import (
    PrecisionPlan,
    SensitivityProfile,
    UnitScore,
    format_price_table,
    parse_budget,
    plan,
    profile_sensitivity,
)
from gnmr_hf.planning.cli import main
from tests.conftest import make_tiny_llama
from tests.test_dual_path import load

pytest.importorskip("peft")
pytest.importorskip("bitsandbytes")

ROOT = Path(__file__).resolve().parents[1]
NUM_LAYERS = 4
# the tiny LLaMA (hidden 64, 2 of 4 KV heads): k_proj / v_proj 64 x 32 x 2 B are the smallest linears
SMALLEST = 64 * 32 * 2
TOTAL = NUM_LAYERS * (2 * 64 * 64 * 2 + 2 * SMALLEST + 3 * 64 * 128 * 2)


def dual(path):
    return gnmr_hf.prepare_dual_path(load(path, "nf4"), path, units="linears", dtype=torch.float32).eval()


def make_batches(n=2, seed=0, width=12):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        ids = torch.randint(0, 128, (2, width), generator=g)
        mask = torch.ones_like(ids)
        mask[1, -3:] = 0
        out.append({"input_ids": ids, "attention_mask": mask, "labels": ids.masked_fill(mask == 0, -100)})
    return out


@pytest.fixture(scope="module")
def model(tiny_llama_dir):
    return dual(tiny_llama_dir)


@pytest.fixture(scope="module")
def batches():
    return make_batches()


@pytest.fixture(scope="module")
def prof(model, batches):
    return profile_sensitivity(model, batches, criteria=("first_order",))


WORDS = ("Question Answer what is plus minus times the of a and to how many apples has she he they left "
         "give gives total each").split()


def tiny_tokenizer():
    """A word-level tokenizer of under 128 ids (the tiny LLaMA's vocabulary), as save_pretrained writes it."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<pad>", "</s>"]
    vocab = {t: i for i, t in enumerate(specials + WORDS + [str(d) for d in range(10)] + list(":?.,#=+-*/$"))}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Sequence([pre_tokenizers.Whitespace(), pre_tokenizers.Digits(individual_digits=True)])
    assert len(vocab) <= 128
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>", pad_token="<pad>", eos_token="</s>")


@pytest.fixture(scope="module")
def tiny_with_tokenizer(tmp_path_factory):
    path = make_tiny_llama(tmp_path_factory.mktemp("tiny_tok"))
    tiny_tokenizer().save_pretrained(path)
    return path


def cli(capsys, *argv):
    code = main(list(argv))
    captured = capsys.readouterr()
    return code, captured.out, captured.err.strip().splitlines()


# ------------------------------------------------------------------------------- 4: collator batches


def test_collator_batch_encodings_and_a_dataloader_are_accepted(model, batches, prof):
    from torch.utils.data import DataLoader
    from transformers import BatchEncoding, DataCollatorForLanguageModeling

    encoded = [BatchEncoding(dict(b)) for b in batches]
    again = profile_sensitivity(model, encoded, criteria=("first_order",))
    assert again.scores("first_order") == pytest.approx(prof.scores("first_order"), abs=1e-9)
    # a real collator's output and a DataLoader over it (iterated, not refused)
    collate = DataCollatorForLanguageModeling(tiny_tokenizer(), mlm=False, return_tensors="pt")
    rows = [{"input_ids": list(range(3, 3 + n))} for n in (5, 7, 6, 4)]
    out = collate(rows[:2])
    assert isinstance(out, BatchEncoding)
    loader = DataLoader(rows, batch_size=2, collate_fn=collate)
    from_loader = profile_sensitivity(model, loader, criteria=("first_order",))
    from_list = profile_sensitivity(model, [collate(rows[:2]), collate(rows[2:])], criteria=("first_order",))
    assert from_loader.batches == 2 and from_loader.tokens == from_list.tokens
    assert from_loader.scores("first_order") == pytest.approx(from_list.scores("first_order"), abs=1e-9)
    p = plan(from_loader, budget_fraction=0.1, model=model, batches=loader)  # the same loader again: same batches
    assert p.measured["profile"]["loss_plan"] > 0
    with pytest.raises(ValueError, match=r"batch 0 must be a mapping .*got tuple"):
        profile_sensitivity(model, [(batches[0]["input_ids"],)])


# ------------------------------------------------------------------------------- 5: budget strings


@pytest.mark.parametrize("text, message", [
    ("1.5", "bare number above 1 is ambiguous"), ("2", "bare number above 1 is ambiguous"),
    ("4095", "bare number above 1 is ambiguous"), ("1e99", "bare number above 1 is ambiguous"),
    ("0%", r"percentage must be in \(0, 100\]"), ("0", "keeps nothing"), ("0.5B", "less than one byte"),
    ("1.5B", "whole number"), ("1e999MB", "is not a percentage"),
])
def test_ambiguous_or_empty_budget_strings_are_refused(text, message):
    with pytest.raises(ValueError, match=message) as e:
        parse_budget(text)
    assert str(e.value).startswith(f"budget {text!r}") and "\n" not in str(e.value)


def test_budget_units_still_parse():
    assert parse_budget("1") == (None, 1.0)  # a fraction in (0, 1]
    assert parse_budget("0.1") == (None, 0.1) and parse_budget("10%") == (None, 0.1)
    assert parse_budget("4095B") == (4095, None) and parse_budget("4 KiB") == (4096, None)
    assert parse_budget("2kb") == (2000, None) and parse_budget("1.5MiB") == (1572864, None)
    assert parse_budget("2GB") == (2 * 10**9, None) and parse_budget("1GiB") == (2**30, None)


def test_a_budget_that_buys_nothing_or_exceeds_the_total_is_refused(prof):
    assert prof.total_bytes == TOTAL and min(u.bytes for u in prof.units) == SMALLEST
    for kw in ({"budget_bytes": SMALLEST - 1}, {"budget_bytes": 0}, {"budget_fraction": 1e-6}):
        with pytest.raises(ValueError, match=f"buys no unit: the smallest unit .* is {SMALLEST} B .* total {TOTAL} B"):
            plan(prof, **kw)
    with pytest.raises(ValueError, match=f"exceeds .* the smallest unit .* is {SMALLEST} B .* total {TOTAL} B"):
        plan(prof, budget_bytes=int(1e99))
    with pytest.raises(ValueError, match=r"budget_fraction must be in \(0, 1\]"):
        plan(prof, budget_fraction=0.0)
    assert plan(prof, budget_bytes=SMALLEST).bytes <= SMALLEST  # the smallest budget that buys one unit
    assert plan(prof, budget_bytes=TOTAL).budget_bytes == TOTAL


def test_the_recipe_budget_goes_through_the_same_refusals():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    for text in ("2", "0%", "1.5"):
        with pytest.raises(finetune.RecipeError, match=rf"profile\.budget '{text}'"):
            finetune.ProfileArguments.from_dict({"budget": text})
    assert finetune.ProfileArguments.from_dict({"budget": "300MB"}).budget == "300MB"


def test_cli_refuses_a_bare_byte_count_in_one_line(tmp_path, capsys):
    code, _, err = cli(capsys, "--output", str(tmp_path / "o"), "--budget", "4095")
    assert code == 2 and len(err) == 1 and "bare number above 1 is ambiguous" in err[0]
    assert not (tmp_path / "o").exists()


# ------------------------------------------------------------------------------- 7: profile.json


def fake_dict():
    units = [UnitScore(index=i, name=f"layers.{i}.mlp.up_proj", modules=[f"model.layers.{i}.mlp.up_proj"],
                       bytes=100, layer=i, op="up_proj", scores={"loss": 0.1 * (i + 1)}) for i in range(4)]
    prof = SensitivityProfile(units=units, criteria=["loss"], losses={"low": 2.0, "high": 1.0}, costs={},
                              batches=1, tokens=10, keep_modules=["lm_head"], meta={"batch_tokens": [10]})
    return prof.to_dict()


def edited(change):
    d = copy.deepcopy(fake_dict())
    change(d)
    return d


@pytest.mark.parametrize("change, message", [
    (lambda d: d["units"].pop(1), r"units\[1\]\.index is 2, not its position 1"),
    (lambda d: d["units"][2].update(index=1), r"units\[2\]\.index is 1, not its position 2"),
    (lambda d: d["units"][0].update(modules="model.layers.0.mlp.up_proj"),
     r"units\[0\]\.modules must be a list of module names, got str"),
    (lambda d: d.pop("tokens"), r"missing field 'tokens'"),
    (lambda d: d["units"][3].pop("bytes"), r"missing field 'units\[3\]\.bytes'"),
    (lambda d: d["units"][1].update(bytes=-5), r"units\[1\]\.bytes must be an integer >= 0"),
    (lambda d: d.update(format=99), r"format 99 is not a profile format"),
    (lambda d: d["losses"].pop("high"), r"missing field 'losses\.high'"),
    (lambda d: d["units"][0]["scores"].update(loss="big"), r"units\[0\]\.scores must be"),
    (lambda d: d.update(keep_modules="lm_head"), r"keep_modules must be a list"),
])
def test_a_hand_edited_profile_is_refused_naming_the_field(tmp_path, change, message):
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(edited(change)))
    with pytest.raises(ValueError, match=message) as e:
        SensitivityProfile.from_json(path)
    assert "\n" not in str(e.value) and str(e.value).startswith(str(path))


def test_profiles_written_by_earlier_code_still_load():
    d = fake_dict()
    d.pop("format")
    d["meta"] = {}  # no batch_tokens, no batch_digests
    assert SensitivityProfile.from_dict(d).total_bytes == 400
    # profiles written by earlier gnmr_hf (bench/value/qlora_budget.py's own profile.json is another format)
    for name in ("profile_criteria/profile.json", "profile_criteria/recipe_profile_1_batch.json",
                 "profile_criteria/recipe_profile_2_batches.json", "qlora_budget/profile_full.json"):
        prof = SensitivityProfile.from_json(ROOT / "bench" / "results" / name)
        assert len(prof.units) == 210 and [u.index for u in prof.units] == list(range(210))


# ------------------------------------------------------------------------------- 8: plan checks its inputs


def test_plan_refuses_batches_that_are_not_the_profiles(model, batches, prof):
    other = make_batches(seed=5)  # same shapes and target-token counts, other tokens
    with pytest.raises(ValueError, match="batches are not the profile's: batch 0 differs"):
        plan(prof, budget_fraction=0.1, model=model, batches=other)
    with pytest.raises(ValueError, match="batches are not the profile's: 1 batch"):
        plan(prof, budget_fraction=0.1, model=model, batches=batches[:1])
    p = plan(prof, budget_fraction=0.1, model=model, batches=batches, heldout=other)  # other data: heldout=
    assert set(p.measured) == {"profile", "heldout"}
    # a profile written before fingerprints were recorded is checked by its target-token counts
    old = SensitivityProfile.from_dict({**prof.to_dict(), "meta": {"batch_tokens": prof.meta["batch_tokens"]}})
    plan(old, budget_fraction=0.1, model=model, batches=batches)
    with pytest.raises(ValueError, match=r"target tokens per batch \[19, 19\], the profile saw \[21, 19\]"):
        plan(SensitivityProfile.from_dict({**old.to_dict(), "meta": {"batch_tokens": [21, 19]}}),
             budget_fraction=0.1, model=model, batches=batches)


def test_plan_and_measure_plan_refuse_another_model(tmp_path, batches, prof):
    bigger = dual(make_tiny_llama(tmp_path / "tiny12", num_layers=12))
    with pytest.raises(ValueError, match="the model is not the profiled one: the profile has 28 units, the model 84"):
        plan(prof, budget_fraction=0.1, model=bigger, batches=batches)
    # a plan from another profile: its indices name other units of this model
    p = plan(prof, budget_fraction=0.1)
    renamed = PrecisionPlan(**{**p.__dict__, "names": ["layers.9.mlp.up_proj"] * len(p.indices)})
    with pytest.raises(ValueError, match="the plan is not for this model"):
        gnmr_hf.measure_plan(bigger, renamed, batches)
    with pytest.raises(ValueError, match=r"unit indices \[84\] are not units of this model"):
        gnmr_hf.measure_plan(bigger, [84], batches)


# ------------------------------------------------------------------------------- 10, 11, 13: the CLI


@pytest.mark.slow  # a subprocess or a full CLI run: the slow tier
def test_cli_reports_short_held_out_data_and_writes_no_data_folder(tiny_with_tokenizer, tmp_path, capsys):
    data = tmp_path / "five.jsonl"
    data.write_text("".join(json.dumps({"question": f"what is {i} plus {i} ?", "answer": f"{2 * i} #### {2 * i}"})
                            + "\n" for i in range(5)))
    out = tmp_path / "prof"
    code, stdout, err = cli(capsys, "--model", str(tiny_with_tokenizer), "--data", str(data), "--output", str(out),
                            "--heldout-batches", "3", "--batch-size", "4", "--no-plot", "--quiet")
    assert code == 0, err
    assert "profiling 1 batch(es) (4 example(s)" in stdout and "held-out 1 batch(es) (1 example(s)" in stdout
    assert any("warning: --heldout-batches 3 x batch size 4 asked for 12 example(s); the data left 1" in line
               for line in err)
    assert sorted(p.name for p in out.iterdir()) == ["profile.json"]
    saved = json.loads((out / "profile.json").read_text())
    assert saved["batches"] == 1 and saved["plan"]["measured"]["heldout"]
    # the default data (generated into a temporary folder, not DIR/data)
    out2 = tmp_path / "prof2"
    code, stdout, err = cli(capsys, "--model", str(tiny_with_tokenizer), "--output", str(out2), "--batch-size", "2",
                            "--no-plot", "--quiet")
    assert code == 0, err
    assert sorted(p.name for p in out2.iterdir()) == ["profile.json"]


def test_cli_refuses_empty_held_out_data_before_loading(tiny_with_tokenizer, tmp_path, capsys):
    text = tmp_path / "two.txt"
    text.write_text("apples left")  # two tokens: one piece, for the profile batch
    code, stdout, err = cli(capsys, "--model", str(tiny_with_tokenizer), "--data", str(text), "--output",
                            str(tmp_path / "o"), "--heldout-batches", "2")
    assert code == 2 and len(err) == 1
    assert err[0].startswith("gnmr-hf profile: error: --heldout-batches 2: the data has nothing left for held-out")
    assert "loading" not in stdout and not (tmp_path / "o").exists()


def test_cli_one_line_errors_for_an_output_file_and_a_folder_without_tokenizer(tiny_llama_dir, tmp_path, capsys):
    existing = tmp_path / "file.txt"
    existing.write_text("x")
    code, _, err = cli(capsys, "--model", str(tiny_llama_dir), "--output", str(existing))
    assert code == 2 and err == [f"gnmr-hf profile: error: --output {existing}: an existing file, not a folder"]
    code, _, err = cli(capsys, "--model", str(tiny_llama_dir), "--output", str(existing / "sub"))
    assert code == 2 and len(err) == 1 and "is a file, not a folder" in err[0]
    code, _, err = cli(capsys, "--model", str(tiny_llama_dir), "--output", str(tmp_path / "o"))
    assert code == 2 and len(err) == 1
    assert err[0].startswith(f"gnmr-hf profile: error: --model {tiny_llama_dir}: the folder has no tokenizer files "
                             "(it needs tokenizer.json, or tokenizer.model")
    assert not (tmp_path / "o").exists()


def test_no_negative_zero_in_the_price_table_and_summary():
    p = PrecisionPlan(criterion="loss", budget_bytes=10, total_bytes=100, indices=[0], names=["u"], modules=["m"],
                      bytes=10, predicted_gain=-1e-5, predicted_gap_closed=-1e-5, gain_score="loss",
                      measured={"profile": {"loss_low": 2.0, "loss_high": 1.0, "loss_plan": 2.0001,
                                            "gap_closed": -0.0001}})
    table, summary = format_price_table([p]), p.summary()
    assert "-0.000" not in table and "| 0.000 | 0.000 |" in table
    assert "-0.000" not in summary and "measured gap closed on profile: 0.000" in summary
    p.measured["profile"]["gap_closed"] = -0.25
    assert "| -0.250 |" in format_price_table([p])  # real negatives keep their sign


# item 13 (runtime): a plan over another number of units than the model has is refused naming the plan
def test_a_plan_for_another_model_is_refused_at_train_begin_naming_the_plan(tiny_llama_dir, tmp_path):
    import datasets
    import peft
    from transformers import Trainer, TrainingArguments

    from gnmr_hf.units import find_linear_units

    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), recovery_source=tiny_llama_dir, units="linears",
                                      dtype=torch.float32)
    model = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "v_proj"], task_type="CAUSAL_LM"))
    n = len(find_linear_units(model))
    assert n == 28
    callback = gnmr_hf.GNMRCallback(policy=gnmr_hf.StaticPolicy(84, [0, 83]))  # a 12-layer model's plan
    ids = torch.randint(0, 128, (2, 8), generator=torch.Generator().manual_seed(0)).tolist()
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=1, per_device_train_batch_size=2, report_to="none",
                             save_strategy="no", use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, callbacks=[callback],
                      train_dataset=datasets.Dataset.from_list([{"input_ids": r, "labels": r} for r in ids]))
    with pytest.raises(ValueError, match=r"the policy StaticSetPolicy was built for 84 units .*but the model has 28 "
                                         r"\(.*layers\.0\.self_attn\.q_proj, \.\.\.\)"):
        trainer.train()


# the budget in memory over the all-low model (the user's currency), and the price table in both
def test_cli_budget_in_memory_over_nf4(tiny_with_tokenizer, tmp_path, capsys):
    out = tmp_path / "prof"
    code, stdout, err = cli(capsys, "--model", str(tiny_with_tokenizer), "--output", str(out), "--batch-size", "2",
                            "--budget", "+25%nf4", "--no-plot", "--no-ladder", "--quiet")
    assert code == 0, err
    saved = json.loads((out / "profile.json").read_text())
    line = next(x for x in stdout.splitlines() if x.startswith("[profile] budget +25%nf4:"))
    assert "over the 0.1 MiB nf4 model" in line
    from gnmr_hf.planning import over_low_prices

    prices = over_low_prices(tiny_with_tokenizer, [m for u in saved["units"] for m in u["modules"]], "nf4")
    # the plan's bytes over NF4 stay within 25 % of the all-NF4 model
    assert 0 < saved["plan"]["bytes"] / prices["bf16_per_over_byte"] <= 0.25 * prices["low_model_bytes"]
    header = next(x for x in stdout.splitlines() if x.startswith("| budget |"))
    assert "memory over NF4" in header
    code, _, err = cli(capsys, "--model", str(tiny_with_tokenizer), "--output", str(tmp_path / "p2"),
                       "--budget", "+10%int8", "--no-plot", "--quiet")
    assert code == 2 and err[-1].endswith("--budget +10%int8 is memory over the int8 model, but --low is nf4")
