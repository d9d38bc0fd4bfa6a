"""gnmr-hf export for vLLM and transformers (issue 48, item 2): the bitsandbytes folder's skip list, matched
by each loader against its own module names.

For every tiny architecture of tests/test_serving_groups.py a grouped BF16 plan (whole serving groups kept)
is exported with the default ``--target vllm`` and checked both ways: vLLM's rule (``is_layer_skipped_bnb``,
transcribed from vllm/model_executor/layers/quantization/bitsandbytes.py @ 01f5395fdf04, see
gnmr_hf/planning/groups.py; vLLM's own function too when ``vllm`` imports, which it does not on this CPU-only
machine) applied to vLLM's module names keeps exactly the planned groups, and stock ``from_pretrained(folder)``
keeps exactly the planned linears unquantised (the fused aliases change nothing for transformers). A plan
that splits a group is refused for vLLM in one line with nothing written, and exported with
``--target transformers``, which the card states. vLLM itself is not run here.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.test_serving_groups import ARCHS, COMMON, VLLM_LAYER

transformers = pytest.importorskip("transformers")
bnb = pytest.importorskip("bitsandbytes")

from gnmr_hf import export  # noqa: E402
from gnmr_hf.planning import SensitivityProfile, UnitScore  # noqa: E402
from gnmr_hf.planning.groups import is_layer_skipped_bnb, serving_groups  # noqa: E402

try:  # vLLM's own function, when it imports
    from vllm.model_executor.layers.quantization.bitsandbytes import is_layer_skipped_bnb as vllm_rule
except Exception:  # noqa: BLE001 - any import failure means: not available
    vllm_rule = None

N_LAYERS = COMMON["num_hidden_layers"]
# the grouped plan, in vLLM's module names (the same for every architecture: VLLM_LAYER): whole groups kept
GROUPED = ["model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.1.self_attn.o_proj",
           "model.layers.2.mlp.down_proj", "model.layers.2.self_attn.qkv_proj"]
# the transformers linears behind a vLLM module, worked out by hand from the model classes
MEMBERS = {"qkv_proj": ("q_proj", "k_proj", "v_proj"), "gate_up_proj": ("gate_proj", "up_proj")}


def _hf_members(arch: str, vllm_name: str) -> list[str]:
    parent, leaf = vllm_name.rsplit(".", 1)
    if arch == "phi3" or leaf not in MEMBERS:  # Phi3 is fused in transformers already
        return [vllm_name]
    return [f"{parent}.{m}" for m in MEMBERS[leaf]]


def _build(arch: str, path: Path) -> Path:
    cfg_cls, model_cls, extra = ARCHS[arch]
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(getattr(transformers, cfg_cls)(**{**COMMON, **extra})).to(torch.bfloat16)
    model.save_pretrained(path)
    return path


def _linears(model) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]


def _write_plan(model_path: Path, kept: list[str], out: Path) -> list[str]:
    """A profile.json of ``model_path`` (one unit per decoder linear, scores made up: the export reads the
    plan's skip list, not the scores) whose plan keeps ``kept``; returns its skip list."""
    config = transformers.AutoConfig.from_pretrained(model_path)
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(config)
    from transformers.quantizers.base import get_keys_to_not_convert

    keep = sorted(set(get_keys_to_not_convert(model)) | {"lm_head"})  # what transformers keeps by default
    mods = dict(model.named_modules())
    units = [UnitScore(index=i, name=n.removeprefix("model."), modules=[n],
                       bytes=mods[n].in_features * mods[n].out_features * 2, layer=int(n.split(".")[2]),
                       op=n.rsplit(".", 1)[-1], scores={"first_order": float(n in kept)})
             for i, n in enumerate(_linears(model))]
    prof = SensitivityProfile(units=units, criteria=["first_order"], losses={"low": 5.0, "high": 4.0}, costs={},
                              batches=1, tokens=24, keep_modules=keep)
    skips = keep + sorted(kept)
    prof.to_json(out / "profile.json", skip_modules=skips)
    return skips


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch_dir(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(f"vllm_{request.param}")
    return request.param, _build(request.param, root / "base"), root


def _unquantised(model) -> list[str]:
    return sorted(n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)
                  and not isinstance(m, (bnb.nn.Linear4bit, bnb.nn.Linear8bitLt)))


def test_a_grouped_plan_is_kept_by_vllm_and_by_transformers(arch_dir, tmp_path):
    arch, path, root = arch_dir
    kept = sorted(m for g in GROUPED for m in _hf_members(arch, g))
    skips = _write_plan(path, kept, root / "grouped")
    out = tmp_path / "out"
    summary = export.export_planned(path, root / "grouped", out)  # the default: --target vllm
    entries = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    # the aliases, worked out by hand: every kept group vLLM fuses under a name transformers does not have
    aliases = [] if arch == "phi3" else sorted(g for g in GROUPED if g.rsplit(".", 1)[-1] in MEMBERS)
    assert entries == skips + aliases and summary["vllm_aliases"] == aliases and summary["target"] == "vllm"
    assert summary["split_groups"] == []

    # vLLM's rule on vLLM's module names for this architecture (groups.py's, cross-checked by hand)
    config = transformers.AutoConfig.from_pretrained(path)
    with torch.device("meta"):
        meta = transformers.AutoModelForCausalLM.from_config(config)
    vllm_names = [g.name for g in serving_groups(meta)]
    assert sorted(vllm_names) == sorted(f"model.layers.{i}.{m}" for i in range(N_LAYERS) for m in VLLM_LAYER)
    skipped = [n for n in vllm_names if is_layer_skipped_bnb(n, entries)]
    assert sorted(skipped) == sorted(GROUPED)
    assert is_layer_skipped_bnb("lm_head", entries)
    if vllm_rule is not None:
        assert [n for n in vllm_names if vllm_rule(n, entries)] == skipped
    # every exported entry: what it selects among vLLM's names is kept whole by the plan
    for entry in entries:
        for n in vllm_names:
            if is_layer_skipped_bnb(n, [entry]):
                assert n in GROUPED and all(m in kept for m in _hf_members(arch, n)), (entry, n)
    # without the aliases vLLM would quantise the kept fused groups (the q/k/v BF16 weights arriving where a
    # 4-bit one is expected): what the aliases change
    bare = [n for n in vllm_names if is_layer_skipped_bnb(n, skips)]
    assert sorted(bare) == sorted(GROUPED if arch == "phi3" else set(GROUPED) - set(aliases))

    # transformers' rule, by its own function, on transformers' names: an alias matches no module
    from transformers.quantizers.quantizers_utils import should_convert_module

    hf_names = [n for n, _ in meta.named_modules() if n]
    for entry in entries:
        hits = [n for n in hf_names if not should_convert_module(n, [entry])]
        assert hits == ([] if entry in aliases else [entry]), entry
    # and by loading the folder: exactly the plan's linears unquantised, the rest 4-bit
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)  # no arguments
    assert [n for n in _unquantised(loaded) if n.startswith("model.layers.")] == kept
    assert "lm_head" in _unquantised(loaded)
    assert len([m for m in loaded.modules() if isinstance(m, bnb.nn.Linear4bit)]) == len(_linears(meta)) - len(kept)
    card = (out / "README.md").read_text()
    assert "## Serving" in card and "vLLM" in card and "For transformers only" not in card
    assert all(f"- `{a}`" in card for a in aliases)
    assert json.loads((out / ".gnmr_export.json").read_text())["target"] == "vllm"


