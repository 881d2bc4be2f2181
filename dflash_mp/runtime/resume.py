"""Where a job starts: the checkpoint a resume continues from, and what a resumed job may change.

The first drafter picks the checkpoint and every rank starts at its step (`agree_on_start`).

A checkpoint records where the data stands (micro-batches consumed) and everything that decides
which records a micro-batch index holds and which indices a step takes: seed, micro-batch size,
micro-batches per step (grad_accum x drafters), epochs and the data files (paths, sizes, record
count). A resume that would move the data (repeat or skip records) is refused naming the field.
topology.targets, learning rate, logging or max_steps do not move data and may change; drafters
and grad_accum may trade against each other as long as their product stays the same.
"""

from __future__ import annotations

import functools
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

from dflash_mp.config.schema import RootConfig
from dflash_mp.data import Records
from dflash_mp.run import checkpoint
from dflash_mp.run.logs import get_logger
from dflash_mp.runtime.distributed import Job, broadcast_int
from dflash_mp.runtime.topology import Topology

LAYOUT_VERSION = 1


class ResumeRefused(ValueError):
    """A resume would change the data order; the message names the field and the fix."""


def data_files_fingerprint(paths: list[str], num_records: int) -> dict[str, Any]:
    """What identifies the data: absolute paths, sizes in bytes, record count (no content hash:
    reading terabytes at every start would cost more than it catches)."""
    files = []
    for path in paths:
        absolute = os.path.abspath(path)
        files.append({"path": absolute, "bytes": os.path.getsize(absolute)})
    return {"files": files, "records": num_records}


def data_layout(cfg: RootConfig, topology: Topology, data: dict[str, Any], step: int) -> dict:
    """The JSON-able layout of a checkpoint taken after `step` optimizer steps; `data` is
    `data_files_fingerprint(...)`."""
    return {
        "version": LAYOUT_VERSION,
        "micro_batch_index": step * topology.micro_batches_per_step,
        "micro_batch_size": cfg.train.micro_batch_size,
        "seed": cfg.train.seed,
        "grad_accum": topology.grad_accum,
        "drafters": topology.drafters,
        "epochs": cfg.train.epochs,
        # Packed rows depend on the row length too; unpacked, it changes no record's place.
        "packing": cfg.data.max_length if cfg.data.packing else False,
        "data": data,
    }


_SETTING = {
    "micro_batch_size": "train.micro_batch_size",
    "seed": "train.seed",
    "epochs": "train.epochs",
    "grad_accum": "train.grad_accum",
    "drafters": "topology.drafters",
    "packing": "data.packing (with data.max_length)",
}


def _refuse(field: str, old: Any, new: Any, checkpoint: str) -> ResumeRefused:
    return ResumeRefused(
        f"cannot resume from {checkpoint}: {field} was {old} when it was saved and is {new} now, "
        "which would repeat or skip training data. Restore the setting, or start a new run "
        "(another run_dir, train.resume=false)"
    )


def check_settings(saved: dict, current: dict, checkpoint: str) -> list[str]:
    """check_layout's part that needs only the config (no data read): seed, micro-batch size,
    epochs and micro-batches per step. `current["drafters"]` None (not known yet) skips the last."""
    saved = {"packing": False, **saved}  # checkpoints from before data.packing: unpacked
    for key in ("micro_batch_size", "seed", "epochs", "packing"):
        if saved[key] != current[key]:
            raise _refuse(_SETTING[key], saved[key], current[key], checkpoint)
    notes: list[str] = []
    per_step = ("grad_accum", "drafters")
    if current["drafters"] is None:
        return notes
    if saved["grad_accum"] * saved["drafters"] != current["grad_accum"] * current["drafters"]:
        changed = [k for k in per_step if saved[k] != current[k]]
        names = " and ".join(_SETTING[k] for k in changed)
        old = ", ".join(f"{_SETTING[k]}={saved[k]}" for k in per_step)
        new = ", ".join(f"{_SETTING[k]}={current[k]}" for k in per_step)
        raise ResumeRefused(
            f"cannot resume from {checkpoint}: {names} changed ({old} when it was saved, {new} now), "
            "so a step would take another number of micro-batches and the data would be repeated or "
            "skipped. Keep grad_accum x drafters the same, or start a new run (another run_dir, "
            "train.resume=false)"
        )
    if any(saved[k] != current[k] for k in per_step):
        notes.append(
            f"grad_accum x drafters changed from {saved['grad_accum']} x {saved['drafters']} to "
            f"{current['grad_accum']} x {current['drafters']}: same micro-batches per step, same data order"
        )
    return notes


def check_layout(saved: dict | None, current: dict, checkpoint: str) -> list[str]:
    """Raise ResumeRefused if `current` would read the data otherwise than `saved` continues.

    Returns notes on allowed changes for the log. `saved` None (a checkpoint older than the
    layout record) cannot be checked: a note says so.
    """
    if saved is None:
        return [f"{checkpoint} records no data layout (an older checkpoint): the data order is not checked"]
    notes = check_settings(saved, current, checkpoint)
    old_data, new_data = saved["data"], current["data"]
    if old_data["records"] != new_data["records"]:
        raise _refuse(
            "the number of records in data.train_files", old_data["records"], new_data["records"], checkpoint
        )
    old_paths = [f["path"] for f in old_data["files"]]
    new_paths = [f["path"] for f in new_data["files"]]
    if old_paths != new_paths:
        raise _refuse("data.train_files", old_paths, new_paths, checkpoint)
    for old, new in zip(old_data["files"], new_data["files"], strict=True):
        if old["bytes"] != new["bytes"]:
            raise _refuse(f"the size in bytes of {new['path']}", old["bytes"], new["bytes"], checkpoint)
    if saved["micro_batch_index"] != current["micro_batch_index"]:  # a consequence of the above
        raise _refuse(
            "the micro-batch position", saved["micro_batch_index"], current["micro_batch_index"], checkpoint
        )
    return notes


