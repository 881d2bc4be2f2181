"""HF-format drafter export (`config.json` + `model.safetensors`) that the reference `dflash` loads.

An export is written to a temporary directory beside its destination, synced, and only then
swapped in, so a crash mid-export never leaves a half-written drafter where a reader expects one.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file
from transformers import Qwen3Config

from dflash_mp.models.drafter import DFlashDrafter

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _config_json(drafter: DFlashDrafter, dtype: torch.dtype) -> str:
    config = drafter.config.to_dict()
    config["architectures"] = ["DFlashDraftModel"]
    dtype_name = str(dtype).removeprefix("torch.")
    # transformers 5 reads `dtype`; older readers (and serving engines) still read `torch_dtype`.
    config["dtype"] = dtype_name
    config["torch_dtype"] = dtype_name
    return json.dumps(config, indent=2, sort_keys=True) + "\n"


def export_drafter(
    drafter: DFlashDrafter, out_dir: str | Path, dtype: torch.dtype | None = torch.bfloat16
) -> Path:
    """Write the drafter to `out_dir` in HF format, replacing any previous export only once complete.

    `dtype` None keeps the parameters' own dtype. Pass the unwrapped module (not DDP / compiled).
    """
    out_dir = Path(out_dir).resolve()
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    state = {
        name: tensor.detach().to(device="cpu", dtype=dtype or tensor.dtype).contiguous().clone()
        for name, tensor in drafter.state_dict().items()
    }
    saved_dtype = next(iter(state.values())).dtype
    staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.tmp-", dir=out_dir.parent))
    try:
        (staging / CONFIG_NAME).write_text(_config_json(drafter, saved_dtype))
        save_file(state, staging / WEIGHTS_NAME, metadata={"format": "pt"})
        for path in (staging / CONFIG_NAME, staging / WEIGHTS_NAME, staging):
            _fsync(path)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    # A directory cannot be renamed over a non-empty one: move the old export aside (into an empty
    # placeholder, which rename may replace), put the new one in place, then delete the old one.
    previous = None
    if out_dir.exists():
        previous = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.old-", dir=out_dir.parent))
        os.replace(out_dir, previous)
    try:
        os.replace(staging, out_dir)
    except BaseException:
        if previous is not None:
            os.replace(previous, out_dir)
        shutil.rmtree(staging, ignore_errors=True)
        raise
    _fsync(out_dir.parent)
    if previous is not None:
        shutil.rmtree(previous, ignore_errors=True)
    return out_dir


def load_exported_drafter(path: str | Path) -> DFlashDrafter:
    """A drafter from an export directory, with parameters in the dtype they were saved in."""
    path = Path(path)
    config = Qwen3Config.from_json_file(path / CONFIG_NAME)
    drafter = DFlashDrafter(config)
    drafter.load_state_dict(load_file(path / WEIGHTS_NAME), strict=True, assign=True)
    return drafter
