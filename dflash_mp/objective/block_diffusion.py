"""DFlash block-diffusion training math: the loss of a micro-batch (its anchors, blocks and labels:
draft_blocks.py; the mask: block_mask.py).

The label at block index k of the block anchored at a is x[a + k], weighted exp(-(k-1)/gamma) on
response tokens (draft_blocks.py says why); the loss is the weighted CE of the drafter's logits
through the target's frozen LM head, taken chunk by chunk with its gradient (lm_head_loss.py).
DSpark and XPress drafters train on their own terms (dspark_loss.py, xpress_loss.py).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.profiler import record_function

from dflash_mp.models.block_rows import BlockRows
from dflash_mp.objective.draft_blocks import DraftBlocks, context_positions, draft_blocks
from dflash_mp.objective.dspark_loss import DSparkLossWeights, dspark_loss
from dflash_mp.objective.lm_head_loss import (
    LM_HEAD_CHUNK_ROWS,
    LossStats,
    chunked_lm_head_loss,
    lm_head_loss_and_candidates,
)
from dflash_mp.objective.selector_loss import selector_loss
from dflash_mp.objective.xpress_loss import XPressWeights, xpress_drafter_loss


def loss_blocks(
    drafter: nn.Module,
    batch: Any,
    *,
    seed: int,
    num_anchors: int,
    gamma: float,
    attention: str,
    row_tokens: int | None = None,
) -> DraftBlocks:
    """The anchors, block tokens, labels and mask `drafter_loss` trains `drafter` on for `batch`.

    They depend on the batch and the seed only (not on the weights), so a trainer may queue them
    for the next micro-batch while the device still runs the current step (`DrafterTrainer.prepare`).
    """
    if attention not in ("flex", "flash", "sdpa"):
        raise ValueError(f"attention={attention!r}: must be 'flex', 'flash' or 'sdpa'")
    # DDP keeps the drafter's attributes on .module.
    drafter_module = getattr(drafter, "module", drafter)
    with record_function("dflash::loss_blocks"):
        return draft_blocks(
            batch,
            seed=seed,
            num_anchors=num_anchors,
            block_size=drafter_module.block_size,
            mask_token_id=drafter_module.mask_token_id,
            gamma=gamma,
            attention=attention,
            window=getattr(drafter_module, "sliding_window", None),  # sliding layers' own mask
            row_tokens=row_tokens,  # packed rows: num_anchors per this many tokens
        )


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
    selector_alpha: float = 1.0,
    selector_gold: str = "drop",
    blocks: DraftBlocks | None = None,
    row_tokens: int | None = None,
    dpace_alpha: float | None = None,
    xpress: XPressWeights | None = None,
    dspark: DSparkLossWeights | None = None,
    vocabulary_chunk_rows: int | None = None,
) -> tuple[Tensor, LossStats]:
    """The DFlash loss of one micro-batch; shared by the reference trainer and the drafter ranks.

    A DFlash 2 drafter (one with a `candidate_selector`) adds `selector_alpha` times the selector
    term (`dflash_mp.objective.selector_loss`; `selector_gold` says what a label outside the top-K does) and
    its metrics under stats["selector"].

    `batch` has input_ids, loss_mask, lengths, sample_ids, epoch and hidden_states [B,S,K*H];
    `drafter(context_features, block_embeddings, context_positions, block_positions, mask)`
    returns [B, N*Bs, H]. `attention` picks the mask form: "flex" (BlockMask, GPU), "flash"
    (TileMask for FlashAttention 4, Hopper and newer) or "sdpa" (dense bool mask; CPU, where
    flex_attention has no backward). `blocks`: `loss_blocks` of this batch with the same
    arguments, made earlier; None makes them here. `dpace_alpha`: train.position_weights=dpace
    (position_weights.py), None: the decay. An XPress drafter (a `refiner_head`) trains on its
    refiner's passes and terms instead (xpress_loss.py, weights `xpress`). Every arch takes its
    loss's work over the vocabulary `vocabulary_chunk_rows` rows at a time (None: its default).
    """
    if blocks is None:
        options = dict(seed=seed, num_anchors=num_anchors, gamma=gamma, attention=attention)
        blocks = loss_blocks(drafter, batch, **options, row_tokens=row_tokens)
    drafter_module = getattr(drafter, "module", drafter)
    if getattr(drafter_module, "arch", "dflash") == "dspark":  # its own labels, forward and terms
        weights = dspark or DSparkLossWeights()
        options = (gamma, weights, dpace_alpha, vocabulary_chunk_rows)
        return dspark_loss(drafter, embed_weight, head_weight, batch, blocks, *options)  # type: ignore[return-value]
    # A DFlash drafter computes no row twice and none the loss does not score (block_rows.py).
    sparing = getattr(drafter_module, "skips_repeated_rows", False)
    hidden = _drafter_hidden(drafter, embed_weight, batch, blocks, sparing)
    if getattr(drafter_module, "refiner_head", None) is not None:
        terms = (xpress or XPressWeights())._replace(dpace_alpha=dpace_alpha)
        return xpress_drafter_loss(drafter_module, hidden, head_weight, blocks, terms, vocabulary_chunk_rows)  # type: ignore[return-value]
    options = (selector_alpha, selector_gold, dpace_alpha, vocabulary_chunk_rows)
    return _head_loss(drafter_module, hidden, head_weight, blocks, sparing, *options)


def _drafter_hidden(
    drafter: nn.Module, embed_weight: Tensor, batch: Any, blocks: DraftBlocks, sparing: bool
) -> Tensor:
    """The drafter's output over the blocks, [B, N*Bs, H]; only the rows the loss scores if `sparing`."""
    drafter_module = getattr(drafter, "module", drafter)
    input_ids = batch.input_ids
    batch_size, seq_len = input_ids.shape
    block_embeddings = _block_embeddings(drafter_module, embed_weight, blocks, input_ids, sparing)
    # Profiler scopes (bench/sections/profile.py reads them; nearly free when no profiler runs).
    with record_function("dflash::drafter_forward"):
        forward_args = (
            batch.hidden_states,
            block_embeddings,
            context_positions(batch_size, seq_len, input_ids.device)
            if blocks.context_positions is None
            else blocks.context_positions,
            blocks.positions,
            blocks.mask,
        )
        return drafter(*forward_args, scored_rows_only=True) if sparing else drafter(*forward_args)


