"""DFlash block-diffusion training math: anchors, draft blocks, the block-sparse mask, the loss.

The drafter is trained exactly the way the reference inference (`dflash.dflash_generate`,
DESIGN.md §3) reads it. At inference, after the target accepted tokens up to position p,
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

import hashlib
from collections.abc import Callable
from typing import Any, TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_block_mask
from torch.utils.checkpoint import checkpoint

MaskMod = Callable[[Tensor, Tensor, Tensor, Tensor], Tensor]


class LossStats(TypedDict):
    """Tensors (no GPU sync) that callers sum over micro-batches and ranks."""

    correct: Tensor  # [Bs] int64: argmax == label at block index k, where weight > 0 (k=0 is 0)
    count: Tensor  # [Bs] int64: positions with weight > 0 at block index k (k=0 is 0)
    weight_sum: Tensor  # [] float32: sum of loss weights, the loss's denominator


# ----------------------------------------------------------------------------- anchors


def _anchor_generator(seed: int, epoch: int, sample_id: int) -> torch.Generator:
    # A stable hash (not Python's salted hash()) so every rank and every run derives the same
    # stream for a record: anchors depend on (seed, epoch, sample) only, never on the topology
    # or batch composition (DESIGN.md §2 determinism), and are fresh each epoch (§3).
    digest = hashlib.blake2b(f"{seed}/{epoch}/{sample_id}".encode(), digest_size=8).digest()
    return torch.Generator(device="cpu").manual_seed(int.from_bytes(digest, "little") >> 1)


def sample_anchors(
    loss_mask: Tensor, lengths: Tensor, sample_ids: Tensor, epoch: int, seed: int, num_anchors: int
) -> tuple[Tensor, Tensor]:
    """Draw up to `num_anchors` distinct sorted anchor positions per sequence.

    Eligible p: a response token with some context before it (p >= 1) and something to predict
    after it (p + 1 < length). Returns (anchors [B,N] int64, valid [B,N] bool); invalid slots
    come last and hold anchor 0, which keeps every mask row non-empty (see `block_mask_mod`).
    """
    # One host copy per micro-batch: the per-sequence generators live on the CPU anyway.
    loss_mask_cpu, lengths_cpu, ids_cpu = loss_mask.bool().cpu(), lengths.cpu(), sample_ids.cpu()
    batch, seq_len = loss_mask_cpu.shape
    positions = torch.arange(seq_len)
    anchors = torch.zeros(batch, num_anchors, dtype=torch.long)
    valid = torch.zeros(batch, num_anchors, dtype=torch.bool)
    for row in range(batch):
        is_eligible = loss_mask_cpu[row] & (positions >= 1) & (positions + 1 < lengths_cpu[row])
        eligible = is_eligible.nonzero()[:, 0]
        generator = _anchor_generator(seed, epoch, int(ids_cpu[row]))
        # A random permutation's prefix is a uniform draw without replacement.
        chosen = eligible[torch.randperm(eligible.numel(), generator=generator)[:num_anchors]]
        anchors[row, : chosen.numel()] = chosen.sort().values
        valid[row, : chosen.numel()] = True
    return anchors.to(loss_mask.device), valid.to(loss_mask.device)


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


def block_labels(
    input_ids: Tensor,
    loss_mask: Tensor,
    lengths: Tensor,
    anchors: Tensor,
    valid: Tensor,
    block_size: int,
    gamma: float,
) -> tuple[Tensor, Tensor]:
    """Labels [B,N,Bs] and loss weights [B,N,Bs] float32.

    The label at block index k is x[a + k], NOT x[a + k + 1]: the block's first slot already
    holds x[a], and inference reads output k as the token at p + k (DESIGN.md §3). Index 0 has
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
    decay = torch.exp(-(offsets - 1).float() / gamma)
    decay[0] = 0.0
    weights = decay * (valid[:, :, None] & in_range & is_response).float()
    return labels, weights


# ----------------------------------------------------------------------------- block-sparse mask


