"""JSON between ranks (no pickle) and on disk (atomic writes)."""

from __future__ import annotations

import json
import os
import threading

import torch
import torch.distributed as dist


def gather_json(obj: dict, group) -> list[dict]:
    """Every rank's `obj` on every rank, as JSON bytes over a gloo group (no pickling)."""
    world = dist.get_world_size(group)
    payload = json.dumps(obj, default=str).encode()
    size = torch.tensor([len(payload)], dtype=torch.int64)
    sizes = [torch.zeros(1, dtype=torch.int64) for _ in range(world)]
    dist.all_gather(sizes, size, group=group)
    longest = max(int(s) for s in sizes)
    buffer = torch.zeros(longest, dtype=torch.uint8)
    buffer[: len(payload)] = torch.frombuffer(bytearray(payload), dtype=torch.uint8)
    buffers = [torch.zeros(longest, dtype=torch.uint8) for _ in range(world)]
    dist.all_gather(buffers, buffer, group=group)
    return [json.loads(bytes(b[: int(s)].tolist()).decode()) for b, s in zip(buffers, sizes, strict=True)]


def deep_merge(into: dict, other: dict) -> dict:
    for key, value in other.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            deep_merge(into[key], value)
        else:
            into[key] = value
    return into


def write_json(path: str, obj: dict) -> None:
    """Atomic write (tmp + rename), non-finite numbers as null."""

    def clean(x):
        if isinstance(x, float) and not (x == x and abs(x) != float("inf")):
            return None
        if isinstance(x, dict):
            return {str(k): clean(v) for k, v in x.items()}
        if isinstance(x, (list, tuple)):
            return [clean(v) for v in x]
        return x

    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp-{os.getpid()}-{threading.get_ident()}"
    with open(tmp, "w") as f:
        json.dump(clean(obj), f, indent=2, default=str)
        f.write("\n")
    os.replace(tmp, path)


def read_json(path: str) -> dict | None:
    try:
        with open(path) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None
