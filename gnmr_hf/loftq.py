"""LoftQ initialisation of a QLoRA adapter, on any device: PEFT's own code with one line changed.

Used by the recipes' ``lora_init: loftq`` (recipes/finetune.py) and bench/value/qlora_budget.py's ``loftq``
methods; :func:`replace_lora_weights_loftq` is the entry point.

PEFT 0.21's ``replace_lora_weights_loftq`` (``peft.utils.loftq_utils``) initialises each LoRA pair of a
bitsandbytes 4-bit model from the SVD of the quantisation residual ``W - dequant(W_4bit)``, but its
``_loftq_init_new`` hard-codes the compute device::

    compute_device = "xpu" if is_xpu_available() else "cuda"

so it fails on a machine without an accelerator. :func:`replace_lora_weights_loftq` runs PEFT's
``replace_lora_weights_loftq`` unchanged with ``_loftq_init_new`` rebuilt from PEFT's own source with
that one line replaced by ``compute_device = qweight.device`` (the device the 4-bit weight is on), for
the duration of the call. The patch is checked: if PEFT's source no longer has that line, it raises
instead of guessing (tests/test_loftq.py also checks that exactly one line differs).

The 4-bit layers must hold bitsandbytes' reference layout (``keep_reference_layout``): a weight repacked
for bitsandbytes' CPU inference kernel does not de-quantise with ``dequantize_4bit``.
"""

from __future__ import annotations

import inspect
import textwrap
import types
from contextlib import contextmanager
from typing import Any

from gnmr_hf.units import short_name

CUDA_LINE = 'compute_device = "xpu" if is_xpu_available() else "cuda"'
CPU_LINE = "compute_device = qweight.device"


def patched_source() -> tuple[str, str]:
    """PEFT's ``_loftq_init_new`` source and the same with the compute-device line replaced."""
    from peft.utils import loftq_utils

    original = textwrap.dedent(inspect.getsource(loftq_utils._loftq_init_new))
    if original.count(CUDA_LINE) != 1:
        raise RuntimeError(f"peft.utils.loftq_utils._loftq_init_new no longer holds the line {CUDA_LINE!r}: "
                           "check whether this PEFT version runs LoftQ on the CPU as it is")
    return original, original.replace(CUDA_LINE, CPU_LINE)


def _cpu_init() -> types.FunctionType:
    from peft.utils import loftq_utils

    _, source = patched_source()
    namespace: dict[str, Any] = {}
    # compiled in loftq_utils' own globals, so every name it uses (torch, bnb checks, the SVD) is PEFT's
    exec(compile(source, inspect.getsourcefile(loftq_utils), "exec"), loftq_utils.__dict__, namespace)  # noqa: S102
    return namespace["_loftq_init_new"]


@contextmanager
def loftq_on_the_weight_device():
    """Within the block, PEFT's LoftQ computes on the 4-bit weight's device."""
    from peft.utils import loftq_utils

    saved = loftq_utils._loftq_init_new
    loftq_utils._loftq_init_new = _cpu_init()
    try:
        yield
    finally:
        loftq_utils._loftq_init_new = saved


def replace_lora_weights_loftq(peft_model: Any, model_path: str, adapter_name: str = "default",
                               account_for_scaling: bool = True, callback: Any = None,
                               skip: Any = None, progress: bool = True) -> Any:
    """PEFT's ``replace_lora_weights_loftq`` on the weights' own device (see the module docstring).

    Returns ``peft_model``, its LoRA pairs on 4-bit linears initialised from the rank-r SVD of each
    linear's quantisation residual ``W - dequant(W_4bit)`` (``W`` read from ``model_path``'s safetensors).

    Args:
        skip: module names whose pairs keep their initialisation, e.g. a plan's linears that run on BF16
            (no residual there); any spelling of a decoder linear's name matches: the stock
            ``model.layers.3.self_attn.v_proj``, PEFT's ``base_model.model.model.layers.3.self_attn.v_proj``
            or ``layers.3.self_attn.v_proj`` (compared by :func:`gnmr_hf.units.short_name`).
        account_for_scaling: PEFT sets ``B A`` to the rank-r residual and ignores LoRA's ``scaling``
            (``lora_alpha / r``), so with ``lora_alpha != r`` the adapter adds ``scaling`` times the
            residual. True (LoftQ's intent): both factors are divided by ``sqrt(scaling)`` afterwards, so
            ``scaling * B A`` is the residual. False: PEFT's result as it is.
        callback: PEFT's ``callback(model, module_name) -> bool`` (False rolls that module's LoRA back to
            the weights it had before), e.g. to leave the linears that run in BF16 with the stock init.
        progress: a tqdm bar over the 4-bit linears (PEFT's loop has none; SmolLM2's 210 take ~18 s on a CPU).

    Raises:
        ValueError: (:func:`check_loftq_input`) before anything changes: not a PEFT model with LoRA on
            4-bit linears, a rank above a linear's smaller dimension, or ``model_path`` holding other weights.
    """
    from peft import replace_lora_weights_loftq as peft_loftq
    from peft.tuners.lora import Linear4bit

    pairs = check_loftq_input(peft_model, model_path, adapter_name, skip)
    if skip:
        # PEFT names the modules without its own wrapper prefix; short names compare any spelling
        keep = {short_name(str(n)) for n in skip}
        inner = callback

        def callback(model, module_name, _inner=inner):  # noqa: ANN001  (PEFT's callback signature)
            if short_name(module_name) in keep:
                return False  # roll back: keep the pair PEFT had before
            return True if _inner is None else _inner(model, module_name)

    # the values before, cloned: ``weight.data`` is a new object at every access, so identity says nothing
    before = {id(m): (m.lora_A[adapter_name].weight.detach().clone(), m.lora_B[adapter_name].weight.detach().clone())
              for m in pairs}
    from tqdm.auto import tqdm

    bar = tqdm(total=sum(isinstance(m, Linear4bit) for m in peft_model.modules()), desc="LoftQ", unit="linear",
               disable=not progress)
    inner_cb = callback

    def counted(model, module_name, _inner=inner_cb):  # noqa: ANN001  (PEFT's callback signature)
        bar.update(1)
        return True if _inner is None else _inner(model, module_name)

    try:
        with loftq_on_the_weight_device():
            peft_loftq(peft_model, model_path=str(model_path), adapter_name=adapter_name, callback=counted)
    finally:
        bar.close()
    if account_for_scaling:
        for module in replaced_pairs(peft_model, before, adapter_name):
            root = float(module.scaling[adapter_name]) ** 0.5
            module.lora_A[adapter_name].weight.data /= root
            module.lora_B[adapter_name].weight.data /= root
    return peft_model


