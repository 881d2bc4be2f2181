"""XPress's training objective (docs/drafter.md, XPress): the refiner's passes and loss terms.

As `speculators.models.xpress` trains it, with every cross-entropy on the data tokens (its
`ce_from_data` with the loss "ce"):

    loss = CE(base + bias(true previous tokens))                     teacher-forced pass
         + consistency_weight * mean_j CE(base + bias(round j-1's argmax))   Jacobi rounds
         + base_anchor_weight * CE(base)                             the drafter's own logits

Each CE is sum(mask * decay * ce) / (sum(mask) + 1e-8) over the micro-batch's block positions,
the reference's reduction (the DFlash loss divides by sum(decay) instead); `base_anchor_full_weight`
drops the decay from the anchor term. With train.position_weights=dpace every decayed term takes
D-PACE weights from its own CE instead of the decay, as the reference's terms do. Logits are materialised ([blocks * Bs, V]), as the reference
does.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_mp.models.xpress import XPressRefiner, jacobi_rounds, previous_tokens
from dflash_mp.objective.draft_blocks import DraftBlocks
from dflash_mp.objective.position_weights import dpace_weights

# The metrics each micro-batch reports, summed over a step (`xpress_metrics` averages them).
XPRESS_TERMS = ("tf_loss", "consistency_loss", "base_anchor_loss")
_DENOMINATOR_EPS = 1e-8  # the reference's `_hard_label_ce`


class XPressWeights(NamedTuple):
    """The loss weights (`model.xpress_*` fields)."""

    consistency_weight: float = 0.3
    consistency_passes: int = 3
    base_anchor_weight: float = 0.6
    base_anchor_full_weight: bool = False
    dpace_alpha: float | None = None  # train.position_weights=dpace; None: the decay


def data_ce(
    logits: Tensor, labels: Tensor, mask: Tensor, decay: Tensor | None, dpace_alpha: float | None = None
) -> Tensor:
    """sum(mask * decay * CE(logits, labels)) / (sum(mask) + 1e-8); logits [N, Bs, V], the rest
    [N, Bs]. decay None: no position weights; `dpace_alpha`: D-PACE weights from this CE instead."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.reshape(-1), reduction="none").view(mask.shape)
    weight = mask.float()
    if decay is not None and dpace_alpha is not None:
        weight = dpace_weights(ce, mask, dpace_alpha)
    elif decay is not None:
        weight = weight * decay.float()
    return (ce * weight).sum() / (mask.float().sum() + _DENOMINATOR_EPS)


def xpress_terms(
    refiner: XPressRefiner,
    base_logits: Tensor,
    hidden: Tensor,
    labels: Tensor,
    before_anchor: Tensor,
    mask: Tensor,
    decay: Tensor,
    weights: XPressWeights,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(loss, {term: value}, teacher-forced refined logits) of blocks [N, Bs]: base_logits
    [N, Bs, V] and hidden [N, Bs, H] of the drafter, labels [N, Bs] the data tokens (index 0 the
    anchor's own), before_anchor [N] the token before each anchor, mask [N, Bs] the scored
    positions (never index 0), decay [N, Bs] the position weights."""
    cache = refiner.hidden_cache(hidden)
    teacher = base_logits + refiner.block_bias(previous_tokens(labels, before_anchor), cache)
    alpha = weights.dpace_alpha
    tf_loss = data_ce(teacher, labels, mask, decay, alpha)
    loss, terms = tf_loss, {"tf_loss": tf_loss.detach()}
    if weights.consistency_weight > 0 and weights.consistency_passes > 0:
        rounds = jacobi_rounds(
            refiner, base_logits, cache, labels[:, 0], before_anchor, weights.consistency_passes
        )
        consistency = torch.stack([data_ce(r, labels, mask, decay, alpha) for r in rounds]).mean()
        loss = loss + weights.consistency_weight * consistency
        terms["consistency_loss"] = consistency.detach()
    if weights.base_anchor_weight > 0:
        anchor_decay = None if weights.base_anchor_full_weight else decay
        anchor_term = data_ce(base_logits, labels, mask, anchor_decay, alpha)
        loss = loss + weights.base_anchor_weight * anchor_term
        terms["base_anchor_loss"] = anchor_term.detach()
    return loss, terms, teacher


def xpress_drafter_loss(
    drafter: nn.Module, hidden: Tensor, head_weight: Tensor, blocks: DraftBlocks, xpress: XPressWeights
) -> tuple[Tensor, dict]:
    """The XPress loss of a micro-batch and its `LossStats` (lm_head_loss.py) plus stats["xpress"]:
    hidden [B, N*Bs, H] of every block row; the blocks' labels/weights [B, N, Bs] (`block_labels`:
    weight = decay * scored) and before_anchor [B, N]. Accuracy is the teacher-forced refined
    argmax's, as the reference reports it."""
    labels, weights, before_anchor = blocks.labels, blocks.weights, blocks.before_anchor
    block_size = labels.shape[-1]
    hidden = hidden.reshape(-1, block_size, hidden.shape[-1])
    base = drafter.logits(hidden, lambda h: F.linear(h, head_weight.to(h.dtype)))
    mask = weights > 0
    decay = torch.where(mask, weights, 0.0)  # weights are decay on scored positions, 0 elsewhere
    flat = (-1, block_size)
    loss, terms, teacher = xpress_terms(
        drafter.refiner_head,
        base,
        hidden,
        labels.reshape(flat),
        before_anchor.reshape(-1),
        mask.reshape(flat),
        decay.reshape(flat),
        xpress,
    )
    with torch.no_grad():
        scored = mask.reshape(flat)
        correct = (teacher.argmax(-1) == labels.reshape(flat)) & scored
        packed = torch.stack([terms.get(name, torch.zeros((), device=loss.device)) for name in XPRESS_TERMS])
    stats = {
        "correct": correct.sum(0),
        "count": scored.sum(0),
        # Every term is over the scored count (data_ce, as the reference): that is the micro-batch's
        # share of the global batch, so its loss x count sums over micro-batches, ranks and documents.
        "weight_sum": mask.float().sum(),
        "xpress": packed.float(),
    }
    return loss, stats


def xpress_metrics(totals: Tensor, scored_micro_batches: float) -> dict[str, float]:
    """The metrics record's XPress fields: each term's mean over the micro-batches with loss tokens."""
    values = (totals / max(scored_micro_batches, 1.0)).tolist()
    return dict(zip(XPRESS_TERMS, values, strict=True))


def xpress_weights(model: Any) -> XPressWeights:
    """The loss weights of a config's `model` section (model.xpress_*)."""
    return XPressWeights(
        consistency_weight=float(model.xpress_consistency_weight),
        consistency_passes=int(model.xpress_consistency_passes),
        base_anchor_weight=float(model.xpress_base_anchor_weight),
        base_anchor_full_weight=bool(model.xpress_base_anchor_full_weight),
    )
