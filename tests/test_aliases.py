"""One model resolver (``gnmr_hf.offline.gguf_models.resolve_model``) behind every entry point that takes a
model: ``gnmr-hf profile``, ``gnmr-hf eval``, ``gnmr-hf export``, the demo, ``recipes/finetune.py`` and the
bench scripts. Every alias of ``MODELS`` goes through each entry point's resolution; an unknown name is one
line that lists the aliases.

The converted checkpoints are faked by the cache the resolver reads (``$GNMR_HF_CACHE/<alias>`` holding a
tiny random LLaMA and the conversion's done-marker), so no GGUF is converted and no real model is loaded:
each entry point is stopped (``_Reached``) at the first step that receives the resolved folder, and the
test checks it received that alias's folder.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from gnmr_hf.offline import gguf_models
from tests.conftest import load_bench, make_tiny_llama

ROOT = Path(__file__).resolve().parents[1]
ALIASES = tuple(gguf_models.MODELS)


class _Reached(Exception):
    """Raised by a patched step: the entry point got this far, with ``args[0]``."""


def _stop(*args, **kwargs):
    raise _Reached(*args)


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """``$GNMR_HF_CACHE`` with every alias already "converted": a tiny LLaMA (a different depth per alias, so
    the folders cannot be confused) and a word-level tokenizer."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    root = tmp_path_factory.mktemp("gnmr_cache")
    vocab = {w: i for i, w in enumerate(["<unk>", "<eos>", "a", "b", "c"])}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>", unk_token="<unk>")
    for depth, alias in enumerate(ALIASES, 1):
        folder = make_tiny_llama(root / alias, num_layers=depth, hidden=32)
        tokenizer.save_pretrained(folder)
        (folder / gguf_models._DONE_MARKER).write_text("a test fake\n")
    return root


@pytest.fixture
def fake_cache(cache, monkeypatch):
    monkeypatch.setenv("GNMR_HF_CACHE", str(cache))
    monkeypatch.setattr(gguf_models, "_convert", lambda *a: pytest.fail("no conversion may run in these tests"))
    return cache


def test_the_resolver_maps_every_alias_and_passes_folders_and_hub_ids(fake_cache, tmp_path):
    assert len(ALIASES) >= 2
    for alias in ALIASES:
        assert gguf_models.resolve_model(alias) == str(fake_cache / alias)
    assert gguf_models.resolve_model(tmp_path) == str(tmp_path)
    assert gguf_models.resolve_model("org/some-model") == "org/some-model"


@pytest.mark.parametrize("name", ["llama-7b", "./no-such-folder", "/no/such/folder", "gemma3"])
def test_an_unknown_name_is_one_line_listing_the_aliases(fake_cache, name):
    with pytest.raises(FileNotFoundError) as e:  # what the CLIs already catch
        gguf_models.resolve_model(name)
    msg = str(e.value)
    assert "\n" not in msg and name in msg and all(a in msg for a in ALIASES)
    assert type(e.value).__name__ == "ModelNotFoundError"


def test_a_file_is_not_a_model(fake_cache, tmp_path):
    (tmp_path / "model.gguf").write_bytes(b"GGUF")
    with pytest.raises(FileNotFoundError, match="a file, not a model folder"):
        gguf_models.resolve_model(tmp_path / "model.gguf")


# ---------------------------------------------------------------- gnmr-hf profile
@pytest.mark.parametrize("alias", ALIASES)
def test_profile_takes_every_alias(fake_cache, alias, tmp_path, monkeypatch):
    from gnmr_hf.planning import cli

    monkeypatch.setattr(cli, "_load_tokenizer", _stop)
    with pytest.raises(_Reached) as e:
        cli.main(["--model", alias, "--output", str(tmp_path / "prof")])
    assert Path(e.value.args[0]) == fake_cache / alias


