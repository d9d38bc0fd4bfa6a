"""A new precision and a new export format are one file each: a toy rung (6-bit row-wise codes) and a toy export
format registered from this file alone (gnmr_hf.rungs.register_rung, gnmr_hf.exports.register_format), then
planned with the ladder's own entry points (rung_gains, choose_rungs), saved and read back as a Plan, loaded by
load_planned, trained one LoRA step, exported through ``gnmr-hf export --format`` and reloaded."""

from __future__ import annotations

import math

import pytest
import torch
from safetensors.torch import load_file, save_file

from gnmr_hf.exports import ExportFormat, get_format, register_format, unregister_format
from gnmr_hf.memory import weight_bytes
from gnmr_hf.planning import ladder
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.rungs import LinearBytes, Rung, get_rung, planned_rungs, register_rung, unregister_rung

pytest.importorskip("bitsandbytes")

TOY, FMT = "toy6", "toy-folder"
LEVELS = 31  # 6-bit symmetric codes: -31 .. 31


def toy_codes(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Row-wise symmetric 6-bit codes (stored one a byte) and one BF16 scale a row."""
    w = w.float()
    scale = (w.abs().amax(dim=1, keepdim=True) / LEVELS).clamp_min(1e-12).to(torch.bfloat16)
    codes = torch.round(w / scale.float()).clamp(-LEVELS, LEVELS).to(torch.int8)
    return codes, scale


def toy_fake_quant(w: torch.Tensor) -> torch.Tensor:
    codes, scale = toy_codes(w)
    return (codes.float() * scale.float()).to(w.dtype)


class ToyLinear(torch.nn.Linear):
    """What a linear planned on the toy rung is loaded as: its int8 codes (a frozen parameter) and row scales."""

    def __init__(self, weight: torch.Tensor):
        out_f, in_f = weight.shape
        super().__init__(in_f, out_f, bias=False, device="meta")
        codes, scale = toy_codes(weight)
        self.weight = torch.nn.Parameter(codes.to(weight.device), requires_grad=False)
        self.register_buffer("scale", scale.to(weight.device))

    def forward(self, x):
        return torch.nn.functional.linear(x, (self.weight.float() * self.scale.float()).to(x.dtype), self.bias)


def toy_bytes(numel: int, rows: int, **_) -> LinearBytes:
    return LinearBytes(numel, 2 * rows)  # what ToyLinear holds: the int8 codes (counted) and its BF16 scales


def write_toy(name: str, weight: torch.Tensor) -> dict[str, torch.Tensor]:
    """The toy format's entry for the toy rung: the codes and scales of one linear."""
    codes, scale = toy_codes(weight)
    return {f"{name}.codes": codes.contiguous(), f"{name}.scale": scale.contiguous()}


def export_toy(args, model_path: str) -> dict:
    """The toy format: the adapter merged into the BF16 weights, every planned linear written by its rung's
    ``exports[FMT]`` entry, the rest of the model as BF16 tensors; plan.json beside."""
    import peft
    from transformers import AutoModelForCausalLM

    plan = Plan.load(args.plan)
    missing = sorted({r for r in plan.rungs.values() if FMT not in get_rung(r).exports})
    if missing:
        raise ValueError(f"{FMT} writes no {missing}")
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.bfloat16)
    if args.adapter:
        model = peft.PeftModel.from_pretrained(model, args.adapter).merge_and_unload()
    state = {k: v.contiguous() for k, v in model.state_dict().items()}
    for name, rung in plan.rungs.items():
        state.update(get_rung(rung).exports[FMT](name, state.pop(f"{name}.weight")))
    from pathlib import Path

    out = Path(args.output)
    out.mkdir(parents=True)
    save_file(state, str(out / "model.safetensors"))
    model.config.save_pretrained(out)
    plan.save(out / "plan.json")
    return {"folder": str(out), "planned": len(plan.rungs)}


