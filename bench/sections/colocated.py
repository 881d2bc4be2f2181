"""The colocated baseline: target forward + drafter step back to back in every process.

On N ranks every process does so (whatever role it played before) and the drafters train under
DDP over all N, rank r on the micro-batches dflash_mp.runtime.colocated gives it; on 1 rank the one
process does it without DDP, which is the colocated rate of one GPU (no all-reduce cost), next to
the stage rates that the split layouts would get from the same GPU. A rank holding a
tensor-parallel share of the target builds a whole one instead (colocated runs TP=1).
"""

from __future__ import annotations

import gc
import time

import torch
import torch.distributed as dist
from benchlib.compile_watch import CompileWatch
from benchlib.state import BenchState
from benchlib.synthetic import random_target
from benchlib.timing import count_nonfinite, distribution, sync

from dflash_mp.runtime.colocated import through_target

TIMEOUT_S = 420


def early_tokens(early: list) -> int:
    """Real tokens of the micro-batch prepared ahead (read, not yet trained on)."""
    return sum(int(prepared.batch.lengths.sum()) for prepared in early)


def run(bench: BenchState) -> dict:
    args = bench.args
    _make_room(bench)
    start = time.perf_counter()
    trainer = _build_pair(bench)
    build_s = time.perf_counter() - start
    watch = CompileWatch()
    step_s, records, first_step_s, t0 = [], [], 0.0, 0.0
    start = prev = time.perf_counter()

    # As dflash_mp.runtime.colocated: the next step's first micro-batch goes through the target and is
    # prepared while the device runs the update.
    early = []
    for i in range(args.warmup + args.colocated_iters):
        if i == args.warmup:
            sync(bench.device)
            watch.start()
            t0 = prev = time.perf_counter()
            # What the reader has read by now: warm-up steps, and the step prepared early.
            tokens_before = bench.reader.tokens_read - early_tokens(early)
        for micro in range(bench.A):
            batch = early.pop() if early else _micro_batch(bench, i, micro)
            trainer.micro_step(batch, last_of_step=micro == bench.A - 1)
        record = trainer.optimizer_step(
            while_waiting=lambda i=i, trainer=trainer: early.append(
                trainer.prepare(_micro_batch(bench, i + 1, 0))
            )
        )
        now = time.perf_counter()
        if i == 0:
            first_step_s = now - start
            bench.log(f"colocated: first step (compile included) {first_step_s:.1f}s")
        if i >= args.warmup:
            step_s.append(now - prev)
            records.append(record)
        prev = now
    sync(bench.device)
    seconds = time.perf_counter() - t0
    tokens = bench.reader.tokens_read - early_tokens(early) - tokens_before
    nonfinite = count_nonfinite("colocated", records)
    del trainer
    return {
        "per_rank": {
            str(bench.rank): {
                "samples_per_s": args.colocated_iters * bench.A * bench.B / seconds,
                # Real (unpadded) tokens: rows of chat data (--data chat*) hold fewer than S.
                "tokens_per_s": tokens / seconds,
                "data": args.data,
                "ms_per_step": seconds / args.colocated_iters * 1e3,
                "step_time": distribution(step_s),
                "build_s": build_s,
                "first_step_s": first_step_s,
                "recompiles_after_warmup": watch.result()["recompiles"],
                "recompile_reasons": watch.result()["recompile_reasons"],
                "skipped_nonfinite_steps": nonfinite,
            }
        },
        "ranks": bench.world,
        "ddp": not bench.single,
        "steps": args.colocated_iters,
        "warmup": args.warmup,
    }


def _make_room(bench: BenchState) -> None:
    """Free what this process's earlier roles built and colocated cannot use."""
    if "drafter" in bench.roles:  # the drafter-only objects make room for this process's colocated pair
        bench.trainer = bench.features = None
    if bench.mesh is not None:  # a share of a tensor-parallel replica: colocated needs the whole target
        bench.extractor = None
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()


def _build_pair(bench: BenchState):
    """This process's whole target (built unless it holds one already) and a drafter trainer."""
    if bench.extractor is None:
        bench.extractor = random_target(
            bench.shape,
            bench.dtype,
            bench.device,
            seed=bench.args.seed + 10,
            compile_layers=bench.compiled,
            packed_rows=bench.args.data == "chat-packed",
            layer_ids=bench.feature_layer_ids,
        )
    # DDP over every rank; on 1 rank no group, so no DDP.
    return bench.new_trainer(group=None if bench.single else dist.group.WORLD)


def _micro_batch(bench: BenchState, i: int, micro: int):
    """Step i's micro-batch `micro` of this rank, through the target: the order colocated reads in."""
    m = (i * bench.world + bench.rank) * bench.A + micro
    return through_target(bench.reader.read(m), bench.extractor, bench.dtype, bench.device)
