"""flex_block_mask's tile rule against the element rule, with anchors, document starts and windows on
tile edges (CPU; the tile lists are what flex_attention and FlashAttention 4 skip or take whole on
GPU).

The tiles must be sound, element by element against `dense_block_mask` (`block_mask_mod`): a *full*
tile (no mask applied) holds only allowed pairs, and a *skipped* tile (listed neither full nor
partial) holds none, in both orientations (key tiles per query tile for the forward, query tiles
per key tile for the backward). Anchors put a query tile's lowest and highest anchor exactly on a
key tile's first and last key and one beside them; starts and windows cross edges the same way.
"""

from __future__ import annotations

import pytest
import torch
from torch import Tensor

from dflash_mp.kernels.block_mask import FLEX_TILE, dense_block_mask, flex_block_mask

T = FLEX_TILE


def _listed(count: Tensor, indices: Tensor, width: int) -> Tensor:
    """A tile list (count [B,1,R], indices [B,1,R,C]) as [B, R, width] bool: listed tiles True."""
    batch, _, rows = count.shape
    slots = torch.arange(indices.shape[-1])
    chosen = torch.where(slots < count[..., None], indices.long(), width)[:, 0]
    tiles = torch.zeros(batch, rows, width + 1, dtype=torch.bool)
    return tiles.scatter_(2, chosen, True)[:, :, :width]


def _elements(tiles: Tensor, rows: int, cols: int) -> Tensor:
    return tiles.repeat_interleave(T, 1).repeat_interleave(T, 2)[:, :rows, :cols]


