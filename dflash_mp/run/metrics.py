"""Per-step metrics: metrics.jsonl, a console progress line with ETA, optional wandb.

All of it lives on the first drafter rank only. metrics.jsonl is strict JSON: a non-finite
number (a NaN loss of a skipped step) is written as null, which every JSON reader accepts.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import re
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_mp.run.logs import get_logger


def truncate_metrics(path: Path, last_step: int) -> None:
    """Drop lines past `last_step` (a resumed run rewrites the steps after its checkpoint)."""
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if json.loads(line)["step"] <= last_step:
                kept.append(line)
        except (ValueError, KeyError):
            continue  # a line cut short by a kill
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(f"{line}\n" for line in kept))
    os.replace(tmp, path)


class MetricsWriteError(OSError):
    """metrics.jsonl could not be written; the message names the file, the cause and what is kept."""


def finite_or_null(value: Any) -> Any:
    """`value` with every NaN and infinity (also inside lists and dicts) replaced by None."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, list):
        return [finite_or_null(v) for v in value]
    if isinstance(value, dict):
        return {k: finite_or_null(v) for k, v in value.items()}
    return value


class NothingTrained(RuntimeError):
    """Every optimizer step of the job was skipped: the drafter learned nothing."""


class StepTally:
    """Which of a job's optimizer steps applied an update, so that one that applied none fails."""

    def __init__(self) -> None:
        self.steps: list[int] = []
        self.skipped: Counter = Counter()  # skip_reason -> steps

    def add(self, record: dict[str, Any]) -> None:
        self.steps.append(record["step"])
        if record.get("skipped"):
            self.skipped[record.get("skip_reason")] += 1

    def require_training(self) -> None:
        if not self.steps or sum(self.skipped.values()) < len(self.steps):
            return
        reasons = ", ".join(f"{reason}: {count}" for reason, count in self.skipped.most_common())
        raise NothingTrained(
            f"trained nothing: all {len(self.steps)} steps of this job (steps {self.steps[0]} to "
            f"{self.steps[-1]}) were skipped ({reasons}), so no update was applied. no_loss_tokens: the "
            "records had no loss token (bad or unreadable data: `python -m dflash_mp.launch doctor` "
            "reads a sample and names file:line); nonfinite: check the target's hidden states and optim.lr"
        )


class MetricsLogger:
    def __init__(
        self, run_dir: str | Path, total_steps: int, first_step: int, logger_cfg, config: dict
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        truncate_metrics(self.path, first_step)
        self.file = open(self.path, "a")  # noqa: SIM115 - held open for the run
        self.last_written = first_step
        self.total_steps = total_steps
        self.first_step = first_step
        self.start = time.perf_counter()
        self.progress_every = max(1, int(logger_cfg.progress_every))
        self.wandb = None
        if logger_cfg.backend == "wandb":
            self.wandb = _init_wandb(run_dir, logger_cfg, config)

    def log(self, record: dict[str, Any]) -> None:
        try:
            self.file.write(json.dumps(finite_or_null(record), allow_nan=False) + "\n")
            self.file.flush()
        except OSError as error:
            raise self._write_failure(record["step"], error) from error
        self.last_written = record["step"]
        if self.wandb is not None:
            flat = {k: v for k, v in record.items() if isinstance(v, (int, float))}
            for key, values in record.items():  # per-position lists: acc, and DFlash 2's selector metrics
                if isinstance(values, list):
                    flat.update({f"{key}/pos{k + 1}": v for k, v in enumerate(values)})
            self.wandb.log(flat, step=record["step"])
        step = record["step"]
        if step % self.progress_every == 0 or step == self.total_steps:
            self._progress(record)

    def _progress(self, record: dict[str, Any]) -> None:
        done = record["step"] - self.first_step
        elapsed = time.perf_counter() - self.start
        eta = elapsed / max(done, 1) * (self.total_steps - record["step"])
        width = 24
        filled = int(width * record["step"] / max(self.total_steps, 1))
        bar = "#" * filled + "-" * (width - filled)
        loss = "-" if record["loss"] is None else f"{record['loss']:.4f}"  # None: a skipped step
        line = (
            f"[{bar}] step {record['step']}/{self.total_steps} loss {loss} "
            f"lr {record['lr']:.2e} {record['samples_per_s']:.1f} rows/s {record.get('tokens_per_s', 0):.0f} tokens/s "
            f"ETA {time.strftime('%H:%M:%S', time.gmtime(eta))}"
        )
        if "peak_memory_gib" in record:
            line += f" peak {record['peak_memory_gib']:.1f} GiB"
        if record.get("slow_paths"):  # fused kernels turned off (their warning is in the rank's log)
            line += f" SLOW: {record['slow_paths']} on the torch path"
        if sys.stderr.isatty():
            print(
                "\r" + line,
                end="" if record["step"] < self.total_steps else "\n",
                file=sys.stderr,
                flush=True,
            )
        else:
            get_logger().info(line)

    def _write_failure(self, step: int, error: OSError) -> MetricsWriteError:
        from dflash_mp.run.rundir import write_error_cause

        checkpoints = sorted(p.name for p in self.path.parent.glob("checkpoints/step_*"))
        kept = f"checkpoints up to {checkpoints[-1]}" if checkpoints else "no checkpoint yet"
        return MetricsWriteError(
            f"cannot write step {step} to {self.path}: {write_error_cause(error, self.path.parent)}. "
            f"Kept: {self.path.name} through step {self.last_written}, {kept}. Free space (or raise "
            "the quota or limit), then continue with train.resume=true"
        )

    def close(self) -> None:
        self.file.close()
        if self.wandb is not None:
            self.wandb.finish()


def _init_wandb(run_dir, logger_cfg, config: dict):
    try:
        import wandb
    except ImportError as e:
        raise RuntimeError("logger=wandb needs the wandb package: pip install 'dflash_mp[wandb]'") from e
    # The API key stays in the environment (WANDB_API_KEY / ~/.netrc); nothing here writes it.
    return wandb.init(
        project=logger_cfg.project,
        mode=logger_cfg.mode,
        dir=str(run_dir),
        config=config,
        name=Path(run_dir).name,
        resume="allow",
        id=wandb_run_id(run_dir),
    )


def wandb_run_id(run_dir: str | Path) -> str:
    """The same id for every attempt of one run directory (a resume continues the wandb run), and
    different ids for directories of the same name (sweep points `.../0` of different sweeps)."""
    path = Path(run_dir).resolve()
    digest = hashlib.sha256(str(path).encode()).hexdigest()[:16]
    name = re.sub(r"[^A-Za-z0-9_-]", "_", path.name)[:48]
    return f"{name}-{digest}"
