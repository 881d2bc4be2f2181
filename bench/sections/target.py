"""target_only: the target forward alone, to the last layer the drafter reads."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import benchlib as bl

from dflash_mp.roles import hidden_states_for_drafter

if TYPE_CHECKING:
    from bench import Bench

TIMEOUT_S = 180


def run(bench: Bench) -> dict:
    if "target" not in bench.roles:
        return {}
    args, batch = bench.args, bench.reader.read(0)
    watch = bl.CompileWatch()
    start, first_forward_s = time.perf_counter(), None
    for i in range(args.warmup):
        hidden_states_for_drafter(bench.extractor, batch, bench.dtype, bench.device)
        if i == 0:
            bl.sync(bench.device)
            first_forward_s = time.perf_counter() - start
            bench.log(f"target_only: first forward (compile included) {first_forward_s:.1f}s")
    bl.sync(bench.device)
    watch.start()
    marks = bl.Marks(bench.device)
    t0 = time.perf_counter()
    marks.mark()
    for _ in range(args.iters):
        hidden = hidden_states_for_drafter(bench.extractor, batch, bench.dtype, bench.device)
        marks.mark()
    bl.sync(bench.device)
    seconds = time.perf_counter() - t0
    assert hidden.shape == (bench.B, bench.S, bench.feature_size), hidden.shape
    flops = bench.partial["sections"]["setup"]["result"]["target"]["flops_per_seq"] * bench.B * args.iters
    return {
        "samples_per_s": args.iters * bench.B / seconds,
        "ms_per_seq": seconds / (args.iters * bench.B) * 1e3,
        "forward_time": bl.distribution(marks.intervals()),
        "tflops": flops / seconds / 1e12,
        "mfu": bench.mfu(flops / seconds),
        "iters": args.iters,
        "warmup": args.warmup,
        "first_forward_s": first_forward_s,
        "compile_seconds_so_far": bl.compile_seconds(),
        "recompiles_after_warmup": watch.result()["recompiles"],
    }
