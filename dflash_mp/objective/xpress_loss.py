"""XPress's training objective (docs/drafter.md, XPress): the refiner's passes and loss terms.

As `speculators.models.xpress` trains it, with every cross-entropy on the data tokens (its
`ce_from_data` with the loss "ce"):

    loss = CE(base + bias(true previous tokens))                     teacher-forced pass
         + consistency_weight * mean_j CE(base + bias(round j-1's argmax))   Jacobi rounds
         + base_anchor_weight * CE(base)                             the drafter's own logits

Each CE is sum(mask * decay * ce) / (sum(mask) + 1e-8) over the micro-batch's block positions,
the reference's reduction (the DFlash loss divides by sum(decay) instead); `base_anchor_full_weight`
drops the decay from the anchor term. With train.position_weights=dpace every decayed term takes
D-PACE weights from its own CE instead of the decay, as the reference's terms do.

Training runs `xpress_drafter_loss`, whose gradient objective/xpress_rows.py takes during the
forward; `xpress_terms` is the same loss through autograd, the reference it is tested against
(tests/test_xpress_chunks.py) and that the parity tests hold equal to speculators' XPress.

Unlike the reference, `xpress_terms` does not materialise the logits for the whole micro-batch:
every pass's [blocks * Bs, V] (about 5 GB fp32 per pass at Qwen3-8B's 8192 block rows) would not
fit beside a target. The head's logits, the passes and their CEs run a chunk of whole blocks at a time
(`vocabulary_chunk_blocks`), each chunk recomputed in the backward (activation checkpointing), so at
most one chunk's [rows, V] tensors are alive. A block's passes, argmaxes and D-PACE weights read
only that block, so each chunk returns its weighted CE per position and each term is summed over
the micro-batch and divided by its scored count once: the unchunked loss and terms to the bit, and
its gradients up to the order in which the chunks' shares are summed (tests/test_xpress_chunks.py).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.checkpoint import checkpoint

from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks
from dflash_mp.models.xpress import XPressRefiner, jacobi_passes, teacher_forced
from dflash_mp.objective.draft_blocks import DraftBlocks
from dflash_mp.objective.position_weights import dpace_weights
from dflash_mp.objective.xpress_rows import DENOMINATOR_EPS, XPressRowOptions, combine_passes, xpress_row_loss

# The metrics each micro-batch reports, summed over a step (`xpress_metrics` averages them).
XPRESS_TERMS = ("tf_loss", "consistency_loss", "base_anchor_loss")


class XPressWeights(NamedTuple):
    """The loss weights (`model.xpress_*` fields)."""

    consistency_weight: float = 0.3
    consistency_passes: int = 3
    base_anchor_weight: float = 0.6
    base_anchor_full_weight: bool = False
    dpace_alpha: float | None = None  # train.position_weights=dpace; None: the decay


def weighted_ce(
    logits: Tensor, labels: Tensor, mask: Tensor, decay: Tensor | None, dpace_alpha: float | None = None
) -> Tensor:
    """mask * decay * CE(logits, labels) [N, Bs], what one CE term sums; logits [N, Bs, V], the rest
    [N, Bs]. decay None: no position weights; `dpace_alpha`: D-PACE weights from this CE instead
    (per block, so whole blocks of a chunk have the values they have in the micro-batch)."""
    ce = F.cross_entropy(logits.flatten(0, -2).float(), labels.reshape(-1), reduction="none").view(mask.shape)
    weight = mask.float()
    if decay is not None and dpace_alpha is not None:
        weight = dpace_weights(ce, mask, dpace_alpha)
    elif decay is not None:
        weight = weight * decay.float()
    return ce * weight


def consistency_rounds(weights: XPressWeights) -> int:
    """The Jacobi rounds the consistency term runs (0 without a weight)."""
    if weights.consistency_weight > 0 and weights.consistency_passes > 0:
        return weights.consistency_passes
    return 0


def _chunk_terms(
    refiner: XPressRefiner,
    to_logits: Callable[[Tensor], Tensor] | None,
    base: Tensor,
    hidden: Tensor,
    labels: Tensor,
    before_anchor: Tensor,
    mask: Tensor,
    decay: Tensor,
    weights: XPressWeights,
) -> tuple[Tensor, Tensor]:
    """(each pass's `weighted_ce` [P, n, Bs]: teacher-forced, each round, the base anchor; the
    teacher-forced argmax == label & mask [n, Bs]) of a chunk of blocks (`xpress_terms`' arguments)."""
    base = base if to_logits is None else to_logits(base)
    cache = refiner.hidden_cache(hidden)
    alpha = weights.dpace_alpha
    teacher = teacher_forced(refiner, base, cache, labels, before_anchor)
    terms = [weighted_ce(teacher, labels, mask, decay, alpha)]
    correct = (teacher.detach().argmax(-1) == labels) & mask
    del teacher  # each pass's [n, Bs, V] goes once its CE has what the backward needs
    passes = jacobi_passes(refiner, base, cache, labels[:, 0], before_anchor, consistency_rounds(weights))
    terms += [weighted_ce(refined, labels, mask, decay, alpha) for refined in passes]
    if weights.base_anchor_weight > 0:
        anchor_decay = None if weights.base_anchor_full_weight else decay
        terms.append(weighted_ce(base, labels, mask, anchor_decay, alpha))
    return torch.stack(terms), correct


def xpress_terms(
    refiner: XPressRefiner,
    base: Tensor,
    hidden: Tensor,
    labels: Tensor,
    before_anchor: Tensor,
    mask: Tensor,
    decay: Tensor,
    weights: XPressWeights,
    to_logits: Callable[[Tensor], Tensor] | None = None,
    chunk_blocks: int | None = None,
) -> tuple[Tensor, dict[str, Tensor], Tensor]:
    """(loss, {term: value}, teacher-forced argmax == label on scored positions [N, Bs]) of blocks
    [N, Bs]: base [N, Bs, V] the drafter's logits, or what `to_logits` makes them of a chunk of it;
    hidden [N, Bs, H] the drafter's; labels [N, Bs] the data tokens (index 0 the anchor's own),
    before_anchor [N] the token before each anchor, mask [N, Bs] the scored positions (never index
    0), decay [N, Bs] the position weights. `chunk_blocks` blocks at a time (default:
    `vocabulary_chunk_blocks`), each recomputed in the backward."""
    vocab, block_size = refiner.readout.weight.shape[0], labels.shape[1]
    chunk = chunk_blocks or vocabulary_chunk_blocks(vocab, block_size)
    rows_ce, correct = [], []
    for start in range(0, labels.shape[0], chunk):
        rows = slice(start, start + chunk)
        args = (refiner, to_logits, base[rows], hidden[rows], labels[rows], before_anchor[rows])
        args += (mask[rows], decay[rows], weights)
        if torch.is_grad_enabled():
            chunk_ce, chunk_correct = checkpoint(_chunk_terms, *args, use_reentrant=False)
        else:
            chunk_ce, chunk_correct = _chunk_terms(*args)
        rows_ce.append(chunk_ce)
        correct.append(chunk_correct)
    # Each term's sum over the whole micro-batch at once (the unchunked sum's order), then over the
    # micro-batch's scored count, the reference's reduction.
    sums = torch.stack([term.sum() for term in torch.cat(rows_ce, dim=1)])
    values = sums / (mask.float().sum() + DENOMINATOR_EPS)
    rounds = consistency_rounds(weights)
    loss, terms = combine_passes(values, rounds, weights.consistency_weight, weights.base_anchor_weight)
    return loss, terms, torch.cat(correct)


def xpress_drafter_loss(
    drafter: nn.Module,
    hidden: Tensor,
    head_weight: Tensor,
    blocks: DraftBlocks,
    xpress: XPressWeights,
    chunk_rows: int | None = None,
) -> tuple[Tensor, dict]:
    """The XPress loss of a micro-batch and its `LossStats` (lm_head_loss.py) plus stats["xpress"]:
    hidden [B, N*Bs, H] of every block row; the blocks' labels/weights [B, N, Bs] (`block_labels`:
    weight = decay * scored) and before_anchor [B, N]. Accuracy is the teacher-forced refined
    argmax's, as the reference reports it. The head's logits too are made a chunk at a time, of
    `chunk_rows` rows (train.vocabulary_chunk_rows; None: the default)."""
    labels, weights, before_anchor = blocks.labels, blocks.weights, blocks.before_anchor
    block_size = labels.shape[-1]
    hidden = hidden.reshape(-1, block_size, hidden.shape[-1])
    mask = weights > 0
    decay = torch.where(mask, weights, 0.0)  # weights are decay on scored positions, 0 elsewhere
    flat = (-1, block_size)
    options = XPressRowOptions(
        consistency_rounds(xpress),
        xpress.consistency_weight,
        xpress.base_anchor_weight,
        xpress.base_anchor_full_weight,
        xpress.dpace_alpha,
        drafter.output_multiplier,
        drafter.final_logit_softcapping,
        chunk_rows,
    )
    targets = (labels.reshape(flat), before_anchor.reshape(-1), mask.reshape(flat), decay.reshape(flat))
    loss, values, correct = xpress_row_loss(drafter.refiner_head, hidden, head_weight, targets, options)
    _, terms = combine_passes(values, options.rounds, xpress.consistency_weight, xpress.base_anchor_weight)
    with torch.no_grad():
        packed = torch.stack([terms.get(name, torch.zeros((), device=loss.device)) for name in XPRESS_TERMS])
    stats = {
        "correct": correct.sum(0),
        "count": mask.reshape(flat).sum(0),
        # Every term is over the scored count (as the reference): that is the micro-batch's share
        # of the global batch, so its loss x count sums over micro-batches, ranks and documents.
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
