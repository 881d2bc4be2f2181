"""Hydra jobs as torchrun jobs: a single run, or the points of a `-m` sweep.

A failed sweep point does not end the sweep: each point records its outcome in
SWEEP_DIR/points/<n>.json, the remaining points run, and `SweepSummary` (a Hydra callback, in
conf/config.yaml) prints a table of every point at the end, writes it to SWEEP_DIR/summary.txt and
exits non-zero when any point failed. The records are files, so this holds for launchers that run
points in other processes or on other machines (submitit) too. A point requeued after a
preemption (its run directory holds the PREEMPTED marker) resumes from its checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dflash_mp.launch.launcher import default_run_dir, launch
from dflash_mp.launch.outcome import EXIT_FAILED, EXIT_SUCCEEDED, STATE_OF_EXIT_CODE
from dflash_mp.runtime.watchdog import preempted_marker

POINTS_DIR = "points"
SUMMARY_NAME = "summary.txt"


def launch_from_hydra(dict_cfg: DictConfig) -> int:
    """Turn the current Hydra job (a single run or one point of a sweep) into a torchrun job."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("run_dir=")]
    multirun = hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN"
    if dict_cfg.run_dir:
        run_dir = Path(dict_cfg.run_dir)
    elif multirun:
        run_dir = Path(hydra_cfg.sweep.dir) / str(hydra_cfg.sweep.subdir)
    else:
        run_dir = default_run_dir(dict_cfg.name)
    run_dir = run_dir.resolve()
    if not multirun:
        code = launch(dict_cfg, overrides, run_dir)
        if code != EXIT_SUCCEEDED:
            raise SystemExit(code)
        return code
    if resume_if_preempted(run_dir, dict_cfg, overrides):
        print(f"dflash_mp: sweep point {hydra_cfg.job.num} was preempted: resuming it", flush=True)
    try:
        code = launch(dict_cfg, overrides, run_dir)
    except Exception as e:  # the launcher itself failed: this point fails, the sweep goes on
        print(f"dflash_mp: sweep point {hydra_cfg.job.num} failed: {type(e).__name__}: {e}", file=sys.stderr)
        code = EXIT_FAILED
    record_point(Path(hydra_cfg.sweep.dir), int(hydra_cfg.job.num), overrides, code, run_dir)
    return code


def resume_if_preempted(run_dir: Path, dict_cfg: DictConfig, overrides: list[str]) -> bool:
    """A point requeued after a preemption (submitit runs it again with the same overrides)
    continues from its checkpoint instead of being refused as a fresh start in a used run_dir."""
    if dict_cfg.train.resume or not preempted_marker(run_dir).exists():
        return False
    overrides.append("train.resume=true")
    dict_cfg.train.resume = True
    return True


def record_point(sweep_dir: Path, num: int, overrides: list[str], code: int, run_dir: Path) -> None:
    points = sweep_dir / POINTS_DIR
    points.mkdir(parents=True, exist_ok=True)
    # From the exit code, not job.json: a point refused a taken run_dir must not report that job.
    outcome = STATE_OF_EXIT_CODE.get(code, "failed")
    record = {
        "point": num,
        "overrides": overrides,
        "outcome": outcome,
        "exit_code": code,
        "run_dir": str(run_dir),
    }
    (points / f"{num}.json").write_text(json.dumps(record))


def read_points(sweep_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in (sweep_dir / POINTS_DIR).glob("*.json"):
        try:
            records.append(json.loads(path.read_text()))
        except (OSError, ValueError):
            continue
    return sorted(records, key=lambda r: r["point"])


def summary_table(records: list[dict[str, Any]]) -> str:
    rows = [("point", "outcome", "exit", "run_dir", "overrides")]
    rows += [
        (str(r["point"]), r["outcome"], str(r["exit_code"]), r["run_dir"], " ".join(r["overrides"]))
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(4)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[4] for row in rows
    )


class SweepSummary(Callback):
    """At the end of a `-m` sweep: every point's outcome, and a non-zero exit if any failed."""

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(config.hydra.sweep.dir)
        records = read_points(sweep_dir)
        if not records:
            return
        failed = [r for r in records if r["exit_code"] != EXIT_SUCCEEDED]
        table = summary_table(records)
        verdict = (
            f"{len(failed)} of {len(records)} point(s) failed"
            if failed
            else f"all {len(records)} point(s) succeeded"
        )
        text = f"sweep {sweep_dir}: {verdict}\n{table}\n"
        (sweep_dir / SUMMARY_NAME).write_text(text)
        print(text, end="", flush=True)
        if failed:
            raise SystemExit(EXIT_FAILED)
