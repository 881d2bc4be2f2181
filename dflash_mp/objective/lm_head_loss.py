"""The DFlash loss through the target's frozen LM head: the weighted CE of the drafter's hidden
states times the head, taken chunk by chunk with its gradient (`_LinearCrossEntropy`), so the
logits of a micro-batch never exist whole; and the DFlash 2 selector's top-K candidates, taken
while each chunk's logits do.

`decay_weighted_ce` is the same loss over logits held whole, the reference the tests compare with.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import NotRequired, TypedDict

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_mp.kernels.fused_ce import ce_and_grad_in_place, fused_ce_runs_on
from dflash_mp.kernels.top_k import top_k_ids
from dflash_mp.models.block_rows import scored_rows
from dflash_mp.objective.position_weights import loss_row_weights
from dflash_mp.objective.selector_loss import SelectorStats, TopK


class LossStats(TypedDict):
    """Tensors (no GPU sync) that callers sum over micro-batches and ranks."""

    correct: Tensor  # [Bs] int64: argmax == label at block index k, where weight > 0 (k=0 is 0)
    count: Tensor  # [Bs] int64: positions with weight > 0 at block index k (k=0 is 0)
    weight_sum: Tensor  # [] float32: sum of loss weights, the loss's denominator
    selector: NotRequired[SelectorStats]  # DFlash 2 drafters only


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


def _read_logits(
    logits: Tensor, labels: Tensor, scale: Tensor, multiplier: float, softcap: float | None
) -> tuple[Tensor, Tensor | None, Tensor, Tensor]:
    """The fp32 logits as the CE reads them (times `multiplier`, soft-capped), tanh(x / c) or None,
    the rows' log-normalisers [M,1] and sum(scale * CE)."""
    x = logits.float()
    if multiplier != 1.0:  # x * 1 is exact: one [M,V] pass fewer when eager
        x = x * multiplier
    capped = None
    if softcap is not None and softcap > 0:
        capped = torch.tanh(x / softcap)
        x = capped * softcap
    log_normaliser = torch.logsumexp(x, dim=-1, keepdim=True)
    label_logit = x.gather(-1, labels[:, None])
    loss = (scale[:, None] * (log_normaliser - label_logit)).sum()
    return x, capped, log_normaliser, loss


