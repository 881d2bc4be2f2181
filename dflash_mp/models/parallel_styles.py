"""The two tensor-parallel styles a target replica needs that torch does not have.

- `ExpertsParallel`: a mixture-of-experts layer's routed experts (transformers' fused 3-D weights,
  [experts, out, in], or [experts, in, out] when `is_transposed`). Every rank of a replica sees
  the same tokens, so each keeps 1/k of every expert's intermediate width: the gate/up shard and
  the down shard line up, the router stays whole (every rank routes every token alike), and the
  k partial outputs sum to the expert output. That is transformers' `moe_tp_experts` layout; its
  expert-parallel plan (`grouped_gemm`, whole experts per rank) splits the same memory, but would
  leave the work per rank to the router's balance and change the routing; this layout changes
  neither, and runs unchanged on every experts implementation (eager loop, batched_mm,
  grouped_mm).
- `PerHeadParameters`: a bare per-head parameter (gpt-oss's attention sinks) split by heads
  alongside the column-wise q/k/v projections.

The shards are plain local tensors, copied out of the full weight so that it can be freed; the
full weights are the same on every rank (read from the same checkpoint, or built from one seed).
"""

from __future__ import annotations

import torch
import torch.distributed._functional_collectives as funcol
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import ParallelStyle

_PACKED = ("gate_up_proj", "gate_up_proj_bias")  # gate and up, packed along one dimension
_UP = ("up_proj", "up_proj_bias")  # experts without a gate
_DOWN = "down_proj"
_DOWN_BIAS = "down_proj_bias"


def _fresh(tensor: torch.Tensor) -> torch.Tensor:
    """A copy with its own storage (a view would keep the whole weight alive)."""
    return tensor.clone(memory_format=torch.contiguous_format)


class ExpertsParallel(ParallelStyle):
    """Keeps 1/k of each expert's intermediate width on each rank and sums the experts' output."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not hasattr(module, "is_transposed"):
            raise ValueError(
                f"{type(module).__name__} does not say how its expert weights are laid out "
                "(transformers' is_transposed / is_concatenated): this transformers version cannot "
                "run a mixture-of-experts target tensor-parallel; upgrade transformers or set "
                "topology.target_parallel=1"
            )
        parallel, rank = device_mesh.size(), device_mesh.get_local_rank()
        transposed = bool(module.is_transposed)
        interleaved = not getattr(module, "is_concatenated", True)
        width = _intermediate_width(module, transposed)
        if width % parallel:
            raise ValueError(
                f"{type(module).__name__}: the experts' intermediate width {width} does not divide by "
                f"topology.target_parallel={parallel}"
            )
        part = width // parallel
        for name, param in list(module.named_parameters(recurse=False)):
            if name in _PACKED:
                dim = -1 if transposed or param.dim() == 2 else -2
                if interleaved:  # gate_j, up_j side by side: 2 x part neighbouring columns
                    shard = param.narrow(dim, 2 * rank * part, 2 * part)
                else:  # [gate; up]: the same rows of each half
                    halves = (param.narrow(dim, half * width + rank * part, part) for half in (0, 1))
                    shard = torch.cat(list(halves), dim=dim)
            elif name in _UP:
                dim = -1 if transposed or param.dim() == 2 else -2
                shard = param.narrow(dim, rank * part, part)
            elif name == _DOWN:
                shard = param.narrow(-2 if transposed else -1, rank * part, part)
            elif name == _DOWN_BIAS:
                # Added once: the all-reduce sums every rank's output.
                shard = param if rank == 0 else torch.zeros_like(param)
            else:
                raise ValueError(
                    f"{type(module).__name__}.{name}: an expert parameter the tensor-parallel replica "
                    "does not know how to split; set topology.target_parallel=1"
                )
            module._parameters[name] = nn.Parameter(_fresh(shard), requires_grad=param.requires_grad)
        group = device_mesh.get_group()

        def sum_over_replica(_module: nn.Module, _args: tuple, output: torch.Tensor) -> torch.Tensor:
            # Functional all-reduce: traceable inside a compiled layer.
            return funcol.all_reduce(output, "sum", group)

        module.register_forward_hook(sum_over_replica)
        return module


def _intermediate_width(module: nn.Module, transposed: bool) -> int:
    down = getattr(module, _DOWN, None)
    if not isinstance(down, torch.Tensor) or down.dim() != 3:
        raise ValueError(
            f"{type(module).__name__} has no 3-D down_proj ([experts, ...]): not a fused experts "
            "module the tensor-parallel replica can split; set topology.target_parallel=1"
        )
    return down.shape[-2] if transposed else down.shape[-1]


class PerHeadParameters(ParallelStyle):
    """Splits bare parameters of a module by heads (dim 0), as its column-wise q/k/v are."""

    def __init__(self, names: tuple[str, ...]) -> None:
        self.names = names

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        parallel, rank = device_mesh.size(), device_mesh.get_local_rank()
        for name in self.names:
            param = module.get_parameter(name)
            if param.shape[0] % parallel:
                raise ValueError(
                    f"{type(module).__name__}.{name}: {param.shape[0]} heads do not divide by "
                    f"topology.target_parallel={parallel}"
                )
            part = param.shape[0] // parallel
            shard = _fresh(param.narrow(0, rank * part, part))
            module._parameters[name] = nn.Parameter(shard, requires_grad=param.requires_grad)
        return module
