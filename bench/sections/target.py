"""target_only: the target forward alone, to the last layer the drafter reads.

Every target rank runs it; the ranks of a tensor-parallel replica run each forward together (the
replica is the unit: its rate and its MFU over its GPUs). Each replica's leader reports under
per_replica; rank 0's replica also at the top (what the summary and dflash_mp.plan read).
"""

from __future__ import annotations

import time

from benchlib.compile_watch import CompileWatch, compile_seconds
from benchlib.state import BenchState
from benchlib.timing import Marks, distribution, sync

from dflash_mp.runtime.roles import hidden_states_for_drafter

TIMEOUT_S = 180


def run(bench: BenchState) -> dict:
    if "target" not in bench.roles:
        return {}
    args, batch = bench.args, bench.reader.read(0)
    watch = CompileWatch()
    start, first_forward_s = time.perf_counter(), None
    for i in range(args.warmup):
        hidden_states_for_drafter(bench.extractor, batch, bench.dtype, bench.device)
        if i == 0:
            sync(bench.device)
            first_forward_s = time.perf_counter() - start
            bench.log(f"target_only: first forward (compile included) {first_forward_s:.1f}s")
    sync(bench.device)
    watch.start()
    marks = Marks(bench.device)
    t0 = time.perf_counter()
    marks.mark()
    for _ in range(args.iters):
        hidden = hidden_states_for_drafter(bench.extractor, batch, bench.dtype, bench.device)
        marks.mark()
    sync(bench.device)
    seconds = time.perf_counter() - t0
    assert hidden.shape == (bench.B, batch.input_ids.shape[1], bench.feature_size), hidden.shape
    flops = bench.partial["sections"]["setup"]["result"]["target"]["flops_per_seq"] * bench.B * args.iters
    k = bench.target_parallel
    measured = {
        "samples_per_s": args.iters * bench.B / seconds,
        "ms_per_seq": seconds / (args.iters * bench.B) * 1e3,
        "forward_time": distribution(marks.intervals()),
        "tflops": flops / seconds / 1e12,
        # A replica's useful FLOPs over the peak of its k GPUs.
        "mfu": bench.mfu(flops / seconds, gpus=k),
        "first_forward_s": first_forward_s,
        "recompiles_after_warmup": watch.result()["recompiles"],
    }
    rank = str(bench.rank)
    result: dict = {
        "per_rank": {
            rank: {key: measured[key] for key in ("samples_per_s", "ms_per_seq", "recompiles_after_warmup")}
        },
        "replicas": bench.layout.replicas,
        "target_parallel": k,
        "iters": args.iters,
        "warmup": args.warmup,
    }
    if bench.layout.is_leader(bench.rank):
        replica = bench.layout.replica_of(bench.rank)
        result["per_replica"] = {str(replica): {"ranks": bench.layout.replica_ranks(replica), **measured}}
    if bench.rank == 0:
        result.update(measured, compile_seconds_so_far=compile_seconds())
    return result
