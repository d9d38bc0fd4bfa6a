"""Sensitivity profile of the quantised linears, and a BF16 plan for a byte budget.

Before training, a few batches of the user's own data say which quantised linears are worth keeping on
their original BF16 weights. The model is a dual-path model (:func:`gnmr_hf.prepare_dual_path`, best with
``units="linears"``: one unit per linear), optionally PEFT-wrapped. Every unit gets a score under one or
more criteria (the loss L is the mean over all target tokens of the batches; "low" = every unit on its
quantised path, "high" = on the checkpoint's BF16 weight):

==================  ========================================================================================
criterion           score of unit u (higher = more worth recovering)
==================  ========================================================================================
``loss``            the forward-loss restore gain ``L(all low) - L(u on BF16, the rest low)``: one forward per
                    unit per batch (the reference). Decoder layers below the unit are not recomputed: their
                    outputs are taken from the all-low forward of the same batch (they do not depend on u).
``first_order``     the first-order estimate of ``loss`` from one forward + backward at the low point:
                    ``-<dL/dW_u, W_high,u - W_low,u> = -sum_t delta_t . (y_high(x_t) - y_low(x_t))``, with
                    x_t the linear's input and delta_t the loss gradient at its output (hooks; no weight
                    gradient is formed, the base weights stay frozen).
``output``          the linear's output error on its real inputs, ``||(W_low - W_high) x||`` over all tokens
                    (the difference of the module's two paths on the captured input; one forward). Also
                    ``output_rel`` = ``||dW x||^2 / ||W_high x||^2``.
``lora_grad``       the oracle's quantity (:mod:`gnmr_hf.core.oracle`): ``||g_low,u - g_high,u||`` of the unit's
                    LoRA gradient, all units low vs all high (two backwards per batch; needs LoRA). Also
                    ``lora_grad_rel``, the relative recovery gap. It measures how much the *whole*
                    quantised network corrupts u's gradient, not what recovering u alone buys.
``weight_error``    data-free: ``||W_high - W_low||_F^2`` of the unit's linears, as the backend computes them (both
                    paths on the identity). Planned by score per byte it is "weight error per byte": the
                    baseline a data-aware criterion has to beat.
==================  ========================================================================================

``loss`` and ``first_order`` are in loss units (gains); their sums over a set are the *predicted* gain of
the set. Single gains do not add (units interact), so :func:`plan` measures the chosen set with one more
forward. A unit's ``bytes`` is the BF16 size of its weights (``out * in * 2``: what keeping it unquantised
costs); the quantised weights' BF16 bytes are the sum over all units.

Typical use::

    model = gnmr_hf.prepare_dual_path(model_4bit, recovery_source=path, units="linears", dtype=torch.float32)
    prof = gnmr_hf.profile_sensitivity(model, batches, criteria=("first_order",))
    p = gnmr_hf.plan(prof, budget_fraction=0.10, model=model, batches=batches)
    print(p.summary())
    cfg = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4",
                             llm_int8_skip_modules=gnmr_hf.skip_modules(p))

``gnmr-hf profile`` (:mod:`gnmr_hf.planning.cli`) does all of it from the command line, with a price table
and a plot.

One file per job (docs/design.md, "Layout"):

==================  ========================================================================================
``criteria``        the criteria, one function each, and their registry (:data:`CRITERIA`)
``passes``          what the criteria and the planner share: the units, batches, path switching, the loss
``profiler``        :func:`profile_sensitivity`: the criteria asked for, into one profile
``results``         :class:`SensitivityProfile`, :class:`UnitScore` and ``profile.json``
``planner``         :class:`PrecisionPlan`, the greedy fill by score per byte, :func:`plan`, :func:`measure_plan`
``plan``            :class:`Plan`: one type for every plan (BF16-only, ladder, INT4), its file, :class:`PlanError`
``make``            :func:`make_plan`: every plan (BF16-only, ladder, INT4) chosen in one currency, bytes over
                    the all-low model as served (:func:`plan_prices`, :func:`plan_budget`, :func:`plan_gains`)
``rung_criteria``   a registered criterion on each rung of a ladder or INT4 plan (the rung's weight standing in
                    for the high path): :func:`make_plan`'s gains for a ``criterion=`` other than the default
``rung_swap``       a plan put on one loaded low model in place and taken off again (the ladder table's rows)
``budget``          budget currencies (memory over the all-low model; a size; a share) and the price table
``skiplist``        :func:`skip_modules`: the names a stock ``BitsAndBytesConfig`` keeps unquantised
``ladder``          the precision ladder: INT8 and BF16 rungs under one memory budget, :func:`load_planned`
``gguf_plan``       a plan over a GGUF type (``q4_0`` ...): the file's ggml blocks as quantise-dequantise, its tensor
                    bytes as prices, the first-order rung gains (``gnmr-hf profile --serve gguf``)
``cli``             ``gnmr-hf profile``: its flags and data; ``profile_run`` (bitsandbytes low formats) and
                    ``profile_int4`` (``--low int4`` and ``--serve gguf``) run it
==================  ========================================================================================

The plot is :func:`gnmr_hf.reporting.profile_plot.plot_profile`.
"""

from gnmr_hf.planning.budget import format_price_table, memory_budget, over_low_prices, parse_budget
from gnmr_hf.planning.criteria import CRITERIA, DEFAULT_CRITERION, GAIN_SCORES, SCORE_NAMES
from gnmr_hf.planning.make import make_plan, plan_budget, plan_gains, plan_prices
from gnmr_hf.planning.plan import Plan, PlanError
from gnmr_hf.planning.planner import (
    PrecisionPlan,
    budget_error,
    fill_in_order,
    greedy_select,
    measure_plan,
    plan,
    random_sets,
)
from gnmr_hf.planning.profiler import profile_sensitivity
from gnmr_hf.planning.results import FORMAT_VERSION, SensitivityProfile, UnitScore
from gnmr_hf.planning.skiplist import skip_modules
from gnmr_hf.rungs import planned_rungs  # re-exported: the rungs a plan may put a linear on (the registry's)

__all__ = [
    "CRITERIA",
    "DEFAULT_CRITERION",
    "FORMAT_VERSION",
    "GAIN_SCORES",
    "Plan",
    "PlanError",
    "SCORE_NAMES",
    "PrecisionPlan",
    "SensitivityProfile",
    "UnitScore",
    "budget_error",
    "fill_in_order",
    "format_price_table",
    "greedy_select",
    "make_plan",
    "measure_plan",
    "memory_budget",
    "over_low_prices",
    "parse_budget",
    "plan",
    "plan_budget",
    "plan_gains",
    "plan_prices",
    "planned_rungs",
    "profile_sensitivity",
    "random_sets",
    "skip_modules",
]
