"""Hydra jobs as torchrun jobs: a single run, or the points of a `-m` sweep.

Each point of a sweep runs in a directory of its own under the sweep directory (the given
run_dir, else $DFLASH_SWEEP_DIR or runs/sweep-<time>), named by its index and swept overrides
(sweep_points.py); a sweep some point of which could not start there is refused before any
point starts. A failed point does not end the sweep: each point records its outcome, final loss
and tau in SWEEP_DIR/points/<n>.json, the remaining points run, and `SweepSummary` (a Hydra
callback, in conf/config.yaml) prints a table of every point at the end, writes it to
SWEEP_DIR/summary.txt beside the points and exits non-zero when any point failed. The records are
files, so this holds for launchers that run points in other processes or on other machines
(submitit) too. A point requeued after a preemption (its run directory holds the PREEMPTED
marker) resumes from its checkpoint.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

from hydra.experimental.callback import Callback
from omegaconf import DictConfig

from dflash_mp.launch.launcher import default_run_dir, launch
from dflash_mp.launch.outcome import EXIT_FAILED, EXIT_PREFLIGHT, EXIT_SUCCEEDED, STATE_OF_EXIT_CODE
from dflash_mp.launch.sweep_points import (
    POINTS_DIR,
    direct_points,
    final_numbers,
    register_resolvers,
    sweep_problems,
    swept_keys,
)
from dflash_mp.runtime.watchdog import preempted_marker

SUMMARY_NAME = "summary.txt"
# A sweep's points name their directories through a resolver (sweep_points.direct_points): Hydra
# imports this module, its callback, before any point, wherever the point runs (submitit too).
register_resolvers()


def launch_from_hydra(dict_cfg: DictConfig) -> int:
    """Turn the current Hydra job (a single run or one point of a sweep) into a torchrun job."""
    from hydra.core.hydra_config import HydraConfig

    hydra_cfg = HydraConfig.get()
    overrides = [o for o in hydra_cfg.overrides.task if not o.startswith("run_dir=")]
    multirun = hydra_cfg.mode is not None and hydra_cfg.mode.name == "MULTIRUN"
    if not multirun:
        run_dir = Path(dict_cfg.run_dir) if dict_cfg.run_dir else default_run_dir(dict_cfg.name)
        code = launch(dict_cfg, overrides, run_dir.resolve())
        if code != EXIT_SUCCEEDED:
            raise SystemExit(code)
        return code
    # The point's own directory under the sweep directory (a given run_dir is that parent).
    run_dir = Path(hydra_cfg.runtime.output_dir).resolve()
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
        **final_numbers(run_dir),
    }
    (points / f"{num}.json").write_text(json.dumps(record))


def read_points(sweep_dir: Path) -> list[dict[str, Any]]:
    records = []
    for path in (sweep_dir / POINTS_DIR).glob("*.json"):
        try:
            record = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(record, dict) and "point" in record:  # not the swept keys' file
            records.append(record)
    return sorted(records, key=lambda r: r["point"])


def _number(value: Any, digits: int) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def summary_table(records: list[dict[str, Any]]) -> str:
    rows = [("point", "outcome", "exit", "loss", "tau", "run_dir", "overrides")]
    rows += [
        (
            str(r["point"]),
            r["outcome"],
            str(r["exit_code"]),
            _number(r.get("final_loss"), 4),
            _number(r.get("last_tau"), 2),
            r["run_dir"],
            " ".join(r["overrides"]),
        )
        for r in records
    ]
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=False)) + "  " + row[-1]
        for row in rows
    )


class SweepSummary(Callback):
    """Before a `-m` sweep: every point's directory checked; at its end: every point's outcome,
    final loss and tau, and a non-zero exit if any failed."""

    def on_multirun_start(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.get("run_dir") or config.hydra.sweep.dir)).resolve()
        swept = swept_keys(config)
        problems = sweep_problems(config, sweep_dir, swept)
        if problems:
            text = "\n".join(f"  - {p}" for p in problems)
            print(f"dflash_mp: sweep refused, no point was started:\n{text}", file=sys.stderr, flush=True)
            raise SystemExit(EXIT_PREFLIGHT)
        direct_points(config, sweep_dir, swept)
        print(
            f"dflash_mp: sweep of {', '.join(swept) or 'one point'}: points run under {sweep_dir}", flush=True
        )

    def on_multirun_end(self, config: DictConfig, **kwargs: Any) -> None:
        sweep_dir = Path(str(config.hydra.sweep.dir)).resolve()
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