def _block_embeddings(
    drafter_module: nn.Module, embed_weight: Tensor, blocks: DraftBlocks, input_ids: Tensor, sparing: bool
) -> Tensor | BlockRows:
    """The blocks' input embeddings: every row, or (`sparing`) each block's anchor and the mask row."""
    # Targets that scale their embeddings (Gemma) get block embeddings scaled as at inference.
    embedding_scale = getattr(drafter_module, "input_embedding_scale", 1.0)
    if not sparing:
        return F.embedding(blocks.ids, embed_weight) * embedding_scale
    # Every block is the anchor's token, then mask tokens (`block_inputs`).
    block_size = drafter_module.block_size
    mask_row = torch.full((1, 1), drafter_module.mask_token_id, device=input_ids.device)
    return BlockRows(
        F.embedding(blocks.ids[:, ::block_size], embed_weight) * embedding_scale,
        (F.embedding(mask_row, embed_weight) * embedding_scale).expand(input_ids.shape[0], 1, -1),
    )


def _head_loss(
    drafter_module: nn.Module,
    hidden: Tensor,
    head_weight: Tensor,
    blocks: DraftBlocks,
    sparing: bool,
    selector_alpha: float,
    selector_gold: str,
    dpace_alpha: float | None,
    chunk_rows: int | None,
) -> tuple[Tensor, LossStats]:
    """The CE through the LM head, plus `selector_alpha` times the selector term for a DFlash 2
    drafter (`drafter_loss` says what each argument is), its logits `chunk_rows` rows at a time."""
    labels, weights = blocks.labels, blocks.weights
    chunk_tokens = chunk_rows or LM_HEAD_CHUNK_ROWS
    multiplier = getattr(drafter_module, "output_multiplier", 1.0)
    softcap = getattr(drafter_module, "final_logit_softcapping", None)
    selector = getattr(drafter_module, "candidate_selector", None)
    if selector is None:
        with record_function("dflash::lm_head_ce"):
            return chunked_lm_head_loss(
                hidden,
                head_weight,
                labels,
                weights,
                chunk_tokens,
                multiplier=multiplier,
                softcap=softcap,
                scored_only=sparing,
                dpace_alpha=dpace_alpha,
            )
    with record_function("dflash::lm_head_ce"):
        loss, stats, candidates = lm_head_loss_and_candidates(
            hidden, head_weight, labels, weights, selector.top_k, chunk_tokens, multiplier=multiplier,
            softcap=softcap, dpace_alpha=dpace_alpha,
        )  # fmt: skip
    with record_function("dflash::selector"):
        term, stats["selector"] = selector_loss(
            selector,
            hidden,
            head_weight,
            candidates,
            labels,
            weights,
            stats["weight_sum"],
            selector_gold,
            multiplier=multiplier,
            softcap=softcap,
            dpace_alpha=dpace_alpha,
        )
    return loss + selector_alpha * term, stats
