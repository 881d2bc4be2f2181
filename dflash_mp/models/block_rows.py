"""Rows of back-to-back draft blocks that training need not compute one by one.

A block is its anchor's token followed by mask tokens, so until the first layer mixes positions
(RoPE, attention) all the mask rows of a micro-batch are one row: the first layer's norm and q/k/v
projections need only [each block's first row ; the mask row], expanded after. And the loss scores
block indices 1..Bs-1 only, so the last layer's output at index 0 feeds nothing: its o_proj and MLP
skip that row. Layouts: "full" is [B, N*Bs, ...] (block n at rows n*Bs..), "compact" is
[B, N+1, ...] (the N first rows, then the mask row), "scored" is [B, N*(Bs-1), ...].
"""

from __future__ import annotations

from typing import NamedTuple

import torch
from torch import Tensor


class BlockRows(NamedTuple):
    """Block inputs given by their distinct rows: `first` [B, N, H] (each block's index 0) and
    `mask` [B, 1, H] (the row every other index holds; an expanded view costs no memory)."""

    first: Tensor
    mask: Tensor

    def compact(self) -> Tensor:
        return torch.cat([self.first, self.mask], dim=1)


def expand_compact(compact: Tensor, block_size: int) -> Tensor:
    """[B, N+1, ...] compact rows -> [B, N*Bs, ...] full rows. Its backward sums the mask row's
    gradient over every index it fills (a reduction, not a scatter)."""
    first, mask = compact[:, :-1], compact[:, -1:]
    batch, blocks = first.shape[:2]
    repeated = mask.unsqueeze(2).expand(batch, blocks, block_size - 1, *mask.shape[2:])
    return torch.cat([first.unsqueeze(2), repeated], dim=2).flatten(1, 2)


def scored_rows(full: Tensor, block_size: int) -> Tensor:
    """[B, N*Bs, ...] full rows -> [B, N*(Bs-1), ...]: every block without its index 0."""
    batch, rows = full.shape[:2]
    by_block = full.reshape(batch, rows // block_size, block_size, *full.shape[2:])
    return by_block[:, :, 1:].flatten(1, 2)
