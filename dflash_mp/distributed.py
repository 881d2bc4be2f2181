"""Process-group setup for one torchrun job: device, roles, the three groups.

- the default group (NCCL on GPU, gloo on CPU) carries hidden states point-to-point;
- `meta_group` (gloo, all ranks) carries the small headers and startup agreements on the CPU;
- `drafter_group` (drafter ranks only) carries the drafters' gradient all-reduce, so
  target ranks never join a drafter collective.
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_mp.topology import Role, Topology


@dataclass
class Job:
    rank: int
    local_rank: int
    world_size: int
    topology: Topology
    device: torch.device
    meta_group: dist.ProcessGroup
    drafter_group: dist.ProcessGroup | None

    @property
    def role(self) -> Role:
        return self.topology.role_of(self.rank)

    @property
    def drafter_index(self) -> int:
        return self.rank - self.topology.targets

    @property
    def is_first_drafter(self) -> bool:
        return self.rank == self.topology.targets


def env_ranks() -> tuple[int, int, int]:
    """(rank, local_rank, world_size) from torchrun's environment."""
    return int(os.environ["RANK"]), int(os.environ.get("LOCAL_RANK", 0)), int(os.environ["WORLD_SIZE"])


def under_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ and "MASTER_ADDR" in os.environ


def pick_device(requested: str, local_rank: int) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise RuntimeError("train.device=cuda but no CUDA device is visible; use train.device=cpu")
    if local_rank >= torch.cuda.device_count():
        raise RuntimeError(
            f"LOCAL_RANK {local_rank} but only {torch.cuda.device_count()} GPU(s) are visible: "
            "launch with --nproc-per-node equal to the GPUs per node"
        )
    torch.cuda.set_device(local_rank)
    return torch.device("cuda", local_rank)


def init_job(
    topology: Topology, device_request: str, timeout_s: float = 600.0, drafter_group: bool = True
) -> Job:
    """This rank's device and groups. drafter_group=False (a one-process run that plays both roles,
    e.g. the benchmark on one GPU) skips the drafter group: its trainer then runs without DDP."""
    rank, local_rank, world_size = env_ranks()
    device = pick_device(device_request, local_rank)
    timeout = timedelta(seconds=timeout_s)
    if device.type == "cuda":
        dist.init_process_group("nccl", device_id=device, timeout=timeout)
    else:
        dist.init_process_group("gloo", timeout=timeout)
    meta_group = dist.new_group(backend="gloo", timeout=timeout)
    drafter_ranks = list(range(topology.targets, topology.world_size)) if drafter_group else []
    # new_group is collective over the world: every rank calls it, members or not.
    group = dist.new_group(ranks=drafter_ranks, timeout=timeout) if drafter_ranks else None
    return Job(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        topology=topology,
        device=device,
        meta_group=meta_group,
        drafter_group=group if rank in drafter_ranks else None,
    )


def shared_run_dir(requested: str, name: str, meta_group) -> str:
    """The run directory every rank agrees on; rank 0 picks one if none was given.

    Sent as fixed-size bytes over the gloo group (no pickling).
    """
    if requested:
        return requested
    buffer = torch.zeros(4096, dtype=torch.uint8)
    if dist.get_rank() == 0:
        chosen = os.path.abspath(f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}").encode()
        buffer[: len(chosen)] = torch.frombuffer(bytearray(chosen), dtype=torch.uint8)
    dist.broadcast(buffer, src=0, group=meta_group)
    return bytes(buffer[buffer != 0].tolist()).decode()


def broadcast_int(value: int, src: int, group) -> int:
    """Share one integer from `src` with every rank of `group` (a gloo group: CPU tensors)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=src, group=group)
    return int(tensor.item())
