"""A planned recipe's plan (the ``profile:`` block): chosen by :func:`gnmr_hf.planning.make_plan`, or read from
``profile.plan``, and turned into the callback's policy and the run's record.

- :func:`planned_policy`: profile the first ``profile.batches`` training batches and plan under ``profile.budget``
  (the one currency: bytes over the all-NF4 model as served), BF16-only or the ladder (``profile.rungs``), free
  or in whole serving groups (``profile.groups``); or, with ``profile.plan``, :func:`saved_plan_policy`.
- :func:`check_saved_plan`: a saved plan that does not fit the run (model, low format, group size, rungs,
  groups) refused in one line before the model loads.
- :func:`same_plan_on_every_rank`: every rank of a DDP run planned the same linears.

Every function writes ``{output_dir}/profile.json`` on the main process and returns ``(policy, record)``.
"""

from __future__ import annotations

import dataclasses
import time
from pathlib import Path
from typing import Any

import torch

from gnmr_hf.backends.base import dual_path_modules
from gnmr_hf.backends.dispatch import prepare_dual_path
from gnmr_hf.core.controller import init_steps_from_fraction
from gnmr_hf.core.policies import HybridPolicy, StaticPolicy
from gnmr_hf.planning import memory_budget
from gnmr_hf.planning.ladder import _check_same_model
from gnmr_hf.planning.make import make_plan, plan_budget, plan_gains, plan_prices, precision_plan
from gnmr_hf.planning.passes import _units
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.profiler import model_identity
from gnmr_hf.planning.results import SensitivityProfile
from gnmr_hf.recipe import NF4_PRECISIONS, Recipe, RecipeError
from gnmr_hf.recipe_model import resolve_model_path


def stored_bytes_per_bf16_byte(model) -> float:
    """The recovery weights' stored bytes per BF16 byte (1.0 for BF16, 2.0 for FP32): the dtype every
    dual-path layer keeps its checkpoint weight in."""
    dtypes = {m._gnmr_source.dtype for m in dual_path_modules(model) if getattr(m, "_gnmr_source", None) is not None}
    if len(dtypes) != 1:
        raise RecipeError(f"the dual-path layers keep their recovery weights in {len(dtypes)} dtypes "
                          f"({sorted(map(str, dtypes))}); a profile plan needs one")
    return torch.finfo(dtypes.pop()).bits / 16


def same_plan_on_every_rank(plan: dict[str, Any]) -> int:
    """Check that every rank planned the same linears (each profiles the same batches; a difference would make
    the ranks train different models): rank 0's plan is gathered with every other rank's and compared on every
    rank, so all of them stop together on a difference. Returns the number of ranks that agreed (1 without a
    process group)."""
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return 1
    mine = {k: plan.get(k) for k in ("indices", "modules", "rungs")}
    every: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(every, mine)
    odd = [r for r, p in enumerate(every) if p != every[0]]
    if odd:
        raise RecipeError(f"the ranks planned different linears (rank {odd[0]} differs from rank 0: "
                          f"{every[odd[0]]['indices']} vs {every[0]['indices']}); profile.batches must read the "
                          "same data on every rank")
    return len(every)


def _currency_record(budget: str | None, budget_bytes: int | None, nf4: int, price: int, held: int) -> dict[str, Any]:
    """run.json's budget keys, the same in every planned recipe (docs/profile.md, "The one budget currency")."""
    return {"budget": budget, "budget_bytes": budget_bytes, "price_over_nf4_bytes": price,
            "memory_over_nf4": price / nf4, "nf4_model_bytes": nf4, "held_bytes": held, "held_over_nf4": held / nf4}


def _held(units) -> list[int]:
    """What each unit's recovery path holds when active: a BF16 rung in the compute dtype, an INT8 rung its int8
    weight and row scales."""
    return [sum(m._gnmr_source.weight_bytes(m) for m in u.dual) for u in units]


def _indices(units, chosen) -> list[int]:
    return [i for i, u in enumerate(units) if any(m in chosen for m in u.modules)]


