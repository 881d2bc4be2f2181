"""The block-sparse attention mask of DFlash training (docs/DESIGN.md §3).

Keys are [context features 0..S-1 ; block tokens of all N blocks]. A query of block n (anchor
a_n) sees the context positions before a_n and its own block (non-causal), nothing of other
blocks; in a sliding-attention layer a query sees only keys less than `window` positions from it
(the reference's rule). The same rule serves four forms: a flex_attention mask_mod, a dense boolean mask
for SDPA on CPU, a flex BlockMask built tile by tile from the anchors (no compiled
create_block_mask), and that BlockMask's tile lists with the anchors for FlashAttention 4, whose
kernels apply the rule as CuTe code (`dflash_mp.kernels.flash_attention`).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


def block_mask_mod(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None = None,
    starts: Tensor | None = None,
) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> True where the query may attend the key.

    Keys are [context 0..S-1 ; block tokens]. Query q is in block n = q // Bs; it sees context
    key j iff j < a_n (features strictly before the anchor, as the cropped KV cache at inference)
    and block key t iff t // Bs == n (its own block, non-causal). Pure tensor ops, so the same
    function runs under flex_attention's vmap and, with broadcast index tensors, densely.

    A sliding-attention layer (`window` set) also needs |query position - key position| < window,
    the reference's `_attention_mask` rule (non-causal): query q sits at a_n + q % Bs, context key
    j at j, block key t at a_n + t % Bs.

    Packed rows (`starts` [B, N]: where block n's document begins) see context from there only:
    starts[b, n] <= j < a_n.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size
        anchor = anchors[b, block]
        sees_context = kv_idx < anchor
        if starts is not None:
            sees_context = sees_context & (kv_idx >= starts[b, block])
        in_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        if window is None:
            return sees_context | in_own_block
        offset = q_idx % block_size
        sees_context = sees_context & (anchor + offset - kv_idx < window)
        in_own_block = in_own_block & ((offset - (kv_idx - context_len) % block_size).abs() < window)
        return sees_context | in_own_block

    return mask_mod


def dense_block_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None = None,
    starts: Tensor | None = None,
) -> Tensor:
    """The block-sparse mask as a dense bool tensor [B,1,Q,S+Q] (True = attend) for SDPA."""
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    device = anchors.device
    mask_mod = block_mask_mod(anchors, context_len, block_size, window, starts)
    return mask_mod(
        torch.arange(batch, device=device)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
        torch.arange(num_queries, device=device)[None, None, :, None],
        torch.arange(context_len + num_queries, device=device)[None, None, None, :],
    )


# flex_attention's default tile: masks are described per (128 queries x 128 keys) tile.
FLEX_TILE = 128


def _tiles_to_ordered(tiles: Tensor) -> tuple[Tensor, Tensor]:
    """[B, rows, columns] bool -> (count [B,1,rows], indices [B,1,rows,columns]) int32, listed tiles
    first: flex's ordered form (as its `_dense_to_ordered`)."""
    count = tiles.sum(-1, dtype=torch.int32)
    indices = torch.argsort(tiles.to(torch.int8), dim=-1, descending=True, stable=True).to(torch.int32)
    return _row_major(count[:, None]), _row_major(indices[:, None])


def _row_major(tensor: Tensor) -> Tensor:
    """`tensor` with row-major strides on every dimension, size-1 ones included.

    contiguous() leaves a size-1 dimension's stride as it was (from a transpose, say), and
    FlashAttention 4's DLPack import insists on stride 1 in the last one: a one-tile-wide list
    failed there. Same elements, so a view, or a copy where the layout differs otherwise.
    """
    tensor = tensor.contiguous()
    strides, step = [], 1
    for size in reversed(tensor.shape):
        strides.append(step)
        step *= size
    return tensor.as_strided(tensor.shape, tuple(reversed(strides)))


