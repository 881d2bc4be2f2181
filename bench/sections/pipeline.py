"""The real pipeline: run_target on rank 0 and run_drafter on rank 1 (the runtime's code), with
device-timeline marks that give each stage's busy and wait fractions.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import benchlib as bl
import torch

from dflash_mp.roles import run_drafter, run_target
from dflash_mp.trainer import DrafterTrainer

if TYPE_CHECKING:
    from bench import Bench

TIMEOUT_S = 300


class TimedExtractor:
    """The target's extractor, with a device-timeline mark before and after every forward."""

    def __init__(self, extractor, device: torch.device, on_call=None) -> None:
        self.extractor = extractor
        self.hidden_size, self.layer_ids = extractor.hidden_size, extractor.layer_ids
        self.marks = bl.Marks(device)
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
    is in (after the receive's stream wait) and where its optimizer step ends. In between the
    drafter is busy; outside it waits for data."""

    def __init__(self, trainer: DrafterTrainer, device: torch.device, on_call=None) -> None:
        self.trainer = trainer
        self.marks = bl.Marks(device)
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

    def optimizer_step(self, extra: dict | None = None) -> dict:
        record = self.trainer.optimizer_step(extra)
        self.steps.append((self._start, self.marks.mark()))
        self._start = None
        return record


def busy_fraction(marks: bl.Marks, intervals: list[tuple[int, int]]) -> tuple[float, float]:
    """(busy seconds, span seconds) over `intervals` of `marks`."""
    busy = sum(marks.seconds(a, b) for a, b in intervals)
    return busy, marks.seconds(intervals[0][0], intervals[-1][1])


def run(bench: Bench) -> dict:
    args, warmup = bench.args, bench.args.warmup
    steps = warmup + args.pipeline_steps
    start = time.perf_counter()
    if bench.rank == 0:
        extractor = TimedExtractor(bench.extractor, bench.device, on_call=bench.fault_at("pipeline"))
        run_target(bench.cfg, bench.job, 0, steps, bench.reader, extractor, bench.dtype)
        bl.sync(bench.device)
        busy, span = busy_fraction(extractor.marks, extractor.calls[warmup * bench.A :])
        return {
            "target_busy_frac": busy / span,
            "target_wait_frac": 1 - busy / span,
            "target_forward_time": bl.distribution(
                [extractor.marks.seconds(a, b) for a, b in extractor.calls[warmup * bench.A :]]
            ),
            "target_elapsed_s": time.perf_counter() - start,
        }
    trainer = RecordingTrainer(bench.trainer, bench.device, on_call=bench.fault_at("pipeline"))
    records, stamps = [], []
    watch = bl.CompileWatch()

    def on_step(record: dict) -> None:
        records.append(record)
        stamps.append(time.perf_counter())
        if len(records) == 1:
            bench.log(f"pipeline: first step after {stamps[0] - start:.1f}s")
        if len(records) == warmup:
            watch.start()

    run_drafter(bench.cfg, bench.job, trainer, 0, steps, on_step)
    bl.sync(bench.device)
    measured = len(stamps) - warmup
    window = stamps[-1] - stamps[warmup - 1]
    samples_per_s = measured * bench.A * bench.B / window
    busy, span = busy_fraction(trainer.marks, trainer.steps[warmup:])
    last = records[-1]
    return {
        "samples_per_s": samples_per_s,
        "tokens_per_s": samples_per_s * bench.S,
        "ms_per_step": window / measured * 1e3,
        "steps": measured,
        "warmup": warmup,
        "step_time": bl.distribution(
            [b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:], strict=False)]
        ),
        "time_to_first_step_s": stamps[0] - start,
        "drafter_busy_frac": busy / span,
        "drafter_wait_frac": 1 - busy / span,
        "runtime_reported": {
            k: last.get(k)
            for k in ("drafter_busy_frac", "drafter_wait_frac", "target_busy_frac", "target_wait_frac")
        },
        "recompiles_after_warmup": watch.result()["recompiles"],
        "recompile_reasons": watch.result()["recompile_reasons"],
        "skipped_nonfinite_steps": sum(bool(r["skipped"]) for r in records[warmup:]),
    }