def _low(recipe: Recipe) -> str:
    return "nf4" if recipe.script.precision in NF4_PRECISIONS else "int8"


def _profile_batches(recipe: Recipe, model, train_ds, tokenizer) -> list[dict[str, Any]]:
    """The first ``profile.batches`` training batches, collated as the Trainer collates them, on the model's
    device."""
    from transformers import DataCollatorForSeq2Seq

    prof, bs = recipe.profile, recipe.training.per_device_train_batch_size
    if len(train_ds) < prof.batches * bs:
        raise RecipeError(f"profile.batches {prof.batches} x batch size {bs} is more than the "
                          f"{len(train_ds)} training examples")
    collate = DataCollatorForSeq2Seq(tokenizer, padding=True, label_pad_token_id=-100)
    device = next(p.device for p in model.parameters())
    return [{k: v.to(device) for k, v in collate([train_ds[j] for j in range(i * bs, (i + 1) * bs)]).items()}
            for i in range(prof.batches)]


def _write(recipe: Recipe, write) -> None:
    """``write(out)`` on the main process, ``out`` the output folder (created)."""
    if recipe.training.process_index == 0:
        out = Path(recipe.training.output_dir)
        out.mkdir(parents=True, exist_ok=True)
        write(out)


def planned_policy(recipe: Recipe, model, train_ds, tokenizer,
                   model_path: str | None = None) -> tuple[Any, dict[str, Any]]:
    """Plan the run (see the module docstring) and build the callback's policy (``StaticPolicy``, or
    ``HybridPolicy`` for ``profile.policy: hybrid``); writes ``{output_dir}/profile.json`` on the main process.

    The budget is in the one currency of every planned recipe: what the plan adds to the served model over
    the all-NF4 one, whatever ``compute_dtype`` the recovery path holds it in; a budget that buys no linear is
    refused before the profile.

    Returns:
        ``(policy, plan_record)``.
    """
    model_path = model_path or resolve_model_path(recipe.script.model)
    if recipe.profile.plan is not None:  # --profile.plan: the saved plan, nothing profiled
        return saved_plan_policy(recipe, model, model_path)
    batches = _profile_batches(recipe, model, train_ds, tokenizer)
    if recipe.profile.ladder:
        return ladder_policy(recipe, model, batches, model_path)
    return bf16_policy(recipe, model, batches, model_path)


def _priced(recipe: Recipe, model, model_path: str, rungs: tuple[str, ...], share: float = 1.0):
    """The plan's prices, its full budget and the part it may spend, in the one currency; every refusal one
    ``RecipeError`` line (``profile.budget ...``) before anything is profiled."""
    prof, dq = recipe.profile, recipe.script.bnb_4bit_use_double_quant
    try:
        prices = plan_prices(model, rungs, _low(recipe), model_path, dq)
        budget = plan_budget(prof.budget, prices)
        spend = budget if share == 1.0 else plan_budget(
            prof.budget, prices, share, shown=f"{prof.budget} x (1 - profile.gnmr_share {prof.gnmr_share:g})")
    except PlanError as e:
        raise RecipeError(f"profile.{e}") from None
    return prices, budget, spend


def _make(recipe: Recipe, model, batches, model_path: str, prices, rungs, gains=None, share: float = 1.0) -> Plan:
    prof, script = recipe.profile, recipe.script
    try:
        return make_plan(model, batches, prof.budget, rungs, prof.groups, prof.criterion, low=prices.low,
                         model_path=model_path, double_quant=script.bnb_4bit_use_double_quant, share=share,
                         prices=prices, gains=gains, dtype=getattr(torch, script.compute_dtype),
                         budget_text=prof.budget if share == 1.0 else
                         f"{prof.budget} x (1 - profile.gnmr_share {prof.gnmr_share:g})", serve=prof.serve)
    except PlanError as e:
        raise RecipeError(f"profile.{e}") from None


