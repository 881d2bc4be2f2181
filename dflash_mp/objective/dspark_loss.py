"""DSpark's training objective (`model.arch=dspark`; heads: models/dspark.py; docs/drafter.md: DSpark).

Per micro-batch, on the blocks `draft_blocks` builds (same anchors, block tokens and mask as DFlash):

- labels: with `sample_from_anchor` (the default) block position k predicts x[a+k+1] for every
  k in 0..Bs-1, weighted exp(-k/gamma); without, position k >= 1 predicts x[a+k] as in DFlash.
  A label must be a response token of the anchor's record, inside the row.
- logits: the target head's logits of the drafter's hidden states (scaled as the target scales
  them) plus the Markov bias of the teacher-forced previous token (`previous_tokens`).
- teacher: the target's own next-token distribution at the label's previous position, from the
  target's normed last hidden state, which target ranks append to the features for DSpark
  (`dflash_mp.config.dspark_checks.feature_layer_ids`).
- loss = ce_alpha * CE(label) + kl_alpha * KL(teacher || draft) + tv_alpha * TV(draft, teacher)
  + confidence_alpha * BCE(confidence logit, 1 - TV), each term sum(w * term) / sum(w) over the
  micro-batch (the DFlash loss's normalisation). 1 - TV = sum_v min(p_v, q_v) is the probability
  that rejection sampling accepts the position's draft.
- train.position_weights=dpace (speculators 0.9.0's DSpark `compute_metrics`): each of CE, KL and
  TV gets D-PACE weights (position_weights.py) from its own per-position value, the BCE keeps the
  decay, and every term is divided by the count of scored positions instead (the reference's
  reduction, as the DFlash loss under D-PACE).

Vocabulary-sized work (two head matmuls, the Markov projection, the softmaxes) runs a chunk of
whole blocks at a time, once, with CE, KL and TV's gradient taken on the spot (dspark_rows.py
`dspark_row_loss`), so at most one chunk's [rows, V] tensors are alive. The same terms through
autograd, the reference the tests compare with, are tests/dspark_autograd_reference.py.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_mp.models.dspark import previous_tokens
from dflash_mp.objective.draft_blocks import block_labels, context_positions
from dflash_mp.objective.dspark_rows import (
    RowLossOptions,
    dspark_row_loss,
    loss_denominator,
)


@dataclass(frozen=True)
class DSparkLossWeights:
    """The loss terms' weights (model.dspark_*_alpha)."""

    ce: float = 0.1
    kl: float = 0.0
    tv: float = 1.8
    confidence: float = 1.0


def dspark_labels(
    batch: Any, anchors: Tensor, valid: Tensor, block_size: int, gamma: float, sample_from_anchor: bool
) -> tuple[Tensor, Tensor, Tensor]:
    """(labels [B,N,Bs], weights [B,N,Bs] float32, label positions [B,N,Bs]) of the blocks at
    `anchors` (module docstring). Without `sample_from_anchor` they are DFlash's (`block_labels`)."""
    document_ids = getattr(batch, "document_ids", None)
    offsets = torch.arange(block_size, device=anchors.device)
    if not sample_from_anchor:
        labels, weights = block_labels(
            batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, block_size, gamma, document_ids
        )
        return labels, weights, anchors[:, :, None] + offsets
    seq_len = batch.input_ids.shape[1]
    positions = anchors[:, :, None] + offsets + 1
    in_range = positions < batch.lengths[:, None, None]
    flat = positions.clamp(max=seq_len - 1).flatten(1)  # out-of-range slots get weight 0 below
    labels = batch.input_ids.gather(1, flat).view_as(positions)
    scored = valid[:, :, None] & in_range & batch.loss_mask.bool().gather(1, flat).view_as(positions)
    if document_ids is not None:
        scored &= (
            document_ids.gather(1, flat).view_as(positions) == document_ids.gather(1, anchors)[:, :, None]
        )
    decay = torch.exp(-offsets.float() / gamma)
    return labels, decay * scored.float(), positions


def confidence_bce(
    confidence_logits: Tensor | None, accept: Tensor, weights: Tensor, denominator: Tensor
) -> Tensor:
    """sum(w * BCE(confidence logit, accept)) / denominator over rows [M] (0 without the head)."""
    if confidence_logits is None:
        return torch.zeros((), device=accept.device)
    elementwise = F.binary_cross_entropy_with_logits(confidence_logits.float(), accept, reduction="none")
    return (weights * elementwise).sum() / denominator


