"""The DFlash 2 selector's training term and its metrics.

At every supervised block position k >= 1 the selector picks among the target head's top-K
logits (the unary candidates C, taken during the chunked LM-head loss). Its term is a K-way
cross-entropy over

    s(b) = U(b) + <A[x_{a+k-1}] * W_h h_k, B[b]>,   b in C,   label x_{a+k}

teacher-forced: the predecessor is the true previous token (the anchor for k = 1). Weights are
the DFlash loss's (decay exp(-(k-1)/gamma) x validity x loss mask), and the term shares the DFlash
loss's denominator, so total = (sum w CE_lm + alpha * sum w CE_sel) / sum w (SpecForge's
normalisation). A label outside the top-K is dropped from the term ("drop", SpecForge and
Automodel) or put into the last candidate slot for the loss only ("inject", speculators).
Gradient reaches the backbone through U and W_h h. Nothing here is vocabulary-sized: U is the dot
product of h with the K candidates' head rows, computed chunk by chunk (`_CandidateLogits`).

Metrics, per block index like the DFlash accuracy (index 0 holds zeros): unary top-K recall,
teacher-forced selector accuracy, and the acceptance of two self-conditioned paths through the
block, the served one (the selector walk from the anchor, as decoding runs it) and the unary-only
one (the head's argmax): position k counts as accepted when every pick up to k equals the label.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NamedTuple, TypedDict

import torch
from torch import Tensor

from dflash_mp.kernels.weighted_rows import weighted_row_sum
from dflash_mp.models.dflash2 import CandidateSelector
from dflash_mp.models.drafter import scale_logits
from dflash_mp.objective.position_weights import dpace_weights

# Per-block-index counts, summed over micro-batches and ranks like LossStats' correct/count.
SELECTOR_COUNTS = ("topk_hits", "selector_correct", "served_accepted", "unary_accepted")
GOLD_OUTSIDE_TOP_K = ("drop", "inject")


class TopK(NamedTuple):
    """Each scored row's top-K head ids [M, K], their raw logits [M, K] and the label's [M] (fp32),
    as the chunked LM-head loss finds them."""

    ids: Tensor
    logits: Tensor
    label_logits: Tensor


class SelectorStats(TypedDict):
    topk_hits: Tensor  # [Bs] int64: label among the unary top-K, where weight > 0
    selector_correct: Tensor  # [Bs] int64: teacher-forced selector argmax == label, where weight > 0
    served_accepted: Tensor  # [Bs] int64: selector walk right at every index <= k, where weight > 0
    unary_accepted: Tensor  # [Bs] int64: head argmax right at every index <= k, where weight > 0
    loss: Tensor  # [] float32: the selector term (before alpha), detached


class _CandidateLogits(torch.autograd.Function):
    """logits[m, k] = hidden[m] . head[candidates[m, k]], a chunk of rows at a time.

    Autograd through `head[candidates]` would keep a [rows, K, H] gather alive for the backward;
    here each chunk's gather lives only while it is used, and the backward's sum over the K head
    rows, weighted by the gradient, is one `weighted_row_sum` (no gather in memory at all).
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, head: Tensor, candidates: Tensor, chunk_rows: int, known: Tensor | None
    ) -> Tensor:
        if known is not None:  # the values, taken from the LM-head loss's logits: only the backward is left
            out = known.clone()
        else:
            out = torch.empty(candidates.shape, dtype=torch.float32, device=hidden.device)
        for start in range(0, hidden.shape[0] if known is None else 0, chunk_rows):
            rows = slice(start, start + chunk_rows)
            rows_of_head = head[candidates[rows]]
            out[rows] = torch.einsum("mh,mkh->mk", hidden[rows].to(head.dtype), rows_of_head).float()
        ctx.save_for_backward(hidden, head, candidates)
        ctx.chunk_rows = chunk_rows
        return out

    @staticmethod
    def backward(ctx, out_grad: Tensor):
        hidden, head, candidates = ctx.saved_tensors
        hidden_grad = head_grad = None
        if ctx.needs_input_grad[0]:  # sum_k grad[m, k] * head[candidates[m, k]]
            hidden_grad = weighted_row_sum(head, candidates, out_grad).to(hidden.dtype)
        if ctx.needs_input_grad[1]:  # the head is frozen in training; this serves the tests
            head_grad = torch.zeros_like(head, dtype=torch.float32)
            for start in range(0, hidden.shape[0], ctx.chunk_rows):
                rows = slice(start, start + ctx.chunk_rows)
                outer = out_grad[rows].float()[:, :, None] * hidden[rows].float()[:, None, :]
                head_grad.index_add_(0, candidates[rows].flatten(), outer.flatten(0, 1))
            head_grad = head_grad.to(head.dtype)
        return hidden_grad, head_grad, None, None, None