def bf16_policy(recipe: Recipe, model, batches, model_path: str) -> tuple[Any, dict[str, Any]]:
    """A BF16-only plan (``profile.rungs: [bf16]``): the linears ``profile.criterion`` scores highest per served
    byte, within the budget (its ``1 - profile.gnmr_share`` part for a hybrid run)."""
    prof, args = recipe.profile, recipe.training
    share = 1.0 if prof.policy == "static" else 1 - prof.gnmr_share
    prices, budget, _ = _priced(recipe, model, model_path, ("bf16",), share)
    units = _units(model, "linears")
    # every rank profiles the same batches of the same weights, so every rank plans the same set
    try:
        gains = plan_gains(model, batches, prices, prof.criterion,
                           progress=args.process_index == 0 and not args.disable_tqdm)
    except PlanError as e:
        raise RecipeError(str(e)) from None
    plan = _make(recipe, model, batches, model_path, prices, ("bf16",), gains, share)
    profile = gains.profile
    chosen = _indices(units, plan.rungs)
    if not chosen and prof.policy == "static":
        raise RecipeError(f"profile.budget {prof.budget} = {budget} B over the NF4 model buys nothing: no linear "
                          f"that fits has a positive {gains.criterion} score on the {prof.batches} profiled batch(es) "
                          "(give a larger budget or other data, or plan without one: precision nf4)")
    unit_bytes = _held(units)
    held, price, extra = sum(unit_bytes[i] for i in chosen), plan.price_bytes, {}
    if prof.policy == "static":
        policy = StaticPolicy(len(units), chosen, max_active=max(1, len(chosen)), unit_bytes=unit_bytes)
    else:
        config = recipe.gnmr.config
        if recipe.gnmr.init_fraction is not None:
            steps = args.max_steps if args.max_steps > 0 else 0
            config = dataclasses.replace(config, init_steps=init_steps_from_fraction(recipe.gnmr.init_fraction, steps))
        # GNMR gets the rest of the budget; the controller counts held bytes, so the rest is turned into held
        # bytes at the smallest held-per-served ratio of any linear: any set it holds then fits the rest as served
        rest = budget - price
        served = [sum(prices.prices[m]["bf16"] for m in u.modules) for u in units]
        cap = int(rest * min(h / p for h, p in zip(unit_bytes, served) if p > 0))
        policy = HybridPolicy(len(units), chosen, dataclasses.replace(config, max_active=len(units),
                                                                      max_active_bytes=cap), unit_bytes=unit_bytes)
        extra = {"gnmr_budget_bytes": rest, "gnmr_max_active_bytes": cap}
    view = precision_plan(plan, profile, model, batches)
    record = {**view.to_dict(), "plan_budget_bytes": plan.budget_bytes, "criterion": gains.criterion,
              "policy": prof.policy, "low": _low(recipe), "serve": prof.serve,
              **_currency_record(prof.budget, budget, prices.low_model_bytes, price, held), **extra,
              "stored_bytes_per_bf16_byte": stored_bytes_per_bf16_byte(model),
              "profile_seconds": round(sum(c.get("seconds", 0.0) for c in profile.costs.values()), 2)}

    def write(out: Path) -> None:
        profile.to_json(out / "profile.json", plan=record, skip_modules=view.skip_modules())
        print(view.summary())
        nf4 = prices.low_model_bytes
        print(f"budget {prof.budget}: {budget / 2**20:.2f} MiB over the {nf4 / 2**20:.1f} MiB NF4 model; the plan "
              f"adds {price / 2**20:.2f} MiB served (+{100 * price / nf4:.1f} %) and its recovery path holds "
              f"{held / 2**20:.2f} MiB in {recipe.script.compute_dtype} while training")
        print(f"profile.json: llm_int8_skip_modules for a stock BitsAndBytesConfig: {len(view.skip_modules())} names")

    _write(recipe, write)
    return policy, record


