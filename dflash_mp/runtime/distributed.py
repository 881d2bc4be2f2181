"""Process-group setup for one torchrun job: device, roles, the three groups.

- the default group (NCCL on GPU, gloo on CPU) carries hidden states point-to-point;
- `meta_group` (gloo, all ranks) carries the small headers and startup agreements on the CPU;
- `drafter_group` (drafter ranks only) carries the drafters' gradient all-reduce, so
  target ranks never join a drafter collective; in the colocated layout it is the default group;
- `replica_group` (topology.target_parallel > 1: the ranks of one target replica) carries the
  replica's tensor-parallel all-reduces (dflash_mp.runtime.target_parallel).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist

from dflash_mp.runtime.topology import Role, Topology

# The process groups' timeout outlives the watchdog (which allows a waiting rank PEER_GRACE_S more,
# and the launcher's backstop another 10 s): a rank waiting on a peer that stopped making progress
# must not time out first and be blamed; the watchdog names the peer.
PROCESS_GROUP_TIMEOUT_MARGIN_S = 120.0
# How long a rank that leaves early waits for the receives it still has posted (a few micro-batches
# the targets produce anyway): well inside torchrun's grace before it kills the ranks.
LEAVE_TIMEOUT_S = 30.0
# Without a watchdog (watchdog.timeout_s=0) the groups' timeout is the only hang detection left:
# long enough for a slow target load or a long eval, short enough to end a hung job the same day.
PROCESS_GROUP_TIMEOUT_WITHOUT_WATCHDOG_S = 3600.0


@dataclass
class Job:
    rank: int
    local_rank: int
    world_size: int
    topology: Topology
    device: torch.device
    meta_group: dist.ProcessGroup
    drafter_group: dist.ProcessGroup | None
    # This target rank's replica group (topology.target_parallel > 1), else None.
    replica_group: dist.ProcessGroup | None = None

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


def process_group_timeout_s(watchdog_timeout_s: float) -> float:
    """The communication timeout for a job whose watchdog fires after `watchdog_timeout_s` (0: off)."""
    if watchdog_timeout_s <= 0:
        return PROCESS_GROUP_TIMEOUT_WITHOUT_WATCHDOG_S
    return watchdog_timeout_s + PROCESS_GROUP_TIMEOUT_MARGIN_S


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
    if topology.colocated and drafter_ranks:
        group = dist.group.WORLD  # every rank trains: no second communicator for the same ranks
    else:
        # new_group is collective over the world: every rank calls it, members or not.
        group = dist.new_group(ranks=drafter_ranks, timeout=timeout) if drafter_ranks else None
    from dflash_mp.runtime.target_parallel import new_replica_groups

    replica_group = new_replica_groups(topology, timeout)
    return Job(
        rank=rank,
        local_rank=local_rank,
        world_size=world_size,
        topology=topology,
        device=device,
        meta_group=meta_group,
        drafter_group=group if rank in drafter_ranks else None,
        replica_group=replica_group,
    )


def shared_run_dir(requested: str, name: str, meta_group) -> str:
    """The run directory every rank agrees on; rank 0 picks one if none was given.

    Sent as fixed-size bytes over the gloo group (no pickling).
    """
    if requested:
        return requested
    chosen = os.path.abspath(f"runs/{name}-{time.strftime('%Y%m%d-%H%M%S')}") if dist.get_rank() == 0 else ""
    return broadcast_text(chosen, src=0, group=meta_group)


def broadcast_text(text: str, src: int, group, max_bytes: int = 4096) -> str:
    """Share a short UTF-8 string from `src` with every rank of `group` (a gloo group), as
    fixed-size bytes: no pickling."""
    buffer = torch.zeros(max_bytes, dtype=torch.uint8)
    if dist.get_rank() == src and text:
        data = text.encode()[:max_bytes]
        buffer[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    dist.broadcast(buffer, src=src, group=group)
    return bytes(buffer[buffer != 0].tolist()).decode(errors="replace")


def broadcast_int(value: int, src: int, group) -> int:
    """Share one integer from `src` with every rank of `group` (a gloo group: CPU tensors)."""
    tensor = torch.tensor([value], dtype=torch.int64)
    dist.broadcast(tensor, src=src, group=group)
    return int(tensor.item())


def leave_process_groups(timeout_s: float = LEAVE_TIMEOUT_S) -> bool:
    """Before a rank exits early (a stop request, a refused start): see through the receives it
    still has posted (dflash_mp.runtime.transport.settle_open_receivers), then destroy the process groups.
    Else the rank aborts after it ended cleanly ("terminate called without an active exception",
    "Fatal Python error: Aborted"): left to the interpreter's exit, gloo's threads are still
    joinable when C++ destroys them, and a thread waiting on a posted receive wakes into the
    interpreter's teardown when a header comes or the sender goes. False when a receive is still
    posted after `timeout_s`: the caller must then end the process without that teardown."""
    from dflash_mp.runtime.transport import settle_open_receivers

    settled = settle_open_receivers(timeout_s)
    if dist.is_initialized():
        dist.destroy_process_group()
    return settled
