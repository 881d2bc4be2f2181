"""Where the points of a `-m` sweep run, and what a point's run left: its final loss and tau.

The sweep directory is the given `run_dir` (else hydra.sweep.dir: $DFLASH_SWEEP_DIR, else
runs/sweep-<time>): each point runs in a directory of its own under it, named by its index and its
swept overrides (`1_optim.lr-0.003`), and the summary is written beside them. The sweep callback
sets this up when the sweep starts (`direct_points`: Hydra's own directory for a point is the
point's run directory), after checking every point's directory (`sweep_problems`): a sweep that
cannot run all its points is refused before the first one starts, by the rules a single run is
refused by.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from omegaconf import DictConfig, OmegaConf, open_dict, read_write

from dflash_mp.run.rundir import RunDirBusy, earlier_run, fresh_start_problem, lock_run_dir
from dflash_mp.runtime.watchdog import preempted_marker

POINTS_DIR = "points"  # one JSON record per point, beside the points' run directories
POINT_RESOLVER = "dflash_sweep_point"
MAX_NAME = 100  # characters of a point's directory name
# What Hydra reads unquoted in `run_dir=...` (a point's path goes to the ranks as an override).
_UNSAFE = re.compile(r"[^A-Za-z0-9._+-]")
_TRUE = ("true", "True", "1", "yes")


def point_name(num: int, overrides: Iterable[str], swept: Iterable[str]) -> str:
    """`<num>_<key>-<value>_...` for the swept overrides of point `num`, safe in a path and an override."""
    keys = set(swept)
    parts = [str(num)]
    for override in overrides:
        key, _, value = override.partition("=")
        if key.lstrip("+~") in keys:
            parts.append(f"{key.lstrip('+~')}-{value}")
    return _UNSAFE.sub("_", "_".join(parts))[:MAX_NAME]


def _point_subdir(*swept: str, _root_: DictConfig) -> str:
    """hydra.sweep.subdir of the job being launched: its index and swept overrides."""
    hydra = _root_.hydra
    return point_name(int(hydra.job.num), list(hydra.overrides.task), swept)


def register_resolvers() -> None:
    if not OmegaConf.has_resolver(POINT_RESOLVER):
        OmegaConf.register_new_resolver(POINT_RESOLVER, _point_subdir)


def direct_points(config: DictConfig, sweep_dir: Path, swept: list[str]) -> None:
    """Make every point of the sweep about to start run in `sweep_dir`/<its name>: set in the
    sweep's config (what the sweeper and launcher read) and added to its Hydra overrides (what each
    point's config is composed with)."""
    quoted = "'" + str(sweep_dir).replace("\\", "\\\\").replace("'", "\\'") + "'"
    subdir = "${" + POINT_RESOLVER + ":" + ",".join(swept) + "}"  # the keys are dotted names
    with read_write(config.hydra), open_dict(config.hydra):
        config.hydra.sweep.dir = str(sweep_dir)
        config.hydra.sweep.subdir = subdir
        config.hydra.overrides.hydra.extend([f"hydra.sweep.dir={quoted}", f"hydra.sweep.subdir='{subdir}'"])


# ------------------------------------------------------------------------------ the plan, checked


def swept_keys(config: DictConfig) -> list[str]:
    """Keys the sweep varies: sweep overrides on the command line and the sweeper's params."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    params = config.hydra.sweeper.get("params") or {}
    parsed = OverridesParser.create().parse_overrides(list(config.hydra.overrides.task))
    keys = [o.get_key_element().lstrip("+~") for o in parsed if o.is_sweep_override()]
    return keys + [str(key) for key in params if key not in keys]


def planned_points(config: DictConfig) -> list[list[str]] | None:
    """Every point's overrides, as Hydra's basic sweeper will make them; None for another sweeper
    (its points are known only as it runs them, and each is checked when it starts)."""
    from hydra._internal.core_plugins.basic_sweeper import BasicSweeper
    from hydra.core.override_parser.overrides_parser import OverridesParser

    if not str(config.hydra.sweeper.get("_target_", "")).endswith("BasicSweeper"):
        return None
    params = [f"{key}={value}" for key, value in (config.hydra.sweeper.get("params") or {}).items()]
    parsed = OverridesParser.create().parse_overrides(params + list(config.hydra.overrides.task))
    return [point for batch in BasicSweeper.split_arguments(parsed, None) for point in batch]


def _flag(overrides: list[str], key: str, default: bool) -> bool:
    for override in reversed(overrides):
        name, _, value = override.partition("=")
        if name.lstrip("+") == key:
            return value in _TRUE
    return default


def point_problem(run_dir: Path, overrides: list[str], config: DictConfig) -> str | None:
    """Why a point could not start in `run_dir` (the rules of a single run); None when it can."""
    if not run_dir.is_dir():
        return None
    resume = _flag(overrides, "train.resume", bool(config.train.resume))
    overwrite = _flag(overrides, "train.overwrite", bool(config.train.get("overwrite", False)))
    if preempted_marker(run_dir).exists():
        resume = True  # a requeued point resumes from its checkpoint (sweep.resume_if_preempted)
    if (run_dir / "job.lock").exists():
        try:
            lock_run_dir(run_dir).release()
        except RunDirBusy as e:
            return str(e)
    return fresh_start_problem(run_dir, resume, overwrite)


def sweep_problems(config: DictConfig, sweep_dir: Path, swept: list[str]) -> list[str]:
    """Every reason the sweep cannot run all its points, found before the first one starts."""
    if "run_dir" in swept:
        return ["run_dir cannot be swept: it is the directory the sweep's points run in, one under it each"]
    if found := earlier_run(sweep_dir):
        return [
            f"run_dir={sweep_dir} holds a run ({', '.join(found)}): in a sweep, run_dir is the "
            "directory the points run in, one under it each; choose another run_dir"
        ]
    points = planned_points(config) or []
    named = ((num, point, sweep_dir / point_name(num, point, swept)) for num, point in enumerate(points))
    problems = [(num, point_problem(path, point, config)) for num, point, path in named]
    return [f"point {num}: {problem}" for num, problem in problems if problem]


# ------------------------------------------------------------------------------ a point's results


def final_numbers(run_dir: Path) -> dict[str, Any]:
    """The last loss and the last tau in run_dir/metrics.jsonl (None where none was logged)."""
    numbers: dict[str, Any] = {"final_loss": None, "last_tau": None, "last_step": None}
    try:
        with open(run_dir / "metrics.jsonl", encoding="utf-8") as f:
            for line in f:
                _take(numbers, line)
    except OSError:
        pass
    return numbers


def _take(numbers: dict[str, Any], line: str) -> None:
    try:
        record = json.loads(line)
    except ValueError:  # a line cut short by a kill
        return
    if not isinstance(record, dict):
        return
    if isinstance(record.get("loss"), (int, float)):  # null: a skipped step
        numbers["final_loss"], numbers["last_step"] = record["loss"], record.get("step")
    if isinstance(record.get("tau"), (int, float)):
        numbers["last_tau"] = record["tau"]
