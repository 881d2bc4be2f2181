"""Atomic, resumable checkpoints of the drafter's training state.

Layout: run_dir/checkpoints/step_00000120/{drafter.safetensors, optimizer.pt, meta.json}.
A checkpoint is written into a hidden temporary directory, every file fsynced, and only
then renamed to its final name (rename is atomic on POSIX), so a crash mid-save never
leaves a directory that looks whole but is not. meta.json is written last and names the
step, the data layout (dflash_mp.runtime.resume) and each file's size and sha256; a directory without a
readable meta.json is not a checkpoint. A resume verifies the newest against those records and falls
back to the newest intact one (a disk or a copy can corrupt a file after the save). A failed write
removes its partial copy and names the file, the cause and the checkpoint kept. Files get the read
permissions of the checkpoint directory (safetensors would create them 0600).

Re-saving a step moves the old directory aside before the rename and deletes it after, so a kill
in between loses nothing: `sweep_stale` (at every save and at resume) puts such a directory back
and deletes temporary directories of saves that were killed. One job writes a run's checkpoints
(its first drafter), so every temporary directory but the one being written is stale.
"""

from __future__ import annotations

import hashlib
import json
import os
import random
import re
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

_NAME = re.compile(r"^step_(\d{8})$")
_TMP_PREFIX = ".tmp-step_"
_ASIDE = re.compile(r"^\.replaced-(step_\d{8})-\d+$")
FORMAT = 3  # 2: meta.json holds the data layout; 3: and each file's size and sha256
FILES = ("drafter.safetensors", "optimizer.pt")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be written or used; the message names the path, the cause and the fix."""


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

    `data_layout` (dflash_mp.runtime.resume.data_layout) goes into meta.json for the resume check.
    """
    root = Path(checkpoint_dir)
    root.mkdir(parents=True, exist_ok=True)
    final = step_dir(root, state.step)
    tmp = root / f"{_TMP_PREFIX}{state.step:08d}-{os.getpid()}"
    sweep_stale(root)
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        _write(tmp, state, data_layout, stat.S_IMODE(root.stat().st_mode))
    except Exception as error:
        shutil.rmtree(tmp, ignore_errors=True)
        raise _write_failure(root, state.step, tmp, error) from error
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


def _write(tmp: Path, state: TrainingState, data_layout: dict | None, mode: int) -> None:
    tmp.mkdir()
    model = {k: v.detach().to("cpu").contiguous() for k, v in state.model.items()}
    save_file(model, str(tmp / "drafter.safetensors"))
    # Through a Python file: a failed write then carries its OSError (errno), not only torch's
    # "unexpected pos".
    with open(tmp / "optimizer.pt", "wb") as f:
        torch.save({"optimizer": state.optimizer, "rng": state.rng}, f)
    files = {name: {"bytes": (tmp / name).stat().st_size, "sha256": _sha256(tmp / name)} for name in FILES}
    meta = {"step": state.step, "format": FORMAT, "data_layout": data_layout, "files": files}
    (tmp / "meta.json").write_text(json.dumps(meta))
    for name in (*FILES, "meta.json"):
        os.chmod(tmp / name, mode & 0o666)  # as readable as the directory, never executable
        fsync_path(tmp / name)
    os.chmod(tmp, mode)
    fsync_path(tmp)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 24):
            digest.update(chunk)
    return digest.hexdigest()


def _write_failure(root: Path, step: int, tmp: Path, error: Exception) -> CheckpointError:
    from dflash_mp.run.rundir import write_error_cause

    kept = latest(root)
    return CheckpointError(
        f"cannot write the checkpoint of step {step} into {root}: {write_error_cause(error, root)}. "
        f"Its partial copy ({tmp.name}) was removed and no checkpoint was replaced: "
        + (f"the newest is still {kept.name}" if kept else "there is no earlier checkpoint")
        + ". Free space (or raise the quota or limit), then continue with train.resume=true"
    )


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


def verify(path: str | Path) -> str | None:
    """Why the checkpoint at `path` must not be used (None: intact): meta.json unreadable or of
    another step, a file missing, or of another size or sha256 than recorded at the save. Before
    format 3 no sizes or digests were recorded: only the files' presence is checked."""
    path = Path(path)
    match = _NAME.match(path.name)
    try:
        meta = json.loads((path / "meta.json").read_text())
    except (OSError, ValueError) as e:
        return f"meta.json is missing or unreadable ({type(e).__name__}: {e})"
    if not isinstance(meta, dict) or match is None or meta.get("step") != int(match.group(1)):
        return f"meta.json does not name step {match.group(1) if match else '?'}"
    recorded = meta.get("files") or {}
    for name in FILES:
        file = path / name
        if not file.is_file():
            return f"{name} is missing"
        if name not in recorded:
            continue
        size = file.stat().st_size
        if size != recorded[name]["bytes"]:
            return f"{name} has {size} bytes, {recorded[name]['bytes']} were written"
        if _sha256(file) != recorded[name]["sha256"]:
            return f"{name} does not match the sha256 recorded when it was written"
    return None


def newest_intact(checkpoint_dir: str | Path, warn: Callable[[str], None]) -> Path | None:
    """The newest checkpoint that verifies; each newer one that does not is named through `warn`.
    None when there is no checkpoint at all; CheckpointError, naming each, when none verifies."""
    root = Path(checkpoint_dir)
    found = sorted((p for p in root.iterdir() if _NAME.match(p.name)), reverse=True) if root.is_dir() else []
    bad = []
    for path in found:
        problem = verify(path)
        if problem is None:
            for skipped in bad:
                warn(f"skipping the damaged checkpoint {skipped}; resuming from {path.name} instead")
            return path
        bad.append(f"{path}: {problem}")
    if bad:
        listed = "".join(f"\n  - {b}" for b in bad)
        raise CheckpointError(
            f"no intact checkpoint to resume from in {root}:{listed}\nRestore them from a copy, or "
            "start over (train.resume=false with another run_dir, or train.overwrite=true)"
        )
    return None


def read_meta(path: str | Path) -> dict:
    """meta.json of a checkpoint: step, format and (format 2) the data layout."""
    return json.loads((Path(path) / "meta.json").read_text())


def load(path: str | Path) -> TrainingState:
    """Load on the CPU; `optimizer.load_state_dict` moves its state to the parameters' device."""
    path = Path(path)
    try:
        meta = json.loads((path / "meta.json").read_text())
        model = load_file(str(path / "drafter.safetensors"))
        # weights_only: a checkpoint directory may come from elsewhere; never run its pickles.
        rest = torch.load(path / "optimizer.pt", map_location="cpu", weights_only=True)
    except Exception as e:
        raise CheckpointError(
            f"cannot read the checkpoint {path}: {type(e).__name__}: {e}. Restore it from a copy, or "
            "delete it to resume from the one before"
        ) from e
    return TrainingState(step=int(meta["step"]), model=model, optimizer=rest["optimizer"], rng=rest["rng"])
