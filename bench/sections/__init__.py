"""One module per benchmark section; each has `run(bench: BenchState) -> dict` (its part of the JSON)
and TIMEOUT_S. The state they share is benchlib/state.py; the runner (bench/runner.py) imports them.

This package holds only their names: the flags need them, and bench.py refuses a layout that does
not fit the ranks before torch and the models are imported."""

from __future__ import annotations

# In running order (--sections picks among them, the order stays this one); bench/runner.py's
# SECTIONS gives each its module.
NAMES = (
    "matmul_peak",
    "setup",
    "drafter_only",
    "target_only",
    "target_parallel_check",
    "profile",
    "pipeline",
    "transport",
    "colocated",
)
# What runs without --sections: the profiler slows the steps it watches and is read on demand.
DEFAULT_SECTIONS = tuple(name for name in NAMES if name != "profile")