@pytest.fixture
def toy():
    rung = register_rung(Rung(TOY, toy_bytes, fake_quant=toy_fake_quant, module=lambda w, **_: ToyLinear(w),
                              exports={FMT: write_toy}, planned=True, doc="6-bit row-wise codes"))
    fmt = register_format(ExportFormat(FMT, export_toy, lambda s: f"wrote {s['folder']} ({s['planned']} planned)",
                                       errors=(ValueError,)))
    yield rung, fmt
    unregister_rung(TOY)
    unregister_format(FMT)


def test_a_toy_rung_and_format_plan_train_export_and_reload(toy, tiny_llama_dir, tmp_path, capsys):
    import peft

    from gnmr_hf.export import main as export_main

    # the registry prices it by its own bytes, the ladder offers it
    assert TOY in planned_rungs() and weight_bytes(64 * 128, 128, TOY) == LinearBytes(64 * 128, 256)
    prices = ladder.rung_prices(64 * 128, 128)
    assert prices[TOY] == 64 * 128 + 256 - weight_bytes(64 * 128, 128, "nf4").total > 0

    # plan: the ladder's first-order gains of the toy rung at the all-NF4 point, then the knapsack over it alone
    torch.manual_seed(0)
    ids = torch.randint(0, 128, (2, 12))
    low = ladder.load_planned(tiny_llama_dir, {}, dtype=torch.float32)
    units = ladder.rung_gains(low, tiny_llama_dir, [{"input_ids": ids, "labels": ids}], rungs=(TOY, "bf16"))
    assert all(set(u.gains) == {TOY, "bf16"} and math.isfinite(u.gains[TOY]) for u in units)
    best = sorted((u for u in units if u.gains[TOY] > 0), key=lambda u: -u.gains[TOY] / u.prices[TOY])[:3]
    chosen = ladder.choose_rungs(units, sum(u.prices[TOY] for u in best), rungs=(TOY,))
    assert chosen == {u.name: TOY for u in best} and len(chosen) == 3
    path = Plan(rungs=chosen, low="nf4", rung_set=(TOY,)).save(tmp_path / "plan" / "profile.json")
    assert Plan.load(path.parent).rungs == chosen

    # load: the toy modules swapped in over the checkpoint weight, computing its fake quantisation
    model = ladder.load_planned(tiny_llama_dir, path.parent, dtype=torch.float32)
    mods = dict(model.named_modules())
    name = next(iter(chosen))
    assert isinstance(mods[name], ToyLinear)
    w = load_file(str(tiny_llama_dir / "model.safetensors"))[f"{name}.weight"]
    x = torch.randn(3, w.shape[1])
    codes, scale = toy_codes(w)
    expected = torch.nn.functional.linear(x, codes.float() * scale.float())
    assert torch.allclose(mods[name](x), expected, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(mods[name](x), torch.nn.functional.linear(x, w.float()), atol=1e-4)  # it quantised

    # one LoRA step over every decoder linear (NF4, toy)
    lora = peft.get_peft_model(model, peft.LoraConfig(r=4, target_modules=["q_proj", "k_proj", "v_proj", "o_proj",
                                                                          "gate_proj", "up_proj", "down_proj"]))
    opt = torch.optim.AdamW([p for p in lora.parameters() if p.requires_grad], lr=1e-2)
    b = dict(lora.named_parameters())[f"base_model.model.{name}.lora_B.default.weight"]
    assert not b.any()
    lora(input_ids=ids, labels=ids).loss.backward()
    opt.step()
    assert b.abs().sum() > 0  # the toy linear's adapter trained
    lora.save_pretrained(tmp_path / "adapter")

    # export through gnmr-hf export's dispatcher, reload
    out = tmp_path / "out"
    assert export_main(["--model", str(tiny_llama_dir), "--plan", str(path), "--output", str(out), "--format", FMT,
                        "--adapter", str(tmp_path / "adapter")]) == 0
    assert f"wrote {out} (3 planned)" in capsys.readouterr().out
    saved = load_file(str(out / "model.safetensors"))
    merged = peft.PeftModel.from_pretrained(
        __import__("transformers").AutoModelForCausalLM.from_pretrained(tiny_llama_dir, dtype=torch.bfloat16),
        str(tmp_path / "adapter")).merge_and_unload()
    for n in chosen:
        codes, scale = toy_codes(dict(merged.named_parameters())[f"{n}.weight"].detach())
        assert torch.equal(saved[f"{n}.codes"], codes) and torch.equal(saved[f"{n}.scale"], scale)
        assert f"{n}.weight" not in saved
    assert Plan.load(out / "plan.json").rungs == chosen
    # reload: the folder is the whole model (every other tensor in it, strict), the planned linears de-quantised
    from transformers import AutoConfig, AutoModelForCausalLM

    reloaded = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(out), dtype=torch.bfloat16)
    state = {k: v for k, v in saved.items() if not k.endswith((".codes", ".scale"))}
    state.update({f"{n}.weight": (saved[f"{n}.codes"].float() * saved[f"{n}.scale"].float()).to(torch.bfloat16)
                  for n in chosen})
    reloaded.load_state_dict(state, strict=True)
    with torch.no_grad():
        for n in chosen:  # the merged model with the toy rung's fake quantisation on the planned linears
            dict(merged.named_parameters())[f"{n}.weight"].copy_(toy_fake_quant(dict(merged.named_parameters())[f"{n}.weight"]))
        assert torch.equal(reloaded(input_ids=ids).logits, merged(input_ids=ids).logits)


