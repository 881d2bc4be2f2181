"""Tensor parallelism of the frozen target, from the model config's own plan.

transformers configs carry `base_model_tp_plan` (module pattern -> "colwise" | "rowwise" | ...);
this applies it with torch's `parallelize_module` over a 1-D DeviceMesh, one decoder layer at a
time, so a layer is sharded as soon as it is on the device. Column-wise projections keep their
head shards local; the row-wise ones (o_proj, down_proj) all-reduce, so every layer's output,
and hence the hidden states, come out replicated on each rank of the mesh.

A mixture-of-experts target's routed experts are split by dflash_mp.models.parallel_styles
(each rank keeps a slice of every expert), whichever of transformers' styles names them: its
plans spell them differently from version to version, tensor-parallel (`packed_colwise`,
`moe_tp_experts`) or expert-parallel (`grouped_gemm`, `ep_router`), and where the
tensor-parallel plan leaves the experts out (gpt-oss in recent versions) its
`base_model_ep_plan` names them. A style not mapped here is refused, naming the entry.

Pure torch: the mesh comes from the caller (dflash_mp.runtime.target_parallel builds it).
"""

from __future__ import annotations

from fnmatch import fnmatch
from typing import Any

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    RowwiseParallel,
    parallelize_module,
)

from dflash_mp.models.parallel_styles import ExpertsParallel, PerHeadParameters
from dflash_mp.models.target_kernels import is_moe

_LAYER_PREFIX = "layers.*."
_COLWISE = ("colwise", "local_colwise")
_ROWWISE = ("rowwise", "local_rowwise")
# Column-wise with the output gathered back whole (Qwen3.5's linear attention): memory split only.
_GATHERED = ("colwise_gather_output",)
# Left whole on every rank: a gradient all-reduce only (a frozen target has none; MLA's kv_a
# projection in transformers >= 5.2x is whole too, its rope slice reduced in backward), the router
# (every rank routes every token) and the owner of parameters that are local shards already.
_WHOLE = ("replicated_with_grad_allreduce", "mla_kv_a_proj", "ep_router", "local_params")
# What transformers' plans call the routed experts and their weights, over its 5.x versions.
_EXPERT_STYLES = (
    *_COLWISE, *_ROWWISE, "packed_colwise", "packed_rowwise", "local_packed_rowwise", "local",
    "grouped_gemm", "moe_tp_experts", "ep_dispatch_experts", "gather",
)  # fmt: skip
# Bare per-head parameters, split with the heads (gpt-oss's attention sinks).
_PER_HEAD_PARAMETERS = ("sinks",)
_PER_HEAD_STYLES = (*_COLWISE, *_ROWWISE, "local")
_EXPERTS = "experts"


def _experts_path(path: str) -> str | None:
    """The experts module an entry names or lies under ("mlp.experts.down_proj" -> "mlp.experts")."""
    parts = path.split(".")
    return ".".join(parts[: parts.index(_EXPERTS) + 1]) if _EXPERTS in parts else None


def _add(styles: dict[str, ParallelStyle], field: str, pattern: str, style: str) -> None:
    """Map one plan entry (`field`[`pattern`] = `style`) into `styles`, keyed relative to a layer."""
    if not pattern.startswith(_LAYER_PREFIX) or style in _WHOLE:
        return  # the embedding and the final norm stay whole: small next to the layers
    path = pattern[len(_LAYER_PREFIX) :]
    owner, _, leaf = path.rpartition(".")
    experts = _experts_path(path)
    if experts is not None and style in _EXPERT_STYLES:
        styles[experts] = ExpertsParallel()
    elif leaf in _PER_HEAD_PARAMETERS and style in _PER_HEAD_STYLES:
        named = styles.get(owner)
        names = named.names if isinstance(named, PerHeadParameters) else ()
        styles[owner] = PerHeadParameters((*names, leaf))
    elif style in _COLWISE:
        styles[path] = ColwiseParallel()
    elif style in _ROWWISE:
        styles[path] = RowwiseParallel()
    elif style in _GATHERED:
        styles[path] = ColwiseParallel(output_layouts=Replicate())
    else:
        raise ValueError(
            f"the target's {field}[{pattern!r}] = {style!r}: a style topology.target_parallel does not "
            "support (colwise, rowwise, colwise_gather_output, the experts' styles); set "
            "topology.target_parallel=1"
        )


