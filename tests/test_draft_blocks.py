"""The flex mask's query-tile lists, which it builds itself instead of BlockMask.from_kv_blocks."""

from __future__ import annotations

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash_mp.block_mask import flex_block_mask


@pytest.mark.parametrize("window", [None, 37])
def test_the_query_tile_lists_are_those_blockmask_would_transpose(window) -> None:
    anchors = torch.sort(torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(1))).values
    mask = flex_block_mask(anchors, 300, 4, window)
    reference = BlockMask.from_kv_blocks(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices
    )
    assert window is not None or mask.full_q_num_blocks.any()  # full tiles to list (none in a window)
    for ours, theirs in [
        (mask.q_num_blocks, reference.q_num_blocks),
        (mask.q_indices, reference.q_indices),
        (mask.full_q_num_blocks, reference.full_q_num_blocks),
        (mask.full_q_indices, reference.full_q_indices),
    ]:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)
