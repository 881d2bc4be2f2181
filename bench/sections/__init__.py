"""One module per benchmark section; each has `run(bench: BenchState) -> dict` (its part of the JSON)
and TIMEOUT_S. The state they share is benchlib/state.py; the runner (bench.py) imports them.

SECTIONS (name -> module) is imported on first use: the flags only need the names, and bench.py
refuses a layout that does not fit the ranks before torch and the models are imported."""

from __future__ import annotations

import importlib
from types import ModuleType

# In running order (--sections picks among them, the order stays this one): name -> module.
MODULES = {
    "matmul_peak": "matmul_peak",
    "setup": "setup",
    "drafter_only": "drafter",
    "target_only": "target",
    "target_parallel_check": "tp_check",
    "profile": "profile",
    "pipeline": "pipeline",
    "transport": "transport",
    "colocated": "colocated",
}
NAMES = tuple(MODULES)
# What runs without --sections: the profiler slows the steps it watches and is read on demand.
DEFAULT_SECTIONS = tuple(name for name in MODULES if name != "profile")


def __getattr__(name: str) -> dict[str, ModuleType]:
    if name != "SECTIONS":
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    sections = {
        section: importlib.import_module(f"{__name__}.{module}") for section, module in MODULES.items()
    }
    globals()["SECTIONS"] = sections
    return sections
