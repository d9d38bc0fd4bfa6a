"""Serving groups (gnmr_hf.planning.groups): what vLLM fuses, for every tiny architecture the package is tested
on, checked against vLLM's own rules transcribed from its source (the versions are named in
gnmr_hf/planning/groups.py: bitsandbytes.py @ 01f5395fdf04, compressed_tensors/utils.py @ 008014e8503b; when
``vllm`` imports here, its ``is_layer_skipped_bnb`` is compared too)."""

from __future__ import annotations

import random

import pytest
import torch

transformers = pytest.importorskip("transformers")

from gnmr_hf.export import transformers_selects  # noqa: E402
from gnmr_hf.planning import greedy_select  # noqa: E402
from gnmr_hf.planning.groups import (  # noqa: E402
    ServingGroup,
    ServingLayoutError,
    decoder_linears,
    describe_split,
    expand_rungs,
    grouped_ladder_units,
    is_layer_skipped_bnb,
    purchase_totals,
    purchases,
    serving_groups,
    split_groups,
    vllm_ct_scheme,
    vllm_skip_entries,
)
from gnmr_hf.planning.ladder import LadderUnit, choose_rungs  # noqa: E402

COMMON = dict(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, max_position_embeddings=128)
ARCHS = {  # config class, model class, extra config
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {"sliding_window": 64}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 64}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 64}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {"pad_token_id": 0}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
}
# what vLLM builds per decoder layer (its module names' last two parts), worked out from its model files
VLLM_LAYER = ["self_attn.qkv_proj", "self_attn.o_proj", "mlp.gate_up_proj", "mlp.down_proj"]

try:  # vLLM's own function, when it imports (it does not on this CPU-only machine)
    from vllm.model_executor.layers.quantization.bitsandbytes import is_layer_skipped_bnb as vllm_rule
except Exception:  # noqa: BLE001 - any import failure means: not available
    vllm_rule = None


def _meta_model(arch: str):
    cfg_cls, model_cls, extra = ARCHS[arch]
    config = getattr(transformers, cfg_cls)(**{**COMMON, **extra})
    with torch.device("meta"):
        return getattr(transformers, model_cls)(config)


@pytest.fixture(scope="module", params=sorted(ARCHS))
def arch(request):
    return request.param, _meta_model(request.param)


def _linears(model) -> list[str]:
    """The decoder linears, found independently of the package: every nn.Linear under model.layers."""
    return [n for n, m in model.named_modules() if isinstance(m, torch.nn.Linear) and n.startswith("model.layers.")]


def test_groups_cover_every_decoder_linear_once(arch):
    name, model = arch
    groups = serving_groups(model)
    members = [m for g in groups for m in g.members]
    assert sorted(members) == sorted(_linears(model)) and len(members) == len(set(members))
    assert decoder_linears(model) == _linears(model)
    # vLLM's module names: four per layer, as vLLM's model classes build them (in transformers' module order)
    assert sorted(g.name for g in groups) == sorted(f"model.layers.{i}.{m}" for i in range(COMMON["num_hidden_layers"])
                                                    for m in VLLM_LAYER)
    for g in groups:
        leaf = g.name.rsplit(".", 1)[-1]
        parent = g.name.rsplit(".", 1)[0]
        if name == "phi3" or leaf in ("o_proj", "down_proj"):
            assert g.members == (g.name,) and not g.fused
        elif leaf == "qkv_proj":
            assert g.members == tuple(f"{parent}.{m}" for m in ("q_proj", "k_proj", "v_proj")) and g.fused
        else:
            assert g.members == (f"{parent}.gate_proj", f"{parent}.up_proj") and g.fused


def test_groups_of_a_peft_wrapped_model_are_the_plain_ones():
    peft = pytest.importorskip("peft")
    cfg = transformers.LlamaConfig(**COMMON)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg)
    plain, names = serving_groups(model), _linears(model)
    wrapped = peft.get_peft_model(model, peft.LoraConfig(r=2, target_modules=["q_proj", "v_proj", "down_proj"]))
    assert serving_groups(wrapped) == plain
    assert serving_groups("LlamaForCausalLM", names) == plain  # by architecture name and linears