def _ce_and_grad(
    logits: Tensor, labels: Tensor, scale: Tensor, multiplier: float = 1.0, softcap: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """For rows of logits [M,V]: sum(scale * CE), d(that)/d(logits) in the logits' dtype, argmax == label.

    The CE reads the logits as the reference's `compute_logits` leaves them: times `multiplier`,
    then soft-capped, c * tanh(x / c), whose derivative 1 - tanh^2 enters the gradient. Written as
    elementwise ops and row reductions so that, compiled, it is one pass to reduce and one to write
    the gradient, with no fp32 copy of the logits in memory.
    """
    x, capped, log_normaliser, loss = _read_logits(logits, labels, scale, multiplier, softcap)
    is_label = torch.arange(x.shape[-1], device=x.device) == labels[:, None]
    grad = (torch.exp(x - log_normaliser) - is_label.float()) * scale[:, None]
    if capped is not None:
        grad = grad * (1 - capped * capped)
    grad = grad * multiplier
    return loss, grad.to(logits.dtype), x.argmax(-1) == labels


def _ce_and_grad_eager(
    logits: Tensor, labels: Tensor, scale: Tensor, multiplier: float = 1.0, softcap: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """`_ce_and_grad` to the same bits in fewer [M,V] passes, for eager use (CPU): each eager op
    writes a fresh temporary of that size, so the one-hot, and a multiplier of 1, are left out
    (x * 1 and p - 0 are exact). 4x faster at vocab 151936."""
    x, capped, log_normaliser, loss = _read_logits(logits, labels, scale, multiplier, softcap)
    grad = torch.sub(x, log_normaliser).exp_()
    grad[torch.arange(labels.shape[0], device=x.device), labels] -= 1.0
    grad.mul_(scale[:, None])
    if capped is not None:
        grad.mul_(1 - capped * capped)
    if multiplier != 1.0:
        grad.mul_(multiplier)
    return loss, grad.to(logits.dtype), x.argmax(-1) == labels


@functools.cache
def _compiled_ce_and_grad() -> Callable[..., tuple[Tensor, Tensor, Tensor]]:
    # Chunks have at most two sizes per micro-batch shape; a micro-batch of another size (records
    # skipped as bad) makes the row count dynamic once, instead of a recompile per size.
    return torch.compile(_ce_and_grad)


LM_HEAD_CHUNK_ROWS = 2048  # rows of logits per chunk by default (train.vocabulary_chunk_rows)
# Eager chunks of logits stay under 8 MiB of fp32: temporaries that small are reused from the
# allocator's free lists, larger ones are fresh pages every op (on CPU at vocab 151936, 13-row
# chunks take the loss and its gradient 2.6x faster than one 448-row chunk).
_EAGER_CHUNK_ELEMENTS = 1 << 21


class _LinearCrossEntropy(torch.autograd.Function):
    """sum_i scale_i * CE(hidden_i @ head.T, label_i), with the gradient computed during the forward.

    The head is frozen in training, so its backward needs only the input gradient; computing it
    chunk by chunk while the logits are at hand means the logits are never stored nor recomputed:
    two head matmuls per chunk instead of the three of checkpointing, and one chunk of logits alive.
    """

    @staticmethod
    def forward(
        ctx,
        hidden: Tensor,
        head: Tensor,
        labels: Tensor,
        scale: Tensor,
        chunk_tokens: int,
        grad_enabled: bool,
        top_k: int = 0,
        multiplier: float = 1.0,
        softcap: float | None = None,
    ):
        rows = hidden.shape[0]
        # Under no_grad nobody will call backward: skip the gradient matmuls.
        need_hidden_grad = grad_enabled and ctx.needs_input_grad[0]
        need_head_grad = grad_enabled and ctx.needs_input_grad[1]
        if hidden.is_cuda:  # two Triton passes, the gradient over the logits; else inductor's
            ce_and_grad = ce_and_grad_in_place if fused_ce_runs_on(hidden.device) else _compiled_ce_and_grad()
        else:  # eager: every op allocates a [rows, vocab] temporary
            ce_and_grad = _ce_and_grad_eager
            chunk_tokens = min(chunk_tokens, max(1, _EAGER_CHUNK_ELEMENTS // head.shape[0]))
        # Equal chunks (at most two sizes), so the compiled part sees few shapes.
        num_chunks = max(1, -(-rows // chunk_tokens))
        size = max(1, -(-rows // num_chunks))
        loss = torch.zeros((), dtype=torch.float32, device=hidden.device)
        correct = torch.zeros(rows, dtype=torch.bool, device=hidden.device)
        hidden_grad = torch.empty_like(hidden) if need_hidden_grad else None  # every row is written
        head_grad = torch.zeros_like(head, dtype=torch.float32) if need_head_grad else None
        # The DFlash 2 selector's candidates: each row's top-K ids and their logits (and the label's,
        # for "inject"), taken while the logits exist, so the selector gathers no head rows for them.
        candidates = torch.zeros(rows, top_k, dtype=torch.long, device=hidden.device)
        candidate_logits = torch.zeros(rows, top_k, dtype=torch.float32, device=hidden.device)
        label_logits = torch.zeros(rows if top_k else 0, dtype=torch.float32, device=hidden.device)
        for start in range(0, rows, size):
            rows_of_chunk = slice(start, start + size)
            chunk = hidden[rows_of_chunk]
            logits = F.linear(chunk, head)
            if top_k:  # multiplier > 0 and the cap are increasing: the raw logits rank alike
                ids = top_k_ids(logits, top_k)
                candidates[rows_of_chunk] = ids
                candidate_logits[rows_of_chunk] = logits.gather(-1, ids).float()
                label_logits[rows_of_chunk] = logits.gather(-1, labels[rows_of_chunk, None])[:, 0].float()
            chunk_loss, logits_grad, correct[rows_of_chunk] = ce_and_grad(
                logits, labels[rows_of_chunk], scale[rows_of_chunk], multiplier, softcap
            )
            del logits  # freed before the next chunk's are made
            loss += chunk_loss
            if hidden_grad is not None:
                hidden_grad[rows_of_chunk] = logits_grad @ head.to(logits_grad.dtype)
            if head_grad is not None:
                head_grad += (logits_grad.T @ chunk.to(logits_grad.dtype)).float()
        ctx.save_for_backward(hidden_grad, head_grad)
        ctx.head_dtype = head.dtype
        ctx.mark_non_differentiable(correct, candidates, candidate_logits, label_logits)
        return loss, correct, candidates, candidate_logits, label_logits

    @staticmethod
    def backward(ctx, loss_grad: Tensor, *_non_differentiable: Tensor | None):
        hidden_grad, head_grad = ctx.saved_tensors
        if hidden_grad is not None:
            hidden_grad = hidden_grad * loss_grad.to(hidden_grad.dtype)
        if head_grad is not None:
            head_grad = (head_grad * loss_grad).to(ctx.head_dtype)
        return hidden_grad, head_grad, None, None, None, None, None, None, None


def chunked_lm_head_loss(
    hidden: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    chunk_tokens: int = LM_HEAD_CHUNK_ROWS,
    multiplier: float = 1.0,
    softcap: float | None = None,
    scored_only: bool = False,
    dpace_alpha: float | None = None,
) -> tuple[Tensor, LossStats]:
    """`decay_weighted_ce(scale_logits(hidden @ head_weight.T), ...)` without materialising all
    logits (see `lm_head_loss_and_candidates`)."""
    loss, stats, _ = lm_head_loss_and_candidates(
        hidden, head_weight, labels, weights, 0, chunk_tokens, multiplier, softcap, scored_only, dpace_alpha
    )
    return loss, stats


def lm_head_loss_and_candidates(
    hidden: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    top_k: int,
    chunk_tokens: int = LM_HEAD_CHUNK_ROWS,
    multiplier: float = 1.0,
    softcap: float | None = None,
    scored_only: bool = False,
    dpace_alpha: float | None = None,
) -> tuple[Tensor, LossStats, Tensor]:
    """`decay_weighted_ce(scale_logits(hidden @ head_weight.T, multiplier, softcap), ...)` without
    materialising all logits.

    hidden [B,N*Bs,H], head_weight [V,H], labels/weights [B,N,Bs]; block index 0 must carry
    weight 0 (it holds the known token; `block_labels` never scores it) and is skipped
    (`scored_only`: hidden is [B,N*(Bs-1),H], without those rows). Logits
    exist one chunk of `chunk_tokens` rows at a time (2048 x 152k bf16 = 0.6 GB) and their
    gradient is taken on the spot (`_LinearCrossEntropy`). Shapes depend only on the batch shape
    and nothing reads back from the GPU, so a compiled step never waits on the host here.
    Also returns the DFlash 2 selector's candidates, a `TopK`: the top-`top_k` head ids of every
    scored row, [B*N*(Bs-1), top_k] sorted by logit ([.., 0] when top_k is 0), with their raw
    logits and the label's (detached: `selector_loss` gives them their gradient). `dpace_alpha`:
    D-PACE weights (position_weights.py) in place of the decay in `weights`.
    """
    batch, num_blocks, block_size = labels.shape
    scored_hidden = hidden if scored_only else scored_rows(hidden, block_size)
    scored_hidden = scored_hidden.reshape(-1, hidden.shape[-1])
    scored_labels = labels[:, :, 1:].reshape(-1)
    options = (dpace_alpha, multiplier, softcap, chunk_tokens)
    row_weights = loss_row_weights(scored_hidden, head_weight, scored_labels, weights, *options)
    scored_weights, weight_sum = row_weights
    # clamp_min: an all-zero-weight batch gives 0 / tiny = 0, not NaN, and keeps the graph.
    scale = scored_weights / weight_sum.clamp_min(torch.finfo(torch.float32).tiny)
    loss, correct, ids, candidate_logits, label_logits = _LinearCrossEntropy.apply(
        scored_hidden,
        head_weight,
        scored_labels,
        scale,
        chunk_tokens,
        torch.is_grad_enabled(),
        top_k,
        multiplier,
        softcap,
    )
    scored = (weights[:, :, 1:] > 0).reshape(-1, block_size - 1)
    zero = torch.zeros(1, dtype=torch.long, device=weights.device)
    correct_by_index = torch.cat([zero, (correct.view_as(scored) & scored).sum(0)])
    count_by_index = torch.cat([zero, scored.sum(0)])
    stats = LossStats(correct=correct_by_index, count=count_by_index, weight_sum=weight_sum)
    return loss, stats, TopK(ids, candidate_logits, label_logits)


def per_position_accuracy(correct: Tensor, count: Tensor) -> list[float]:
    """Accuracy at block indices k = 1..Bs-1 (list index k-1); 0.0 where nothing was scored."""
    accuracy = correct[1:].double() / count[1:].clamp_min(1).double()
    return accuracy.tolist()
