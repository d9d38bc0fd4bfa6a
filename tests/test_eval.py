"""The bundled lm-eval script: real lm-evaluation-harness runs on a tiny model and on SmolLM2.

lm-eval is slow to import and run, so each model is evaluated once per module (fixtures below) and
many tests assert on those results.

The tiny model is a hand-built *bigram* LLaMA (attention and MLP outputs zeroed, so each position's
logits depend only on its own token) whose greedy continuation of "...Answer:" is " #### 42" and then
"Question:", the harness's GSM8K stop sequence. Its GSM8K output is therefore known in advance, and
the fixture data's answers decide the exact match: two of three test answers end in "#### 42".
"""

from __future__ import annotations

import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

REPO = Path(__file__).resolve().parents[1]
GSM8K_RESPONSE = " #### 42\n"  # what the bigram model generates after "Answer:" (until "Question:")
TASKS_ALL = "gsm8k,mmlu,hellaswag,wikitext"


# ----------------------------------------------------------------------------------- fixture data
def write_fixture_data(root: Path) -> Path:
    """Small files in the four hub schemas, written for these tests."""

    def dump(rel: str, rows: list[dict]) -> None:
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(r) + "\n" for r in rows))

    dump("gsm8k/train.jsonl", [
        {"question": "Ava has 3 apples and buys 4 more. How many apples does Ava have?",
         "answer": "Ava has 3 + 4 = <<3+4=7>>7 apples.\n#### 7"},
        {"question": "Ben reads 5 pages a day for 6 days. How many pages does he read?",
         "answer": "Ben reads 5 * 6 = <<5*6=30>>30 pages.\n#### 30"},
        {"question": "A box holds 12 eggs. How many eggs are in 2 boxes?",
         "answer": "2 boxes hold 2 * 12 = <<2*12=24>>24 eggs.\n#### 24"},
        {"question": "Farid has 50 cards and gives away 8. How many cards are left?",
         "answer": "Farid has 50 - 8 = <<50-8=42>>42 cards left.\n#### 42"},
        {"question": "Grace buys 3 packs of 5 pens. How many pens does she buy?",
         "answer": "She buys 3 * 5 = <<3*5=15>>15 pens.\n#### 15"},
    ])
    dump("gsm8k/test.jsonl", [
        {"question": "Chloe has 40 stickers and gets 2 more. How many stickers does she have?",
         "answer": "Chloe has 40 + 2 = <<40+2=42>>42 stickers.\n#### 42"},
        {"question": "Dev has 20 marbles and loses 3. How many marbles are left?",
         "answer": "Dev has 20 - 3 = <<20-3=17>>17 marbles left.\n#### 17"},
        {"question": "Elena packs 6 bags of 7 shells. How many shells is that?",
         "answer": "She packs 6 * 7 = <<6*7=42>>42 shells.\n#### 42"},
    ])
    mmlu_dev = [
        {"question": "What is 2 + 3?", "subject": "elementary_mathematics", "choices": ["4", "5", "6", "7"], "answer": 1},
        {"question": "Which planet is closest to the Sun?", "subject": "astronomy",
         "choices": ["Venus", "Earth", "Mercury", "Mars"], "answer": 2},
    ]
    mmlu_test = [
        {"question": "What is 9 × 8?", "subject": "elementary_mathematics", "choices": ["72", "63", "81", "64"], "answer": 0},
        {"question": "What is 100 − 37?", "subject": "elementary_mathematics", "choices": ["73", "67", "63", "53"], "answer": 2},
        {"question": "What is 15 ÷ 3?", "subject": "elementary_mathematics", "choices": ["3", "4", "6", "5"], "answer": 3},
        {"question": "Which planet is the largest in the Solar System?", "subject": "astronomy",
         "choices": ["Saturn", "Jupiter", "Neptune", "Earth"], "answer": 1},
        {"question": "What is the Moon?", "subject": "astronomy",
         "choices": ["A star", "A planet", "A natural satellite of the Earth", "A comet"], "answer": 2},
    ]
    dump("mmlu/dev.jsonl", mmlu_dev)
    dump("mmlu/test.jsonl", mmlu_test)

    def hs(i: int, label_text: str, ctx_a: str, ctx_b: str, endings: list[str], label: int, split: str) -> dict:
        return {"ind": i, "activity_label": label_text, "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
                "endings": endings, "source_id": f"test~{i}", "split": split, "split_type": "indomain",
                "label": str(label)}

    dump("hellaswag/train.jsonl", [
        hs(0, "Cooking", "A man cracks two eggs into a bowl.", "he", ["whisks them with a fork.", "paints the wall.",
           "climbs a tree.", "reads a map."], 0, "train"),
        hs(1, "Gardening", "A woman kneels by a flower bed.", "she", ["flies a kite.", "pulls out the weeds.",
           "swims a lap.", "bakes bread."], 1, "train"),
    ])
    dump("hellaswag/validation.jsonl", [
        hs(0, "Cycling", "A boy puts on a helmet.", "he", ["eats the helmet.", "sings opera.",
           "gets on his bike and rides away.", "sleeps in the garage."], 2, "val"),
        hs(1, "Cleaning", "A woman fills a bucket with soapy water.", "she", ["mops the kitchen floor.",
           "plants a tree in it.", "throws it at the moon.", "sells it online."], 0, "val"),
        hs(2, "Music", "A girl sits down at the piano.", "she", ["eats the keys.", "drives to work.",
           "paints the ceiling.", "begins to play a song."], 3, "val"),
    ])
    page = (" = Valkyria Chronicles = \n\nThe game began development in 2010 , carrying over a large portion of the "
            "work done on the previous game . Many of the characters returned .\n")
    dump("wikitext/train.jsonl", [{"page": page}])
    dump("wikitext/validation.jsonl", [{"page": " = Tower = \n\nThe tower is 300 m tall and made of iron .\n"}])
    dump("wikitext/test.jsonl", [
        {"page": " = Robert Boulter = \n\nRobert Boulter is an English film , television and theatre actor . "
                 "He had a guest @-@ starring role on the television series The Bill in 2000 .\n"},
        {"page": " = River Thames = \n\nThe River Thames flows through southern England , including London . "
                 "It is 346 km long , the longest river entirely in England .\n"},
    ])
    return root


