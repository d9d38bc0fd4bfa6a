"""Calibrated LoRA initialisation of a QLoRA adapter: each 4-bit linear's LoRA pair set, in closed form, to the
rank-r correction that minimises that linear's *output* error against its BF16 weight on calibration data.

Used by the recipes' ``lora_init: calibrated`` (recipes/finetune.py) and bench/value/calibrated_init.py;
:func:`calibrated_lora_init` is the entry point.

The derivation (CLoQ, Deng et al., arXiv 2501.18475, Theorem 3.1; QERA, Zhang et al., ICLR 2025,
arXiv 2410.06040, "QERA-exact"). For one linear with weight ``W`` (out x in), its de-quantised 4-bit weight
``Q`` and the quantisation error ``E = W - Q``, the LoRA pair ``(B, A)`` (out x r, r x in) with LoRA's scaling
``s = lora_alpha / r`` adds ``s B A x`` to ``Q x``. Over calibration inputs ``x`` with second moment
``H = E[x x^T]`` (in x in), the layer's expected squared output error is::

    E || W x - (Q + s B A) x ||^2 = || (E - L) H^{1/2} ||_F^2,      L = s B A  (rank <= r)

``H^{1/2}`` is invertible once damped (``H + damp * mean(diag H) * I``), so ``L -> L H^{1/2}`` is a bijection
between rank-r matrices and, by Eckart-Young, the minimiser is::

    L* = [E H^{1/2}]_r H^{-1/2},  with  E H^{1/2} = U S V^T  (truncated to the r largest singular values)

and the pair is ``B = U_r S_r^{1/2} / sqrt(s)``, ``A = S_r^{1/2} V_r^T H^{-1/2} / sqrt(s)`` (the singular values
split evenly between the factors, LoRA's scaling between them too, so ``s B A = L*``). With ``H = I`` this is
LoftQ's one-shot init (the SVD of the weight error), which QERA shows minimises the wrong target: the weight
error, not the output error. ``H^{1/2}`` and ``H^{-1/2}`` come from one float64 eigendecomposition.

``H`` is gathered by forward pre-hooks on the LoRA-wrapped 4-bit linears over ``batches`` (the model as it
stands, adapters disabled, so each linear sees the inputs of the quantised model; padding positions left out
where the batch's ``attention_mask`` marks them), one float64 ``in x in`` sum per linear. ``W`` is read
from the safetensors checkpoint the model was quantised from, as LoftQ reads it (``gnmr_hf.loftq``). The base
weight is not changed, so the saved adapter is a stock PEFT adapter (``adapter_config.json`` and the two factors
per linear) that loads onto the same 4-bit base and reproduces the initialised model.
"""

from __future__ import annotations

import time
from typing import Any

from gnmr_hf.loftq import check_loftq_input
from gnmr_hf.units import short_name

#: default damping of ``H``: ``damp * mean(diag H)`` added to its diagonal (GPTQ's 0.01)
DEFAULT_DAMP = 0.01


def _lora_4bit_pairs(peft_model: Any, adapter_name: str) -> list[tuple[str, Any]]:
    from peft.tuners.lora import Linear4bit

    return [(n, m) for n, m in peft_model.named_modules() if isinstance(m, Linear4bit) and adapter_name in m.lora_A]


def hessian_roots(hessian: Any, damp: float = DEFAULT_DAMP) -> tuple[Any, Any]:
    """``(H^{1/2}, H^{-1/2})`` of the damped ``H + damp * mean(diag H) * I``, from one float64 eigendecomposition."""
    import torch

    h = hessian.to(torch.float64)
    h = (h + h.T) / 2
    mean_diag = float(h.diagonal().mean())
    h = h + max(damp * mean_diag, 1e-12) * torch.eye(h.shape[0], dtype=h.dtype, device=h.device)
    evals, evecs = torch.linalg.eigh(h)
    evals = evals.clamp_min(max(float(evals.max()), 1e-30) * 1e-12)
    root = evals.sqrt()
    return (evecs * root) @ evecs.T, (evecs / root) @ evecs.T