def test_vllm_rule_by_hand():
    # worked out from vLLM's code: an entry equal to a dotted component, or to a leading dotted part
    skip = ["model.layers.1", "lm_head"]
    assert is_layer_skipped_bnb("model.layers.1.self_attn.qkv_proj", skip)
    assert not is_layer_skipped_bnb("model.layers.11.self_attn.qkv_proj", skip)  # a prefix of parts, not of text
    assert is_layer_skipped_bnb("lm_head", skip)
    assert not is_layer_skipped_bnb("model.layers.1.self_attn.qkv_proj", ["model.layers.1.self_attn.q_proj"])
    assert is_layer_skipped_bnb("model.layers.7.mlp.down_proj", ["down_proj"])  # a bare component catches all
    assert not is_layer_skipped_bnb("model.layers.7.mlp.down_proj", ["layers.7"])  # no component, no leading part
    if vllm_rule is not None:
        for prefix in ("model.layers.1.self_attn.qkv_proj", "model.layers.11.mlp.gate_up_proj", "lm_head"):
            for s in (skip, ["down_proj"], ["model.layers.1.self_attn.q_proj"]):
                assert vllm_rule(prefix, s) == is_layer_skipped_bnb(prefix, s)


@pytest.mark.parametrize("seed", range(4))
def test_fused_aliases_make_vllm_keep_exactly_the_fully_kept_groups(arch, seed):
    name, model = arch
    groups = serving_groups(model)
    linears = _linears(model)
    rng = random.Random(seed)
    # a plan keeps whole groups (the grouped plan) plus a few loose linears (a split the aliases must not cover)
    kept = {m for i, g in enumerate(groups) if i in (0, 2) or rng.random() < 0.4 for m in g.members}
    kept |= {n for n in linears if rng.random() < 0.1}
    skip = ["lm_head"] + sorted(kept) + vllm_skip_entries(kept, groups)
    vllm_names = [g.name for g in groups]
    for g in groups:
        assert is_layer_skipped_bnb(g.name, skip) == all(m in kept for m in g.members), g
        if vllm_rule is not None:
            assert vllm_rule(g.name, skip) == is_layer_skipped_bnb(g.name, skip)
    assert is_layer_skipped_bnb("lm_head", skip)
    # transformers' rule on transformers' names: exactly the kept linears (an alias names no module there)
    hf_names = [n for n, _ in model.named_modules() if n]
    for entry in skip:
        hits = [n for n in hf_names if transformers_selects(entry, n)]
        if entry in kept or entry == "lm_head":
            assert hits == [entry]
        else:
            assert hits == [] and entry in vllm_names
    # without the aliases vLLM misses the fully kept fused groups: the aliases are what made it work
    fused_kept = [g for g in groups if g.fused and all(m in kept for m in g.members)]
    bare = ["lm_head"] + sorted(kept)
    assert not any(is_layer_skipped_bnb(g.name, bare) for g in fused_kept)
    assert bool(fused_kept) == (name != "phi3")  # layer 0's qkv and gate_up are kept: the fused case is exercised


def test_a_split_plan_is_detected(arch):
    name, model = arch
    groups = serving_groups(model)
    first = next(n for n in _linears(model) if n.startswith("model.layers.1.self_attn."))
    split = split_groups([first], groups)
    whole = [m for g in groups if g.name.startswith("model.layers.1.self_attn.qkv") for m in g.members]
    if name == "phi3":  # already fused in transformers: a linear is its group
        assert split == [] and whole == ["model.layers.1.self_attn.qkv_proj"]
        return
    assert [g.name for g in split] == ["model.layers.1.self_attn.qkv_proj"]
    assert split_groups(whole, groups) == []
    # a ladder plan: members on different rungs split a group, one rung for all does not
    rungs = {whole[0]: "int8", whole[1]: "int8", whole[2]: "bf16"}
    assert [g.name for g in split_groups(rungs, groups)] == ["model.layers.1.self_attn.qkv_proj"]
    assert split_groups({m: "int8" for m in whole}, groups) == []
    assert describe_split(split_groups(rungs, groups), rungs) == \
        "model.layers.1.self_attn.qkv_proj (q_proj int8, k_proj int8, v_proj bf16)"


def test_an_unknown_layout_is_refused_in_one_line_naming_the_linears():
    config = transformers.GPTNeoXConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                        num_attention_heads=4)
    with torch.device("meta"):
        model = transformers.GPTNeoXForCausalLM(config)
    with pytest.raises(ServingLayoutError) as e:
        serving_groups(model)
    msg = str(e.value)
    assert "\n" not in msg and msg.startswith("GPTNeoXForCausalLM: no known vLLM fused layout")
    assert "query_key_value x2" in msg and "dense_h_to_4h x2" in msg
    names = _linears(_meta_model("llama"))
    with pytest.raises(ServingLayoutError, match=r"outside vLLM's layout for it, e.g. model.layers.0.mlp.extra_proj"):
        serving_groups("LlamaForCausalLM", names + ["model.layers.0.mlp.extra_proj"])
    with pytest.raises(ServingLayoutError, match=r"model.layers.0.self_attn.qkv_proj lacks model.layers.0.self_attn.k_proj"):
        serving_groups("LlamaForCausalLM", [n for n in names if n != "model.layers.0.self_attn.k_proj"])


