"""Helpers of bench/bench.py, one module per concern; `import benchlib as bl` reaches them all.

shapes: the benchmark shapes and their config. synthetic: random micro-batches and models built on
the device. flops: useful-FLOP counts. timing: device-timeline marks, statistics, the matmul peak,
memory. compile_watch: recompilations after warm-up. jsonio: JSON between ranks and on disk.
watchdog: deadlines and failed peers. power: energy, power and clock from NVML. state: what the
sections share (`benchlib.state.BenchState`, imported by name: it builds the job's process groups).

Each name is imported from its module on first use (PEP 562): bench.py reads the flags (the shapes'
names) and refuses a layout that does not fit the ranks before torch and the models are imported.
"""

from __future__ import annotations

import importlib

# module of this package -> the names it gives `bl`
_NAMES = {
    "compile_watch": "CompileWatch compile_seconds frames_compiled_total install_recompile_log",
    "flops": "DRAFTER_FLOPS_COUNTING TARGET_FLOPS_COUNTING drafter_flops_per_micro_batch target_flops_per_seq",
    "jsonio": "deep_merge gather_json read_json write_json",
    "power": "PowerMeter",
    "shapes": "SHAPES Shape bench_config predicted_memory",
    "synthetic": "DeviceInitDrafter SyntheticReader batch_to count_params random_drafter "
    "random_embed_and_head random_target received_form seeded",
    "timing": "GB GIB Marks count_nonfinite distribution matmul_peak memory_report memory_reset sync",
    "watchdog": "Watchdog",
}
_MODULE_OF = {name: module for module, names in _NAMES.items() for name in names.split()}
_MODULES = {*_NAMES, "family_shapes", "state"}  # `bl.timing` etc. as before

__all__ = sorted(_MODULE_OF)


def __getattr__(name: str):
    if name in _MODULE_OF:
        value = getattr(importlib.import_module(f".{_MODULE_OF[name]}", __name__), name)
    elif name in _MODULES:
        value = importlib.import_module(f".{name}", __name__)
    else:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_MODULE_OF, *_MODULES})
