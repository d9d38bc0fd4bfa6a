"""``prepare_dual_path``: one public verb that picks the backend from the layers it finds.

Like PEFT's ``dispatch_*`` chain in ``peft/tuners/lora/``, each backend is asked in turn whether the
model holds layers it can give a recovery path; the first that does wins. Backends are imported only
when asked, so a missing optional dependency (bitsandbytes) only matters for models that need it.
"""

from __future__ import annotations

from typing import Any

from torch import nn


def prepare_dual_path(model: nn.Module, recovery_source: str, storage: str = "host", **kwargs: Any) -> nn.Module:
    """Give every decoder layer of a quantised model a BF16 recovery path read from ``recovery_source``.

    The backend is chosen from the layers the model holds: bitsandbytes ``Linear8bitLt`` (a model
    loaded with ``BitsAndBytesConfig(load_in_8bit=True)``) goes to :mod:`gnmr_hf.backends.bnb_int8`.
    See that backend's ``prepare_dual_path`` for the arguments.
    """
    from gnmr_hf.backends import bnb_int8

    return bnb_int8.prepare_dual_path(model, recovery_source=recovery_source, storage=storage, **kwargs)