def test_the_same_folder_loads_the_same_without_the_aliases_in_transformers(tmp_path):
    """The aliases change nothing transformers keeps: the list with them and without them load the same
    unquantised linears and the same weights (tiny Llama, INT8)."""
    path = _build("llama", tmp_path / "base")
    kept = sorted(m for g in GROUPED for m in _hf_members("llama", g))
    _write_plan(path, kept, tmp_path / "plan")
    export.export_planned(path, tmp_path / "plan", tmp_path / "v", quant="int8")
    export.export_planned(path, tmp_path / "plan", tmp_path / "t", quant="int8", target="transformers")
    cfg = {k: json.loads((tmp_path / k / "config.json").read_text())["quantization_config"] for k in ("v", "t")}
    assert set(cfg["v"]["llm_int8_skip_modules"]) - set(cfg["t"]["llm_int8_skip_modules"]) == {
        "model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.gate_up_proj", "model.layers.2.self_attn.qkv_proj"}
    a = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "v")
    b = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "t")
    assert _unquantised(a) == _unquantised(b) and [n for n in _unquantised(a) if "layers" in n] == kept
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys() and all(torch.equal(sa[k], sb[k]) for k in sa)
    assert any(isinstance(m, bnb.nn.Linear8bitLt) for m in a.modules())


SPLIT_ARCHS = [a for a in sorted(ARCHS) if a != "phi3"]  # Phi3's fused linears are single modules: no split