def tile_rule_violations(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None = None,
    starts: Tensor | None = None,
) -> list[str]:
    """Where flex_block_mask's tiles disagree with the element rule (empty: sound)."""
    mask = flex_block_mask(anchors, context_len, block_size, window, starts)
    allowed = dense_block_mask(anchors, context_len, block_size, window, starts)[:, 0]
    queries, keys = allowed.shape[1:]
    q_tiles, kv_tiles = -(-queries // T), -(-keys // T)
    forward = (
        _listed(mask.kv_num_blocks, mask.kv_indices, kv_tiles),
        _listed(mask.full_kv_num_blocks, mask.full_kv_indices, kv_tiles),
    )
    backward = tuple(
        _listed(count, indices, q_tiles).transpose(1, 2)
        for count, indices in (
            (mask.q_num_blocks, mask.q_indices),
            (mask.full_q_num_blocks, mask.full_q_indices),
        )
    )
    problems = []
    for direction, (partial, full) in (("forward", forward), ("backward", backward)):
        if (partial & full).any():
            problems.append(f"{direction}: a tile listed both partial and full")
        full_elements = _elements(full, queries, keys)
        listed_elements = _elements(partial | full, queries, keys)
        for b, q, k in (full_elements & ~allowed).nonzero()[:1].tolist():
            problems.append(f"{direction}: full tile holds the masked pair b={b} q={q} key={k}")
        for b, q, k in (allowed & ~listed_elements).nonzero()[:1].tolist():
            problems.append(f"{direction}: skipped tile holds the allowed pair b={b} q={q} key={k}")
    return problems


def edge_values(context_len: int) -> list[int]:
    """Context positions on and beside every key tile's first and last key (and 0, 1, S - 1)."""
    values = {0, 1, context_len - 1}
    for edge in range(0, context_len + 1, T):
        values |= {edge - 1, edge, edge + 1, edge + T - 1}
    return sorted(v for v in values if 0 <= v < context_len)


def edge_anchors(batch: int, num_anchors: int, block_size: int, context_len: int, seed: int) -> Tensor:
    """Sorted anchors where each query tile's lowest and highest anchor are edge values (others
    random between them), the last slots 0 as invalid ones."""
    generator = torch.Generator().manual_seed(seed)
    edges = torch.tensor(edge_values(context_len))
    per_tile = max(1, T // block_size)
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    for b in range(batch):
        for first in range(0, num_anchors, per_tile):
            count = min(per_tile, num_anchors - first)
            low, high = edges[torch.randint(len(edges), (2,), generator=generator)].sort().values.tolist()
            chunk = torch.randint(low, high + 1, (count,), generator=generator)
            chunk[0], chunk[-1] = low, high
            anchors[b, first : first + count] = chunk.sort().values
    anchors[:, -1] = 0  # an invalid slot
    return anchors


def edge_starts(anchors: Tensor, block_size: int, seed: int) -> Tensor:
    """Document starts at or below each anchor where each query tile's lowest and highest start are
    edge values at or below its lowest anchor (others random between them)."""
    generator = torch.Generator().manual_seed(seed)
    per_tile = max(1, T // block_size)
    starts = torch.zeros_like(anchors)
    for b in range(anchors.shape[0]):
        for first in range(0, anchors.shape[1], per_tile):
            chunk = anchors[b, first : first + per_tile]
            valid = chunk[chunk > 0]  # not the invalid slots' anchor 0 (their start is 0 below)
            edges = torch.tensor(edge_values(int(valid.min()) + 1 if len(valid) else 1))
            low, high = edges[torch.randint(len(edges), (2,), generator=generator)].sort().values.tolist()
            picked = torch.randint(low, high + 1, chunk.shape, generator=generator)
            picked[0], picked[-1] = low, high
            starts[b, first : first + per_tile] = picked[torch.randperm(len(picked), generator=generator)]
    return starts.minimum(anchors)


def edge_windows(anchors: Tensor, block_size: int, count: int, seed: int) -> list[int]:
    """Windows at which some (query tile, key tile) pair is exactly at, or one past, the bounds of
    the tile rule: the farthest pair of the tiles (full or not) and the nearest (reached or not)."""
    queries = anchors.repeat_interleave(block_size, 1)
    windows = set()
    for first in range(0, queries.shape[1], T):
        tile = queries[0, first : first + T]
        low, high = int(tile.min()), int(tile.max())
        for key_start in range(0, low + 1, T):
            farthest = high + block_size - 1 - key_start
            nearest = low - (key_start + T - 1)
            windows |= {farthest, farthest + 1, nearest, nearest + 1}
    windows = sorted(w for w in windows if w >= 1)
    generator = torch.Generator().manual_seed(seed)
    return [windows[i] for i in torch.randperm(len(windows), generator=generator)[:count].tolist()]


SHAPES = [  # context length, block size, anchors: tiles of 8, 32, 42.7 and 1/2 block(s) of queries
    (384, 16, 24),
    (300, 4, 70),
    (513, 3, 90),
    (260, 256, 2),
]


@pytest.mark.parametrize(("context_len", "block_size", "num_anchors"), SHAPES)
@pytest.mark.parametrize("window", [None, 1, 2, T - 1, T, T + 1, 200])
def test_tiles_with_anchors_on_tile_edges_match_the_element_rule(
    context_len: int, block_size: int, num_anchors: int, window: int | None
) -> None:
    for seed in range(4):
        anchors = edge_anchors(2, num_anchors, block_size, context_len, seed)
        assert not tile_rule_violations(anchors, context_len, block_size, window), (seed, anchors)


@pytest.mark.parametrize(("context_len", "block_size", "num_anchors"), SHAPES)
def test_windows_at_the_bounds_of_the_tile_rule_match_the_element_rule(
    context_len: int, block_size: int, num_anchors: int
) -> None:
    for seed in range(3):
        anchors = edge_anchors(1, num_anchors, block_size, context_len, seed)
        for window in edge_windows(anchors, block_size, count=8, seed=seed):
            problems = tile_rule_violations(anchors, context_len, block_size, window)
            assert not problems, (seed, window, problems, anchors)


@pytest.mark.parametrize(("context_len", "block_size", "num_anchors"), SHAPES)
@pytest.mark.parametrize("window", [None, T, 37])
def test_packed_tiles_with_starts_on_tile_edges_match_the_element_rule(
    context_len: int, block_size: int, num_anchors: int, window: int | None
) -> None:
    for seed in range(4):
        anchors = edge_anchors(2, num_anchors, block_size, context_len, seed)
        starts = edge_starts(anchors, block_size, seed)
        problems = tile_rule_violations(anchors, context_len, block_size, window, starts)
        assert not problems, (seed, problems, anchors, starts)


def test_random_anchors_starts_and_windows_match_the_element_rule() -> None:
    generator = torch.Generator().manual_seed(0)
    for trial in range(40):
        context_len = int(torch.randint(2, 700, (1,), generator=generator))
        block_size = int(torch.randint(1, 40, (1,), generator=generator))
        num_anchors = int(torch.randint(1, 50, (1,), generator=generator))
        anchors = torch.randint(0, context_len, (2, num_anchors), generator=generator).sort(-1).values
        starts = edge_starts(anchors, block_size, trial) if trial % 2 else None
        window = None if trial % 3 == 0 else int(torch.randint(1, 300, (1,), generator=generator))
        problems = tile_rule_violations(anchors, context_len, block_size, window, starts)
        assert not problems, (context_len, block_size, window, problems, anchors, starts)


def test_a_query_tile_whose_lowest_anchor_is_a_key_tiles_last_key_sees_that_tile_partially() -> None:
    """The edge case by hand: anchors 127 (lowest) .. 200 leave key 127 of tile 0 masked for the
    first block, so tile (0, 0) is partial, never full; anchors from 128 make it full."""
    for lowest, full in ((T - 1, False), (T, True)):
        anchors = torch.tensor([[lowest] + [200] * 7])
        mask = flex_block_mask(anchors, 256, 16)
        full_tiles = _listed(mask.full_kv_num_blocks, mask.full_kv_indices, 4)
        assert bool(full_tiles[0, 0, 0]) == full, lowest
        assert not tile_rule_violations(anchors, 256, 16)