def make_bigram_llama(path: Path, tokenizer_dir: Path, chain_text: str = ": #### 42\nQuestion:") -> Path:
    """A tiny LLaMA with SmolLM2's tokenizer whose greedy output follows ``chain_text`` token by token.

    Attention and MLP outputs are zeroed, so the residual stream at a position is its token's
    embedding; chain tokens get one-hot embeddings and ``lm_head`` maps each to the next chain token.
    """
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tok = AutoTokenizer.from_pretrained(tokenizer_dir)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048,
                         tie_word_embeddings=False, bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    model = LlamaForCausalLM(config)
    chain = tok(chain_text)["input_ids"]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        for slot, (a, b) in enumerate(zip(chain, chain[1:])):
            assert a not in chain[:slot], "the chain must not revisit a token"
            model.model.embed_tokens.weight[a] = 0.0
            model.model.embed_tokens.weight[a, slot] = 1.0
            model.lm_head.weight[b, slot] = 10.0
    model.to(torch.bfloat16).save_pretrained(path)
    tok.save_pretrained(path)
    return path


def make_lora_adapter(base_dir: Path, out: Path, seed: int,
                      target_modules: tuple[str, ...] = ("q_proj", "v_proj", "o_proj", "down_proj")) -> Path:
    """A LoRA adapter made with PEFT on ``base_dir``, random A *and* B (init_lora_weights=False)."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.bfloat16)
    peft_model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=list(target_modules),
                                                  init_lora_weights=False))
    b = [p for n, p in peft_model.named_parameters() if "lora_B" in n]
    assert b and all(p.abs().sum() > 0 for p in b)
    peft_model.save_pretrained(out)
    return out


def _metrics_finite(results: dict, task: str, keys: list[str]) -> None:
    for key in keys:
        value = results["results"][task][key]
        assert isinstance(value, float) and math.isfinite(value), (task, key, value)


# ------------------------------------------------------------------------------------------ fixtures
@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_fixture_data(tmp_path_factory.mktemp("eval_data"))


@pytest.fixture(scope="module")
def bigram_dir(tmp_path_factory, smollm2_dir) -> Path:
    return make_bigram_llama(tmp_path_factory.mktemp("bigram"), smollm2_dir)


@pytest.fixture(scope="module")
def adapters(tmp_path_factory, bigram_dir) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("adapters")
    return make_lora_adapter(bigram_dir, root / "a1", seed=1), make_lora_adapter(bigram_dir, root / "a2", seed=2)


@pytest.fixture(scope="module")
def tiny_results(bigram_dir, data_dir, tmp_path_factory) -> dict:
    from gnmr_hf.evaluation.evaluate import evaluate

    out = tmp_path_factory.mktemp("tiny_out") / "tiny.json"
    return evaluate(str(bigram_dir), "gsm8k,mmlu,hellaswag,wikitext", data_dir=data_dir, device="cpu",
                    log_samples=True, output=out, method="tiny bigram")


@pytest.fixture(scope="module")
def tiny_wikitext_ppl(bigram_dir, data_dir, adapters) -> dict[str, float]:
    """WikiText word perplexity of the tiny model without and with each adapter, BF16, INT8 and NF4."""
    from gnmr_hf.evaluation.evaluate import evaluate

    a1, a2 = adapters
    runs = {"bf16": (None, "bf16"), "bf16+a1": (a1, "bf16"), "bf16+a2": (a2, "bf16"), "int8+a1": (a1, "int8"),
            "nf4+a1": (a1, "nf4")}
    out = {}
    for name, (adapter, precision) in runs.items():
        r = evaluate(str(bigram_dir), "wikitext", adapter=adapter, precision=precision, data_dir=data_dir,
                     device="cpu")
        out[name] = r["results"]["wikitext"]["word_perplexity,none"]
    return out


@pytest.fixture(scope="module")
def smollm2_run(smollm2_dir, data_dir, tmp_path_factory) -> tuple[int, dict, str]:
    """SmolLM2 on all four tasks through the CLI (``gnmr-hf eval``), --limit 1 (GSM8K generation on CPU is slow)."""
    from gnmr_hf.cli import main

    out = tmp_path_factory.mktemp("smol_out") / "smol.json"
    rc = main(["eval", "--model", str(smollm2_dir), "--data-dir", str(data_dir), "--limit", "1",
               "--max-gen-toks", "40", "--device", "cpu", "--log-samples", "--name", "SmolLM2 BF16",
               "--output", str(out)])
    return rc, json.loads(out.read_text()), str(out)


# ------------------------------------------------------------------------------------ tiny model
ALL_METRICS = {
    "gsm8k": ["exact_match,strict-match", "exact_match,flexible-extract"],
    "mmlu": ["acc,none"],
    "hellaswag": ["acc,none", "acc_norm,none"],
    "wikitext": ["word_perplexity,none", "byte_perplexity,none", "bits_per_byte,none"],
}


def test_tiny_every_metric_present_and_finite(tiny_results):
    for task, keys in ALL_METRICS.items():
        _metrics_finite(tiny_results, task, keys)
    # the harness's own few-shot defaults: GSM8K 5-shot, the rest 0-shot
    assert tiny_results["n-shot"]["gsm8k"] == 5
    assert tiny_results["n-shot"]["hellaswag"] == 0 and tiny_results["n-shot"]["wikitext"] == 0


def test_tiny_used_the_local_files_through_the_harness_yaml(tiny_results, data_dir):
    cfg = tiny_results["configs"]["gsm8k"]
    assert cfg["dataset_path"] == "json"
    assert cfg["dataset_kwargs"]["data_files"]["test"] == str(data_dir.resolve() / "gsm8k" / "test.jsonl")
    # everything else is the harness's own GSM8K definition
    assert cfg["doc_to_text"] == "Question: {{question}}\nAnswer:"
    assert [f["name"] for f in cfg["filter_list"]] == ["strict-match", "flexible-extract"]
    assert tiny_results["configs"]["hellaswag"]["dataset_kwargs"]["data_files"]["validation"].endswith(
        "hellaswag/validation.jsonl")
    assert tiny_results["n-samples"]["gsm8k"]["effective"] == 3
    assert tiny_results["n-samples"]["wikitext"]["effective"] == 2


def test_gsm8k_exact_match_is_computed_on_the_answer_line(tiny_results):
    samples = tiny_results["samples"]["gsm8k"]
    strict = [s for s in samples if s["filter"] == "strict-match"]
    assert len(strict) == 3
    for s in strict:
        assert s["resps"] == [[GSM8K_RESPONSE]]  # the bigram model's known output
        assert s["filtered_resps"] == ["42"]
        gold = s["doc"]["answer"].split("#### ")[-1]
        assert s["exact_match"] == (1.0 if gold == "42" else 0.0)
    # two of the three test answers end in "#### 42"
    assert tiny_results["results"]["gsm8k"]["exact_match,strict-match"] == pytest.approx(2 / 3)
    assert tiny_results["results"]["gsm8k"]["exact_match,flexible-extract"] == pytest.approx(2 / 3)
    assert tiny_results["summary"]["gsm8k_em"] == pytest.approx(2 / 3)


def test_mmlu_is_the_harness_subject_tasks_weighted_by_size(tiny_results):
    res = tiny_results["results"]
    assert tiny_results["group_subtasks"]["mmlu"] == ["mmlu_astronomy", "mmlu_elementary_mathematics"] or sorted(
        tiny_results["group_subtasks"]["mmlu"]) == ["mmlu_astronomy", "mmlu_elementary_mathematics"]
    # the harness's per-subject description made it into the prompt
    assert "about astronomy" in tiny_results["configs"]["mmlu_astronomy"]["description"]
    per_doc = [s["acc"] for t in ("mmlu_astronomy", "mmlu_elementary_mathematics") for s in tiny_results["samples"][t]]
    assert len(per_doc) == 5
    assert res["mmlu"]["acc,none"] == pytest.approx(sum(per_doc) / 5)


def test_wikitext_word_perplexity_from_logged_loglikelihoods(tiny_results):
    samples = tiny_results["samples"]["wikitext"]
    ll = sum(float(s["resps"][0][0]) for s in samples)
    words = sum(len(re.split(r"\s+", s["doc"]["page"])) for s in samples)
    nbytes = sum(len(s["doc"]["page"].encode()) for s in samples)
    res = tiny_results["results"]["wikitext"]
    assert res["word_perplexity,none"] == pytest.approx(math.exp(-ll / words), rel=1e-6)
    assert res["bits_per_byte,none"] == pytest.approx(-ll / nbytes / math.log(2), rel=1e-6)


def test_summary_row_and_output_file(tiny_results):
    from gnmr_hf.reporting.report import summary_from_results

    s = tiny_results["summary"]
    assert s["method"] == "tiny bigram"
    assert s["row"] == (f"| tiny bigram | 66.67 | {100 * s['mmlu_acc']:.2f} | {100 * s['hellaswag_acc']:.2f} | "
                        f"{s['wikitext_word_ppl']:.4f} |")
    assert s["hellaswag_acc"] == tiny_results["results"]["hellaswag"]["acc,none"]
    assert summary_from_results(tiny_results, "x")["wikitext_word_ppl"] == s["wikitext_word_ppl"]


def test_perplexity_changes_with_the_adapter(tiny_wikitext_ppl):
    p = tiny_wikitext_ppl
    assert all(math.isfinite(v) for v in p.values())
    assert p["bf16+a1"] != pytest.approx(p["bf16"], rel=1e-3)
    assert p["bf16+a2"] != pytest.approx(p["bf16"], rel=1e-3)
    assert p["bf16+a1"] != pytest.approx(p["bf16+a2"], rel=1e-3)


def test_int8_base_is_close_to_bf16_but_not_identical(tiny_wikitext_ppl):
    # with the adapter, the INT8-quantised v_proj feeds the LoRA on o_proj, so the paths differ a little
    p = tiny_wikitext_ppl
    assert p["int8+a1"] != p["bf16+a1"]
    assert p["int8+a1"] == pytest.approx(p["bf16+a1"], rel=0.2)


def test_int8_loading_uses_bitsandbytes(bigram_dir, adapters):
    import bitsandbytes as bnb

    from gnmr_hf.evaluation.evaluate import load_model

    model, _ = load_model(str(bigram_dir), "int8", adapters[0], "cpu")
    layer = model.base_model.model.model.layers[0]
    assert isinstance(layer.self_attn.k_proj, bnb.nn.Linear8bitLt)
    assert isinstance(layer.self_attn.q_proj.base_layer, bnb.nn.Linear8bitLt)


def test_nf4_base_differs_from_bf16_and_int8(tiny_wikitext_ppl):
    # 4-bit rounding of the same weights moves the perplexity, by less than the adapter's own effect
    p = tiny_wikitext_ppl
    assert math.isfinite(p["nf4+a1"])
    assert p["nf4+a1"] != p["bf16+a1"] and p["nf4+a1"] != p["int8+a1"]
    assert p["nf4+a1"] == pytest.approx(p["bf16+a1"], rel=0.5)


def test_nf4_loading_uses_bitsandbytes_4bit(bigram_dir, adapters):
    import bitsandbytes as bnb
    import torch

    from gnmr_hf.evaluation.evaluate import load_model

    model, _ = load_model(str(bigram_dir), "nf4", adapters[0], "cpu")
    layer = model.base_model.model.model.layers[0]
    for linear in (layer.self_attn.k_proj, layer.self_attn.q_proj.base_layer):
        assert isinstance(linear, bnb.nn.Linear4bit)
        assert linear.weight.quant_state.quant_type == "nf4"
        assert linear.compute_dtype == torch.bfloat16


def test_unknown_precision_is_a_clear_error(bigram_dir):
    from gnmr_hf.evaluation.evaluate import EvalError, load_model

    with pytest.raises(EvalError, match="--precision must be one of bf16, int8, nf4, got 'fp4'"):
        load_model(str(bigram_dir), "fp4")


# ---------------------------------------------------------------------------------------- SmolLM2
def test_smollm2_cli_run(smollm2_run):
    rc, results, _ = smollm2_run
    assert rc == 0
    for task, keys in ALL_METRICS.items():
        _metrics_finite(results, task, keys)
    assert results["n-samples"]["gsm8k"]["effective"] == 1
    assert results["n-samples"]["mmlu_astronomy"]["effective"] == 1
    assert results["summary"]["method"] == "SmolLM2 BF16"
    # a real model on easy text: far better than the tiny random one, and a sane perplexity
    assert 1.0 < results["results"]["wikitext"]["word_perplexity,none"] < 1000.0


def test_smollm2_exact_match_matches_the_answer_line(smollm2_run):
    _, results, _ = smollm2_run
    for s in results["samples"]["gsm8k"]:
        response = s["resps"][0][0]
        gold = s["doc"]["answer"].split("#### ")[-1]
        if s["filter"] == "strict-match":
            m = re.search(r"#### (\-?[0-9\.\,]+)", response)
            extracted = m.group(1) if m else "[invalid]"
        else:
            found = re.findall(r"(-?[$0-9.,]{2,})|(-?[0-9]+)", response)
            extracted = [x for x in found[-1] if x][0] if found else "[invalid]"
        assert s["filtered_resps"] == [extracted]
        cleaned = re.sub(r"\.$", "", extracted.replace(",", "").replace("$", ""))
        assert s["exact_match"] == (1.0 if cleaned == gold else 0.0)


def test_smollm2_perplexity_changes_with_the_adapter(smollm2_dir, smollm2_run, data_dir, tmp_path):
    from gnmr_hf.evaluation.evaluate import evaluate

    _, base, _ = smollm2_run
    adapter = make_lora_adapter(smollm2_dir, tmp_path / "smol_lora", seed=3, target_modules=("q_proj", "v_proj"))
    r = evaluate(str(smollm2_dir), "wikitext", adapter=adapter, data_dir=data_dir, limit=1, device="cpu")
    with_adapter = r["results"]["wikitext"]["word_perplexity,none"]
    assert math.isfinite(with_adapter)
    assert with_adapter != pytest.approx(base["results"]["wikitext"]["word_perplexity,none"], rel=1e-3)
    assert r["summary"]["adapter"] == str(adapter)


def test_report_script_on_real_results(smollm2_run, tiny_results, tmp_path):
    _, smol, smol_path = smollm2_run
    tiny_path = tmp_path / "tiny.json"
    tiny_path.write_text(json.dumps(tiny_results, default=str))
    proc = subprocess.run([sys.executable, str(REPO / "eval" / "report.py"), smol_path, str(tiny_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.strip().splitlines()
    assert lines[0] == "| Method | GSM8K EM | MMLU Acc. | HellaSwag Acc. | WikiText-2 PPL |"
    assert lines[2] == smol["summary"]["row"]
    assert lines[3] == tiny_results["summary"]["row"]


# ------------------------------------------------------------------------------------ clear errors
def _run_cli(capsys, args: list[str]) -> tuple[int, str]:
    from gnmr_hf.evaluation.evaluate import main

    rc = main(args)
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return rc, err


def test_unknown_task(capsys, bigram_dir):
    rc, err = _run_cli(capsys, ["--model", str(bigram_dir), "--tasks", "gsm8k,arc_easy"])
    assert rc == 2 and "unknown task 'arc_easy'" in err and "gsm8k, mmlu, hellaswag, wikitext" in err


def test_unknown_task_through_the_scripts(tmp_path):
    env = {**os.environ, "HF_HUB_OFFLINE": "1"}
    for cmd in ([sys.executable, str(REPO / "eval" / "run_lm_eval.py")],
                [sys.executable, "-m", "gnmr_hf.cli", "eval"]):
        # an existing folder: gnmr-hf refuses a model name that is no folder, alias or hub id before the tasks
        proc = subprocess.run(cmd + ["--model", str(tmp_path), "--tasks", "piqa"], capture_output=True, text=True,
                              timeout=120, env=env)
        assert proc.returncode == 2
        assert "unknown task 'piqa'" in proc.stderr and "Traceback" not in proc.stderr


def test_adapter_folder_without_config(capsys, bigram_dir, tmp_path):
    (tmp_path / "not_an_adapter").mkdir()
    (tmp_path / "not_an_adapter" / "model.safetensors").write_bytes(b"")
    rc, err = _run_cli(capsys, ["--model", str(bigram_dir), "--adapter", str(tmp_path / "not_an_adapter"),
                                "--tasks", "wikitext"])
    assert rc == 2 and "not a PEFT adapter" in err and "adapter_config.json" in err


def test_adapter_for_other_module_names(capsys, bigram_dir, tmp_path):
    from peft import LoraConfig, get_peft_model
    from transformers import GPT2Config, GPT2LMHeadModel

    gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=1, n_head=2, vocab_size=64, n_positions=32))
    get_peft_model(gpt2, LoraConfig(r=2, target_modules=["c_attn"])).save_pretrained(tmp_path / "gpt2_lora")
    rc, err = _run_cli(capsys, ["--model", str(bigram_dir), "--adapter", str(tmp_path / "gpt2_lora"),
                                "--tasks", "wikitext"])
    assert rc == 2 and "does not match the base model" in err and "c_attn" in err


def test_adapter_with_other_shapes(capsys, bigram_dir, tmp_path):
    other = tmp_path / "other_base"
    from transformers import LlamaConfig, LlamaForCausalLM

    LlamaForCausalLM(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2)).save_pretrained(other)
    adapter = make_lora_adapter(other, tmp_path / "narrow_lora", seed=0, target_modules=("q_proj",))
    rc, err = _run_cli(capsys, ["--model", str(bigram_dir), "--adapter", str(adapter), "--tasks", "wikitext"])
    assert rc == 2 and "does not match the base model" in err and "in_features=64" in err


def test_data_dir_missing_a_file(capsys, data_dir, tmp_path):
    import shutil

    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    (broken / "hellaswag" / "validation.jsonl").unlink()
    rc, err = _run_cli(capsys, ["--model", "unused", "--data-dir", str(broken), "--tasks", "gsm8k,hellaswag"])
    assert rc == 2
    assert str(broken / "hellaswag" / "validation.jsonl") in err
    assert "ind, activity_label, ctx_a, ctx_b, ctx, endings, source_id, split, split_type, label" in err


def test_data_file_missing_fields(capsys, data_dir, tmp_path):
    import shutil

    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    rows = [json.loads(x) for x in (broken / "mmlu" / "test.jsonl").read_text().splitlines()]
    del rows[1]["subject"]
    (broken / "mmlu" / "test.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    rc, err = _run_cli(capsys, ["--model", "unused", "--data-dir", str(broken), "--tasks", "mmlu"])
    assert rc == 2 and "test.jsonl:2: missing field(s) subject" in err
    assert "question, subject, choices, answer" in err


def test_unknown_mmlu_subject(capsys, data_dir, tmp_path):
    import shutil

    broken = tmp_path / "data"
    shutil.copytree(data_dir, broken)
    with open(broken / "mmlu" / "test.jsonl", "a") as f:
        f.write(json.dumps({"question": "q", "subject": "cooking", "choices": ["a", "b", "c", "d"], "answer": 0}) + "\n")
    rc, err = _run_cli(capsys, ["--model", "unused", "--data-dir", str(broken), "--tasks", "mmlu"])
    assert rc == 2 and "unknown MMLU subject 'cooking'" in err


# ------------------------------------------------------------- batching, bounds, per-task resume
def _scores(results: dict) -> dict[str, float]:
    return {f"{task}/{key}": value for task, metrics in results["results"].items()
            for key, value in metrics.items() if "," in key and "stderr" not in key}


def test_batched_and_bounded_scores_equal_unbatched_tiny(bigram_dir, data_dir):
    """Batches of 4 and a 16-token GSM8K cap (the generation stops at 'Question:' anyway) score as one
    document at a time with the harness's 256-token default does, on every task (FP32 compute)."""
    from gnmr_hf.evaluation.evaluate import evaluate

    common = dict(data_dir=data_dir, device="cpu", log_samples=True, compute_dtype="float32")
    one = evaluate(str(bigram_dir), TASKS_ALL, batch_size=1, **common)
    batched = evaluate(str(bigram_dir), TASKS_ALL, batch_size=4, max_gen_toks=16, **common)
    a, b = _scores(one), _scores(batched)
    assert a.keys() == b.keys() and len(a) >= 8
    for key in a:
        assert b[key] == pytest.approx(a[key], rel=1e-5), key
    responses = [[s["resps"] for s in r["samples"]["gsm8k"]] for r in (one, batched)]
    assert responses[0] == responses[1] and responses[0][0] == [[GSM8K_RESPONSE]]
    assert batched["summary"]["batch_size"] == 4 and batched["summary"]["compute_dtype"] == "float32"