# ------------------------------------------------------------------------------ the start step


def job_data_layout(cfg: RootConfig, topology: Topology, records: Records) -> Callable[[int], dict]:
    """`step -> data layout` of this job; the data files are fingerprinted once, so checkpoints
    record the data as this job found it."""
    return functools.partial(data_layout, cfg, topology, data_files_fingerprint(records.paths, len(records)))


def agree_on_start(
    cfg: RootConfig, job: Job, run_dir: Path, layout_at: Callable[[int], dict], steps: int
) -> tuple[int, checkpoint.TrainingState | None]:
    """(the step every rank starts at, the first drafter's loaded state or None): the first drafter
    picks the checkpoint and broadcasts its step; the other drafters load that same checkpoint
    (`load_resume_state`)."""
    start_step, state = resume_step(cfg, run_dir, layout_at, steps) if job.is_first_drafter else (0, None)
    first_drafter = job.topology.targets
    return broadcast_int(start_step, first_drafter, job.meta_group), state


def resume_step(
    cfg: RootConfig, run_dir: Path, layout_at: Callable[[int], dict], steps: int
) -> tuple[int, checkpoint.TrainingState | None]:
    """The first drafter's resume point: the newest intact checkpoint (a damaged newer one is
    skipped with a warning), after sweeping what killed saves left. `layout_at(step)` is this
    job's data layout at that step; a checkpoint whose recorded layout it contradicts, or that
    leaves none of the job's `steps` to train, is refused before any weights are read."""
    if not cfg.train.resume:
        return 0, None
    log = get_logger()
    root = run_dir / "checkpoints"
    for note in checkpoint.sweep_stale(root):
        log.info("checkpoints: %s", note)
    path = checkpoint.newest_intact(root, log.warning)
    if path is None:
        log.info("train.resume=true but no complete checkpoint in %s: starting at step 0", run_dir)
        return 0, None
    meta = checkpoint.read_meta(path)
    if int(meta["step"]) >= steps:
        raise ResumeRefused(_nothing_left(path, int(meta["step"]), steps, cfg.train.max_steps))
    for note in check_layout(meta.get("data_layout"), layout_at(int(meta["step"])), str(path)):
        log.warning("resume: %s", note)
    state = checkpoint.load(path)
    log.info("resuming from %s (step %d)", path, state.step)
    return state.step, state


def _nothing_left(path: Path, step: int, steps: int, max_steps: int) -> str:
    return (
        f"cannot resume from {path}: it is at step {step} and this job ends at step {steps} "
        f"(train.max_steps={max_steps}), so there is nothing left to train. Raise "
        f"train.max_steps above {step} (or -1 for train.epochs), or start a new run "
        "(another run_dir, train.resume=false)"
    )


def resume_problem(cfg: RootConfig, run_dir: Path, world_size: int | None) -> str | None:
    """What the first drafter would refuse, known before any worker starts from the checkpoints'
    meta.json alone (no weights or data read): no step left to train before train.max_steps, or a
    setting that moves the data. The first drafter still checks all of it (the data files too)."""
    found = checkpoint.complete_checkpoints(run_dir / "checkpoints") if cfg.train.resume else []
    if not found:
        return None
    oldest, newest = _readable_meta(found[0]), _readable_meta(found[-1])
    if oldest is None or newest is None:  # damaged: the first drafter verifies and falls back
        return None
    # Whichever checkpoint the resume picks (the newest intact) is at least as far as the oldest.
    if cfg.train.max_steps > 0 and int(oldest["step"]) >= cfg.train.max_steps:
        return _nothing_left(found[-1], int(newest["step"]), cfg.train.max_steps, cfg.train.max_steps)
    saved = newest.get("data_layout")
    if not isinstance(saved, dict):
        return None
    drafters = cfg.topology.drafters if cfg.topology.drafters is not None else world_size
    current = {
        "micro_batch_size": cfg.train.micro_batch_size,
        "seed": cfg.train.seed,
        "epochs": cfg.train.epochs,
        "packing": cfg.data.max_length if cfg.data.packing else False,
        "grad_accum": cfg.train.grad_accum,
        "drafters": drafters,
    }
    try:
        check_settings(saved, current, str(found[-1]))
    except ResumeRefused as refused:
        return str(refused)
    return None


def _readable_meta(path: Path) -> dict | None:
    try:
        meta = checkpoint.read_meta(path)
        int(meta["step"])
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return meta


def load_resume_state(run_dir: Path, step: int) -> checkpoint.TrainingState:
    """The checkpoint of `step`, the one the first drafter chose and broadcast: the other
    drafters never look up the newest themselves, which could differ (a save or sweep in
    between, a file system that shows them another listing)."""
    path = checkpoint.step_dir(run_dir / "checkpoints", step)
    if not (path / "meta.json").is_file():
        raise FileNotFoundError(
            f"this drafter cannot see {path}, the checkpoint the first drafter resumes from: "
            "run_dir must be on a file system that every drafter rank shares"
        )
    return checkpoint.load(path)
