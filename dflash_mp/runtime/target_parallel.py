"""Target replicas over several ranks: one tensor-parallel process group and DeviceMesh each.

With `topology.target_parallel=k`, target ranks [r*k, (r+1)*k) hold replica r of the target,
its layers sharded over them (dflash_mp.models.tensor_parallel applies the model config's
own tensor-parallel plan). They read the same micro-batches and run each forward together;
the hidden states come out replicated, and only the replica's leader sends them.
"""

from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh

from dflash_mp.runtime.topology import Topology


def new_replica_groups(topology: Topology, timeout: timedelta) -> dist.ProcessGroup | None:
    """This rank's replica group (None on drafters, or with target_parallel=1).

    new_group is collective over the world: every rank creates every replica's group, in order.
    The backend is the default group's (NCCL on GPU, gloo on CPU).
    """
    if topology.target_parallel == 1:
        return None
    rank = dist.get_rank()
    mine = None
    for replica in range(topology.replicas):
        ranks = topology.replica_ranks(replica)
        group = dist.new_group(ranks=ranks, timeout=timeout)
        if rank in ranks:
            mine = group
    return mine


def replica_mesh(group: dist.ProcessGroup | None, device: torch.device) -> DeviceMesh | None:
    """A 1-D DeviceMesh ("tp") over this rank's replica group; None without one."""
    if group is None:
        return None
    return DeviceMesh.from_group(group, device.type, mesh_dim_names=("tp",))