def dspark_metrics_stats(
    accept: Tensor, confidence_logits: Tensor | None, scored: Tensor, term_values: Tensor
) -> Tensor:
    """One float32 vector of sums for the step's totals (layout: `DSPARK_TOTALS` in
    training/dspark_metrics.py) from the accept rate, confidence logits and scored mask, all
    [blocks, Bs], and the micro-batch's four term values."""
    mask = scored.float()
    predicted = accept if confidence_logits is None else torch.sigmoid(confidence_logits.detach().float())
    # Expected accepted drafts per block (speculators' accept_len): the running product of the
    # per-position rates, plus the bonus token; over blocks with a scored position.
    block_scored = (mask.sum(-1) > 0).float()
    accept_len = ((accept * mask).cumprod(-1).sum(-1) + 1.0) * block_scored
    predicted_len = ((predicted * mask).cumprod(-1).sum(-1) + 1.0) * block_scored
    sums = torch.stack(
        [
            (accept * mask).sum(),
            (predicted * mask).sum(),
            ((predicted - accept).abs() * mask).sum(),
            mask.sum(),
            accept_len.sum(),
            predicted_len.sum(),
            block_scored.sum(),
        ]
    )
    by_position = torch.cat([(accept * mask).sum(0), (predicted * mask).sum(0)])
    return torch.cat([term_values.float(), sums, by_position])


def _teacher_rows(
    features: Tensor, positions: Tensor, seq_len: int, width: int, hidden_size: int
) -> Tensor | None:
    """The target's normed last hidden state [M, H] one position before each label (positions
    [B, N, Bs]), the features' columns after the drafter's `width`; None if they end there."""
    if features.shape[-1] <= width:
        return None
    teacher_rows = (positions - 1).clamp(0, seq_len - 1).flatten(1)
    last = features[..., width : width + hidden_size]
    return last.gather(1, teacher_rows[..., None].expand(-1, -1, hidden_size)).flatten(0, 1)


