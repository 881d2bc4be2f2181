"""Atomic, resumable checkpoints of the drafter's training state.

Layout: run_dir/checkpoints/step_00000120/{drafter.safetensors, optimizer.pt, meta.json}.
A checkpoint is written into a hidden temporary directory, every file fsynced, and only
then renamed to its final name (rename is atomic on POSIX), so a crash mid-save never
leaves a directory that looks whole but is not. meta.json is written last and names the
step; a directory without a readable meta.json is not a checkpoint.
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


def save(checkpoint_dir: str | Path, state: TrainingState, keep: int) -> Path:
    """Write `state` atomically as step_<step>; keep the newest `keep` checkpoints."""
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = root / f"step_{state.step:08d}"
    tmp = root / f".tmp-step_{state.step:08d}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    model = {k: v.detach().to("cpu").contiguous() for k, v in state.model.items()}
    save_file(model, str(tmp / "drafter.safetensors"))
    torch.save({"optimizer": state.optimizer, "rng": state.rng}, tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": state.step, "format": 1}))
    for name in ("drafter.safetensors", "optimizer.pt", "meta.json"):
        fsync_path(tmp / name)
    fsync_path(tmp)
    if final.exists():  # a re-save of the same step (e.g. after a resume) replaces the old one
        shutil.rmtree(final)
    os.rename(tmp, final)
    fsync_path(root)
    for old in complete_checkpoints(root)[:-keep]:
        shutil.rmtree(old, ignore_errors=True)
    return final


def complete_checkpoints(checkpoint_dir: str | Path) -> list[Path]:
    """Complete checkpoints, oldest first."""
    root = Path(checkpoint_dir)
    if not root.is_dir():
        return []
    found = []
    for path in root.iterdir():
        match = _NAME.match(path.name)
        if not match or not (path / "drafter.safetensors").is_file() or not (path / "optimizer.pt").is_file():
            continue
        try:
            meta = json.loads((path / "meta.json").read_text())
        except (OSError, ValueError):
            continue
        if meta.get("step") == int(match.group(1)):
            found.append((meta["step"], path))
    return [path for _, path in sorted(found)]


def latest(checkpoint_dir: str | Path) -> Path | None:
    found = complete_checkpoints(checkpoint_dir)
    return found[-1] if found else None


def load(path: str | Path) -> TrainingState:
    """Load on the CPU; `optimizer.load_state_dict` moves its state to the parameters' device."""
    path = Path(path)
    meta = json.loads((path / "meta.json").read_text())
    model = load_file(str(path / "drafter.safetensors"))
    # weights_only: a checkpoint directory may come from elsewhere; never run its pickles.
    rest = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    return TrainingState(step=int(meta["step"]), model=model, optimizer=rest["optimizer"], rng=rest["rng"])