def closed_form_pair(error: Any, hessian: Any, rank: int, scaling: float = 1.0,
                     damp: float = DEFAULT_DAMP, roots: tuple[Any, Any] | None = None) -> tuple[Any, Any]:
    """``(B, A)`` minimising ``|| (error - scaling * B A) H^{1/2} ||_F`` over rank-``rank`` pairs (module
    docstring), in float64: ``error`` is ``W - Q`` (out x in), ``hessian`` the un-damped ``E[x x^T]`` (in x in);
    ``roots``: its :func:`hessian_roots`, when already computed (linears that share an input share them)."""
    import torch

    e = error.to(torch.float64)
    h_half, h_inv_half = roots if roots is not None else hessian_roots(hessian, damp)
    u, s, vh = torch.linalg.svd(e @ h_half, full_matrices=False)
    r = min(rank, s.numel())
    split = s[:r].sqrt()
    b = u[:, :r] * split
    a = (split[:, None] * vh[:r]) @ h_inv_half
    if r < rank:  # a rank above the linear's smaller dimension: zero rows/columns keep the config's shape
        b = torch.cat([b, b.new_zeros(b.shape[0], rank - r)], 1)
        a = torch.cat([a, a.new_zeros(rank - r, a.shape[1])], 0)
    root_s = float(scaling) ** 0.5
    return b / root_s, a / root_s


def output_error(error: Any, hessian: Any, correction: Any | None = None) -> float:
    """``tr((E - L) H (E - L)^T)``: the expected squared output error of a linear whose weight is off by
    ``error - correction`` on inputs of second moment ``hessian`` (un-damped)."""
    import torch

    d = error.to(torch.float64) if correction is None else error.to(torch.float64) - correction.to(torch.float64)
    return float(((d @ hessian.to(torch.float64)) * d).sum())


def gather_second_moments(peft_model: Any, batches: Any, modules: list[tuple[str, Any]],
                          disable_adapter: bool = True) -> tuple[dict[str, Any], int]:
    """``{name: E[x x^T]}`` (float64, on the CPU) of each module's input over ``batches``, and the token count."""
    import contextlib

    import torch

    sums: dict[str, Any] = {}
    count = {"n": 0}
    mask_now: dict[str, Any] = {"mask": None}
    handles = []

    def hook_for(name):
        def hook(_module, args, kwargs=None):
            x = args[0] if args else (kwargs or {}).get("x")
            x = x.detach()
            mask = mask_now["mask"]
            if mask is not None and x.dim() == 3 and tuple(x.shape[:2]) == tuple(mask.shape):
                x = x[mask.to(torch.bool)]
            x = x.reshape(-1, x.shape[-1]).to(torch.float64)
            xtx = (x.T @ x).cpu()
            sums[name] = xtx if name not in sums else sums[name] + xtx
        return hook

    for name, m in modules:
        handles.append(m.register_forward_pre_hook(hook_for(name)))
    was_training = peft_model.training
    peft_model.eval()
    device = next(p.device for p in peft_model.parameters())
    if isinstance(batches, dict) or hasattr(batches, "keys"):
        batches = [batches]
    try:
        ctx = peft_model.disable_adapter() if disable_adapter and hasattr(peft_model, "disable_adapter") \
            else contextlib.nullcontext()
        with torch.no_grad(), ctx:
            for batch in batches:
                ids = batch["input_ids"].to(device)
                mask = batch.get("attention_mask")
                mask = mask.to(device) if mask is not None else None
                mask_now["mask"] = mask
                count["n"] += int(mask.sum()) if mask is not None else ids.numel()
                peft_model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
        mask_now["mask"] = None
        peft_model.train(was_training)
    if not count["n"]:
        raise ValueError("calibrated_lora_init: the batches hold no token")
    missing = [n for n, _ in modules if n not in sums]
    if missing:
        raise ValueError(f"calibrated_lora_init: {len(missing)} LoRA linears saw no input in the batches "
                         f"(first: {missing[0]})")
    return {n: s / count["n"] for n, s in sums.items()}, count["n"]


