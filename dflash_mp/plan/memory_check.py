"""The preflight's memory line: a config's predicted peak per GPU (dflash_mp.plan.memory) against
the GPU's memory, and the fixes when it does not fit.

The launcher's preflight (`python -m dflash_mp.launch doctor|run|start`, `python -m dflash_mp.train`)
and rank 0 under plain torchrun run it before any rank loads the target. The GPU's memory is that
of the first visible GPU, or `DFLASH_MP_GPU_MEMORY_GIB` (to check a GPU config on a machine
without one, or to plan for a smaller GPU); without either the check is skipped.
"""

from __future__ import annotations

import os
from dataclasses import replace
from typing import Any

from dflash_mp.config.dspark_checks import feature_layer_ids
from dflash_mp.config.schema import RootConfig, read_target_config, resolved_target_layer_ids
from dflash_mp.plan.costs import shape_from_hf_config
from dflash_mp.plan.memory import (
    DEFAULT_CONSTANTS,
    GIB,
    Breakdown,
    TrainingShape,
    colocated_rank,
    drafter_rank,
    target_rank,
    target_weights,
    with_checkpointing,
)
from dflash_mp.plan.memory_heads import loss_chunk_rows, xpress_ce_passes

GPU_MEMORY_ENV = "DFLASH_MP_GPU_MEMORY_GIB"


