"""The real pipeline: run_target on every target rank and run_drafter on every drafter rank (the
runtime's code, over the bench's layout: tensor-parallel replicas, DDP among the drafters), with
device-timeline marks that give each stage's busy and wait fractions.

samples_per_s is the whole layout's rate (the drafters step together, each on A x B samples);
the first target's and the first drafter's details are at the top, every rank's under per_rank.
"""

from __future__ import annotations

import time

import torch
from benchlib.compile_watch import CompileWatch
from benchlib.state import BenchState
from benchlib.timing import Marks, count_nonfinite, distribution, sync

from dflash_mp.runtime.roles import run_drafter, run_target
from dflash_mp.training.trainer import DrafterTrainer

TIMEOUT_S = 300


class TimedExtractor:
    """The target's extractor, with a device-timeline mark before and after every forward."""

    def __init__(self, extractor, device: torch.device, on_call=None) -> None:
        self.extractor = extractor
        self.hidden_size, self.layer_ids = extractor.hidden_size, extractor.layer_ids
        self.marks = Marks(device)
        self.calls: list[tuple[int, int]] = []
        self.on_call = on_call

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.on_call is not None:
            self.on_call(len(self.calls) + 1)
        start = self.marks.mark()
        out = self.extractor(input_ids)
        self.calls.append((start, self.marks.mark()))
        return out


class RecordingTrainer:
    """DrafterTrainer as run_drafter sees it, plus a device-timeline mark where each step's data
    is in (after the receive's stream wait) and where its optimizer step has queued the update
    (the next step's first receive follows). In between the drafter is busy; outside it waits."""

    def __init__(self, trainer: DrafterTrainer, device: torch.device, on_call=None) -> None:
        self.trainer = trainer
        self.marks = Marks(device)
        self.steps: list[tuple[int, int]] = []
        self._start: int | None = None
        self.on_call = on_call
        self.micro_steps = 0

    @property
    def step(self) -> int:
        return self.trainer.step

    @property
    def stop_agreed(self) -> bool:
        return self.trainer.stop_agreed

    def micro_step(self, batch, last_of_step: bool) -> None:
        self.micro_steps += 1
        if self.on_call is not None:
            self.on_call(self.micro_steps)
        if self._start is None:
            self._start = self.marks.mark()
        self.trainer.micro_step(batch, last_of_step=last_of_step)

    def prepare(self, batch):
        return self.trainer.prepare(batch)

    def optimizer_step(self, extra: dict | None = None, while_waiting=None) -> dict:
        ends = []

        def waiting() -> None:  # the update is queued: the step's work ends here, the next receive follows
            ends.append(self.marks.mark())
            if while_waiting is not None:
                while_waiting()

        record = self.trainer.optimizer_step(extra, waiting)
        self.steps.append((self._start, ends[0]))
        self._start = None
        return record


def busy_fraction(marks: Marks, intervals: list[tuple[int, int]]) -> tuple[float, float]:
    """(busy seconds, span seconds) over `intervals` of `marks`."""
    busy = sum(marks.seconds(a, b) for a, b in intervals)
    return busy, marks.seconds(intervals[0][0], intervals[-1][1])


def run(bench: BenchState) -> dict:
    if "target" in bench.roles:
        return _run_target(bench)
    return _run_drafter(bench)


def _run_target(bench: BenchState) -> dict:
    args, warmup = bench.args, bench.args.warmup
    steps = warmup + args.pipeline_steps
    start = time.perf_counter()
    topology = bench.job.topology
    # This replica's forwards during the warm-up steps: recompiles are counted after them.
    warm_calls = len(
        topology.micro_batches_of_target(bench.rank, 0, warmup * topology.micro_batches_per_step)
    )
    watch = CompileWatch()
    fault = bench.fault_at("pipeline")

    def on_call(call: int) -> None:
        fault(call)
        if call == warm_calls + 1:
            watch.start()

    extractor = TimedExtractor(bench.extractor, bench.device, on_call=on_call)
    run_target(bench.cfg, bench.job, 0, steps, bench.reader, extractor, bench.dtype)
    sync(bench.device)
    busy, span = busy_fraction(extractor.marks, extractor.calls[warm_calls:])
    measured = {
        "target_busy_frac": busy / span,
        "target_wait_frac": 1 - busy / span,
        "target_forward_time": distribution(
            [extractor.marks.seconds(a, b) for a, b in extractor.calls[warm_calls:]]
        ),
        "target_elapsed_s": time.perf_counter() - start,
        "target_recompiles_after_warmup": watch.result()["recompiles"],
    }
    result: dict = {
        "per_rank": {
            str(bench.rank): {
                key: measured[key]
                for key in ("target_busy_frac", "target_wait_frac", "target_recompiles_after_warmup")
            }
        }
    }
    if bench.rank == 0:
        result.update(measured)
    return result


def _run_drafter(bench: BenchState) -> dict:
    args, warmup = bench.args, bench.args.warmup
    steps = warmup + args.pipeline_steps
    start = time.perf_counter()
    trainer = RecordingTrainer(bench.trainer, bench.device, on_call=bench.fault_at("pipeline"))
    records, stamps = [], []
    watch = CompileWatch()

    def on_step(record: dict) -> None:
        records.append(record)
        stamps.append(time.perf_counter())
        if len(records) == 1:
            bench.log(f"pipeline: first step after {stamps[0] - start:.1f}s")
        if len(records) == warmup:
            watch.start()

    run_drafter(bench.cfg, bench.job, trainer, 0, steps, on_step)
    sync(bench.device)
    measured = len(stamps) - warmup
    window = stamps[-1] - stamps[warmup - 1]
    per_drafter = measured * bench.A * bench.B / window
    # Every drafter trains on its own A x B samples per step, in lockstep (DDP).
    samples_per_s = per_drafter * bench.layout.drafters
    busy, span = busy_fraction(trainer.marks, trainer.steps[warmup:])
    last = records[-1]
    mine = {
        "samples_per_s": per_drafter,
        "drafter_busy_frac": busy / span,
        "drafter_wait_frac": 1 - busy / span,
        "recompiles_after_warmup": watch.result()["recompiles"],
    }
    result: dict = {"per_rank": {str(bench.rank): mine}}
    if bench.rank != bench.first_drafter:
        return result
    result.update(
        samples_per_s=samples_per_s,
        samples_per_s_per_drafter=per_drafter,
        tokens_per_s=samples_per_s * bench.S,
        ms_per_step=window / measured * 1e3,
        steps=measured,
        warmup=warmup,
        layout=bench.layout.name,
        drafters=bench.layout.drafters,
        replicas=bench.layout.replicas,
        step_time=distribution([b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:], strict=False)]),
        time_to_first_step_s=stamps[0] - start,
        drafter_busy_frac=mine["drafter_busy_frac"],
        drafter_wait_frac=mine["drafter_wait_frac"],
        runtime_reported={
            k: last.get(k)
            for k in ("drafter_busy_frac", "drafter_wait_frac", "target_busy_frac", "target_wait_frac")
        },
        recompiles_after_warmup=mine["recompiles_after_warmup"],
        recompile_reasons=watch.result()["recompile_reasons"],
        skipped_nonfinite_steps=count_nonfinite("pipeline", records[warmup:]),
    )
    return result