def flex_block_mask(
    anchors: Tensor,
    context_len: int,
    block_size: int,
    window: int | None = None,
    starts: Tensor | None = None,
) -> BlockMask:
    """The block-sparse mask as a flex_attention BlockMask (heads broadcast), built tile by tile.

    The mask's structure is known, so each (query tile, key tile) is classified from the anchors
    alone: a context tile is *full* when every query's anchor lies beyond it, *empty* when none
    does; block-token tiles are partial where the query and key block ranges meet. That is a few
    small tensor ops, instead of evaluating mask_mod on all Q x (S+Q) pairs as create_block_mask
    does (compiled, that took 155 s of cold start on an H200; eager, it materialises the pairs).
    Partial tiles apply `block_mask_mod` element by element, so the result is exact. With a
    `window`, a context tile is full only if also every query lies within the window of every key,
    and listed at all only if some query can reach its last key. With `starts` (packed rows), a
    context tile is listed only if some query's document begins before its end, and full only if
    every query's document begins at or before its start.
    """
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    num_keys = context_len + num_queries
    q_tiles, kv_tiles = -(-num_queries // FLEX_TILE), -(-num_keys // FLEX_TILE)
    # Query positions a_n + q % Bs lie in [lowest, highest + Bs - 1] within a tile.
    lowest, highest = _tile_extremes(anchors, block_size, q_tiles)
    key_start = torch.arange(kv_tiles, device=anchors.device) * FLEX_TILE
    key_end = (key_start + FLEX_TILE).clamp(max=num_keys)
    # Context keys [key_start, min(key_end, S)): query q sees key j iff j < anchor(q).
    sees_context = (key_start < context_len) & (key_start < highest)
    all_context = (key_end <= context_len) & (key_end <= lowest)
    if starts is not None:
        first_start, last_start = _tile_extremes(starts, block_size, q_tiles)
        sees_context = sees_context & (key_end > first_start)
        all_context = all_context & (last_start <= key_start)
    if window is not None:
        sees_context = sees_context & (lowest - (key_end - 1) < window)
        all_context = all_context & (highest + block_size - 1 - key_start < window)
    sees_blocks = _sees_block_keys(context_len, block_size, num_queries, q_tiles, key_start, key_end)
    full = all_context
    partial = (sees_context | sees_blocks) & ~full
    mask_mod = block_mask_mod(anchors, context_len, block_size, window, starts)
    return _block_mask_of_tiles(partial, full, num_queries, num_keys, mask_mod)


def _tile_extremes(per_anchor: Tensor, block_size: int, q_tiles: int) -> tuple[Tensor, Tensor]:
    """The lowest and highest of a per-anchor value [B, N] over each query tile, [B, q_tiles, 1]."""
    batch, num_anchors = per_anchor.shape
    num_queries = num_anchors * block_size
    per_query = per_anchor[:, :, None].expand(batch, num_anchors, block_size).reshape(batch, num_queries)
    # Padded to whole tiles with the last query's value (padding rows are never computed).
    padding = q_tiles * FLEX_TILE - num_queries
    per_query = torch.cat([per_query, per_query[:, -1:].expand(batch, padding)], dim=1)
    per_tile = per_query.view(batch, q_tiles, FLEX_TILE)
    return per_tile.min(-1).values[:, :, None], per_tile.max(-1).values[:, :, None]


def _sees_block_keys(
    context_len: int, block_size: int, num_queries: int, q_tiles: int, key_start: Tensor, key_end: Tensor
) -> Tensor:
    """[q_tiles, kv_tiles]: whether a query tile and a key tile share a block's tokens."""
    # Block keys: block-token t (key S + t) is seen by the queries of block t // Bs only.
    query_start = torch.arange(q_tiles, device=key_start.device) * FLEX_TILE
    query_end = (query_start + FLEX_TILE).clamp(max=num_queries)
    first_query_block, last_query_block = query_start // block_size, (query_end - 1) // block_size
    first_key_block = (key_start.clamp(min=context_len) - context_len) // block_size
    last_key_block = (key_end - 1 - context_len) // block_size
    return (
        (key_end > context_len)
        & (first_key_block <= last_query_block[:, None])
        & (first_query_block[:, None] <= last_key_block)
    )


def _block_mask_of_tiles(
    partial: Tensor, full: Tensor, num_queries: int, num_keys: int, mask_mod: Callable
) -> BlockMask:
    """The BlockMask of [B, q_tiles, kv_tiles] partial and full tiles."""
    # Both orientations from the tiles at hand: BlockMask.from_kv_blocks would rebuild the dense
    # tiles from the lists to transpose them, some twenty more small kernels per micro-batch.
    kv_count, kv_indices = _tiles_to_ordered(partial)
    full_kv_count, full_kv_indices = _tiles_to_ordered(full)
    q_count, q_indices = _tiles_to_ordered(partial.transpose(-2, -1))
    full_q_count, full_q_indices = _tiles_to_ordered(full.transpose(-2, -1))
    return BlockMask(
        seq_lengths=(num_queries, num_keys),
        kv_num_blocks=kv_count,
        kv_indices=kv_indices,
        full_kv_num_blocks=full_kv_count,
        full_kv_indices=full_kv_indices,
        q_num_blocks=q_count,
        q_indices=q_indices,
        full_q_num_blocks=full_q_count,
        full_q_indices=full_q_indices,
        BLOCK_SIZE=(FLEX_TILE, FLEX_TILE),
        mask_mod=mask_mod,
    )


class TileMask(NamedTuple):
    """The mask for kernels that apply the rule themselves: flex's tile lists and the anchors."""

    tiles: BlockMask  # which (128 x 128) tiles are skipped, whole or partial, in both orientations
    anchors: Tensor  # int32 [B, A]: block n's anchor; padded to whole query tiles with the last one
    block_size: int
    starts: Tensor | None = None  # int32 [B, A], packed rows: where block n's document begins


def tile_block_mask(
    anchors: Tensor, context_len: int, block_size: int, starts: Tensor | None = None
) -> TileMask:
    """The mask as a TileMask (full-attention layers; sliding ones take `flex_block_mask`)."""
    batch, num_anchors = anchors.shape
    # FA4 evaluates the rule on whole query tiles: every row of the last tile needs an anchor.
    rows = -(-num_anchors * block_size // FLEX_TILE) * FLEX_TILE
    padding = -(-rows // block_size) - num_anchors

    def padded(per_block: Tensor) -> Tensor:
        return (
            torch.cat([per_block, per_block[:, -1:].expand(batch, padding)], dim=1)
            .to(torch.int32)
            .contiguous()
        )

    tiles = flex_block_mask(anchors, context_len, block_size, starts=starts)
    return TileMask(tiles, padded(anchors), block_size, None if starts is None else padded(starts))
