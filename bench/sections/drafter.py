"""drafter_only: the drafter step alone (fwd + bwd + AdamW) on one resident micro-batch.

Every drafter rank runs it, under DDP over the drafter ranks when there are several (as in
training), so a step includes the gradient all-reduce. Samples/s are per drafter rank; the first
drafter's numbers are at the top, every rank's under per_rank.
"""

from __future__ import annotations

import time

from benchlib.compile_watch import CompileWatch, compile_seconds, frames_compiled_total
from benchlib.power import PowerMeter
from benchlib.state import BenchState
from benchlib.timing import count_nonfinite, distribution, sync

TIMEOUT_S = 420  # the cold torch.compile of the drafter (flex_attention fwd + bwd)


def run(bench: BenchState) -> dict:
    if "drafter" not in bench.roles:
        return {}
    trainer, batch, args = bench.trainer, bench.features, bench.args
    watch = CompileWatch()
    meter = PowerMeter(bench.device)
    step_s, records = [], []
    start = prev = time.perf_counter()
    first_step_s = t0 = 0.0
    # As a drafter rank trains (roles.run_drafter): the next step's first micro-batch is prepared
    # while the device runs the update.
    early = [trainer.prepare(batch)]
    for i in range(args.warmup + args.iters):
        if i == args.warmup:
            sync(bench.device)
            watch.start()
            meter.start()
            t0 = prev = time.perf_counter()
        for micro in range(bench.A):
            trainer.micro_step(early.pop() if early else batch, last_of_step=micro == bench.A - 1)
        record = trainer.optimizer_step(while_waiting=lambda: early.append(trainer.prepare(batch)))
        now = time.perf_counter()
        if i == 0:
            first_step_s = now - start
            bench.log(
                f"drafter_only: first step (compile included) {first_step_s:.1f}s, loss {record['loss']:.3f}"
            )
        if i >= args.warmup:
            step_s.append(now - prev)
            records.append(record)
        prev = now
    sync(bench.device)
    seconds = time.perf_counter() - t0
    meter.stop()
    nonfinite = count_nonfinite("drafter_only", records)
    steps = args.iters
    counted = bench.partial["sections"]["setup"]["result"]["drafter"]
    flops = counted["flops_per_micro_batch"] * bench.A * steps
    flops_head_as_trainable = counted["flops_per_micro_batch_head_as_trainable"] * bench.A * steps
    flops_previous = counted["flops_per_micro_batch_previous_counting"] * bench.A * steps
    measured = {
        "samples_per_s": steps * bench.A * bench.B / seconds,
        "ms_per_step": seconds / steps * 1e3,
        "ms_per_micro_batch": seconds / (steps * bench.A) * 1e3,
        "step_time": distribution(step_s),
        "tflops": flops / seconds / 1e12,
        "mfu": bench.mfu(flops / seconds),
        "mfu_head_as_trainable": bench.mfu(flops_head_as_trainable / seconds),
        "mfu_previous_counting": bench.mfu(flops_previous / seconds),  # benchlib/flops.py
        "mfu_at_sustained_matmul_rate": bench.mfu_at_sustained(flops / seconds),
        # At the board's power limit the step's time follows its energy (bench/benchlib/power.py).
        "power": _per_useful_tflop(meter.result(steps), flops / steps),
        "first_step_s": first_step_s,
        "process_start_to_first_step_s": start + first_step_s - bench.process_start,
        "steps": steps,
        "warmup": args.warmup,
        "skipped_nonfinite_steps": nonfinite,
        "last_loss": records[-1]["loss"] if records else None,
        "recompiles_after_warmup": watch.result()["recompiles"],
        "recompile_reasons": watch.result()["recompile_reasons"],
        "dynamo_frames_compiled_total": frames_compiled_total(),
        "compile_seconds_so_far": compile_seconds(),
    }
    result: dict = {
        "per_rank": {
            str(bench.rank): {
                key: measured[key]
                for key in ("samples_per_s", "ms_per_step", "mfu", "recompiles_after_warmup")
            }
        },
        "drafters": bench.layout.drafters,
        "ddp": bench.layout.drafters > 1,
    }
    if bench.rank == bench.first_drafter:
        result.update(measured)
    return result


def _per_useful_tflop(power: dict, flops_per_step: float) -> dict:
    if "energy_j_per_step" in power:
        power["joules_per_useful_tflop"] = power["energy_j_per_step"] / (flops_per_step / 1e12)
    return power
