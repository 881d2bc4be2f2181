"""What a micro-batch's drafter forward takes besides the features: anchors, blocks, labels, mask.

The drafter is trained exactly the way the reference inference (`dflash.dflash_generate`,
docs/DESIGN.md §3) reads it. At inference, after the target accepted tokens up to position p,
the drafter gets the block `[token at p, MASK x (Bs-1)]` at positions p..p+Bs-1, the
target's features of positions < p (its KV cache is cropped to p), and its output at block
index k >= 1 is the guess for the token at position p+k. Training replays that situation
at many anchor positions p of each sequence at once:

    keys    = [context features 0..S-1 ; block tokens of all N blocks]
    queries = block tokens, block n = [x[a_n], MASK, ..., MASK] at positions a_n..a_n+Bs-1
    block n sees context j < a_n and its own Bs tokens (non-causal), nothing of other blocks
    label at block index k = x[a_n + k], weight exp(-(k-1)/gamma) on response tokens, k >= 1

Shapes are static (always N anchor slots, padded with invalid ones) so compiled kernels
never recompile on a varying number of anchors.
"""

from __future__ import annotations

import functools
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_mp.kernels.block_mask import dense_block_mask, flex_block_mask, tile_block_mask
from dflash_mp.models.packed_rows import document_index, document_positions, start_of_document

# ----------------------------------------------------------------------------- anchors

_MASK32 = 0xFFFFFFFF


def _mix32(x: Tensor) -> Tensor:
    """A 32-bit integer finaliser (xor-shift-multiply) on int64 tensors holding values < 2**32.

    The multiplier is below 2**27, so no product leaves int64: the result is the same on every
    device and every torch version, unlike a Generator stream.
    """
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    x = x ^ (x >> 16)
    x = (x * 0x45D9F3B) & _MASK32
    return x ^ (x >> 16)


def anchor_keys(seed: int, epoch: int, sample_ids: Tensor, seq_len: int) -> Tensor:
    """[B, S] int64 pseudo-random keys in [0, 2**32), a pure function of (seed, epoch, sample, position).

    Anchors therefore depend on the record only, never on the topology or batch composition
    (docs/DESIGN.md §2 determinism), and are fresh each epoch (§3).
    """
    positions = torch.arange(seq_len, device=sample_ids.device)
    return document_anchor_keys(seed, epoch, sample_ids[:, None], positions[None, :])


def document_anchor_keys(seed: int, epoch: int, document_ids: Tensor, positions: Tensor) -> Tensor:
    """`anchor_keys` of a record's tokens wherever they sit: keys of (seed, epoch, record id,
    position within the record), broadcast over `document_ids` and `positions`. A record packed
    with others draws the keys it draws alone."""
    ids = document_ids.long()
    stream = _mix32(torch.full_like(ids, seed & _MASK32))
    stream = _mix32(stream ^ (epoch & _MASK32))
    stream = _mix32(stream ^ (ids & _MASK32))
    stream = _mix32(stream ^ ((ids >> 32) & _MASK32))
    # 0x9E3779B1 (the 32-bit golden ratio) spreads consecutive positions before mixing.
    return _mix32(_mix32((stream + positions * 0x9E3779B1) & _MASK32))


def sample_anchors(
    loss_mask: Tensor, lengths: Tensor, sample_ids: Tensor, epoch: int, seed: int, num_anchors: int
) -> tuple[Tensor, Tensor]:
    """Draw up to `num_anchors` distinct sorted anchor positions per sequence.

    Eligible p: a response token with some context before it (p >= 1) whose next token is a
    response token too (loss_mask[p] and loss_mask[p + 1], p + 1 < length). Inference drafts
    only from inside a response: an anchor on a turn-final end-of-turn token would train on
    nothing, or on the next turn at offsets inference never sees. Returns (anchors [B,N] int64,
    valid [B,N] bool); invalid slots come last and hold anchor 0, which keeps every mask row
    non-empty (see `block_mask.block_mask_mod`).

    The eligible positions with the N smallest keys form a uniform draw without replacement.
    Everything runs on the inputs' device with static shapes: no host synchronisation, nothing
    for a compiled step to recompile on.
    """
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    positions = torch.arange(seq_len, device=device)
    response = loss_mask.bool()
    next_is_response = F.pad(response[:, 1:], (0, 1), value=False)
    eligible = response & next_is_response & (positions >= 1) & (positions + 1 < lengths[:, None].to(device))
    # key * S + position is unique per row, so ties cannot make the choice order-dependent.
    keys = anchor_keys(seed, epoch, sample_ids.to(device), seq_len) * seq_len + positions
    never = torch.iinfo(torch.int64).max
    keys = torch.where(eligible, keys, never)
    picked = min(num_anchors, seq_len)
    smallest = keys.topk(picked, dim=-1, largest=False, sorted=False).values
    # Chosen positions ascending, unused slots (key `never`) pushed last by the sort.
    chosen = torch.where(smallest != never, smallest % seq_len, seq_len).sort(dim=-1).values
    valid = chosen < seq_len
    anchors = torch.where(valid, chosen, 0)
    if picked < num_anchors:  # more slots than positions: pad with invalid slots
        anchors = torch.cat([anchors, anchors.new_zeros(batch, num_anchors - picked)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(batch, num_anchors - picked)], dim=1)
    return anchors, valid


