"""The rungs: one file per precision a decoder linear can be stored in, each registering a
:class:`~gnmr_hf.rungs.registry.Rung` (its bytes from a linear's shape, its fake quantisation for planning, the
module a planned linear is loaded as, and how each export format writes it).

==============  ================  ===================================================================
file            rungs             role
==============  ================  ===================================================================
``low4.py``     ``nf4``, ``fp4``  bitsandbytes' 4-bit low formats
``int4.py``     ``int4``,         the compressed-tensors export's W4A16 low formats (symmetric, and
                ``int4-asym``     asymmetric: a zero point per group)
``int8.py``     ``int8``          LLM.int8: a low format and a rung of the precision ladder
``bf16.py``     ``bf16``          the checkpoint weight, unquantised: the top rung
==============  ================  ===================================================================

A new precision is one file here (or anywhere: ``register_rung(Rung(...))``); plans, the ladder's gains and
prices, ``load_planned`` and the exports read the registry.
"""

from gnmr_hf.rungs import bf16, int4, int8, low4  # noqa: F401  (each registers its rungs)
from gnmr_hf.rungs.registry import (
    STOCK,
    LinearBytes,
    Rung,
    RungError,
    get_rung,
    planned_rungs,
    register_rung,
    rung_names,
    unregister_rung,
)

__all__ = ["STOCK", "LinearBytes", "Rung", "RungError", "get_rung", "planned_rungs", "register_rung", "rung_names",
           "unregister_rung"]
