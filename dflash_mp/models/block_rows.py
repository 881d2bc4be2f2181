"""Rows of back-to-back draft blocks that training need not compute one by one.

A block is its anchor's token followed by mask tokens, so until the first layer mixes positions
(RoPE, attention) all the mask rows of a micro-batch are one row: the first layer's norm and q/k/v
projections need only [each block's first row ; the mask row], expanded after. And the loss scores
block indices 1..Bs-1 only, so the last layer's output at index 0 feeds nothing: its o_proj and MLP
skip that row. Layouts: "full" is [B, N*Bs, ...] (block n at rows n*Bs..), `BlockRows` holds the
N first rows and the mask row, "scored" is [B, N*(Bs-1), ...].
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor


class BlockRows(NamedTuple):
    """Block inputs given by their distinct rows: `first` [B, N, ...] (each block's index 0) and
    `mask` [B, 1, ...] (the row every other index holds; an expanded view costs no memory).
    Kept apart (not concatenated) so that no graph slices a dimension whose size varies."""

    first: Tensor
    mask: Tensor

    def map(self, fn: Callable[[Tensor], Tensor]) -> BlockRows:
        """`fn` (row-wise) applied to the distinct rows."""
        return BlockRows(fn(self.first), fn(self.mask))


def expand_rows(rows: BlockRows, block_size: int) -> Tensor:
    """The full rows [B, N*Bs, ...] of `rows`. Its backward sums the mask row's gradient over every
    index it fills (a reduction, not a scatter)."""
    batch, blocks = rows.first.shape[:2]
    repeated = rows.mask.unsqueeze(2).expand(batch, blocks, block_size - 1, *rows.mask.shape[2:])
    return torch.cat([rows.first.unsqueeze(2), repeated], dim=2).flatten(1, 2)


def scored_rows(full: Tensor, block_size: int) -> Tensor:
    """[B, N*Bs, ...] full rows -> [B, N*(Bs-1), ...]: every block without its index 0."""
    batch, rows = full.shape[:2]
    by_block = full.reshape(batch, rows // block_size, block_size, *full.shape[2:])
    return by_block[:, :, 1:].flatten(1, 2)