def sample_document_anchors(
    loss_mask: Tensor,
    lengths: Tensor,
    document_ids: Tensor,
    epoch: int,
    seed: int,
    num_anchors: int,
    row_tokens: int,
) -> tuple[Tensor, Tensor]:
    """`sample_anchors` for packed rows (data.packing): anchors per document.

    Document d of a row gets floor(num_anchors * len_d / row_tokens) anchors (row_tokens =
    data.max_length): the recipe's density of num_anchors per max_length tokens, kept per
    document, so a row's budget never exceeds num_anchors. They are its eligible positions (as
    `sample_anchors`, with p + 1 in the same document) with the smallest keys of (seed, epoch,
    record, position in the record): a record draws the same anchors whatever it is packed with.
    """
    batch, seq_len = loss_mask.shape
    device = loss_mask.device
    positions = torch.arange(seq_len, device=device)
    in_document = document_positions(document_ids)
    response = loss_mask.bool()
    same_next = F.pad(document_ids[:, 1:] == document_ids[:, :-1], (0, 1), value=False)
    next_is_response = F.pad(response[:, 1:], (0, 1), value=False)
    eligible = response & next_is_response & same_next & (in_document >= 1) & (document_ids >= 0)
    eligible &= positions + 1 < lengths[:, None].to(device)
    # (key, position in the record) order; 2**20 > any position, so the pair never collides.
    keys = document_anchor_keys(seed, epoch, document_ids, in_document) * (1 << 20) + in_document
    keys = torch.where(eligible, keys, torch.iinfo(torch.int64).max)
    index = document_index(document_ids)
    sizes = torch.zeros_like(index).scatter_add_(1, index, torch.ones_like(index)).gather(1, index)
    budget = num_anchors * sizes // row_tokens
    # Group the positions by document (a document's group spans its own columns), keys ascending.
    by_key = keys.argsort(dim=-1, stable=True)
    grouped = by_key.gather(1, index.gather(1, by_key).argsort(dim=-1, stable=True))
    rank = positions - start_of_document(document_ids)  # rank of a sorted slot within its group
    chosen = (rank < budget.gather(1, grouped)) & eligible.gather(1, grouped)
    picked = torch.where(chosen, grouped, seq_len).sort(dim=-1).values[:, : min(num_anchors, seq_len)]
    valid = picked < seq_len
    anchors = torch.where(valid, picked, 0)
    if anchors.shape[1] < num_anchors:  # more slots than positions: pad with invalid slots
        pad = num_anchors - anchors.shape[1]
        anchors = torch.cat([anchors, anchors.new_zeros(batch, pad)], dim=1)
        valid = torch.cat([valid, valid.new_zeros(batch, pad)], dim=1)
    return anchors, valid


# ----------------------------------------------------------------------------- blocks and labels


def block_inputs(
    input_ids: Tensor, anchors: Tensor, block_size: int, mask_token_id: int
) -> tuple[Tensor, Tensor]:
    """Block tokens and their true positions, both [B, N*Bs].

    Block n is `[x[a_n], MASK x (Bs-1)]` at positions a_n..a_n+Bs-1, as `dflash_generate` builds
    it from the last accepted token; RoPE must see the same positions as at inference.
    """
    batch, num_anchors = anchors.shape
    block_ids = torch.full(
        (batch, num_anchors, block_size), mask_token_id, dtype=torch.long, device=input_ids.device
    )
    block_ids[:, :, 0] = input_ids.gather(1, anchors)
    offsets = torch.arange(block_size, device=anchors.device)
    block_positions = anchors[:, :, None] + offsets
    return block_ids.flatten(1), block_positions.flatten(1)


def context_positions(batch: int, seq_len: int, device: torch.device | str | None = None) -> Tensor:
    """Positions of the context features, [B, S]: the target saw token j at position j."""
    return torch.arange(seq_len, device=device).expand(batch, seq_len)


