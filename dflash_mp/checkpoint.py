"""Atomic, resumable checkpoints of the drafter's training state.

Layout: run_dir/checkpoints/step_00000120/{drafter.safetensors, optimizer.pt, meta.json}.
A checkpoint is written into a hidden temporary directory, every file fsynced, and only
then renamed to its final name (rename is atomic on POSIX), so a crash mid-save never
leaves a directory that looks whole but is not. meta.json is written last and names the
step and the data layout (dflash_mp.resume); a directory without a readable meta.json is not a
checkpoint.

Re-saving a step moves the old directory aside before the rename and deletes it after, so a kill
in between loses nothing: `sweep_stale` (at every save and at resume) puts such a directory back
and deletes temporary directories of saves that were killed. One job writes a run's checkpoints
(its first drafter), so every temporary directory but the one being written is stale.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-step_"
_ASIDE = re.compile(r"^\.replaced-(step_\d{8})-\d+$")
FORMAT = 2  # 2: meta.json holds the data layout


@dataclass
class TrainingState:
    step: int  # optimizer steps completed; also the data position (step * A * D micro-batches)
    model: dict[str, torch.Tensor]
    optimizer: dict
    rng: dict


def fsync_path(path: Path) -> None:
    """Flush a file's or a directory's entry to disk (before a rename makes it visible)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": list(random.getstate()[1])}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def restore_rng(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    version, _, gauss = random.getstate()
    random.setstate((version, tuple(int(x) for x in state["python"]), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def step_dir(checkpoint_dir: str | Path, step: int) -> Path:
    return Path(checkpoint_dir) / f"step_{step:08d}"


def save(
    checkpoint_dir: str | Path, state: TrainingState, keep: int, data_layout: dict | None = None
) -> Path:
    """Write `state` atomically as step_<step>; keep the newest `keep` checkpoints.

    `data_layout` (dflash_mp.resume.data_layout) goes into meta.json for the resume check.
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, state.step)
    tmp = root / f"{_TMP_PREFIX}{state.step:08d}-{os.getpid()}"
    sweep_stale(root)
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model = {k: v.detach().to("cpu").contiguous() for k, v in state.model.items()}
    save_file(model, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": state.optimizer, "rng": state.rng}, tmp / "optimizer.pt")
    meta = {"step": state.step, "format": FORMAT, "data_layout": data_layout}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for name in ("drafter.safetensors", "optimizer.pt", "meta.json"):
        fsync_path(tmp / name)
    fsync_path(tmp)
    aside = None
    if final.exists():  # a re-save of the same step (e.g. after a resume) replaces the old one
        aside = root / f".replaced-{final.name}-{os.getpid()}"
        shutil.rmtree(aside, ignore_errors=True)
        os.rename(final, aside)
    os.rename(tmp, final)
    fsync_path(root)
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    for old in complete_checkpoints(root)[:-keep]:
        # Renamed first: a deletion cut short leaves a directory that the next sweep removes.
        doomed = root / f".tmp-{old.name}-deleted-{os.getpid()}"
        os.rename(old, doomed)
        shutil.rmtree(doomed, ignore_errors=True)
    return final


def sweep_stale(checkpoint_dir: str | Path) -> list[str]:
    """Finish what killed saves left: put a moved-aside checkpoint back where its step is
    missing, delete the rest (temporary directories, superseded copies). Returns what it did."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    done = []
    for path in sorted(root.iterdir()):
        aside = _ASIDE.match(path.name)
        if aside is not None:
            final = root / aside.group(1)
            if not final.exists() and _is_complete(path, final.name):
                os.rename(path, final)
                fsync_path(root)
                done.append(f"restored {final.name} from {path.name}")
                continue
        elif not path.name.startswith(_TMP_PREFIX):
            continue
        shutil.rmtree(path, ignore_errors=True)
        done.append(f"deleted {path.name}")
    return done


def _is_complete(path: Path, name: str) -> bool:
    """Whether `path` holds a whole checkpoint of the step that `name` (step_XXXXXXXX) names."""
    match = _NAME.match(name)
    if not match or not (path / "drafter.safetensors").is_file() or not (path / "optimizer.pt").is_file():
        return False
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError):
        return False
    return isinstance(meta, dict) and meta.get("step") == int(match.group(1))


def complete_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = [path for path in root.iterdir() if _is_complete(path, path.name)]
    return sorted(found, key=lambda path: path.name)


def latest(checkpoint_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint: step, format and (format 2) the data layout."""
    return json.loads((Path(path) / "meta.json").read_text())


def load(path: str | Path) -> TrainingState:
    """Load on the CPU; `optimizer.load_state_dict` moves its state to the parameters' device."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    model = load_file(str(path / "drafter.safetensors"))
    # weights_only: a checkpoint directory may come from elsewhere; never run its pickles.
    rest = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return TrainingState(step=int(meta["step"]), model=model, optimizer=rest["optimizer"], rng=rest["rng"])