def test_a_registered_format_is_offered_and_an_unknown_rung_refused(toy, tmp_path):
    from gnmr_hf.export import main as export_main

    assert get_format(FMT).run is export_toy
    with pytest.raises(SystemExit):  # argparse: not a choice once unregistered
        unregister_format(FMT)
        export_main(["--model", "m", "--plan", "p", "--output", "o", "--format", FMT])
    register_format(toy[1])
    unregister_rung(TOY)
    with pytest.raises(PlanError, match="unknown rung"):
        Plan(rungs={"model.layers.0.mlp.up_proj": TOY}, rung_set=(TOY,))
    register_rung(toy[0])
    with pytest.raises(PlanError, match="which compressed-tensors has no scheme for"):
        Plan(rungs={"model.layers.0.mlp.up_proj": TOY}, rung_set=(TOY,)).ct_config(["model.layers.0.mlp.up_proj"])
    with pytest.raises(PlanError, match="on toy6 .*cannot hold"):
        Plan(rungs={"model.layers.0.mlp.up_proj": TOY}, rung_set=(TOY,)).skip_modules()


def test_a_recipe_names_a_registered_rung_and_refuses_an_unknown_one_listing_the_registered(toy):
    from gnmr_hf.recipe import RecipeError, load_config, recipes_folder

    ladder_yaml = str(recipes_folder() / "smollm2-135m" / "planned-ladder-nf4.yaml")
    cfg = load_config(["--config", ladder_yaml, "--profile.rungs", f"bf16,{TOY}"])
    # taken as registered, in the registry's order (cheapest per weight first), and planned as a ladder
    assert cfg.profile.rungs == tuple(r for r in planned_rungs() if r in (TOY, "bf16")) and TOY in cfg.profile.rungs
    assert cfg.profile.ladder and cfg.profile.given["rungs"] == "on the command line"
    with pytest.raises(RecipeError, match=rf"rungs from int8, {TOY}, bf16 .*'fp8'|rungs from {TOY}, int8, bf16 .*'fp8'"):
        load_config(["--config", ladder_yaml, "--profile.rungs", "fp8"])
    unregister_rung(TOY)
    try:  # once unregistered, the recipe refuses it in one line that names the rungs still registered
        with pytest.raises(RecipeError, match=rf"distinct rungs from int8, bf16 .*'{TOY},bf16'") as e:
            load_config(["--config", ladder_yaml, "--profile.rungs", f"{TOY},bf16"])
        assert "\n" not in str(e.value)
    finally:
        register_rung(toy[0])


