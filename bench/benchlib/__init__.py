"""Helpers of bench/bench.py, one module per concern; `import benchlib as bl` reaches them all.

shapes: the benchmark shapes and their config. synthetic: random micro-batches and models built on
the device. flops: useful-FLOP counts. timing: device-timeline marks, statistics, the matmul peak,
memory. compile_watch: recompilations after warm-up. jsonio: JSON between ranks and on disk.
watchdog: deadlines and failed peers. power: energy, power and clock from NVML. state: what the
sections share (`benchlib.state.BenchState`, imported by name: it builds the job's process groups).
"""

from .compile_watch import CompileWatch, compile_seconds, frames_compiled_total, install_recompile_log
from .flops import (
    DRAFTER_FLOPS_COUNTING,
    TARGET_FLOPS_COUNTING,
    drafter_flops_per_micro_batch,
    target_flops_per_seq,
)
from .jsonio import deep_merge, gather_json, read_json, write_json
from .power import PowerMeter
from .shapes import SHAPES, Shape, bench_config
from .synthetic import (
    DeviceInitDrafter,
    SyntheticReader,
    batch_to,
    count_params,
    random_drafter,
    random_embed_and_head,
    random_target,
    received_form,
    seeded,
)
from .timing import (
    GB,
    GIB,
    Marks,
    count_nonfinite,
    distribution,
    matmul_peak,
    memory_report,
    memory_reset,
    sync,
)
from .watchdog import Watchdog

__all__ = [
    "DRAFTER_FLOPS_COUNTING",
    "GB",
    "GIB",
    "SHAPES",
    "TARGET_FLOPS_COUNTING",
    "CompileWatch",
    "DeviceInitDrafter",
    "Marks",
    "PowerMeter",
    "Shape",
    "SyntheticReader",
    "Watchdog",
    "batch_to",
    "bench_config",
    "compile_seconds",
    "count_nonfinite",
    "count_params",
    "deep_merge",
    "distribution",
    "drafter_flops_per_micro_batch",
    "frames_compiled_total",
    "gather_json",
    "install_recompile_log",
    "matmul_peak",
    "memory_report",
    "memory_reset",
    "random_drafter",
    "random_embed_and_head",
    "random_target",
    "read_json",
    "received_form",
    "seeded",
    "sync",
    "target_flops_per_seq",
    "write_json",
]