def padded(length: int, multiple: int) -> int:
    return -(-length // max(1, multiple)) * max(1, multiple)


def training_shape(cfg: RootConfig, target_config: dict, world_size: int | None = None) -> TrainingShape:
    """What `cfg` trains, as the memory model reads it (`target_config`: the target's config.json;
    `world_size`: the drafters of a colocated layout whose topology.drafters is null)."""
    m, d, t, tr = cfg.model, cfg.data, cfg.topology, cfg.train
    shape = shape_from_hf_config(target_config, str(target_config.get("_name_or_path") or m.target_path))
    # DSpark's teacher layer: the whole target runs and its last layer travels too (dspark_checks.py).
    drafter_ids = resolved_target_layer_ids(cfg, shape.layers)
    layer_ids = feature_layer_ids(drafter_ids, shape.layers, m)
    experts_per_token = int(target_config.get("num_experts_per_tok") or 1)
    colocated = t.layout == "colocated"
    return TrainingShape(
        target=shape,
        target_layers_kept=max(layer_ids) + 1,
        feature_layers=len(layer_ids),
        draft_layers=m.draft_layers,
        block_size=m.block_size,
        seq_len=padded(d.max_length, d.pad_to_multiple),
        num_anchors=d.num_anchors,
        micro_batch=tr.micro_batch_size,
        grad_accum=tr.grad_accum,
        drafters=t.drafters or world_size or 1,
        activation_checkpointing=tr.activation_checkpointing,
        **drafter_head_fields(m),
        vocabulary_chunk_rows=tr.vocabulary_chunk_rows,
        teacher_layer=len(layer_ids) > len(drafter_ids),
        target_mlp_width=shape.expert_width * experts_per_token,
        target_parallel=1 if colocated else t.target_parallel,
        max_inflight_sends=t.max_inflight_sends,
        cuda_graphs=str(tr.cuda_graphs).lower() != "false" and (colocated or t.target_parallel == 1),
    )


def drafter_head_fields(m: Any) -> dict[str, Any]:
    """TrainingShape's fields that `cfg.model` sets beyond the layers: the arch and its heads (the
    benchmark's prediction takes them too)."""
    return dict(
        arch=m.arch,
        conv_kernel_size=m.conv_kernel_size,
        conv_group_size=m.conv_group_size,
        selector_rank=m.selector_rank,
        markov_rank=m.markov_rank,
        markov_head_type=m.markov_head_type,
        confidence_head=m.enable_confidence_head,
        confidence_head_with_markov=m.confidence_head_with_markov,
        xpress_rank=m.xpress_rank,
        xpress_mlp_ratio=m.xpress_mlp_ratio,
        xpress_passes=xpress_ce_passes(
            m.xpress_consistency_weight, m.xpress_consistency_passes, m.xpress_base_anchor_weight
        ),
    )


def rank_breakdowns(cfg: RootConfig, shape: TrainingShape) -> list[Breakdown]:
    """The ranks of the layout: one colocated rank, or a target rank and a drafter rank."""
    if cfg.topology.layout == "colocated":
        return [colocated_rank(shape)]
    return [target_rank(shape), drafter_rank(shape)]


def gpu_memory_gib(cfg: RootConfig) -> float | None:
    """`DFLASH_MP_GPU_MEMORY_GIB`, else the first visible GPU's memory when the job uses GPUs;
    None when unknown (a CPU job, or no GPU here and no value given)."""
    given = os.environ.get(GPU_MEMORY_ENV, "").strip()
    if given:
        try:
            value = float(given)
        except ValueError:
            raise ValueError(f"{GPU_MEMORY_ENV}={given!r}: must be a number of GiB, e.g. 79.6") from None
        if value > 0:
            return value
        raise ValueError(f"{GPU_MEMORY_ENV}={given!r}: must be positive")
    if cfg.train.device == "cpu":
        return None
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(0).total_memory / 2**30


def layout_name(cfg: RootConfig) -> str:
    t = cfg.topology
    if t.layout == "colocated":
        return "colocated"
    tp = f", target_parallel={t.target_parallel}" if t.target_parallel > 1 else ""
    return f"{t.targets}t{t.drafters}d{tp}"


TENSOR_PARALLEL = (
    "tensor-parallel target replicas (topology.layout=split, topology.target_parallel=2 or more, "
    "topology.targets a multiple of it)"
)


def fixes(cfg: RootConfig, shape: TrainingShape, rank: Breakdown, total: float) -> str:
    """What would make `rank` fit on a GPU of `total` GiB, in one line."""
    d, tr = cfg.data, cfg.train
    if rank.rank != "drafter rank" and target_weights(shape).bytes / GIB > total:
        return f"{TENSOR_PARALLEL}: the target's weights alone exceed the GPU"
    smaller = f"a smaller data.max_length (now {d.max_length})"
    batch = (
        [f"a smaller train.micro_batch_size (now {tr.micro_batch_size})"] if tr.micro_batch_size > 1 else []
    )
    if rank.rank == "target rank":
        options = [TENSOR_PARALLEL, smaller, *batch]
        return ", ".join(options[:-1]) + " or " + options[-1]
    options = []
    if not shape.activation_checkpointing:
        relieved = rank_breakdowns(cfg, with_checkpointing(shape))
        again = next(b for b in relieved if b.rank == rank.rank)
        options.append(f"train.activation_checkpointing=true (predicted {_gib(again.peak_gib)} GiB)")
    options += _smaller_vocabulary_chunk(cfg, shape, rank)
    options += [f"fewer data.num_anchors (now {d.num_anchors})", smaller, *batch]
    if rank.rank == "colocated":
        options.append("a split layout (topology=3t5d)")
    return ", ".join(options[:-1]) + " or " + options[-1]


def _smaller_vocabulary_chunk(cfg: RootConfig, shape: TrainingShape, rank: Breakdown) -> list[str]:
    """A quarter of the loss's vocabulary chunk (whole blocks for DSpark and XPress), with its
    prediction; none where the chunk cannot shrink."""
    now = loss_chunk_rows(shape, DEFAULT_CONSTANTS)
    whole_blocks = shape.arch in ("dspark", "xpress")
    unit = shape.block_size if whole_blocks else 1
    rows = max(1, now // unit // 4) * unit
    if rows >= now:
        return []
    relieved = rank_breakdowns(cfg, replace(shape, vocabulary_chunk_rows=rows))
    again = next(b for b in relieved if b.rank == rank.rank)
    return [
        f"train.vocabulary_chunk_rows={rows} (now {now}; predicted {_gib(again.peak_gib)} GiB, a slower loss)"
    ]


def memory_verdict(
    cfg: RootConfig,
    target_config: dict | None = None,
    total: float | None = None,
    world_size: int | None = None,
) -> tuple[bool, str] | None:
    """(fits, the line) for `cfg` on GPUs of `total` GiB (default: `gpu_memory_gib`); None when
    that is unknown. `target_config`: the target's config.json (default: read at model.target_path)."""
    total = total if total is not None else gpu_memory_gib(cfg)
    if total is None:
        return None
    if target_config is None:
        target_config = read_target_config(str(cfg.model.target_path))
    shape = training_shape(cfg, target_config, world_size)
    ranks = rank_breakdowns(cfg, shape)
    layout = layout_name(cfg)
    over = [rank for rank in ranks if rank.needed_gib > total]
    if not over:
        peaks = " and ".join(f"{_gib(r.peak_gib)} GiB per {_gpu(r)}" for r in ranks)
        return True, f"predicted peak {peaks}{',' if len(ranks) > 1 else ''} of {_gib(total)} GiB ({layout})"
    rank = over[0]
    return False, (
        f"predicted peak {_gib(rank.peak_gib)} GiB per {_gpu(rank)} ({_gib(rank.needed_gib)} GiB with the "
        f"CUDA context and the allocator's reserve) exceeds the {_gib(total)} GiB of the GPU ({layout}): "
        f"try {fixes(cfg, shape, rank, total)}; `python -m dflash_mp.plan memory` prints the breakdown"
    )


def _gib(value: float) -> str:
    return f"{value:.1f}" if value >= 1 else f"{value:.2f}"


def _gpu(rank: Breakdown) -> str:
    """ "GPU" (colocated), "target GPU", "drafter GPU"."""
    return "GPU" if rank.rank == "colocated" else f"{rank.rank.split()[0]} GPU"
