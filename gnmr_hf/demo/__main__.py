"""``python -m gnmr_hf.demo``: the same as ``gnmr-hf demo``."""

from gnmr_hf.demo import main

raise SystemExit(main())