def ladder_policy(recipe: Recipe, model, batches, model_path: str) -> tuple[Any, dict[str, Any]]:
    """``profile.rungs: [int8, bf16]``: the precision ladder. Every decoder linear's first-order gain on each rung
    is measured on ``batches`` with a stock-loaded NF4 model (a second load, freed before training), the rungs are
    chosen under ``profile.budget`` by gain per served byte (:func:`gnmr_hf.planning.make_plan`), the dual path of
    ``model`` is set to those rungs (``prepare_dual_path(..., rungs=...)``) and the planned linears run on them at
    every step (``StaticPolicy``). Writes ``{output_dir}/profile.json`` with the ``rungs`` mapping that
    ``gnmr_hf.load_planned(model_path, profile.json)`` serves from stock bitsandbytes modules."""
    prof, script = recipe.profile, recipe.script
    t0 = time.time()
    prices, budget, _ = _priced(recipe, model, model_path, prof.rungs)
    over_low = memory_budget(prof.budget, model_path, prices.linears, "nf4",
                             double_quant=script.bnb_4bit_use_double_quant)
    if over_low is not None and over_low["over_low_bytes"] != budget:
        raise RecipeError(f"profile.budget {prof.budget}: {over_low['over_low_bytes']} B over NF4 from the "
                          f"checkpoint's config, {budget} B from the loaded model")
    try:
        gains = plan_gains(model, batches, prices, prof.criterion, model_path=model_path,
                           double_quant=script.bnb_4bit_use_double_quant, dtype=getattr(torch, script.compute_dtype))
    except PlanError as e:
        raise RecipeError(str(e)) from None
    plan = _make(recipe, model, batches, model_path, prices, prof.rungs, gains)
    chosen = plan.rungs
    if not chosen:  # as the BF16 planner refuses a budget that buys nothing: no plain NF4 run called planned
        raise RecipeError(f"profile.budget {prof.budget} = {budget} B over the NF4 model buys "
                          f"nothing on the ladder [{', '.join(prof.rungs)}]: no linear that fits has a positive "
                          f"first-order gain on the {prof.batches} profiled batch(es) (give a larger budget or "
                          "other data, or plan without one: precision nf4)")
    policy, record = _rung_policy(recipe, model, model_path, plan)
    record.update({"gain": plan.chosen_by["predicted_gain"], "over_low_bytes": plan.price_bytes,
                   "memory_budget": over_low, "criterion": gains.criterion, "profile_seconds": round(time.time() - t0, 2)})

    def write(out: Path) -> None:
        # the checkpoint the plan was made on: load_planned checks it
        plan.save(out / "profile.json", plan=record,
                  units=[{"name": u.name, "numel": u.numel, "rows": u.rows, "gains": u.gains, "prices": u.prices}
                         for u in gains.units])
        counts = record["rung_counts"]
        print(f"the precision ladder at {prof.budget}: {', '.join(f'{v} {k}' for k, v in counts.items())} "
              f"of {len(gains.units)} linears, +{100 * record['memory_over_nf4']:.1f} % memory over the NF4 model "
              f"({plan.price_bytes / 2**20:.2f} MiB served), first-order gain {record['gain']:.4g}; its recovery "
              f"path holds {record['held_bytes'] / 2**20:.2f} MiB in {script.compute_dtype} while training")
        print("profile.json: serve the mixed model with gnmr_hf.load_planned(model_path, 'profile.json') "
              "(no stock loader mixes 4- and 8-bit linears)")

    _write(recipe, write)
    return policy, record


