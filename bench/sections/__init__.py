"""One module per benchmark section; each has `run(bench: BenchState) -> dict` (its part of the JSON)
and TIMEOUT_S. The state they share is benchlib/state.py; the runner (bench.py) imports them."""

from __future__ import annotations

from types import ModuleType

from sections import colocated, drafter, matmul_peak, pipeline, profile, setup, target, tp_check, transport

# In running order (--sections picks among them, the order stays this one).
SECTIONS: dict[str, ModuleType] = {
    "matmul_peak": matmul_peak,
    "setup": setup,
    "drafter_only": drafter,
    "target_only": target,
    "target_parallel_check": tp_check,
    "profile": profile,
    "pipeline": pipeline,
    "transport": transport,
    "colocated": colocated,
}
# What runs without --sections: the profiler slows the steps it watches and is read on demand.
DEFAULT_SECTIONS = tuple(name for name in SECTIONS if name != "profile")
