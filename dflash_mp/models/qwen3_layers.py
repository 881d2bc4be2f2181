"""The Qwen3 building blocks the drafter uses (RMSNorm, gated MLP, rotary embedding), computed as
transformers' Qwen3 modules compute them (the reference `dflash` drafter is built from those), with
the same parameter and buffer names.

Here rather than imported from `transformers.models.qwen3.modeling_qwen3`: that module pulls in
transformers' whole modeling stack (modeling_utils, generation, masking, torch._dynamo), seconds
of CPU in every drafter process that neither evaluates nor exports. tests/test_drafter_parity.py
holds them equal to transformers' modules.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

# RoPE types whose tables transformers recomputes as the sequence grows (dynamic_rope_update):
# those keep transformers' own module.
_DYNAMIC_ROPE_TYPES = ("dynamic", "longrope")


class RMSNorm(nn.Module):
    """Qwen3RMSNorm: normalised in fp32, cast back, then scaled by the weight."""

    def __init__(self, hidden_size: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(hidden_size))
        self.variance_epsilon = eps

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        input_dtype = hidden_states.dtype
        hidden_states = hidden_states.to(torch.float32)
        variance = hidden_states.pow(2).mean(-1, keepdim=True)
        hidden_states = hidden_states * torch.rsqrt(variance + self.variance_epsilon)
        return self.weight * hidden_states.to(input_dtype)

    def extra_repr(self) -> str:
        return f"{tuple(self.weight.shape)}, eps={self.variance_epsilon}"


class GatedMLP(nn.Module):
    """Qwen3MLP: down(act(gate(x)) * up(x)), no biases."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)
        self.act_fn = _activation(config.hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_fn(self.gate_proj(x)) * self.up_proj(x))


def _activation(name: str) -> nn.Module:
    if name == "silu":  # every drafter this project builds (models/drafter_config.py)
        return nn.SiLU()
    from transformers.activations import ACT2FN

    return ACT2FN[name]


class RotaryEmbedding(nn.Module):
    """Qwen3RotaryEmbedding for RoPE types with fixed tables: (cos, sin) of the positions, scaled
    by the type's attention factor; `inv_freq` is a non-persistent buffer as there."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.rope_type = config.rope_parameters["rope_type"]
        if self.rope_type == "default":
            base = config.rope_parameters["rope_theta"]
            dim = config.head_dim
            inv_freq = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float) / dim))
            self.attention_scaling = 1.0
        else:
            from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

            inv_freq, self.attention_scaling = ROPE_INIT_FUNCTIONS[self.rope_type](config)
        self.register_buffer("inv_freq", inv_freq, persistent=False)
        self.register_buffer("original_inv_freq", inv_freq.clone(), persistent=False)

    def forward(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1)
        cos = emb.cos() * self.attention_scaling
        sin = emb.sin() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


def rotary_embedding(config: Any) -> nn.Module:
    """The drafter's rotary embedding for `config`: ours, or transformers' for the dynamic types."""
    if config.rope_parameters.get("rope_type") in _DYNAMIC_ROPE_TYPES:
        from transformers.models.qwen3.modeling_qwen3 import Qwen3RotaryEmbedding

        return Qwen3RotaryEmbedding(config)
    return RotaryEmbedding(config)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """[x1, x2] -> [-x2, x1] over the last dimension's halves."""
    x1 = x[..., : x.shape[-1] // 2]
    x2 = x[..., x.shape[-1] // 2 :]
    return torch.cat((-x2, x1), dim=-1)