def test_a_registered_rung_is_priced_by_its_own_bytes_everywhere(toy):
    from gnmr_hf.planning.budget import rung_price
    from gnmr_hf.planning.int4 import ct_rung_prices, ct_tensor_bytes

    rows, cols = 64, 128
    own = 64 * 128 + 2 * 64  # toy_bytes: a byte a code, a BF16 scale a row
    assert rung_price(rows * cols, rows, TOY, low="nf4") == own - weight_bytes(rows * cols, rows, "nf4").total
    assert ct_tensor_bytes({"w": (rows, cols, False)}, {"w": TOY}, 0) == own  # no format_bytes: its own bytes
    # compressed-tensors offers the planned rungs that have a scheme there: the toy rung registers none
    assert set(ct_rung_prices(rows, cols)) == {"int8", "bf16"}
    with_scheme = register_rung(Rung(TOY, toy_bytes, exports={"compressed-tensors": "W8A16"}, planned=True), replace=True)
    try:
        assert ct_rung_prices(rows, cols)[TOY] == own - ct_tensor_bytes({"w": (rows, cols, False)}, {}, 0)
    finally:
        register_rung(toy[0], replace=True)
    assert with_scheme is not toy[0] and get_rung(TOY) is toy[0]


def test_the_package_face_offers_both_registrations():
    import gnmr_hf
    import gnmr_hf.exports
    import gnmr_hf.rungs

    assert {"register_rung", "Rung", "register_format", "ExportFormat"} <= set(gnmr_hf.__all__)
    assert gnmr_hf.register_rung is gnmr_hf.rungs.register_rung is register_rung and gnmr_hf.Rung is Rung
    assert gnmr_hf.register_format is gnmr_hf.exports.register_format is register_format
    assert gnmr_hf.ExportFormat is ExportFormat


@pytest.mark.parametrize("rows, cols, group", [(576, 576, 64), (1536, 576, 64), (256, 512, 128)])
def test_the_stock_rungs_bytes_are_the_formats_own(rows, cols, group):
    """Each stock rung's bytes are what its format stores: the INT4 rung's what a compressed-tensors folder holds
    for one W4A16 linear (gnmr_hf.planning.int4.ct_tensor_bytes, the export's own accounting, checked against the
    written files in tests/test_export_ct.py), BF16's two bytes a weight, INT8's a byte a weight and an FP32 scale
    a row (LLM.int8), NF4's half a byte a weight and an FP32 absmax per 64 (tests/test_memory.py measures them)."""
    from gnmr_hf.planning.int4 import ct_tensor_bytes

    n = rows * cols
    # compressed-tensors' pack-quantized layout worked out by hand: int32 words of 32 // bits codes along a row, a
    # BF16 scale per group (W4A16) or per row (W8A16), the int64 weight_shape (two values)
    w4a16 = 4 * rows * (cols // 8) + 2 * rows * (cols // group) + 2 * 8
    w8a16 = 4 * rows * (cols // 4) + 2 * rows + 2 * 8
    assert get_rung("int4").bytes(n, rows, group_size=group).total == ct_tensor_bytes({"w": (rows, cols, False)}, {}, 0,
                                                                                      group) == w4a16
    # the INT8 rung as compressed-tensors writes it (its format_bytes), not as bitsandbytes holds it
    assert get_rung("int8").bytes_in("compressed-tensors", n, rows).total == w8a16 != get_rung("int8").bytes(n, rows).total
    assert ct_tensor_bytes({"w": (rows, cols, True)}, {"w": "int8"}, 7, group) == w8a16 + 2 * rows + 2 * 7
    assert get_rung("bf16").bytes(n, rows).total == ct_tensor_bytes({"w": (rows, cols, False)}, {"w": "bf16"}, 0) == 2 * n
    assert get_rung("int8").bytes(n, rows) == LinearBytes(n, 4 * rows)
    assert get_rung("nf4").bytes(n, rows) == get_rung("fp4").bytes(n, rows) == LinearBytes(n // 2, 4 * (n // 64) + 64)
    assert planned_rungs() == ("int8", "bf16")  # the stock planned rungs, cheapest first