def _rung_policy(recipe: Recipe, model, model_path: str, plan: Plan) -> tuple[Any, dict[str, Any]]:
    """The dual path of ``model`` set to a ladder plan's rungs (INT8: ``Linear8bitLt`` over the checkpoint weight),
    its ``StaticPolicy`` and the record's keys every ladder run shares."""
    prof, script = recipe.profile, recipe.script
    chosen = dict(plan.rungs)
    prepare_dual_path(model, recovery_source=model_path, storage=recipe.gnmr.storage,
                      dtype=getattr(torch, script.compute_dtype), units="linears", rungs=chosen)
    units = _units(model, "linears")
    indices = _indices(units, chosen)
    if sum(1 for i in indices for m in units[i].modules if m in chosen) != len(chosen):
        raise RecipeError(f"the ladder planned {len(chosen)} linears, the model's units hold "
                          f"{sum(len(units[i].modules) for i in indices)} of them")
    unit_bytes = _held(units)
    policy = StaticPolicy(len(units), indices, max_active=max(1, len(indices)), unit_bytes=unit_bytes)
    nf4 = plan.chosen_by.get("low_model_bytes") or plan_prices(model, prof.rungs, "nf4", model_path,
                                                               script.bnb_4bit_use_double_quant).low_model_bytes
    counts = {r: sum(1 for v in chosen.values() if v == r) for r in prof.rungs}
    record = {"rungs": chosen, "rung_counts": counts, "indices": indices, "modules": sorted(chosen),
              "skip_modules": sorted(n for n, r in chosen.items() if r == "bf16"),
              **_currency_record(plan.budget, plan.budget_bytes, nf4, plan.price_bytes, policy.set_bytes),
              "policy": "static", "stored_bytes_per_bf16_byte": torch.finfo(getattr(torch, script.compute_dtype)).bits / 16,
              "groups": plan.groups, "low": "nf4", "serve": plan.serve}
    return policy, record


def check_saved_plan(recipe: Recipe, model_path: str) -> Plan:
    """``profile.plan`` read (:meth:`gnmr_hf.planning.Plan.load`) and checked against this run before anything is
    trained: the model (its recorded identity, else the shapes it records), the low format, the group size, the
    rungs it was chosen over and its serving groups; one ``RecipeError`` line naming what differs and, where a
    profile command writes a plan that fits, that command."""
    prof = recipe.profile
    low = _low(recipe)
    try:
        plan = Plan.load(prof.plan, rung_set=prof.rungs)
    except (PlanError, ValueError) as e:
        raise RecipeError(f"profile.plan: {e}") from None
    where = f"profile.plan {plan.source}"
    if not plan.planned:
        raise RecipeError(f"{where} holds a profile and no plan: give the output of gnmr-hf profile --budget ... "
                          "or of a planned run")
    budget = plan.budget if plan.budget and plan.budget.endswith(low) else f"+10%{low}"
    profile_cmd = f"gnmr-hf profile --model {recipe.script.model} --low {low} --budget {budget}"
    if plan.low != low or plan.group_size is not None:
        raise RecipeError(f"{where} is {plan.describe()}; this run trains over {low} (precision "
                          f"{recipe.script.precision}): profile it over {low} ({profile_cmd} --output DIR)")
    if plan.rung_set != prof.rungs:
        raise RecipeError(f"{where} is {plan.describe()}, not a plan over [{', '.join(prof.rungs)}] as this recipe's "
                          f"profile.rungs: {_rung_fix(prof, plan, low, profile_cmd)}")
    if plan.groups != prof.groups:
        made = f"grouped ({plan.groups})" if plan.groups else "free"
        fix = (f"{profile_cmd} --groups {prof.groups} --output DIR" if prof.groups and not prof.ladder
               else "a run of this recipe without profile.plan" if prof.groups
               else f"profile.groups {plan.groups} trains it as planned")
        raise RecipeError(f"{where} was planned {made}, not with profile.groups {prof.groups or 'null'}: {fix}")
    if prof.serve and plan.serve and plan.serve != prof.serve:
        raise RecipeError(f"{where} was made for serve {plan.serve}, not profile.serve {prof.serve}: "
                          "a run without profile.plan plans for it, or drop profile.serve to train the plan "
                          f"for {plan.serve}")
    try:
        _check_same_model(plan.source, plan.data, model_path,
                          fix=f"profile the model this run trains: {profile_cmd} --output DIR")
    except ValueError as e:
        raise RecipeError(f"profile.plan: {e}") from None
    return plan