def candidate_logits(
    hidden: Tensor,
    head_weight: Tensor,
    candidates: Tensor,
    chunk_rows: int = 2048,
    known: Tensor | None = None,
) -> Tensor:
    """[M, K] float32 head logits of the candidate ids [M, K] for hidden rows [M, H]; `known`
    values (the same logits, computed elsewhere without a gradient) skip the forward's gathers."""
    return _CandidateLogits.apply(hidden, head_weight, candidates, chunk_rows, known)


def selector_loss(
    selector: CandidateSelector,
    hidden: Tensor,
    head_weight: Tensor,
    candidates: TopK | Tensor,
    labels: Tensor,
    weights: Tensor,
    weight_sum: Tensor,
    gold_outside_top_k: str = "drop",
    chunk_rows: int = 2048,
    multiplier: float = 1.0,
    softcap: float | None = None,
    dpace_alpha: float | None = None,
) -> tuple[Tensor, SelectorStats]:
    """The selector term sum(w * CE_sel) / weight_sum and its metrics; with `dpace_alpha`, w are
    D-PACE weights from CE_sel itself (position_weights.py), as speculators' selector loss takes them.

    hidden [B, N*Bs, H] (the drafter's output), candidates [B*N*(Bs-1), K] (the unary top-K of
    block indices 1..Bs-1, sorted by logit; a `TopK` from the LM-head loss also brings their
    logits), labels/weights [B, N, Bs] from `block_labels`.
    The unary scores are the head logits after `multiplier` and the soft cap, as the reference's.
    """
    if gold_outside_top_k not in GOLD_OUTSIDE_TOP_K:
        raise ValueError(f"gold_outside_top_k={gold_outside_top_k!r}: must be one of {GOLD_OUTSIDE_TOP_K}")
    known = candidates if isinstance(candidates, TopK) else None
    candidates = known.ids if known is not None else candidates
    batch, num_blocks, block_size = labels.shape
    top_k = candidates.shape[-1]
    scored_hidden = hidden.reshape(batch, num_blocks, block_size, -1)[:, :, 1:].reshape(-1, hidden.shape[-1])
    targets = labels[:, :, 1:].reshape(-1)
    predecessors = labels[:, :, :-1].reshape(-1)  # teacher forcing: the true previous token
    position_weights = weights[:, :, 1:].reshape(-1).float()

    is_gold = candidates == targets[:, None]
    in_top_k = is_gold.any(-1)
    gold_index = is_gold.int().argmax(-1)  # 0 where absent; such rows are dropped or injected below
    known_logits = None if known is None else known.logits
    if gold_outside_top_k == "inject":
        injected = ~in_top_k[:, None] & (torch.arange(top_k, device=candidates.device) == top_k - 1)
        loss_candidates = torch.where(injected, targets[:, None], candidates)
        if known is not None:
            known_logits = torch.where(injected, known.label_logits[:, None], known.logits)
        gold_index = torch.where(in_top_k, gold_index, top_k - 1)
        loss_weights = position_weights
    else:
        loss_candidates = candidates
        loss_weights = position_weights * in_top_k

    raw = candidate_logits(scored_hidden, head_weight, loss_candidates, chunk_rows, known_logits)
    unary = scale_logits(raw, multiplier, softcap)
    # Compiled on a GPU: the selector's many small ops (the walk alone is Bs-1 sequential steps)
    # become a few fused kernels; on the CPU it runs eagerly, as the reference comparisons do.
    terms = _compiled_selector_terms() if hidden.is_cuda else _selector_terms
    loss, stats = terms(
        selector,
        scored_hidden,
        unary,
        candidates,
        loss_candidates,
        gold_index,
        in_top_k,
        predecessors,
        targets,
        labels[:, :, 0].reshape(-1),
        loss_weights,
        position_weights,
        weight_sum,
        block_size - 1,
        dpace_alpha,
    )
    return loss, stats


