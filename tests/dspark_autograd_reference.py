"""DSpark's loss terms through autograd: the reference `objective/dspark_rows.py` is tested against
(tests/test_dspark_rows.py) and that is held equal to speculators 0.9.0 (tests/test_dspark_parity.py).

`row_terms` takes the vocabulary-sized work a chunk of rows at a time, each chunk recomputed in the
backward under activation checkpointing; `reduce_terms` weighs and sums the terms with the BCE.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.utils.checkpoint import checkpoint

from dflash_mp.models.drafter import scale_logits
from dflash_mp.models.dspark_fields import dspark_chunk_rows
from dflash_mp.objective.dspark_loss import DSparkLossWeights, confidence_bce
from dflash_mp.objective.dspark_rows import loss_denominator, term_row_weights


def _row_terms(
    hidden: Tensor,
    markov: Tensor | None,
    teacher: Tensor | None,
    labels: Tensor,
    head: Tensor,
    markov_w2: Tensor | None,
    multiplier: float,
    softcap: float | None,
) -> tuple[Tensor, Tensor]:
    """Per row [M, 3] (CE, KL(teacher || draft), TV) and the draft's argmax == label [M]."""
    logits = scale_logits(F.linear(hidden, head.to(hidden.dtype)), multiplier, softcap)
    if markov is not None:
        logits = logits + F.linear(markov, markov_w2.to(markov.dtype))
    logits = logits.float()
    log_q = torch.log_softmax(logits, dim=-1)
    ce = -log_q.gather(-1, labels[:, None])[:, 0]
    correct = logits.argmax(-1) == labels
    if teacher is None:
        zero = torch.zeros_like(ce)
        return torch.stack([ce, zero, zero], dim=-1), correct
    with torch.no_grad():
        teacher_logits = scale_logits(F.linear(teacher, head.to(teacher.dtype)), multiplier, softcap)
        p = torch.softmax(teacher_logits.float(), dim=-1)
    kl = F.kl_div(log_q, p, reduction="none").sum(-1)
    tv = 1.0 - torch.minimum(torch.softmax(logits, dim=-1), p).sum(-1)
    return torch.stack([ce, kl, tv], dim=-1), correct


def row_terms(
    hidden: Tensor,
    markov: Tensor | None,
    teacher: Tensor | None,
    labels: Tensor,
    head: Tensor,
    markov_w2: Tensor | None,
    multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_rows: int | None = None,
) -> tuple[Tensor, Tensor]:
    """`_row_terms` over rows [M, ...] a chunk at a time, each chunk recomputed in the backward:
    with `reduce_terms`, the autograd reference of `dspark_row_loss` (tests/test_dspark_rows.py)."""
    chunk_rows = chunk_rows or dspark_chunk_rows(head.shape[0])
    terms, correct = [], []
    for start in range(0, hidden.shape[0], chunk_rows):
        rows = slice(start, start + chunk_rows)
        args = (
            hidden[rows],
            None if markov is None else markov[rows],
            None if teacher is None else teacher[rows],
            labels[rows],
            head,
            markov_w2,
            multiplier,
            softcap,
        )
        if torch.is_grad_enabled():
            chunk_terms, chunk_correct = checkpoint(_row_terms, *args, use_reentrant=False)
        else:
            chunk_terms, chunk_correct = _row_terms(*args)
        terms.append(chunk_terms)
        correct.append(chunk_correct)
    return torch.cat(terms), torch.cat(correct)


def term_weights(
    terms: Tensor, weights: Tensor, dpace_alpha: float | None, block_size: int | None
) -> tuple[Tensor, Tensor]:
    """(weights [M, 3] of the row terms [M, 3], the loss's denominator) from the decay weights [M]:
    the decay and sum(w), or (`dpace_alpha`) each term's D-PACE weights from its own values over
    blocks of `block_size` rows and the count of scored rows (module docstring)."""
    return term_row_weights(terms, weights, dpace_alpha, block_size), loss_denominator(weights, dpace_alpha)


def reduce_terms(
    terms: Tensor,
    confidence_logits: Tensor | None,
    weights: Tensor,
    alphas: DSparkLossWeights,
    dpace_alpha: float | None = None,
    block_size: int | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, the four terms [CE, KL, TV, BCE] before their weights, detached, the accept rate
    1 - TV [M]) from row terms [M, 3], confidence logits [M] (or None) and decay weights [M];
    `dpace_alpha`: D-PACE weights for CE, KL and TV (`term_weights`), the BCE on the decay."""
    row_weights, denominator = term_weights(terms, weights, dpace_alpha, block_size)
    denominator = denominator.clamp_min(torch.finfo(torch.float32).tiny)
    ce, kl, tv = ((row_weights * terms).sum(0) / denominator).unbind()
    accept = (1.0 - terms[:, 2].detach()).clamp(0.0, 1.0)
    bce = confidence_bce(confidence_logits, accept, weights, denominator)
    loss = alphas.ce * ce + alphas.kl * kl + alphas.tv * tv + alphas.confidence * bce
    return loss, torch.stack([ce, kl, tv, bce]).detach(), accept