def test_profile_refuses_an_unknown_name_in_one_line(fake_cache, tmp_path, capsys):
    from gnmr_hf.planning import cli

    assert cli.main(["--model", "llama-7b", "--output", str(tmp_path / "prof")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gnmr-hf profile: error: model 'llama-7b'")
    assert all(a in err[0] for a in ALIASES)


# ---------------------------------------------------------------- gnmr-hf eval
@pytest.mark.parametrize("alias", ALIASES)
def test_eval_takes_every_alias(fake_cache, alias, monkeypatch):
    from gnmr_hf.evaluation import evaluate as ev
    from gnmr_hf.evaluation import run

    monkeypatch.setattr(run, "_harness_model", _stop)
    with pytest.raises(_Reached) as e:
        ev.main(["--model", alias, "--tasks", "wikitext"])
    assert Path(e.value.args[0]) == fake_cache / alias


@pytest.mark.parametrize("alias", ALIASES)
def test_eval_load_model_loads_the_aliased_folder(fake_cache, alias):
    """The API call, really loading: the model is the alias's fake (its depth), not a hub lookup."""
    from gnmr_hf.evaluation.evaluate import load_model

    model, tokenizer = load_model(alias, "bf16", compute_dtype="float32")
    assert model.config.num_hidden_layers == ALIASES.index(alias) + 1
    assert tokenizer.eos_token == "<eos>"


def test_eval_refuses_an_unknown_name_in_one_line(fake_cache, capsys):
    from gnmr_hf.evaluation import evaluate as ev

    assert ev.main(["--model", "llama-7b", "--tasks", "wikitext"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("gnmr-hf eval: error: model 'llama-7b'")
    assert all(a in err[0] for a in ALIASES)


# ---------------------------------------------------------------- gnmr-hf export
@pytest.mark.parametrize("alias", ALIASES)
def test_export_takes_every_alias(fake_cache, alias, tmp_path, monkeypatch):
    import gnmr_hf.export as export
    import gnmr_hf.exports.bitsandbytes as bnb_format

    monkeypatch.setattr(bnb_format, "export_planned", _stop)  # what the dispatcher's default format calls
    with pytest.raises(_Reached) as e:
        export.main(["--model", alias, "--plan", str(tmp_path / "profile.json"), "--output", str(tmp_path / "out")])
    assert Path(e.value.args[0]) == fake_cache / alias


def test_export_refuses_an_unknown_name_in_one_line(fake_cache, tmp_path, capsys):
    import gnmr_hf.export as export

    assert export.main(["--model", "llama-7b", "--plan", str(tmp_path / "p.json"), "--output", str(tmp_path / "o")]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "model 'llama-7b'" in err[0] and all(a in err[0] for a in ALIASES)


# ---------------------------------------------------------------- the demo (its one model, the recipes' alias)
def test_the_demo_resolves_its_model_through_the_resolver(fake_cache, tmp_path, monkeypatch):
    import gnmr_hf.demo as demo
    import gnmr_hf.offline.eval_data as eval_data

    calls = []
    real = gguf_models.resolve_model

    def spy(name):
        calls.append((name, real(name)))
        return calls[-1][1]

    monkeypatch.setattr(gguf_models, "resolve_model", spy)
    monkeypatch.setattr(demo, "missing_requirements", lambda: [])
    monkeypatch.setattr(eval_data, "write_eval_data", _stop)  # the step after the checkpoint
    with pytest.raises(_Reached):
        demo.main(["--out", str(tmp_path / "demo"), "--tasks", "none"])
    assert calls == [("smollm2-135m-instruct", str(fake_cache / "smollm2-135m-instruct"))]  # the recipes' model


# ---------------------------------------------------------------- recipes/finetune.py
def _finetune():
    sys.path.insert(0, str(ROOT / "recipes"))
    import finetune

    return finetune


@pytest.mark.parametrize("alias", ALIASES)
def test_the_recipe_takes_every_alias(fake_cache, alias):
    finetune = _finetune()
    assert finetune.resolve_model_path(alias) == str(fake_cache / alias)


def test_the_recipe_refuses_an_unknown_name_in_one_line(fake_cache):
    finetune = _finetune()
    with pytest.raises(finetune.RecipeError) as e:
        finetune.resolve_model_path("llama-7b")
    assert "\n" not in str(e.value) and all(a in str(e.value) for a in ALIASES)


# ---------------------------------------------------------------- the bench scripts that take --model
def _bench_cases():
    # script, how to call its main, the step that first receives the model folder
    return [
        ("kbit_prep_memory", "argv", ("transformers", "AutoModelForCausalLM", "from_pretrained")),
        ("train_memory", "argv", (None, None, "kept_names")),
        ("nf4_error_rank", "argv", (None, None, "error_shares")),
        ("switch", "sys.argv", ("transformers", "AutoModelForCausalLM", "from_pretrained")),
        ("low_path_loss", "sys.argv", ("transformers", "AutoTokenizer", "from_pretrained")),
    ]


@pytest.mark.parametrize("alias", ALIASES)
@pytest.mark.parametrize("script,call,step", _bench_cases(), ids=[c[0] for c in _bench_cases()])
def test_the_bench_scripts_take_every_alias(fake_cache, alias, script, call, step, monkeypatch):
    module = load_bench(script)
    package, cls, attr = step
    if package is None:
        monkeypatch.setattr(module, attr, _stop)
    else:
        import transformers

        monkeypatch.setattr(getattr(transformers, cls), attr, _stop)
    with pytest.raises(_Reached) as e:
        if call == "argv":
            module.main(["--model", alias])
        else:
            monkeypatch.setattr(sys, "argv", [script, "--model", alias])
            module.main()
    assert Path(e.value.args[0]) == fake_cache / alias


def test_every_bench_script_with_a_model_argument_resolves_it():
    """The scripts above are checked by behaviour; any other bench script taking ``--model`` must at least go
    through the resolver (``resolve_model``, or the recipe's ``resolve_model_path``)."""
    with_model = {p.stem: p.read_text() for p in (ROOT / "bench").glob("*/*.py") if 'add_argument("--model"' in p.read_text()}
    assert {c[0] for c in _bench_cases()} <= set(with_model)
    assert [name for name, text in with_model.items() if "resolve_model" not in text] == []
