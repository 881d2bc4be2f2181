"""What a resumed job may change: the data layout a checkpoint records and the check against it.

A checkpoint records where the data stands (micro-batches consumed) and everything that decides
which records a micro-batch index holds and which indices a step takes: seed, micro-batch size,
micro-batches per step (grad_accum x drafters), epochs and the data files (paths, sizes, record
count). A resume that would move the data (repeat or skip records) is refused naming the field.
topology.targets, learning rate, logging or max_steps do not move data and may change; drafters
and grad_accum may trade against each other as long as their product stays the same.
"""

from __future__ import annotations

import os
from typing import Any

from dflash_mp.config.schema import RootConfig
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
        "data": data,
    }


_SETTING = {
    "micro_batch_size": "train.micro_batch_size",
    "seed": "train.seed",
    "epochs": "train.epochs",
    "grad_accum": "train.grad_accum",
    "drafters": "topology.drafters",
}


def _refuse(field: str, old: Any, new: Any, checkpoint: str) -> ResumeRefused:
    return ResumeRefused(
        f"cannot resume from {checkpoint}: {field} was {old} when it was saved and is {new} now, "
        "which would repeat or skip training data. Restore the setting, or start a new run "
        "(another run_dir, train.resume=false)"
    )


def check_layout(saved: dict | None, current: dict, checkpoint: str) -> list[str]:
    """Raise ResumeRefused if `current` would read the data otherwise than `saved` continues.

    Returns notes on allowed changes for the log. `saved` None (a checkpoint older than the
    layout record) cannot be checked: a note says so.
    """
    if saved is None:
        return [f"{checkpoint} records no data layout (an older checkpoint): the data order is not checked"]
    for key in ("micro_batch_size", "seed", "epochs"):
        if saved[key] != current[key]:
            raise _refuse(_SETTING[key], saved[key], current[key], checkpoint)
    notes = []
    per_step = ("grad_accum", "drafters")
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
