"""The target and the perturbed drafter the draft-field tests share (test_draft_fields*.py)."""

from __future__ import annotations

import torch
from dflash.model import build_target_layer_ids
from transformers import Qwen3Config

from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

HIDDEN, BLOCK, VOCAB = 64, 4, 300
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.2,
)
SCALING = {"input_embedding_scale": 2.5, "output_multiplier": 0.6, "final_logit_softcapping": 1.5}


def fields_drafter(arch: str, window: int | None, scaling: dict | None = None) -> DFlashDrafter:
    """A 3-layer drafter on TARGET (sliding layers around a full one when `window` is set), its norms
    and convolutions moved off their initial values."""
    config = build_drafter_config(
        TARGET,
        3,
        build_target_layer_ids(TARGET.num_hidden_layers, 2),
        block_size=BLOCK,
        mask_token_id=VOCAB - 1,
        arch=arch,
        dflash2={"conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5},
        layer_types=None if window is None else ["sliding_attention", "full_attention", "sliding_attention"],
        sliding_window=window,
        scaling=scaling,
    )
    drafter = DFlashDrafter(config, seed=0)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # off the identity/no-op init, so every module shows in the outputs
        for name, param in drafter.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1 + 0.3 * noise)
            elif "base_kernel" in name or "codebook" in name or "kernel_projection" in name:
                param.add_(0.1 * noise)
    return drafter.eval()
