"""The exports check the plan and the adapter against the model (item 2), and what they and the recipe runner
write to travel names models, not this machine's folders (item 3).

Item 2: ``gnmr-hf export`` (bitsandbytes and compressed-tensors alike) refuses a plan file that records another
model's ``model_identity`` (a BF16 plan and a ladder plan, the same layer names and shapes, other weights), and an
adapter trained on a model of another shape (4 layers into 2, another width), in one line naming what differs,
with the checks ``load_planned`` / ``gnmr-hf eval`` make (:func:`gnmr_hf.export_folder.check_sources`).

Item 3: the model cards, ``.gnmr_export.json``, the adapter copied into a bitsandbytes export, and a recipe's
training folder (the PEFT adapter's adapter_config.json and README.md, run.json) name the model (the offline
alias, else the folder's base name: :func:`gnmr_hf.export_folder.model_name`), never its absolute folder; the
adapter still loads with stock PEFT given the model.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path

import pytest
import torch

peft = pytest.importorskip("peft")
bnb = pytest.importorskip("bitsandbytes")
pytest.importorskip("compressed_tensors")

import gnmr_hf  # noqa: E402
from gnmr_hf import export  # noqa: E402
from gnmr_hf.export_ct import export_compressed_tensors as _export_ct  # noqa: E402
from gnmr_hf.export_folder import MARKER, ExportError, model_name  # noqa: E402
from gnmr_hf.planning.profiler import model_identity  # noqa: E402
from tests.conftest import make_tiny_llama  # noqa: E402
from tests.test_dual_path import load  # noqa: E402


def export_compressed_tensors(*a, **k):  # the tiny models are 64 wide: INT4 groups of 64
    return _export_ct(*a, **{"group_size": 64, **k})


ROOT = Path(__file__).resolve().parents[1]
L1 = "model.layers.1."


def _profile(path: Path, out: Path) -> Path:
    """A real BF16 plan of the model at ``path`` (``gnmr-hf profile``'s steps): it records the model's identity."""
    g = torch.Generator().manual_seed(5)
    batches = [{"input_ids": (x := torch.randint(0, 128, (2, 12), generator=g)), "labels": x} for _ in range(2)]
    model = gnmr_hf.prepare_dual_path(load(path, "nf4"), recovery_source=path, units="linears", dtype=torch.float32)
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    p = gnmr_hf.plan(prof, budget_fraction=0.3, model=model, batches=batches)
    prof.to_json(out / "profile.json", skip_modules=p.skip_modules(), plan=p.to_dict())
    return out


def _adapter(path: Path, out: Path, **lora) -> Path:
    from transformers import AutoModelForCausalLM

    torch.manual_seed(1)
    model = peft.get_peft_model(AutoModelForCausalLM.from_pretrained(path, dtype=torch.bfloat16),
                                peft.LoraConfig(r=2, init_lora_weights=False, **(lora or {"target_modules": ["q_proj"]})))
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="module")
def made(tmp_path_factory):
    """Two 2-layer tiny LLaMAs of the same shapes (seeds 0 and 1), a 4-layer one and a wider one; a plan of each
    2-layer model; adapters of the first, of the 4-layer and of the wide model. The first sits in a folder named
    like the offline alias, as gguf_checkpoint writes it."""
    root = tmp_path_factory.mktemp("r5_export")
    a = make_tiny_llama(root / "models" / "smollm2-135m-instruct", num_layers=2, seed=0)
    b = make_tiny_llama(root / "models" / "other-seed", num_layers=2, seed=1)
    deep = make_tiny_llama(root / "models" / "deep", num_layers=4, seed=2)
    wide = make_tiny_llama(root / "models" / "wide", num_layers=2, seed=3, hidden=96)
    assert model_identity(a)["config"] == model_identity(b)["config"] != model_identity(deep)["config"]
    plan_a, plan_b = _profile(a, root / "plan_a"), _profile(b, root / "plan_b")
    rungs = {L1 + "self_attn.o_proj": "int8", L1 + "mlp.down_proj": "bf16"}  # no fused group split
    (root / "ladder_b").mkdir()
    (root / "ladder_b" / "profile.json").write_text(json.dumps({"rungs": rungs, "model_identity": model_identity(b)}))
    return {"root": root, "a": a, "b": b, "plan_a": plan_a, "plan_b": plan_b, "ladder_b": root / "ladder_b",
            "rungs": rungs, "adapter_a": _adapter(a, root / "adapters" / "lora-a"),
            "adapter_deep": _adapter(deep, root / "adapters" / "lora-deep"),
            "adapter_wide": _adapter(wide, root / "adapters" / "lora-wide")}


def _refused(call, out: Path, *wants: str) -> str:
    with pytest.raises(ExportError) as e:
        call()
    msg = str(e.value)
    assert "\n" not in msg, msg
    for want in wants:
        assert want in msg, msg
    assert not out.exists() and not [p for p in out.parent.iterdir() if p.name.startswith(f".{out.name}-")]
    return msg


# ---------------------------------------------------------------------------------------------- item 2: the plan


def test_a_bf16_plan_of_another_model_is_refused_by_both_exports(made, tmp_path):
    a, plan_b = made["a"], made["plan_b"]
    recorded = json.loads((plan_b / "profile.json").read_text())["meta"]["model_identity"]
    assert recorded == model_identity(made["b"])  # the same names and shapes, other weights
    why = (f"was made for another model than {a}: its weights' fingerprint is {recorded['weights']}, "
           f"{a}'s is {model_identity(a)['weights']}")
    out = tmp_path / "out"
    _refused(lambda: export.export_planned(a, plan_b, out, target="transformers"), out, why)
    _refused(lambda: export_compressed_tensors(a, plan_b, out, target="transformers"), out, why)
    # as load_planned refuses it
    with pytest.raises(ValueError, match="was made for another model"):
        gnmr_hf.load_planned(a, plan_b)
    # the model's own plan passes, in both formats
    export.export_planned(made["b"], plan_b, tmp_path / "bnb", target="transformers")
    export_compressed_tensors(made["b"], plan_b, tmp_path / "ct", target="transformers")


def test_a_ladder_plan_of_another_model_is_refused_by_both_exports(made, tmp_path, capsys):
    a, ladder = made["a"], made["ladder_b"]
    out = tmp_path / "out"
    _refused(lambda: export_compressed_tensors(a, ladder, out), out, "was made for another model than",
             "weights' fingerprint")
    # bitsandbytes takes a ladder plan only with --merge; refused there too
    _refused(lambda: export.export_planned(a, ladder, out, adapter=made["adapter_a"], merge=True), out,
             "was made for another model than", "weights' fingerprint")
    # the command line: one error line, rc 2, for either format
    for extra in (["--format", "compressed-tensors", "--group-size", "64"], ["--merge", "--adapter", str(made["adapter_a"])]):
        capsys.readouterr()
        rc = export.main(["--model", str(a), "--plan", str(ladder), "--output", str(out), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.startswith("gnmr-hf export: error: ") and err.count("\n") == 1, err
        assert "was made for another model" in err and not out.exists()
    # the rungs of the plan exported from the model it was made for
    export_compressed_tensors(made["b"], ladder, tmp_path / "ok")


# ------------------------------------------------------------------------------------------- item 2: the adapter


@pytest.mark.parametrize("which, wants", [
    ("adapter_deep", ["does not match the model", "it has weights for model.layers.2.self_attn.q_proj, which the "
                      "model"]),
    ("adapter_wide", ["does not match the model", "has shape [2, 96]", "in_features=64"]),
])
def test_an_adapter_of_another_shape_is_refused_by_every_export(made, tmp_path, which, wants):
    a, adapter, out = made["a"], made[which], tmp_path / "out"
    for call in (lambda: export.export_planned(a, made["plan_a"], out, adapter=adapter, target="transformers"),
                 lambda: export.export_planned(a, made["plan_a"], out, adapter=adapter, merge=True),
                 lambda: export_compressed_tensors(a, made["plan_a"], out, adapter=adapter, target="transformers"),
                 lambda: export_compressed_tensors(a, made["rungs"], out, adapter=adapter)):
        _refused(call, out, str(adapter), *wants)


def test_an_adapter_of_another_shape_is_refused_on_the_command_line(made, tmp_path, capsys):
    out = tmp_path / "out"
    for extra in ([], ["--merge"], ["--format", "compressed-tensors", "--group-size", "64"]):
        capsys.readouterr()
        rc = export.main(["--model", str(made["a"]), "--plan", str(made["plan_a"]), "--output", str(out), "--target",
                          "transformers", "--adapter", str(made["adapter_deep"]), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and err.count("\n") == 1 and "does not match the model" in err, (extra, err)
        assert not out.exists()


# ----------------------------------------------------------------------------------------- item 3: names, not paths


def _no_path(folder: Path, root: Path, name: str, files: list[str]) -> None:
    for f in files:
        text = (folder / f).read_text()
        assert str(root) not in text, (f, text[:2000])
        assert name in text, (f, name)


def test_model_name_is_the_alias_the_hub_id_or_the_folder_name(tmp_path):
    assert model_name("smollm2-135m-instruct") == "smollm2-135m-instruct"
    assert model_name(tmp_path / "cache" / "gemma3-270m") == "gemma3-270m"
    assert model_name("HuggingFaceTB/SmolLM2-135M") == "HuggingFaceTB/SmolLM2-135M"
    snap = tmp_path / "hub" / "models--HuggingFaceTB--SmolLM2-135M" / "snapshots" / "0123abc"
    snap.mkdir(parents=True)
    assert model_name(snap) == "HuggingFaceTB/SmolLM2-135M"
    assert model_name(f"{tmp_path}/ckpt/my-llama/") == "my-llama"
    assert export.source_name is model_name  # the bitsandbytes card's own rule, unchanged


def test_the_compressed_tensors_card_and_marker_name_the_model_and_adapter(made, tmp_path):
    root, out = made["root"], tmp_path / "ct"
    s = export_compressed_tensors(made["a"], made["plan_a"], out, adapter=made["adapter_a"], target="transformers")
    _no_path(out, root, "smollm2-135m-instruct", ["README.md", MARKER])
    _no_path(out, root, "lora-a", ["README.md", MARKER])
    marker = json.loads((out / MARKER).read_text())
    assert marker["model"] == "smollm2-135m-instruct" and marker["adapter"] == "lora-a"
    assert marker["plan"] == "plan_a/profile.json"
    assert s["adapter"] == str(made["adapter_a"])  # the caller's own summary keeps what it was given
    # a folder not named like an alias: its base name
    export_compressed_tensors(made["b"], made["plan_b"], tmp_path / "ct_b", target="transformers")
    _no_path(tmp_path / "ct_b", root, "other-seed", ["README.md", MARKER])


def test_the_bitsandbytes_export_names_the_model_in_the_adapter_it_copies(made, tmp_path):
    from transformers import AutoModelForCausalLM

    root, out = made["root"], tmp_path / "bnb"
    before = json.loads((made["adapter_a"] / "adapter_config.json").read_text())["base_model_name_or_path"]
    assert before == str(made["a"])  # what PEFT writes for a model loaded from a folder
    export.export_planned(made["a"], made["plan_a"], out, adapter=made["adapter_a"], target="transformers")
    _no_path(out, root, "smollm2-135m-instruct", ["README.md", MARKER, "adapter/adapter_config.json",
                                                  "adapter/README.md"])
    assert "base_model: smollm2-135m-instruct" in (out / "adapter" / "README.md").read_text()
    # stock PEFT loads the copy on the model it is given
    model = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(made["a"]), str(out / "adapter"))
    assert any("lora_A" in n for n, _ in model.named_parameters())
    # the source adapter is untouched
    assert json.loads((made["adapter_a"] / "adapter_config.json").read_text())["base_model_name_or_path"] == before


def _char_tokenizer(path: Path) -> Path:
    """A character tokenizer of < 128 ids beside a tiny LLaMA (the recipe needs a tokenizer; no real model)."""
    from tokenizers import Tokenizer, models
    from transformers import PreTrainedTokenizerFast

    vocab = {"<unk>": 0, "</s>": 1, **{c: i + 2 for i, c in enumerate(sorted(set(string.printable)))}}
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>")),
                                  unk_token="<unk>", eos_token="</s>", pad_token="</s>")
    tok.save_pretrained(path)
    return path


def test_the_training_folder_names_the_model(tmp_path, monkeypatch):
    from transformers import AutoModelForCausalLM

    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    models = tmp_path / "models"
    model = _char_tokenizer(make_tiny_llama(models / "tiny-chat", num_layers=2, seed=4))
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    finetune.run(finetune.load_config([
        "--config", str(ROOT / "recipes" / "smollm2-135m" / "bf16.yaml"), "--model", str(model), "--output_dir", "run",
        "--max_steps", "1", "--num_generated", "4", "--max_seq_len", "48", "--per_device_train_batch_size", "2",
        "--prompt_template", "Q: 2+2?", "--response_template", " A: 4",  # the problems' text is beside the point
        "--compute_dtype", "float32", "--disable_tqdm", "true"]))
    run = work / "run"
    _no_path(run, models, "tiny-chat", ["adapter_config.json", "README.md", "run.json"])
    assert json.loads((run / "adapter_config.json").read_text())["base_model_name_or_path"] == "tiny-chat"
    assert "base_model: tiny-chat" in (run / "README.md").read_text()
    record = json.loads((run / "run.json").read_text())
    assert record["model"] == "tiny-chat" and record["config"]["script"]["model"] == "tiny-chat"
    # stock PEFT loads the adapter given the model, the trained weights with it
    from safetensors.torch import load_file

    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(model), str(run))
    saved = load_file(str(run / "adapter_model.safetensors"))
    params = dict(loaded.named_parameters())
    assert saved and all(torch.equal(params[k.replace(".weight", ".default.weight")], v) for k, v in saved.items())


def test_a_profile_names_the_model_not_its_folder(tiny_llama_dir):
    """profile.json travels with a training folder (and as the plan of step 2): its meta names the model by
    gnmr_hf.offline.gguf_models.model_name (a folder's base name here), never the folder of this machine."""
    import torch

    import gnmr_hf
    from tests.test_dual_path import load

    model = gnmr_hf.prepare_dual_path(load(tiny_llama_dir, "nf4"), recovery_source=tiny_llama_dir, units="linears",
                                      dtype=torch.float32)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(0))
    prof = gnmr_hf.profile_sensitivity(model, [{"input_ids": ids, "labels": ids}], criteria=("first_order",))
    assert model.config._name_or_path == str(tiny_llama_dir)  # what the profile saw: the folder
    assert prof.meta["name_or_path"] == Path(tiny_llama_dir).name
    assert str(tiny_llama_dir) not in json.dumps(prof.to_dict())