def _rows_loss(
    module: nn.Module,
    rows: tuple[Tensor, Tensor | None, Tensor | None, Tensor],
    head_weight: Tensor,
    weights: Tensor,
    confidence: Tensor | None,
    alphas: DSparkLossWeights,
    dpace_alpha: float | None,
    chunk_rows: int | None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The loss of the rows [M] (hidden states, Markov features, teacher rows, labels), the four
    term values, and (accept [M], argmax == label [M]), with the gradient of CE, KL and TV taken in
    one pass over the vocabulary (`dspark_row_loss`)."""
    options = RowLossOptions(
        (alphas.ce, alphas.kl, alphas.tv),
        module.block_size,
        dpace_alpha,
        module.output_multiplier,
        module.final_logit_softcapping,
        chunk_rows,
    )
    w2 = None if module.markov_head is None else module.markov_head.markov_w2.weight
    hidden, markov, teacher, labels = rows
    rows_loss, values, terms, correct = dspark_row_loss(
        hidden, markov, teacher, labels, head_weight, w2, weights, options
    )
    # The BCE as the reference takes it: against 1 - TV (no gradient), on the decay weights.
    denominator = loss_denominator(weights, dpace_alpha).clamp_min(torch.finfo(torch.float32).tiny)
    accept = (1.0 - terms[:, 2]).clamp(0.0, 1.0)
    bce = confidence_bce(confidence, accept, weights, denominator)
    loss = rows_loss + alphas.confidence * bce
    return loss, torch.cat([values, bce.detach()[None]]), accept, correct


def dspark_loss(
    drafter: nn.Module,
    embed_weight: Tensor,
    head_weight: Tensor,
    batch: Any,
    blocks: Any,
    gamma: float,
    alphas: DSparkLossWeights,
    dpace_alpha: float | None = None,
    chunk_rows: int | None = None,
) -> tuple[Tensor, dict]:
    """The DSpark loss of one micro-batch and its stats (`drafter_loss`'s contract, plus
    stats["dspark"], a vector of sums: `dspark_metrics_stats`); `dpace_alpha`: D-PACE weights;
    `chunk_rows`: rows per chunk of the vocabulary work (train.vocabulary_chunk_rows)."""
    module = getattr(drafter, "module", drafter)
    block_size, hidden_size = module.block_size, module.config.hidden_size
    labels, weights, positions = dspark_labels(
        batch, blocks.anchors, blocks.valid, block_size, gamma, module.sample_from_anchor
    )
    batch_size, seq_len = batch.input_ids.shape
    width = len(module.target_layer_ids) * hidden_size
    features = batch.hidden_states
    embeddings = F.embedding(blocks.ids, embed_weight) * module.input_embedding_scale
    context = context_positions(batch_size, seq_len, batch.input_ids.device)
    hidden = drafter(
        features[..., :width],
        embeddings,
        context if blocks.context_positions is None else blocks.context_positions,
        blocks.positions,
        blocks.mask,
    )
    teacher = _teacher_rows(features, positions, seq_len, width, hidden_size)
    if teacher is None and (alphas.kl or alphas.tv or module.confidence_head is not None):
        raise ValueError(
            f"DSpark's KL, TV and confidence terms need the target's last layer in the features "
            f"({features.shape[-1]} wide, the drafter reads {width}): make the target with "
            "dspark_checks.feature_layer_ids (the runtime does)"
        )
    by_block = hidden.reshape(-1, block_size, hidden_size)
    prev_ids = previous_tokens(
        labels.reshape(-1, block_size), blocks.ids[:, ::block_size].reshape(-1), module.sample_from_anchor
    )
    prev_emb = markov = None
    if module.markov_head is not None:
        prev_emb = module.markov_head.embed(prev_ids)
        markov = module.markov_head.features(prev_emb, by_block).flatten(0, 1)
    confidence = None
    if module.confidence_head is not None:
        with_markov = prev_emb if module.confidence_with_markov else None
        confidence = module.confidence_head(by_block, with_markov).flatten()
    flat_weights = weights.flatten()
    rows = (hidden.flatten(0, 1), markov, teacher, labels.flatten())
    loss, term_values, accept, correct = _rows_loss(
        module, rows, head_weight, flat_weights, confidence, alphas, dpace_alpha, chunk_rows
    )
    scored = (weights > 0).reshape(-1, block_size)
    stats = {
        "correct": (correct.view(-1, block_size) & scored).sum(0),
        "count": scored.sum(0),
        # The terms' denominator (term_weights): the micro-batch's share of the global batch.
        "weight_sum": loss_denominator(flat_weights, dpace_alpha),
        "dspark": dspark_metrics_stats(
            accept.view(-1, block_size),
            None if confidence is None else confidence.view(-1, block_size),
            scored,
            term_values,
        ),
    }
    return loss, stats


def loss_weights(m: Any) -> DSparkLossWeights:
    """The loss weights of model config `m` (model.dspark_*_alpha)."""
    return DSparkLossWeights(
        float(m.dspark_ce_alpha),
        float(m.dspark_kl_alpha),
        float(m.dspark_tv_alpha),
        float(m.dspark_confidence_alpha),
    )


def dspark_metrics(totals: Tensor, correct: Tensor, count: Tensor, micro_batches: float) -> dict[str, object]:
    """The metrics record's DSpark fields from the step's all-reduced sums of `dspark_metrics_stats`
    and the per-position correct/count [Bs]: the four terms (mean over micro-batches with loss
    tokens), the actual accept rate 1 - TV next to the confidence head's prediction (mean, and per
    block position), the expected accepted length per block (bonus included) from each, and the
    greedy accuracy at every block position (index 0 included: with sample_from_anchor it drafts)."""
    values = totals.double().tolist()
    block = count.shape[0]
    scored, blocks, per_count = max(values[7], 1.0), max(values[10], 1.0), count.double().clamp_min(1)
    by_position = totals[11:].double().view(2, block) / per_count
    return {
        "dspark_ce": values[0] / max(micro_batches, 1),
        "dspark_kl": values[1] / max(micro_batches, 1),
        "dspark_tv": values[2] / max(micro_batches, 1),
        "confidence_bce": values[3] / max(micro_batches, 1),
        "accept_rate": values[4] / scored,
        "confidence_pred": values[5] / scored,
        "confidence_abs_error": values[6] / scored,
        "accept_len": values[8] / blocks,
        "accept_len_predicted": values[9] / blocks,
        "accept_by_position": by_position[0].tolist(),
        "confidence_by_position": by_position[1].tolist(),
        "dspark_acc": (correct.double() / per_count).tolist(),
    }