def calibrated_lora_init(peft_model: Any, batches: Any, model_path: Any, skip: Any = None,
                         adapter_name: str = "default", damp: float = DEFAULT_DAMP,
                         progress: bool = False, compare_loftq: bool = True,
                         ranks: dict[str, int] | None = None) -> dict[str, Any]:
    """Set every LoRA pair on a bitsandbytes 4-bit linear of ``peft_model`` to the closed-form rank-r
    correction minimising that linear's output error on ``batches`` (module docstring: CLoQ / QERA-exact).

    Args:
        peft_model: a PEFT model with LoRA on bitsandbytes 4-bit linears in the reference layout (as
            :func:`gnmr_hf.loftq.replace_lora_weights_loftq` takes), optionally with a dual path.
        batches: mappings with ``input_ids`` (and ``attention_mask``), e.g. the profile's batches; one mapping
            or a list.
        model_path: the safetensors checkpoint the 4-bit model was quantised from (the BF16 weights ``W``).
        skip: module names whose pairs keep their initialisation (a plan's linears on a BF16 or INT8 rung);
            any spelling of a decoder linear's name (:func:`gnmr_hf.units.short_name`).
        damp: ``H``'s damping as a share of its mean diagonal.
        progress: a tqdm bar over the linears.
        compare_loftq: also compute LoftQ's output error for the summary (one more SVD per linear).
        ranks: ``{linear: k}`` (any spelling of the name, :func:`gnmr_hf.units.short_name`): use only the first
            ``k`` of that pair's ``r`` rank-one terms and leave the rest zero (the forward of an adapter with
            PEFT's ``rank_pattern`` of ``k``, e.g. from :func:`allocate_ranks`); a linear not named uses all ``r``.

    Returns:
        A summary: ``{"linears": n calibrated, "skipped": n, "tokens": calibration tokens, "seconds": s,
        "output_error": {"zero": sum, "loftq": sum, "calibrated": sum}}`` where each sum is the linears'
        ``tr((E - L) H (E - L)^T)`` on the calibration data (``loftq``: the weight-error SVD of the same
        rank, computed for comparison, not applied; absent with ``compare_loftq=False``), and ``"per_linear"``: ``{name: [zero, calibrated]}``.

    Raises:
        ValueError: (:func:`gnmr_hf.loftq.check_loftq_input`) not a PEFT model with LoRA on 4-bit linears, a
            rank above a linear's smaller dimension, ``model_path`` holding other weights; or batches without
            tokens.
    """
    import bitsandbytes.functional as bf
    import torch
    from peft.utils.loftq_utils import _SafetensorLoader

    t0 = time.time()
    check_loftq_input(peft_model, model_path, adapter_name, skip)
    kept = {short_name(str(n)) for n in (skip or [])}
    pairs = [(n, m) for n, m in _lora_4bit_pairs(peft_model, adapter_name) if short_name(n) not in kept]
    skipped = len(_lora_4bit_pairs(peft_model, adapter_name)) - len(pairs)
    hessians, tokens = gather_second_moments(peft_model, batches, pairs)
    loader = _SafetensorLoader(peft_model, str(model_path))
    from tqdm.auto import tqdm

    totals = {"zero": 0.0, "calibrated": 0.0, **({"loftq": 0.0} if compare_loftq else {})}
    per_linear: dict[str, list[float]] = {}
    last = None
    for name, module in tqdm(pairs, desc="calibrated LoRA init", unit="linear", disable=not progress):
        base = module.get_base_layer()
        weight = loader.get_tensor(name.removeprefix("base_model.model.") + ".weight")
        low = bf.dequantize_4bit(base.weight.data, base.weight.quant_state)
        error = weight.to(torch.float64).cpu() - low.to(torch.float64).cpu()
        h = hessians[name]
        rank, scaling = module.r[adapter_name], float(module.scaling[adapter_name])
        use = rank if not ranks else min(rank, int(ranks.get(short_name(name), rank)))
        if last is None or last[0].shape != h.shape or not torch.equal(last[0], h):  # q/k/v, gate/up share inputs
            last = (h, hessian_roots(h, damp))
        b, a = closed_form_pair(error, h, use, scaling, damp, roots=last[1])
        if use < rank:  # the terms past k stay zero: the pair acts as a rank-k one
            b = torch.cat([b, b.new_zeros(b.shape[0], rank - use)], 1)
            a = torch.cat([a, a.new_zeros(rank - use, a.shape[1])], 0)
        lora_a, lora_b = module.lora_A[adapter_name].weight, module.lora_B[adapter_name].weight
        with torch.no_grad():
            lora_a.copy_(a.to(lora_a.device, lora_a.dtype))
            lora_b.copy_(b.to(lora_b.device, lora_b.dtype))
        zero = output_error(error, h)
        calibrated = output_error(error, h, scaling * (b @ a))
        if compare_loftq:
            u, s, vh = torch.linalg.svd(error, full_matrices=False)
            totals["loftq"] += output_error(error, h, (u[:, :rank] * s[:rank]) @ vh[:rank])
        totals["zero"] += zero
        totals["calibrated"] += calibrated
        per_linear[short_name(name)] = [zero, calibrated]
    return {"linears": len(pairs), "skipped": skipped, "tokens": tokens, "damp": damp,
            "seconds": round(time.time() - t0, 2), "output_error": totals, "per_linear": per_linear}