def test_purchases_join_the_units_that_share_a_group():
    model = _meta_model("llama")
    groups = serving_groups(model)
    per_linear = [[n] for n in _linears(model)]
    buys = purchases(per_linear, groups)
    assert [[per_linear[i][0] for i in b] for b in buys] == [list(g.members) for g in groups]
    per_layer = [[n for n in _linears(model) if n.startswith(f"model.layers.{i}.")] for i in range(3)]
    assert purchases(per_layer, groups) == [[0], [1], [2]]  # a layer holds whole groups already
    assert purchase_totals([[0, 2], [1]], [1.5, 2.0, 4.0]) == [5.5, 2.0]


@pytest.mark.parametrize("seed", range(20))
def test_grouped_plans_never_split_a_group(seed):
    model = _meta_model("qwen2")
    groups = serving_groups(model)
    names = _linears(model)
    rng = random.Random(seed)
    # the BF16-only planner over purchases
    scores = [rng.uniform(-1, 3) for _ in names]
    sizes = [rng.randint(1, 9) for _ in names]
    buys = purchases([[n] for n in names], groups)
    picked = greedy_select(purchase_totals(buys, scores), purchase_totals(buys, sizes), sum(sizes) // 3)
    kept = [names[i] for b in picked for i in buys[b]]
    assert kept and split_groups(kept, groups) == []
    assert sum(sizes[names.index(n)] for n in kept) <= sum(sizes) // 3
    # the ladder over grouped units
    units = [LadderUnit(n, 10, 2, gains={"int8": rng.uniform(-1, 2), "bf16": rng.uniform(-1, 3)},
                        prices={"int8": rng.randint(1, 4), "bf16": rng.randint(5, 12)}) for n in names]
    grouped = grouped_ladder_units(units, groups)
    qkv = grouped[0]
    assert qkv.name == "model.layers.0.self_attn.qkv_proj" and qkv.numel == 30 and qkv.rows == 6
    assert qkv.gains["bf16"] == pytest.approx(sum(u.gains["bf16"] for u in units[:3]))
    assert qkv.prices["int8"] == sum(u.prices["int8"] for u in units[:3])
    budget = sum(u.prices["bf16"] for u in units) // 4
    chosen = expand_rungs(choose_rungs(grouped, budget), groups)
    assert split_groups(chosen, groups) == []
    assert sum(units[names.index(n)].prices[r] for n, r in chosen.items()) <= budget
    free = choose_rungs(units, budget)  # the free plan usually splits: the constraint has a price
    if seed == 0:
        assert split_groups(free, groups)


def test_vllm_compressed_tensors_rule_on_fused_names():
    fused = {"qkv_proj": ["q_proj", "k_proj", "v_proj"], "gate_up_proj": ["gate_proj", "up_proj"]}
    p = "model.layers.0."
    groups = {"group_0": {"targets": [p + "self_attn.q_proj", p + "self_attn.k_proj", p + "self_attn.v_proj",
                                      p + "mlp.down_proj"]},
              "group_1": {"targets": [p + "mlp.gate_proj", p + "mlp.up_proj"]}}
    ignore = ["lm_head", p + "self_attn.o_proj"]
    assert vllm_ct_scheme(p + "self_attn.qkv_proj", groups, ignore, fused) == "group_0"
    assert vllm_ct_scheme(p + "mlp.gate_up_proj", groups, ignore, fused) == "group_1"
    assert vllm_ct_scheme(p + "mlp.down_proj", groups, ignore, fused) == "group_0"
    assert vllm_ct_scheme(p + "self_attn.o_proj", groups, ignore, fused) is None
    assert vllm_ct_scheme("lm_head", groups, ignore, fused) is None
    with pytest.raises(ValueError, match="vLLM requires all to use the same scheme"):
        vllm_ct_scheme(p + "self_attn.qkv_proj", groups, ignore + [p + "self_attn.v_proj"], fused)
    # members spread over two groups: vLLM silently takes the first member's (why the export refuses a split)
    spread = {"group_0": {"targets": [p + "self_attn.q_proj"]},
              "group_1": {"targets": [p + "self_attn.k_proj", p + "self_attn.v_proj"]}}
    assert vllm_ct_scheme(p + "self_attn.qkv_proj", spread, [], fused) == "group_0"


def test_serving_group_is_a_value():
    g = ServingGroup("a.qkv_proj", ("a.q_proj", "a.k_proj", "a.v_proj"))
    assert g == ServingGroup("a.qkv_proj", ("a.q_proj", "a.k_proj", "a.v_proj")) and g.fused
