"""Mixture-of-experts for the frozen target: transformers' grouped-GEMM experts with a cheaper
combine, registered as one more experts implementation (EXPERTS_IMPLEMENTATION).

transformers' `grouped_mm` forward sorts the token-expert pairs by expert, runs the up and down
projections as two grouped GEMMs, then multiplies every row by its routing weight, gathers the rows
back into token order and sums each token's top-k rows. Compiled, that gather-and-sum lowers to a
reduction over k, whose loads stride across rows: 13% of a Qwen3-30B-A3B layer on an H200, about
five times its memory-bound time. Here each token's output is written as top-k explicit terms
(weight x gathered row, accumulated in fp32), which inductor lowers to one pointwise kernel whose
loads run along the hidden dimension, and the weighted rows are never materialised. Same maths:
the sum of the same products, only rounded once instead of per product.
"""

from __future__ import annotations

import torch
from torch import nn

EXPERTS_IMPLEMENTATION = "dflash_grouped_mm"


def register() -> bool:
    """Make EXPERTS_IMPLEMENTATION known to transformers; False where this transformers lacks the
    pieces (its experts interface or its grouped linear), so callers keep `grouped_mm`."""
    try:
        from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS, _grouped_linear  # noqa: F401
    except ImportError:
        return False
    if EXPERTS_IMPLEMENTATION not in ALL_EXPERTS_FUNCTIONS:
        ALL_EXPERTS_FUNCTIONS.register(EXPERTS_IMPLEMENTATION, grouped_experts_forward)
    return True


def grouped_experts_forward(
    self: nn.Module, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor
) -> torch.Tensor:
    """The experts forward of transformers' `use_experts_implementation` classes: tokens [T, H],
    top_k_index and top_k_weights [T, k] -> [T, H]."""
    from transformers.integrations.moe import _grouped_linear, grouped_mm_experts_forward

    if getattr(self, "_is_expert_parallel", False):  # sentinel rows from other ranks: transformers' path
        return grouped_mm_experts_forward(self, hidden_states, top_k_index, top_k_weights)
    tokens, top_k = top_k_index.shape
    expert_ids = top_k_index.reshape(-1)
    # The sort's keys in the fewest bits that hold an expert id: a GPU radix sort makes one pass
    # per 8 bits of key (8 for int64: 5% of a Qwen3-30B-A3B forward on an H200).
    keys, perm = torch.sort(expert_ids.to(_key_dtype(self.num_experts)), stable=True)
    expert_ids_sorted = keys.int()  # an index, never a uint8 mask
    rows = hidden_states[perm // top_k]
    # histc, not bincount: no host sync (CUDA takes ints, CPU floats).
    counts_input = expert_ids_sorted if hidden_states.is_cuda else expert_ids_sorted.float()
    per_expert = torch.histc(counts_input, bins=self.num_experts, min=0, max=self.num_experts - 1)
    offsets = torch.cumsum(per_expert, dim=0, dtype=torch.int32)

    def linear(x: torch.Tensor, weight: torch.Tensor, bias_name: str) -> torch.Tensor:
        bias = getattr(self, bias_name)[expert_ids_sorted] if self.has_bias else None
        return _grouped_linear(x, weight, offsets, bias=bias, is_transposed=self.is_transposed)

    if self.has_gate:
        out = self._apply_gate(linear(rows, self.gate_up_proj, "gate_up_proj_bias"))
    else:
        out = self.act_fn(linear(rows, self.up_proj, "up_proj_bias"))
    out = linear(out, self.down_proj, "down_proj_bias")
    if getattr(self, "has_post_expert_norm", False):
        out = self.post_expert_norm(out)
    # Where each token's j-th pair landed in the sorted order.
    position = torch.empty_like(perm)
    position[perm] = torch.arange(perm.numel(), device=perm.device)
    position = position.view(tokens, top_k)
    weights = top_k_weights.float()
    combined = out[position[:, 0]].float() * weights[:, :1]
    for j in range(1, top_k):
        combined = combined + out[position[:, j]].float() * weights[:, j : j + 1]
    return combined.to(hidden_states.dtype)


def _key_dtype(num_experts: int) -> torch.dtype:
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2**15 else torch.int32
