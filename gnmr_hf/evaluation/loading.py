"""Loading what is scored: the base (BF16, bitsandbytes INT8 or NF4 at load, a pre-quantised folder, or a plan on
its training base through :func:`gnmr_hf.planning.ladder.load_planned`) and an optional LoRA adapter applied with
plain PEFT, checked against the base before PEFT touches it."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import torch

from gnmr_hf import hardware
from gnmr_hf._import_utils import require
from gnmr_hf.evaluation.errors import EvalError
from gnmr_hf.evaluation.forms import _export_marker, check_form, describe_scored, folder_quantisation
from gnmr_hf.evaluation.skip_list import _check_skip_modules, _kept_linears
from gnmr_hf.offline import gguf_models
from gnmr_hf.planning import ladder

PRECISIONS = ("bf16", "int8", "nf4")
# the dtype the model computes in (the weights are upcast to it); auto: gnmr_hf.hardware.auto_compute_dtype
COMPUTE_DTYPES = ("bfloat16", "float32", "float16", "auto")


# ------------------------------------------------------------------------------------ model/adapter
def _read_adapter_config(adapter: str | os.PathLike) -> dict[str, Any]:
    path = Path(adapter)
    if not path.is_dir():
        raise EvalError(f"--adapter {path} is not a folder")
    cfg_file = path / "adapter_config.json"
    if not cfg_file.is_file():
        raise EvalError(f"--adapter {path} is not a PEFT adapter: it has no adapter_config.json")
    try:
        cfg = json.loads(cfg_file.read_text())
    except json.JSONDecodeError as e:
        raise EvalError(f"{cfg_file} is not valid JSON ({e})") from None
    if not any((path / n).is_file() for n in ("adapter_model.safetensors", "adapter_model.bin")):
        raise EvalError(f"--adapter {path} is not a PEFT adapter: it has no adapter_model.safetensors")
    return cfg


def _adapter_weights(adapter: Path) -> dict[str, Any]:
    if (adapter / "adapter_model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(str(adapter / "adapter_model.safetensors"))
    return torch.load(adapter / "adapter_model.bin", map_location="cpu", weights_only=True)


def check_adapter_matches(model: Any, adapter: str | os.PathLike, base: str = "the base model") -> None:
    """Raise :class:`EvalError` if the LoRA adapter cannot apply to ``model``.

    Checks, before PEFT touches the model, that the adapter's ``target_modules`` name modules of the
    base (PEFT's own matcher) and that every saved LoRA matrix fits its base layer
    (``lora_A``: [r, in_features], ``lora_B``: [out_features, r]). ``model`` may be on the meta device (the
    exports check with it: :func:`gnmr_hf.export_folder.check_sources`); ``base`` names it in the message.
    """
    from peft import PeftConfig
    from peft.tuners.tuners_utils import check_target_module_exists

    adapter = Path(adapter)
    config = PeftConfig.from_pretrained(str(adapter))
    modules = dict(model.named_modules())
    if getattr(config, "target_modules", None) is not None:
        if not any(check_target_module_exists(config, name) for name in modules):
            raise EvalError(
                f"--adapter {adapter} does not match {base}: its target modules "
                f"{sorted(config.target_modules) if not isinstance(config.target_modules, str) else config.target_modules!r}"
                f" name no module of {base}"
            )
    for key, tensor in _adapter_weights(adapter).items():
        for part, dim in ((".lora_A.", 1), (".lora_B.", 0)):
            if part not in key:
                continue
            name = key.split(part)[0]
            name = name[len("base_model.model."):] if name.startswith("base_model.model.") else name
            layer = modules.get(name)
            if layer is None:
                raise EvalError(f"--adapter {adapter} does not match {base}: it has weights for "
                                f"{name}, which {base} does not have")
            want = getattr(layer, "in_features" if dim == 1 else "out_features", None)
            if want is not None and tensor.shape[dim] != want:
                side = "in_features" if dim == 1 else "out_features"
                raise EvalError(
                    f"--adapter {adapter} does not match {base}: {key} has shape "
                    f"{list(tensor.shape)}, but {name} of {base} has {side}={want}"
                )


def resolve_model(model: str | os.PathLike) -> str:
    """``--model`` through the one resolver (:func:`gnmr_hf.offline.gguf_models.resolve_model`): an offline
    alias becomes its checkpoint folder, a folder or hub id stays; anything else is an :class:`EvalError`."""
    try:
        return gguf_models.resolve_model(model)
    except FileNotFoundError as e:
        raise EvalError(str(e)) from None


def load_model(model: str, precision: str | None = None, adapter: str | os.PathLike | None = None,
               device: str = "cpu", compute_dtype: str = "bfloat16",
               skip_modules: list[str] | None = None, plan: str | os.PathLike | None = None) -> tuple[Any, Any]:
    """Load the base (BF16, bitsandbytes INT8 or NF4, a pre-quantised folder, or a ladder plan) and apply an
    optional LoRA adapter with plain PEFT.

    Args:
        model: a local checkpoint folder, a hub id or an offline alias (:func:`resolve_model`). A folder whose
            ``config.json`` has a ``quantization_config`` (``gnmr-hf export``'s bitsandbytes or compressed-tensors
            folders) is loaded as stock ``from_pretrained`` loads it, on ``device``; ``precision`` must be
            ``"bf16"`` then (nothing is quantised at load).
        precision: ``"bf16"`` (None: the default; ``"nf4"`` with ``plan``), ``"int8"``
            (``BitsAndBytesConfig(load_in_8bit=True)``, BF16 compute) or
            ``"nf4"`` (``BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4")``, BF16 compute:
            the base a QLoRA adapter was trained on). Its layers compute with bitsandbytes' reference
            de-quantise + matmul on every device (:func:`gnmr_hf.backends.bnb_4bit.keep_reference_layout`),
            as the recipes train. With ``plan``: the low path of the linears the plan leaves low.
        adapter: a PEFT adapter folder (``adapter_config.json`` + weights), or None.
        device: ``"cpu"`` or ``"cuda"``.
        compute_dtype: the dtype the model computes in: ``"bfloat16"`` (default), ``"float32"`` (the
            BF16 weights upcast exactly; the INT8/NF4 layers' inputs and the 4-bit compute dtype too),
            ``"float16"``, or ``"auto"`` (:func:`gnmr_hf.hardware.auto_compute_dtype`).
        skip_modules: for ``int8`` / ``nf4``, bitsandbytes' ``llm_int8_skip_modules``: the modules kept
            unquantised (their checkpoint weights in ``compute_dtype``), e.g. a plan's
            :func:`gnmr_hf.skip_modules` list: the mixed base a planned adapter trained on. The list
            replaces transformers' default one (which keeps ``lm_head``), as in ``BitsAndBytesConfig``.
        plan: a plan file (a ladder's ``rungs`` or a BF16-only plan's ``profile.json``, or its folder) loaded
            on ``model`` (its BF16 checkpoint) through :func:`gnmr_hf.planning.ladder.load_planned`: each planned
            linear on its rung (INT8 ``Linear8bitLt``, BF16), the others ``precision`` (``nf4`` or ``int8``).

    Returns:
        ``(model, tokenizer)``, the model in eval mode (:func:`load_scored` also says what was loaded).
    """
    model, tokenizer, _ = load_scored(model, precision, adapter, device, compute_dtype, skip_modules, plan)
    return model, tokenizer


def load_scored(model: str, precision: str | None = None, adapter: str | os.PathLike | None = None,
                device: str = "cpu", compute_dtype: str = "bfloat16", skip_modules: list[str] | None = None,
                plan: str | os.PathLike | None = None) -> tuple[Any, Any, dict[str, Any]]:
    """:func:`load_model`, and what it loaded (:func:`describe_scored`)."""
    require("transformers", "Evaluating a model")
    if precision is not None and precision not in PRECISIONS:
        raise EvalError(f"--precision must be one of {', '.join(PRECISIONS)}, got {precision!r}")
    dtype_name = _compute_dtype(compute_dtype)
    if adapter is not None:
        require("peft", "Loading a LoRA adapter")
        _read_adapter_config(adapter)
    model = resolve_model(model)
    method = folder_quantisation(model)
    precision = check_form(model, precision, skip_modules, plan)
    _check_skip_modules(precision, skip_modules)
    from transformers import AutoTokenizer

    dtype = getattr(torch, dtype_name)
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise EvalError("--device cuda was asked for, but torch sees no CUDA device")
    try:
        tokenizer = AutoTokenizer.from_pretrained(model)
    except (OSError, ValueError) as e:
        raise EvalError(f"cannot load a tokenizer from --model {model}: {e}") from None
    device_map = {"": device if device != "cuda" else torch.cuda.current_device()}
    checkpoint = model if Path(model).is_dir() else None
    if plan is not None:
        base, form = _load_plan(model, plan, precision, dtype, device_map)
        return _finish(base, tokenizer, adapter, form, checkpoint)
    base = _load_base(model, method, precision, dtype, device_map, skip_modules)
    if precision == "bf16" and method is None:
        base = base.to(device)
    if precision == "nf4" or method == "bitsandbytes":
        from gnmr_hf.backends.bnb_4bit import keep_reference_layout  # bitsandbytes: the [bnb] extra

        # the reference de-quantise + matmul, as in training (the recipes, the dual path): without it
        # bitsandbytes repacks on CPUs with AVX512-BF16 (BF16 block scales) and the scores differ by CPU
        keep_reference_layout(base)
    return _finish(base, tokenizer, adapter, _base_form(model, method, precision, skip_modules), checkpoint)


def _load_plan(model: str, plan: str | os.PathLike, precision: str, dtype: torch.dtype,
               device_map: dict[str, Any]) -> tuple[Any, str]:
    """A plan on its training base (:func:`gnmr_hf.planning.ladder.load_planned`), and the words for its form."""
    require("bitsandbytes", "Loading a plan's low linears")
    try:
        base = ladder.load_planned(model, plan, low=precision, dtype=dtype, compute_dtype=dtype, device_map=device_map)
    except (ValueError, OSError) as e:
        raise EvalError(f"--plan {plan}: {e}") from None
    low = {"nf4": "NF4", "int8": "INT8"}[precision]
    return base, f"a plan on its training base ({Path(plan).name}, gnmr_hf.load_planned; the other linears {low})"


def _load_base(model: str, method: str | None, precision: str, dtype: torch.dtype, device_map: dict[str, Any],
               skip_modules: list[str] | None) -> Any:
    """The base through ``from_pretrained``: a pre-quantised folder as its config says, else BF16 or quantised at
    load to ``precision`` (``skip_modules`` kept unquantised, checked against the loaded linears)."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    kwargs: dict[str, Any] = {"dtype": dtype}
    if method is not None:
        require("bitsandbytes" if method == "bitsandbytes" else "compressed_tensors",
                f"Loading a pre-quantised {method} folder")
        kwargs["device_map"] = device_map
    elif precision in ("int8", "nf4"):
        require("bitsandbytes", f"Loading the base model in {precision.upper()}")
        skip = {} if skip_modules is None else {"llm_int8_skip_modules": list(skip_modules)}
        kwargs["quantization_config"] = (
            BitsAndBytesConfig(load_in_8bit=True, **skip) if precision == "int8" else
            BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=dtype, **skip))
        kwargs["device_map"] = device_map
    try:
        base = AutoModelForCausalLM.from_pretrained(model, **kwargs)
    except OSError as e:
        raise EvalError(f"cannot load --model {model}: {e}") from None
    if skip_modules is not None and precision in ("int8", "nf4"):
        _report_kept(base, model, skip_modules)
    return base


def _report_kept(base: Any, model: str, skip_modules: list[str]) -> None:
    """Refuse ``--skip-modules`` entries that keep no linear of ``base``; say on stderr how many linears stay
    unquantised."""
    kept, unmatched = _kept_linears(base, list(skip_modules))
    if unmatched:
        raise EvalError(f"--skip-modules: {len(unmatched)} name(s) keep no linear of {model} unquantised, "
                        f"e.g. {unmatched[0]!r} (full dotted names such as model.layers.0.self_attn.v_proj, "
                        "or a profile.json)")
    total = sum(isinstance(m, torch.nn.Linear) for m in base.modules())
    note = ("" if "lm_head" in kept or not isinstance(getattr(base, "lm_head", None), torch.nn.Module) else
            "; lm_head is not among them, so it is quantised too (add lm_head to keep the stock behaviour)")
    print(f"gnmr-hf eval: --skip-modules keeps {len(kept)} of {total} linears unquantised{note}",
          file=sys.stderr, flush=True)


def _base_form(model: str, method: str | None, precision: str, skip_modules: list[str] | None) -> str:
    """The summary's words for what :func:`_load_base` loaded."""
    if method is not None:
        marker = _export_marker(model)
        return f"an exported {method} folder" + (f" ({marker['kind']})" if marker.get("kind") else "")
    if _export_marker(model).get("kind") == "merged-bf16":
        return "the merged BF16 model (gnmr-hf export --merge)"
    return ("a BF16 checkpoint" if precision == "bf16" else
            f"a BF16 checkpoint quantised at load to {precision.upper()}"
            + ("" if skip_modules is None else f", {len(skip_modules)} --skip-modules entries kept"))


def _finish(base, tokenizer, adapter, form: str, checkpoint) -> tuple[Any, Any, dict[str, Any]]:
    """The adapter applied, eval mode, and what was loaded."""
    if adapter is not None:
        from peft import PeftModel

        check_adapter_matches(base, adapter)
        base = PeftModel.from_pretrained(base, str(adapter), is_trainable=False)
        form += f" + the LoRA adapter {Path(str(adapter).rstrip('/')).name}"
    base.eval()
    return base, tokenizer, describe_scored(base, form, checkpoint)


def _compute_dtype(name: str) -> str:
    """``name`` checked, ``"auto"`` resolved (its reason printed to stderr)."""
    if name not in COMPUTE_DTYPES:
        raise EvalError(f"--compute-dtype must be one of {', '.join(COMPUTE_DTYPES)}, got {name!r}")
    if name != "auto":
        return name
    resolved, reason = hardware.auto_compute_dtype()
    print(f"gnmr-hf eval: compute dtype auto -> {resolved}: {reason}", file=sys.stderr, flush=True)
    return resolved


