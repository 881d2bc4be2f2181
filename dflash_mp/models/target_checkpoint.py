"""The target's safetensors files: which tensor is where, what they weigh, and one tensor read
without building the model.

Which tensors a drafter rank reads (the input embedding and the LM head) is asked of transformers'
own model of the target: `load_embedding_and_head` in dflash_mp.models.target_structure.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import torch
from safetensors import safe_open


def tensor_files(path: str | Path) -> dict[str, Path]:
    """Tensor name -> safetensors file holding it, for a single-file or sharded checkpoint."""
    path = Path(path)
    index = path / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: path / file for name, file in weight_map.items()}
    single = path / "model.safetensors"
    if single.is_file():
        with safe_open(single, framework="pt") as f:
            return dict.fromkeys(f.keys(), single)
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {path}")


def tensor_shapes(files: dict[str, Path]) -> dict[str, tuple[int, ...]]:
    """Every tensor's shape, from the safetensors headers alone (no tensor is read)."""
    shapes: dict[str, tuple[int, ...]] = {}
    for file in set(files.values()):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def checkpoint_bytes(path: str | Path, dtype: torch.dtype) -> int | None:
    """Bytes of the whole checkpoint once loaded with floating tensors in `dtype`, from the
    safetensors headers alone (no tensor is read); None for a checkpoint without safetensors."""
    try:
        files = tensor_files(Path(path))
    except FileNotFoundError:
        return None
    total = 0
    for file in set(files.values()):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open is not iterable
                piece = f.get_slice(name)
                stored = _SAFETENSORS_DTYPES.get(piece.get_dtype(), torch.float32)
                itemsize = (dtype if stored.is_floating_point else stored).itemsize
                total += math.prod(piece.get_shape()) * itemsize
    return total


_SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
    "BOOL": torch.bool,
}  # fmt: skip


def read_tensor(files: dict[str, Path], name: str) -> torch.Tensor:
    """The tensor `name` of a checkpoint whose `files` are tensor_files'."""
    with safe_open(files[name], framework="pt") as f:
        return f.get_tensor(name)
