"""Tensor parallelism of the frozen target, from the model config's own plan.

transformers configs carry `base_model_tp_plan` (module pattern -> "colwise" | "rowwise" | ...);
this applies it with torch's `parallelize_module` over a 1-D DeviceMesh, one decoder layer at a
time, so a layer is sharded as soon as it is on the device. Column-wise projections keep their
head shards local; the row-wise ones (o_proj, down_proj) all-reduce, so every layer's output,
and hence the hidden states, come out replicated on each rank of the mesh.

Pure torch: the mesh comes from the caller (dflash_mp.runtime.target_parallel builds it).
"""

from __future__ import annotations

from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

_LAYER_PREFIX = "layers.*."
# Styles that leave a module whole on every rank (in transformers they only add a gradient
# all-reduce, which a frozen forward-only target never needs).
_REPLICATED_STYLES = ("replicated_with_grad_allreduce",)


def layer_plan(config: Any) -> dict[str, ParallelStyle]:
    """The per-decoder-layer plan (keys relative to a layer) from `config.base_model_tp_plan`.

    Entries outside the layers (embedding, final norm) stay replicated: they are small next to
    the layers. A style we do not map is refused, naming it, rather than run a wrong forward.
    """
    plan = getattr(config, "base_model_tp_plan", None)
    if not plan:
        raise ValueError(
            f"the target ({type(config).__name__}) has no base_model_tp_plan, so it cannot be split "
            "over several ranks: set topology.target_parallel=1"
        )
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in plan.items():
        if not pattern.startswith(_LAYER_PREFIX) or style in _REPLICATED_STYLES:
            continue
        if style == "colwise":
            styles[pattern[len(_LAYER_PREFIX) :]] = ColwiseParallel()
        elif style == "rowwise":
            styles[pattern[len(_LAYER_PREFIX) :]] = RowwiseParallel()
        else:
            raise ValueError(
                f"the target's tensor-parallel plan has style {style!r} for {pattern!r}, which "
                "topology.target_parallel does not support (only colwise/rowwise): set "
                "topology.target_parallel=1"
            )
    if not styles:
        raise ValueError(f"the target's base_model_tp_plan shards nothing in its layers: {dict(plan)}")
    return styles


def check_divisible(config: Any, parallel: int) -> None:
    """Refuse a split that does not divide the heads or the MLP width evenly."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    intermediate = getattr(config, "intermediate_size", parallel)
    if heads % parallel or kv_heads % parallel or intermediate % parallel:
        raise ValueError(
            f"target parallel degree {parallel} must divide num_attention_heads={heads}, "
            f"num_key_value_heads={kv_heads} and intermediate_size={intermediate}"
        )


def shard_layer(layer: nn.Module, plan: dict[str, ParallelStyle], mesh: DeviceMesh) -> nn.Module:
    """Shard one decoder layer in place over `mesh`.

    The mesh's first rank scatters each weight (parallelize_module's default source), so the
    shards are fresh tensors of 1/k the size and the full weights can be freed; the other ranks'
    copies only give shapes.
    """
    parallelize_module(layer, mesh, plan)
    return layer


def parallel_degree(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh.size()