def test_batched_gsm8k_generation_equals_unbatched_smollm2(smollm2_dir, data_dir):
    """The real model's greedy GSM8K answers, 3 problems in one batch against one at a time, in FP32 (in
    BF16 a batch moves some answers: padding and batch shape change the rounding)."""
    from gnmr_hf.evaluation.evaluate import evaluate

    common = dict(data_dir=data_dir, device="cpu", log_samples=True, compute_dtype="float32", num_fewshot=0,
                  max_gen_toks=48)
    runs = [evaluate(str(smollm2_dir), "gsm8k", batch_size=bs, **common) for bs in (1, 3)]
    responses = [[s["resps"] for s in r["samples"]["gsm8k"]] for r in runs]
    assert len(responses[0]) == 2 * 3 and responses[0] == responses[1]  # two filters x three problems
    assert _scores(runs[0]) == _scores(runs[1])


def test_resume_dir_keeps_finished_tasks(bigram_dir, data_dir, tmp_path, monkeypatch):
    """An evaluation interrupted in its second task resumes there: the first task's file is read back."""
    import lm_eval

    from gnmr_hf.evaluation.evaluate import evaluate

    real = lm_eval.simple_evaluate
    calls: list[list[str]] = []

    def interrupted(*args, **kwargs):
        calls.append(list(kwargs["tasks"]))
        if kwargs["tasks"] == ["hellaswag"] and len(calls) == 2:
            raise KeyboardInterrupt  # as if the user pressed Ctrl-C in the middle of HellaSwag
        return real(*args, **kwargs)

    monkeypatch.setattr(lm_eval, "simple_evaluate", interrupted)
    parts = tmp_path / "parts"
    kwargs = dict(data_dir=data_dir, device="cpu", limit=2, resume_dir=parts, compute_dtype="float32")
    with pytest.raises(KeyboardInterrupt):
        evaluate(str(bigram_dir), "wikitext,hellaswag", **kwargs)
    assert (parts / "wikitext.json").is_file() and not (parts / "hellaswag.json").exists()
    assert not list(parts.glob(".*.tmp"))  # nothing half-written
    first = json.loads((parts / "wikitext.json").read_text())

    resumed = evaluate(str(bigram_dir), "wikitext,hellaswag", output=tmp_path / "all.json", **kwargs)
    assert calls == [["wikitext"], ["hellaswag"], ["hellaswag"]]  # wikitext was not scored again
    assert resumed["results"]["wikitext"] == first["results"]["wikitext"]
    assert resumed["summary"]["read_back"] == ["wikitext"]
    assert set(resumed["results"]) == {"wikitext", "hellaswag"}
    assert set(resumed["configs"]) == {"wikitext", "hellaswag"} and resumed["n-samples"]["hellaswag"]["effective"] == 2
    assert json.loads((tmp_path / "all.json").read_text())["summary"]["hellaswag_acc"] is not None

    # all there: nothing is scored (not even the model loaded); other settings: scored again
    evaluate(str(bigram_dir), "wikitext,hellaswag", **kwargs)
    assert len(calls) == 3
    evaluate(str(bigram_dir), "wikitext", **{**kwargs, "limit": 1})
    assert calls[-1] == ["wikitext"] and len(calls) == 4


def test_compute_dtype_reaches_the_model(bigram_dir, adapters):
    from gnmr_hf.evaluation.evaluate import EvalError, load_model

    model, _ = load_model(str(bigram_dir), "bf16", adapters[0], "cpu", compute_dtype="float32")
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    model, _ = load_model(str(bigram_dir), "nf4", None, "cpu", compute_dtype="float32")
    assert model.model.layers[0].self_attn.k_proj.compute_dtype == torch.float32
    with pytest.raises(EvalError, match="--compute-dtype must be one of"):
        load_model(str(bigram_dir), "bf16", compute_dtype="fp8")


def test_cli_usage_errors_are_one_line(capsys):
    from gnmr_hf.evaluation.evaluate import main

    with pytest.raises(SystemExit) as e:
        main(["--model", "x", "--precision", "fp4"])
    err = capsys.readouterr().err
    assert e.value.code == 2 and err.count("\n") == 1
    assert "invalid choice: 'fp4'" in err and "(see gnmr-hf eval --help)" in err
    with pytest.raises(SystemExit):
        main(["--help"])
    assert "examples:" in capsys.readouterr().out
