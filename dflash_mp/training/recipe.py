"""What the config's recipe builds and schedules: the drafter (the same on every rank) and the
learning rate at each step."""

from __future__ import annotations

import math
from typing import Any

from dflash_mp.config.dspark_checks import dspark_fields
from dflash_mp.config.mask_token import mask_token_id
from dflash_mp.config.schema import RootConfig, read_target_config, resolved_target_layer_ids
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import (
    DFLASH2_FIELDS,
    SCALING_DEFAULTS,
    XPRESS_FIELDS,
    build_drafter_config,
)


def lr_at(step: int, total_steps: int, peak: float, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to min_ratio * peak (DFlash recipe: 4% warm-up)."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def drafter_choices(model: Any) -> dict[str, Any]:
    """What `cfg.model` chooses of the drafter beyond the target's shapes: build_drafter_config's
    arch, head fields, attention layout and scaling (the benchmark builds its drafter from these too)."""
    return dict(
        arch=model.arch,
        dflash2={key: getattr(model, key) for key in DFLASH2_FIELDS},
        layer_types=None if model.layer_types is None else list(model.layer_types),
        sliding_window=model.sliding_window,
        scaling={key: getattr(model, key) for key in SCALING_DEFAULTS},
        xpress={key: getattr(model, key) for key in XPRESS_FIELDS},
        dspark=dspark_fields(model),
    )


def build_drafter(cfg: RootConfig) -> DFlashDrafter:
    """A freshly initialised drafter (identical on every rank: seeded by train.seed)."""
    target = read_target_config(cfg.model.target_path)
    layer_ids = resolved_target_layer_ids(cfg, int(target["num_hidden_layers"]))
    config = build_drafter_config(
        target,
        draft_layers=cfg.model.draft_layers,
        target_layer_ids=layer_ids,
        block_size=cfg.model.block_size,
        mask_token_id=mask_token_id(cfg.model),
        **drafter_choices(cfg.model),
    )
    return DFlashDrafter(config, seed=cfg.train.seed)