@pytest.mark.parametrize("arch", SPLIT_ARCHS)
def test_a_split_plan_is_refused_for_vllm_and_written_for_transformers(arch, tmp_path, capsys):
    path = _build(arch, tmp_path / "base")
    # v_proj without q_proj / k_proj (the case), gate_proj without up_proj, a whole o_proj
    kept = ["model.layers.0.mlp.gate_proj", "model.layers.1.self_attn.o_proj", "model.layers.1.self_attn.v_proj"]
    _write_plan(path, kept, tmp_path / "plan")
    out = tmp_path / "work" / "out"
    (tmp_path / "work").mkdir()
    with pytest.raises(export.ExportError) as e:
        export.export_planned(path, tmp_path / "plan", out)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("the plan splits 2 serving group(s) that vLLM fuses into one module")
    assert "model.layers.0.mlp.gate_up_proj (gate_proj bf16, up_proj low)" in msg
    assert "model.layers.1.self_attn.qkv_proj (q_proj low, k_proj low, v_proj bf16)" in msg
    assert "a grouped plan (groups='vllm')" in msg and "--target transformers" in msg
    assert not out.exists() and list((tmp_path / "work").iterdir()) == []  # nothing written, no temporary folder
    # the command: one line on stderr, exit 2
    from gnmr_hf.cli import main

    capsys.readouterr()
    assert main(["export", "--model", str(path), "--plan", str(tmp_path / "plan"), "--output", str(out)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0] == f"gnmr-hf export: error: {msg}"
    assert not out.exists() and list((tmp_path / "work").iterdir()) == []
    # --target transformers: written, loads as planned, and the card says for whom
    assert main(["export", "--model", str(path), "--plan", str(tmp_path / "plan"), "--output", str(out),
                 "--target", "transformers"]) == 0
    assert "for transformers, not vLLM" in capsys.readouterr().out
    entries = json.loads((out / "config.json").read_text())["quantization_config"]["llm_int8_skip_modules"]
    assert not [e for e in entries if e.endswith(("qkv_proj", "gate_up_proj"))]
    loaded = transformers.AutoModelForCausalLM.from_pretrained(out)
    assert [n for n in _unquantised(loaded) if n.startswith("model.layers.")] == sorted(kept)
    card = (out / "README.md").read_text()
    assert "**For transformers only** (exported with `--target transformers`)" in card and "vLLM cannot load it" in card
    assert "`model.layers.0.mlp.gate_up_proj`, `model.layers.1.self_attn.qkv_proj`" in card
    assert json.loads((out / ".gnmr_export.json").read_text())["target"] == "transformers"


def test_an_unknown_fused_layout_is_refused_for_vllm_only(tmp_path):
    config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4)
    torch.manual_seed(0)
    path = tmp_path / "neox"
    transformers.GPTNeoXForCausalLM(config).to(torch.bfloat16).save_pretrained(path)
    with torch.device("meta"):
        meta = transformers.GPTNeoXForCausalLM(config)
    linears = [n for n, m in meta.named_modules() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    kept = [linears[0], linears[5]]
    _write_plan_any(meta, path, kept, tmp_path / "plan")
    with pytest.raises(export.ExportError) as e:
        export.export_planned(path, tmp_path / "plan", tmp_path / "o")
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("GPTNeoXForCausalLM: no known vLLM fused layout")
    assert "query_key_value x2" in msg and "--target transformers" in msg and not (tmp_path / "o").exists()
    s = export.export_planned(path, tmp_path / "plan", tmp_path / "o", target="transformers")
    assert s["split_groups"] is None and s["vllm_aliases"] == []
    loaded = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "o")
    assert [n for n in _unquantised(loaded) if ".layers." in n] == sorted(kept)
    assert "vLLM's fused layout is not known for this architecture" in (tmp_path / "o" / "README.md").read_text()


def _write_plan_any(meta, model_path: Path, kept: list[str], out: Path) -> None:
    """:func:`_write_plan` for a model whose layers are not under ``model.layers``."""
    mods = dict(meta.named_modules())
    names = [n for n, m in mods.items() if isinstance(m, torch.nn.Linear) and ".layers." in n]
    units = [UnitScore(index=i, name=n, modules=[n], bytes=mods[n].in_features * mods[n].out_features * 2,
                       layer=int(n.split(".layers.")[1].split(".")[0]), op=n.rsplit(".", 1)[-1],
                       scores={"first_order": float(n in kept)}) for i, n in enumerate(names)]
    out_emb = next(n for n, m in mods.items() if m is meta.get_output_embeddings())
    prof = SensitivityProfile(units=units, criteria=["first_order"], losses={"low": 5.0, "high": 4.0}, costs={},
                              batches=1, tokens=24, keep_modules=[out_emb])
    prof.to_json(out / "profile.json", skip_modules=[out_emb] + sorted(kept))


def test_a_bad_target_is_refused_before_anything_is_read(tmp_path):
    with pytest.raises(export.ExportError, match=r"^target 'sglang': one of vllm, transformers$"):
        export.export_planned(tmp_path / "nowhere", tmp_path / "p", tmp_path / "o", target="sglang")