def _rung_fix(prof, plan: Plan, low: str, profile_cmd: str) -> str:
    if prof.ladder and plan.rung_set == ("bf16",):
        return (f"{profile_cmd} --output DIR writes the ladder plan beside the BF16-only one (its ladder table at "
                f"the budget; not with --no-ladder), or train the BF16-only plan with profile.rungs bf16 "
                f"(planned-nf4.yaml)" if low != "int8" else "a ladder run's output folder holds one")
    if not prof.ladder:
        return ("give a BF16-only plan (gnmr-hf profile's, a planned-nf4 run's) or train it with profile.rungs "
                f"{','.join(plan.rung_set)} (planned-ladder-nf4.yaml)")
    return f"train it with profile.rungs {','.join(plan.rung_set)}"


def saved_plan_policy(recipe: Recipe, model, model_path: str) -> tuple[Any, dict[str, Any]]:
    """``profile.plan``: train with a saved plan (:func:`check_saved_plan`) as it is, profiling nothing. The plan's
    linears are put on their rungs (a ladder plan: ``prepare_dual_path(..., rungs=...)``) and run on them at every
    step (``StaticPolicy``); ``{output_dir}/profile.json`` records the same plan, in the schema the run would have
    written (the plan's profile with the run's record, or the ladder's ``rungs`` file), so that the exports, eval
    and ``load_planned`` read it as before.

    Returns:
        ``(policy, plan_record)``.
    """
    plan = check_saved_plan(recipe, model_path)
    prof, script = recipe.profile, recipe.script
    chosen = dict(plan.rungs)
    prices = plan_prices(model, prof.rungs, "nf4", model_path, script.bnb_4bit_use_double_quant)
    missing = sorted(set(chosen) - set(prices.linears))
    if missing:
        raise RecipeError(f"profile.plan {plan.source} plans {len(missing)} linear(s) this model's dual path does not "
                          f"hold, e.g. {missing[0]}")
    price = sum(prices.prices[n][r] for n, r in chosen.items())
    served = dataclasses.replace(plan, price_bytes=price, serve=prof.serve or plan.serve,
                                 chosen_by={**plan.chosen_by, "low_model_bytes": prices.low_model_bytes})
    if prof.ladder:
        policy, record = _rung_policy(recipe, model, model_path, served)
    else:
        units = _units(model, "linears")
        indices = _indices(units, chosen)
        unit_bytes = _held(units)
        policy = StaticPolicy(len(units), indices, max_active=max(1, len(indices)), unit_bytes=unit_bytes)
        record = {"rungs": chosen, "indices": indices, "modules": [m for i in indices for m in units[i].modules
                                                                   if m in chosen],
                  "skip_modules": plan.skip_modules(), "policy": "static", "groups": plan.groups,
                  **_currency_record(plan.budget, plan.budget_bytes, prices.low_model_bytes, price, policy.set_bytes),
                  "stored_bytes_per_bf16_byte": stored_bytes_per_bf16_byte(model), "low": plan.low}
        record["names"] = [units[i].name for i in indices]
    record.update({"criterion": plan.chosen_by.get("criterion"), "profile_seconds": 0.0, "serve": served.serve,
                   "plan_file": str(plan.source), "planned_by": plan.chosen_by.get("writer"), "low": plan.low})

    def write(out: Path) -> None:
        data = plan.data
        if prof.ladder:
            units_json = data.get("units") if "rungs" in data else None
            extra = {"units": units_json} if isinstance(units_json, list) and all(
                isinstance(u, dict) and "numel" in u for u in units_json) else {}  # a ladder run's gains and prices
            dataclasses.replace(served, model_identity=plan.model_identity or model_identity(model_path)).save(
                out / "profile.json", plan=record, **extra)
        elif "units" in data and "losses" in data:  # a profile with its plan: the profile, the run's record
            SensitivityProfile.from_dict(data).to_json(out / "profile.json", plan=record,
                                                       skip_modules=plan.skip_modules())
        else:  # the plan as saved, with the server this run was planned for (profile.serve) recorded on it
            dataclasses.replace(plan, serve=served.serve).save(out / "profile.json", plan=record)
        print(f"profile.plan {plan.source}: {plan.describe()}, {len(chosen)} planned linear(s), used as saved (nothing "
              f"profiled); {price / 2**20:.2f} MiB served over the NF4 model")

    _write(recipe, write)
    return policy, record