@functools.lru_cache(maxsize=8)  # the same few values every micro-batch: kernels saved at step start
def loss_decay(block_size: int, gamma: float, device: torch.device) -> Tensor:
    """[Bs] float32: 0 at block index 0, exp(-(k-1)/gamma) at k >= 1 (shared: do not modify it)."""
    offsets = torch.arange(block_size, device=device)
    # Index 0 zeroed with where(), not an item assignment: that would copy a host scalar (a sync).
    return torch.where(offsets == 0, 0.0, torch.exp(-(offsets - 1).float() / gamma))


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    lengths: Tensor,
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    gamma: float,
    document_ids: Tensor | None = None,
) -> tuple[Tensor, Tensor]:
    """Labels [B,N,Bs] and loss weights [B,N,Bs] float32 (packed rows: labels of the anchor's
    own document only).

    The label at block index k is x[a + k], NOT x[a + k + 1]: the block's first slot already
    holds x[a], and inference reads output k as the token at p + k (docs/DESIGN.md §3). Index 0 has
    nothing to predict (weight 0). The decay exp(-(k-1)/gamma) is the DFlash paper's: early
    slots matter most, since one wrong guess rejects everything after it in the block.
    """
    seq_len = input_ids.shape[1]
    offsets = torch.arange(block_size, device=anchors.device)
    label_positions = anchors[:, :, None] + offsets  # [B,N,Bs]
    in_range = label_positions < lengths[:, None, None]
    # Clamp only to keep the gather in bounds; out-of-range slots get weight 0 below.
    flat_positions = label_positions.clamp(max=seq_len - 1).flatten(1)
    labels = input_ids.gather(1, flat_positions).view_as(label_positions)
    is_response = loss_mask.bool().gather(1, flat_positions).view_as(label_positions)
    scored = valid[:, :, None] & in_range & is_response
    if document_ids is not None:
        label_documents = document_ids.gather(1, flat_positions).view_as(label_positions)
        scored &= label_documents == document_ids.gather(1, anchors)[:, :, None]
    weights = loss_decay(block_size, gamma, anchors.device) * scored.float()
    return labels, weights


# ----------------------------------------------------------------------------- a micro-batch's blocks


class DraftBlocks(NamedTuple):
    ids: Tensor  # [B, N*Bs] block tokens: the anchor's, then mask tokens
    positions: Tensor  # [B, N*Bs] their true positions
    labels: Tensor  # [B, N, Bs]
    weights: Tensor  # [B, N, Bs] float32 loss weights
    mask: Any  # BlockMask (flex), TileMask (flash) or dense bool (sdpa); or one per layer type
    context_positions: Tensor | None = None  # [B, S] packed rows' positions in their documents
    before_anchor: Tensor | None = None  # [B, N] the token before each anchor (XPress's refiner reads it)
    anchors: Tensor | None = None  # [B, N] anchor positions (DSpark's labels: dspark_loss.py)
    valid: Tensor | None = None  # [B, N] bool: the anchor slot holds an anchor


def draft_blocks(
    batch: Any,
    *,
    seed: int,
    num_anchors: int,
    block_size: int,
    mask_token_id: int,
    gamma: float,
    attention: str,
    window: int | None = None,
    row_tokens: int | None = None,
) -> DraftBlocks:
    """Anchors, block tokens, labels and mask of one micro-batch (`batch` as `drafter_loss` takes it).

    `window` (a drafter with sliding-attention layers) adds the sliding layers' mask: `mask` is then
    {"full_attention": ..., "sliding_attention": ...}. A batch of packed rows (`document_ids` not
    None) takes anchors per document (`sample_document_anchors`, `row_tokens` = data.max_length),
    positions within the document, and a mask that sees only the anchor's own document. Small eager ops (torch.compile of them took
    minutes to compile on an H200, and failed on a new sequence length; see BENCHMARKS.md).
    """
    seq_len = batch.input_ids.shape[1]
    document_ids = getattr(batch, "document_ids", None)
    if document_ids is None:
        anchors, valid = sample_anchors(
            batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, seed, num_anchors
        )
        ids, positions = block_inputs(batch.input_ids, anchors, block_size, mask_token_id)
        starts = context = None
    else:
        anchors, valid = sample_document_anchors(
            batch.loss_mask,
            batch.lengths,
            document_ids,
            batch.epoch,
            seed,
            num_anchors,
            row_tokens or seq_len,
        )
        ids, _ = block_inputs(batch.input_ids, anchors, block_size, mask_token_id)
        context = document_positions(document_ids)
        offsets = torch.arange(block_size, device=anchors.device)
        positions = (context.gather(1, anchors)[:, :, None] + offsets).flatten(1)
        starts = start_of_document(document_ids).gather(1, anchors)
    labels, weights = block_labels(
        batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, block_size, gamma, document_ids
    )
    build_mask = dense_block_mask if attention == "sdpa" else flex_block_mask
    # FlashAttention 4 serves the full-attention layers; sliding ones keep flex (its rule has no window).
    full_mask = tile_block_mask if attention == "flash" else build_mask
    mask = full_mask(anchors, seq_len, block_size, starts=starts)
    if window is not None:
        sliding = build_mask(anchors, seq_len, block_size, window, starts=starts)
        mask = {"full_attention": mask, "sliding_attention": sliding}
    # An anchor has context before it in its own document (p >= 1), so p - 1 is that document's.
    before_anchor = batch.input_ids.gather(1, (anchors - 1).clamp(min=0))
    return DraftBlocks(
        ids, positions, labels, weights, mask, context, before_anchor, anchors=anchors, valid=valid
    )
