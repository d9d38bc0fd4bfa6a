"""The former home of the planner, kept so that ``from gnmr_hf.profile import ...`` written against earlier
releases still works: everything lives in :mod:`gnmr_hf.planning` (one file per job) and is re-exported here,
the same objects. ``python -m gnmr_hf.profile`` is ``gnmr-hf profile``."""

from gnmr_hf.planning import *  # noqa: F403
from gnmr_hf.planning import __all__ as _planning_all
from gnmr_hf.planning.cli import build_parser, main
from gnmr_hf.reporting.profile_plot import plot_profile

__all__ = [*_planning_all, "build_parser", "main", "plot_profile"]

if __name__ == "__main__":
    raise SystemExit(main())
