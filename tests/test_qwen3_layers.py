"""The drafter's own Qwen3 blocks (dflash_mp/models/qwen3_layers.py) against transformers' Qwen3
modules, which the reference `dflash` drafter is built from: same outputs bit for bit, same
gradients, same parameter and buffer names, and the same RoPE settings accepted and refused."""

from __future__ import annotations

import pytest
import torch
from transformers import Qwen3Config
from transformers.models.qwen3 import modeling_qwen3 as hf

from dflash_mp.models import qwen3_layers as ours

CONFIG = dict(
    hidden_size=64, intermediate_size=96, num_attention_heads=4, head_dim=16, max_position_embeddings=512
)


def _config(**fields) -> Qwen3Config:
    config = Qwen3Config(**CONFIG)
    for key, value in fields.items():
        setattr(config, key, value)
    return config


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rms_norm_and_mlp_equal_transformers_with_gradients(dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    config = _config()
    pairs = [
        (ours.RMSNorm(64, eps=1e-6), hf.Qwen3RMSNorm(64, eps=1e-6)),
        (ours.GatedMLP(config), hf.Qwen3MLP(config)),
    ]
    for mine, theirs in pairs:
        for parameter in theirs.parameters():
            parameter.data.normal_()
        mine.load_state_dict(theirs.state_dict(), strict=True)
        mine.to(dtype), theirs.to(dtype)
        x = torch.randn(3, 5, 64, dtype=dtype)
        a, b = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_mine, out_theirs = mine(a), theirs(b)
        assert torch.equal(out_mine, out_theirs), type(theirs).__name__
        out_mine.square().sum().backward()
        out_theirs.square().sum().backward()
        assert torch.equal(a.grad, b.grad)
        for (name, p), (_, q) in zip(mine.named_parameters(), theirs.named_parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name


def test_rotate_half_equals_transformers() -> None:
    x = torch.randn(2, 4, 7, 16)
    assert torch.equal(ours.rotate_half(x), hf.rotate_half(x))


ROPES = [
    {"rope_type": "default", "rope_theta": 1e6},
    {"rope_type": "linear", "rope_theta": 1e4, "factor": 4.0},
    {"rope_type": "yarn", "rope_theta": 1e6, "factor": 4.0, "original_max_position_embeddings": 128},
    {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "dynamic", "rope_theta": 1e4, "factor": 2.0},
    {"rope_type": "default"},  # no rope_theta
    {"rope_type": "no-such-type", "rope_theta": 1e6},
]  # fmt: skip


@pytest.mark.parametrize("rope", ROPES, ids=lambda rope: f"{rope['rope_type']}-{len(rope)}")
def test_the_rotary_embedding_equals_transformers_or_fails_as_it_does(rope: dict) -> None:
    """What the drafter builds and what the preflight's check (models/drafter_config.py) counts."""
    config = _config(rope_parameters=dict(rope))
    try:
        theirs = hf.Qwen3RotaryEmbedding(config)
    except (KeyError, ValueError, TypeError) as error:
        with pytest.raises(type(error)):
            ours.rotary_embedding(config)
        return
    mine = ours.rotary_embedding(config)
    assert mine.state_dict().keys() == theirs.state_dict().keys()
    assert dict(mine.named_buffers()).keys() == dict(theirs.named_buffers()).keys()
    positions = torch.arange(0, 700, 3)[None]  # past max_position_embeddings: dynamic types rescale
    for dtype in (torch.float32, torch.bfloat16):
        x = torch.zeros(1, dtype=dtype)
        for got, expected in zip(mine(x, positions), theirs(x, positions), strict=True):
            assert got.dtype == expected.dtype and torch.equal(got, expected)