def _selector_terms(
    selector: CandidateSelector,
    scored_hidden: Tensor,
    unary: Tensor,
    candidates: Tensor,
    loss_candidates: Tensor,
    gold_index: Tensor,
    in_top_k: Tensor,
    predecessors: Tensor,
    targets: Tensor,
    anchor_ids: Tensor,
    loss_weights: Tensor,
    position_weights: Tensor,
    weight_sum: Tensor,
    steps: int,
    dpace_alpha: float | None = None,
) -> tuple[Tensor, SelectorStats]:
    """The selector's K-way cross-entropy over `loss_candidates` and the metrics (rows = scored
    block positions, `steps` = Bs - 1 per block: [blocks * steps])."""
    top_k = candidates.shape[-1]
    projected = selector.hidden_projection(scored_hidden)
    scores = unary + selector.pair_scores(projected, predecessors, loss_candidates).float()
    ce = torch.logsumexp(scores, dim=-1) - scores.gather(-1, gold_index[:, None])[:, 0]
    if dpace_alpha is not None:  # a dropped label is a position D-PACE does not score
        by_block = (-1, steps)
        scored = (loss_weights > 0).view(by_block)
        loss_weights = dpace_weights(ce.view(by_block), scored, dpace_alpha).flatten()
    loss = (loss_weights * ce).sum() / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)

    with torch.no_grad():
        # Accuracy over the real candidates: an injected gold never counts as found.
        selector_right = (scores.argmax(-1) == gold_index) & in_top_k
        by_block = (-1, steps)
        served, _ = selector.walk_candidates(
            projected.detach().view(-1, steps, projected.shape[-1]),
            unary.detach().view(-1, steps, top_k),
            candidates.view(-1, steps, top_k),
            anchor_ids,
        )
        truth = targets.view(by_block)
        served_accepted = (served == truth).int().cumprod(-1).bool()
        unary_accepted = (candidates[:, 0].view(by_block) == truth).int().cumprod(-1).bool()
        scored_by_block = (position_weights > 0).view(by_block)

        def per_index(hit: Tensor) -> Tensor:
            counts = (hit.view(by_block) & scored_by_block).sum(0)
            return torch.cat([counts.new_zeros(1), counts])

        stats = SelectorStats(
            topk_hits=per_index(in_top_k),
            selector_correct=per_index(selector_right),
            served_accepted=per_index(served_accepted),
            unary_accepted=per_index(unary_accepted),
            loss=loss.detach().float(),
        )
    return loss, stats


@functools.cache
def _compiled_selector_terms() -> Callable[..., tuple[Tensor, SelectorStats]]:
    return torch.compile(_selector_terms)


# ----------------------------------------------------------------------------- per-step metrics


def add_selector_stats(totals: dict[str, Tensor], stats: SelectorStats | None) -> None:
    """Accumulate one micro-batch's stats into `totals` (a trainer's per-step sums)."""
    if stats is None:
        return
    for key in (*SELECTOR_COUNTS, "loss"):
        totals[key] = stats[key] + totals[key] if key in totals else stats[key]


def pack_selector_totals(
    totals: dict[str, Tensor], block_size: int, device: torch.device, enabled: bool = True
) -> Tensor:
    """One float64 vector [4*Bs + 1] (counts, then the loss sum) for the step's all-reduce; zeros
    for what no micro-batch reported, so every rank packs the same shape. Empty when not `enabled`
    (a DFlash drafter)."""
    if not enabled:
        return torch.zeros(0, dtype=torch.float64, device=device)
    parts = [totals.get(key, torch.zeros(block_size)).to(device, torch.float64) for key in SELECTOR_COUNTS]
    parts.append(totals.get("loss", torch.zeros(())).reshape(1).to(device, torch.float64))
    return torch.cat(parts)


def selector_metrics(packed: Tensor, count: Tensor, micro_batches: float) -> dict[str, object]:
    """The metrics record's selector fields from the all-reduced `pack_selector_totals` vector and
    the DFlash count [Bs] (positions with weight > 0): lists are per block index k = 1..Bs-1."""
    block_size = count.shape[0]
    counts = packed[: 4 * block_size].view(4, block_size)[:, 1:].double()
    rates = (counts / count[1:].double().clamp_min(1)).tolist()
    return {
        "selector_loss": float(packed[-1]) / max(micro_batches, 1),
        "topk_recall": rates[0],
        "selector_acc": rates[1],
        "accept_selector": rates[2],
        "accept_unary": rates[3],
        # Expected accepted drafts per block along each path (the sum of its per-index rates).
        "accepted_len_selector": sum(rates[2]),
        "accepted_len_unary": sum(rates[3]),
    }