def layer_plan(config: Any) -> dict[str, ParallelStyle]:
    """The per-decoder-layer plan (keys relative to a layer) from the config's plans.

    `base_model_tp_plan` first; a mixture-of-experts target whose tensor-parallel plan leaves the
    experts out takes them from `base_model_ep_plan`. Entries outside the layers stay replicated.
    """
    name = type(config).__name__
    tp_plan = getattr(config, "base_model_tp_plan", None) or {}
    if not tp_plan:
        raise ValueError(
            f"the target ({name}) has no base_model_tp_plan, so it cannot be split over several "
            "ranks: set topology.target_parallel=1"
        )
    styles: dict[str, ParallelStyle] = {}
    for pattern, style in tp_plan.items():
        _add(styles, "base_model_tp_plan", pattern, style)
    splits_experts = any(isinstance(style, ExpertsParallel) for style in styles.values())
    if is_moe(config) and not splits_experts:
        ep_plan = getattr(config, "base_model_ep_plan", None) or {}
        for pattern, style in ep_plan.items():
            _add(styles, "base_model_ep_plan", pattern, style)
        if not any(isinstance(style, ExpertsParallel) for style in styles.values()):
            raise ValueError(
                f"the target ({name}) is a mixture of experts, but neither its base_model_tp_plan nor "
                "its base_model_ep_plan names the experts (layers.*.mlp.experts), which would stay "
                "whole on every rank: set topology.target_parallel=1"
            )
    if not styles:
        raise ValueError(f"the target's base_model_tp_plan shards nothing in its layers: {dict(tp_plan)}")
    return styles


def check_divisible(config: Any, parallel: int) -> None:
    """Refuse a split that does not divide the heads, the MLP width or the experts' width evenly."""
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    widths = {
        key: getattr(config, key, None)
        for key in ("intermediate_size", "moe_intermediate_size", "shared_expert_intermediate_size")
    }
    uneven = [
        f"{key}={value}" for key, value in widths.items() if isinstance(value, int) and value % parallel
    ]
    if heads % parallel or kv_heads % parallel or uneven:
        sizes = ", ".join([f"num_attention_heads={heads}", f"num_key_value_heads={kv_heads}", *uneven])
        raise ValueError(f"target parallel degree {parallel} must divide {sizes}")


def plan_problems(target: dict[str, Any], parallel: int) -> list[str]:
    """The preflight's check of a k-rank replica against the target's config.json: the plans of
    its model_type must map, and the experts' widths divide by k. No model is built; a model_type
    transformers does not know (remote code) is checked when it loads."""
    if not (isinstance(parallel, int) and parallel > 1):
        return []
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    model_type = target.get("model_type")
    if model_type not in CONFIG_MAPPING:
        return []
    try:
        config = CONFIG_MAPPING[model_type].from_dict(target)
    except Exception:  # noqa: BLE001 - a config transformers cannot read fails its own check
        return []
    field = f"topology.target_parallel={parallel}"
    try:
        layer_plan(config)
    except ValueError as e:
        return [f"{field}: {e}"]
    # intermediate_size (gpt-oss's expert width too) and the heads: topology's own check.
    widths = ("moe_intermediate_size", "shared_expert_intermediate_size")
    return [
        f"{field}: the target's {key}={target[key]} does not divide by it; use a "
        "topology.target_parallel that divides it"
        for key in widths
        if isinstance(target.get(key), int) and target[key] % parallel
    ]


def _resolve(module: nn.Module, path: str) -> list[nn.Module]:
    """The submodules `path` names (fnmatch per step); a parameter at its end is refused."""
    found = [module]
    for token in path.split("."):
        children = [c for m in found for n, c in m.named_children() if fnmatch(n, token)]
        if not children and any(token in dict(m.named_parameters(recurse=False)) for m in found):
            raise ValueError(
                f"the target's tensor-parallel plan entry {path!r} names a parameter the replica "
                "cannot split; set topology.target_parallel=1"
            )
        found = children
    return found


def shard_layer(layer: nn.Module, plan: dict[str, ParallelStyle], mesh: DeviceMesh) -> nn.Module:
    """Shard one decoder layer in place over `mesh`.

    Entries naming modules this layer lacks (a hybrid's other attention kind, a dense MLP in a
    MoE stack) are skipped. The mesh's first rank scatters each linear weight
    (parallelize_module's default source) and the experts are sliced locally, so the shards are
    fresh tensors of 1/k the size and the full weights can be freed.
    """
    present = {path: style for path, style in plan.items() if _resolve(layer, path)}
    parallelize_module(layer, mesh, present)
    return layer


def parallel_degree(mesh: DeviceMesh | None) -> int:
    return 1 if mesh is None else mesh.size()