def block_mask_mod(anchors: Tensor, context_len: int, block_size: int) -> MaskMod:
    """mask_mod(b, h, q_idx, kv_idx) -> True where the query may attend the key.

    Keys are [context 0..S-1 ; block tokens]. Query q is in block n = q // Bs; it sees context
    key j iff j < a_n (features strictly before the anchor, as the cropped KV cache at inference)
    and block key t iff t // Bs == n (its own block, non-causal). Pure tensor ops, so the same
    function runs under flex_attention's vmap and, with broadcast index tensors, densely.
    """

    def mask_mod(b: Tensor, h: Tensor, q_idx: Tensor, kv_idx: Tensor) -> Tensor:
        block = q_idx // block_size
        sees_context = kv_idx < anchors[b, block]
        in_own_block = (kv_idx >= context_len) & ((kv_idx - context_len) // block_size == block)
        return sees_context | in_own_block

    return mask_mod


def dense_block_mask(anchors: Tensor, context_len: int, block_size: int) -> Tensor:
    """The block-sparse mask as a dense bool tensor [B,1,Q,S+Q] (True = attend) for SDPA."""
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    device = anchors.device
    mask_mod = block_mask_mod(anchors, context_len, block_size)
    return mask_mod(
        torch.arange(batch, device=device)[:, None, None, None],
        torch.zeros(1, 1, 1, 1, dtype=torch.long, device=device),
        torch.arange(num_queries, device=device)[None, None, :, None],
        torch.arange(context_len + num_queries, device=device)[None, None, None, :],
    )


# Compiled, mask creation evaluates mask_mod tile by tile instead of materialising [B,Q,S+Q]
# (the torch docs' recommendation; create_block_mask's `_compile` flag is deprecated).
_compiled_create_block_mask = torch.compile(create_block_mask)


def flex_block_mask(anchors: Tensor, context_len: int, block_size: int) -> BlockMask:
    """The block-sparse mask as a flex_attention BlockMask (heads broadcast); compiled on GPU."""
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    create = _compiled_create_block_mask if anchors.is_cuda else create_block_mask
    return create(
        block_mask_mod(anchors, context_len, block_size),
        batch,
        None,
        num_queries,
        context_len + num_queries,
        device=anchors.device,
    )


# ----------------------------------------------------------------------------- loss


def decay_weighted_ce(logits: Tensor, labels: Tensor, weights: Tensor) -> tuple[Tensor, LossStats]:
    """loss = sum(w * CE) / sum(w) over logits [B,N,Bs,V]; 0 (still differentiable) if sum(w) == 0."""
    block_size = labels.shape[-1]
    logits = logits.float()
    ce = F.cross_entropy(logits.flatten(0, -2), labels.flatten(), reduction="none")
    weight_sum = weights.sum()
    # clamp_min: an all-zero-weight batch gives 0 / tiny = 0, not NaN, and keeps the graph.
    loss = (weights.flatten() * ce).sum() / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    scored = (weights > 0).reshape(-1, block_size)
    correct = (logits.argmax(-1) == labels).reshape(-1, block_size) & scored
    return loss, LossStats(correct=correct.sum(0), count=scored.sum(0), weight_sum=weight_sum)


def _chunk_weighted_ce(
    hidden: Tensor, head_weight: Tensor, labels: Tensor, weights: Tensor
) -> tuple[Tensor, Tensor]:
    logits = F.linear(hidden, head_weight).float()
    ce = F.cross_entropy(logits, labels, reduction="none")
    return (weights * ce).sum(), logits.argmax(-1) == labels


def chunked_lm_head_loss(
    hidden: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_tokens: int = 1024,
) -> tuple[Tensor, LossStats]:
    """`decay_weighted_ce(hidden @ head_weight.T, ...)` without materialising all logits.

    hidden [B,N*Bs,H], head_weight [V,H], labels/weights [B,N,Bs]. Only positions with
    weight > 0 are scored, and each chunk of `chunk_tokens` of them runs under activation
    checkpointing, so peak memory is one chunk's logits (1024 x 152k fp32 = 0.6 GB) instead of
    8192 x 152k; the price is recomputing each chunk's head matmul in backward.
    """
    block_size = labels.shape[-1]
    weights_flat = weights.flatten()
    # nonzero() syncs with the GPU once per micro-batch; it is what lets zero-weight positions
    # (prompt tokens, slot 0, padding anchors) cost nothing.
    scored = weights_flat.nonzero()[:, 0]
    selected_hidden = hidden.reshape(-1, hidden.shape[-1])[scored]
    selected_labels = labels.flatten()[scored]
    selected_weights = weights_flat[scored]
    # split() of an empty selection still yields one empty chunk, so the loss below is always
    # a graph node (0 with zero gradients) and backward/DDP work on a batch with nothing to score.
    chunk_losses, chunk_correct = [], []
    for hidden_chunk, label_chunk, weight_chunk in zip(
        selected_hidden.split(chunk_tokens),
        selected_labels.split(chunk_tokens),
        selected_weights.split(chunk_tokens),
        strict=True,
    ):
        chunk_loss, correct_chunk = checkpoint(
            _chunk_weighted_ce, hidden_chunk, head_weight, label_chunk, weight_chunk, use_reentrant=False
        )
        chunk_losses.append(chunk_loss)
        chunk_correct.append(correct_chunk)
    weight_sum = weights_flat.sum()
    loss = torch.stack(chunk_losses).sum() / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    block_index = scored % block_size
    zeros = torch.zeros(block_size, dtype=torch.long, device=weights.device)
    correct = zeros.index_add(0, block_index, torch.cat(chunk_correct).long())
    count = zeros.index_add(0, block_index, torch.ones_like(block_index))
    return loss, LossStats(correct=correct, count=count, weight_sum=weight_sum)


def per_position_accuracy(correct: Tensor, count: Tensor) -> list[float]:
    """Accuracy at block indices k = 1..Bs-1 (list index k-1); 0.0 where nothing was scored."""
    accuracy = correct[1:].double() / count[1:].clamp_min(1).double()
    return accuracy.tolist()


# ----------------------------------------------------------------------------- one training step's loss


def drafter_loss(
    drafter: nn.Module,
    embed_weight: Tensor,
    head_weight: Tensor,
    batch: Any,
    *,
    seed: int,
    num_anchors: int,
    gamma: float,
    attention: str,
) -> tuple[Tensor, LossStats]:
    """The DFlash loss of one micro-batch; shared by the reference trainer and the drafter ranks.

    `batch` has input_ids, loss_mask, lengths, sample_ids, epoch and hidden_states [B,S,K*H];
    `drafter(context_features, block_embeddings, context_positions, block_positions, mask)`
    returns [B, N*Bs, H]. `attention` picks the mask form: "flex" (BlockMask, GPU) or "sdpa"
    (dense bool mask; CPU, where flex_attention has no backward).
    """
    if attention not in ("flex", "sdpa"):
        raise ValueError(f"attention={attention!r}: must be 'flex' or 'sdpa'")
    # DDP keeps the drafter's attributes on .module.
    drafter_module = getattr(drafter, "module", drafter)
    block_size, mask_token_id = drafter_module.block_size, drafter_module.mask_token_id
    input_ids = batch.input_ids
    batch_size, seq_len = input_ids.shape
    anchors, valid = sample_anchors(
        batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, seed, num_anchors
    )
    block_ids, block_positions = block_inputs(input_ids, anchors, block_size, mask_token_id)
    labels, weights = block_labels(
        input_ids, batch.loss_mask, batch.lengths, anchors, valid, block_size, gamma
    )
    build_mask = flex_block_mask if attention == "flex" else dense_block_mask
    hidden = drafter(
        batch.hidden_states,
        F.embedding(block_ids, embed_weight),
        context_positions(batch_size, seq_len, input_ids.device),
        block_positions,
        build_mask(anchors, seq_len, block_size),
    )
    return chunked_lm_head_loss(hidden, head_weight, labels, weights)