def error_spectra(peft_model: Any, batches: Any, model_path: Any, skip: Any = None, adapter_name: str = "default",
                  damp: float = DEFAULT_DAMP) -> dict[str, Any]:
    """Each 4-bit LoRA linear's output-error spectrum on ``batches``: the squared singular values of
    ``E H^{1/2}`` (module docstring), largest first. Keeping the first ``k`` terms of the closed form leaves the
    output error ``sum(s2[k:])`` (Eckart-Young), so ``s2[k]`` is what the ``k+1``-th rank buys.

    Returns ``{"spectra": {linear: float64 tensor}, "shapes": {linear: (out, in)}, "tokens": n}`` keyed by
    :func:`gnmr_hf.units.short_name`; arguments as :func:`calibrated_lora_init`'s."""
    import bitsandbytes.functional as bf
    import torch
    from peft.utils.loftq_utils import _SafetensorLoader

    check_loftq_input(peft_model, model_path, adapter_name, skip)
    kept = {short_name(str(n)) for n in (skip or [])}
    pairs = [(n, m) for n, m in _lora_4bit_pairs(peft_model, adapter_name) if short_name(n) not in kept]
    hessians, tokens = gather_second_moments(peft_model, batches, pairs)
    loader = _SafetensorLoader(peft_model, str(model_path))
    spectra: dict[str, Any] = {}
    shapes: dict[str, tuple[int, int]] = {}
    last = None
    for name, module in pairs:
        base = module.get_base_layer()
        weight = loader.get_tensor(name.removeprefix("base_model.model.") + ".weight")
        low = bf.dequantize_4bit(base.weight.data, base.weight.quant_state)
        error = weight.to(torch.float64).cpu() - low.to(torch.float64).cpu()
        h = hessians[name]
        if last is None or last[0].shape != h.shape or not torch.equal(last[0], h):
            last = (h, hessian_roots(h, damp))
        spectra[short_name(name)] = torch.linalg.svdvals(error @ last[1][0]) ** 2
        shapes[short_name(name)] = tuple(error.shape)
    return {"spectra": spectra, "shapes": shapes, "tokens": tokens}


def allocate_ranks(spectra: dict[str, Any], shapes: dict[str, tuple[int, int]], rank: int, min_rank: int = 1,
                   max_rank: int | None = None) -> dict[str, int]:
    """Ranks for the linears at the adapter bytes of ``rank`` on each (``sum(rank * (out + in))`` parameters),
    spent where the output error is: starting from ``min_rank`` each, the next rank goes, greedily, to the linear
    whose next squared singular value (:func:`error_spectra`) per parameter it costs (``out + in``) is largest,
    up to ``max_rank`` (default ``2 * rank``) and the linear's smaller dimension. The spectra fall, so the greedy
    takes each linear's terms in order; the sum of parameters never exceeds the uniform adapter's.

    Returns ``{linear: k}`` for PEFT's ``LoraConfig(rank_pattern=...)`` (keys as given)."""
    import heapq

    if rank < 1 or min_rank < 1 or min_rank > rank:
        raise ValueError(f"allocate_ranks: need 1 <= min_rank ({min_rank}) <= rank ({rank})")
    top = 2 * rank if max_rank is None else int(max_rank)
    if top < rank:
        raise ValueError(f"allocate_ranks: max_rank ({top}) below rank ({rank})")
    if set(spectra) != set(shapes):
        raise ValueError("allocate_ranks: spectra and shapes name different linears")
    cost = {n: int(shapes[n][0]) + int(shapes[n][1]) for n in spectra}
    cap = {n: min(top, min(int(shapes[n][0]), int(shapes[n][1]))) for n in spectra}
    ranks = {n: min(min_rank, cap[n]) for n in spectra}
    left = sum(min(rank, cap[n]) * cost[n] for n in spectra) - sum(ranks[n] * cost[n] for n in spectra)
    s2 = {n: [float(v) for v in spectra[n]] for n in spectra}

    def gain(n: str) -> float:
        k = ranks[n]
        return s2[n][k] if k < len(s2[n]) else 0.0

    heap = [(-gain(n) / cost[n], n) for n in spectra if ranks[n] < cap[n]]
    heapq.heapify(heap)
    while heap:
        _, n = heapq.heappop(heap)
        if cost[n] > left:
            continue  # a cheaper linear may still fit
        ranks[n] += 1
        left -= cost[n]
        if ranks[n] < cap[n]:
            heapq.heappush(heap, (-gain(n) / cost[n], n))
    return ranks


def peft_rank_pattern(ranks: dict[str, int], rank: int) -> dict[str, int]:
    """``ranks`` (:func:`allocate_ranks`) as PEFT's ``LoraConfig(rank_pattern=...)``: the linears whose rank is not
    ``rank``, each name escaped (PEFT matches a key as a regular expression against the end of a module's name)."""
    import re

    return {re.escape(n): int(k) for n, k in sorted(ranks.items()) if int(k) != int(rank)}