#: the largest ``||dequant(W_4bit) - W|| / ||W||`` accepted between the model and ``model_path``: the
#: source check's NF4/FP4 threshold (gnmr_hf.backends.bnb_4bit; the right checkpoint gives ~0.1, others >= 1)
LOFTQ_SOURCE_TOLERANCE = 0.4


def check_loftq_input(peft_model: Any, model_path: Any, adapter_name: str = "default", skip: Any = None) -> list[Any]:
    """The LoRA modules over 4-bit linears LoftQ will initialise, after refusing in one line what PEFT
    would take silently or fail on later: a model that is not a ``PeftModel`` with LoRA on bitsandbytes
    4-bit linears, a rank ``r`` above a linear's smaller dimension (LoftQ's SVD would shrink the pair to
    that rank and the saved adapter would not reload), a ``model_path`` without safetensors or whose
    weight for the first linear is not the one the model was quantised from (the adapter would then add
    the difference between two models)."""
    import torch
    from peft.tuners.lora import Linear4bit

    if not hasattr(peft_model, "get_base_model"):
        raise ValueError(f"LoftQ needs a PEFT model with LoRA on its 4-bit linears (peft.get_peft_model(model, "
                         f"LoraConfig(...))), got {type(peft_model).__name__}")
    pairs = [(n, m) for n, m in peft_model.named_modules() if isinstance(m, Linear4bit) and adapter_name in m.lora_A]
    if not pairs:
        raise ValueError(f"LoftQ: no LoRA adapter {adapter_name!r} on a bitsandbytes 4-bit linear of this model "
                         "(load it with BitsAndBytesConfig(load_in_4bit=True) and target its linears with LoRA)")
    kept = {short_name(str(n)) for n in (skip or [])}
    for name, m in pairs:
        r, shape = m.r[adapter_name], (m.out_features, m.in_features)
        if r > min(shape) and short_name(name) not in kept:
            raise ValueError(f"LoftQ: LoRA rank r={r} is above the smaller dimension of {name} ({shape[0]} x "
                             f"{shape[1]}): its SVD gives rank {min(shape)} at most, and an adapter of another rank "
                             f"than its config does not reload; use r <= {min(shape)} or target other modules")
    from pathlib import Path

    if not any(Path(str(model_path)).glob("*.safetensors")):
        raise ValueError(f"LoftQ: model_path {model_path} holds no .safetensors file (the BF16 checkpoint the "
                         "4-bit model was loaded from)")
    import bitsandbytes.functional as bf
    from peft.utils.loftq_utils import _SafetensorLoader

    name, module = pairs[0]
    weight = _SafetensorLoader(peft_model, str(model_path)).get_tensor(name.removeprefix("base_model.model.") + ".weight")
    low = bf.dequantize_4bit(module.weight.data, module.weight.quant_state).to(torch.float32)
    weight = weight.to(low.device, torch.float32)
    error = float(torch.linalg.vector_norm(low - weight) / torch.linalg.vector_norm(weight).clamp_min(1e-30))
    if not error <= LOFTQ_SOURCE_TOLERANCE:
        raise ValueError(f"LoftQ: model_path {model_path} is not the checkpoint this model was quantised from: "
                         f"{name}'s 4-bit weight differs from its weight there by {error:.3g} of its norm (the right "
                         f"checkpoint gives about 0.1, the limit is {LOFTQ_SOURCE_TOLERANCE})")
    return [m for _, m in pairs]


def replaced_pairs(peft_model: Any, before: dict[int, tuple[Any, Any]], adapter_name: str = "default") -> list[Any]:
    """The 4-bit LoRA modules whose A or B differ from ``before`` (``id(module) -> (A, B)`` clones):
    the pairs LoftQ replaced; a rolled-back (skipped) pair holds its old values again."""
    import torch

    out = []
    for module in peft_model.modules():
        if id(module) in before:
            a, b = before[id(module)]
            if not (torch.equal(module.lora_A[adapter_name].weight, a) and torch.equal(module.lora_B[adapter_name].weight, b)):
                out.append(module)
    return out
