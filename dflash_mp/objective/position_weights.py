"""How the block loss weighs the positions of a block: the DFlash decay, or D-PACE.

`train.position_weights=decay` (the default) is the DFlash paper's: block index k >= 1 weighs
exp(-(k-1)/gamma) (`draft_blocks.loss_decay`) and the loss is sum(w * CE) / sum(w).

`train.position_weights=dpace` is D-PACE (arXiv 2605.18810) as speculators 0.9.0 computes it
(`speculators.losses.utils.dpace_loss_decay`, selected by `--per-position-loss-weight dpace`; the
recommended DFlash recipe of vllm-project/speculators issue #979). Per token, within its block:

    q_k  = exp(-CE_k)                                   the drafter's confidence in the label
    s_k  = (1 - alpha) * q_k + alpha                    smoothed up toward 1 (1 where not scored)
    C_k  = s_1 * ... * s_k                              how likely the block survives to k
    w_k  = sum over scored j >= k of C_j  (0 where k is not scored)

so a position counts for every later position its acceptance lets through. The weights are taken
without a gradient (the CE's gradient is only reweighted) and the loss is sum(w * CE) / (number of
scored positions), not / sum(w): speculators' `loss_function` divides the weighted sum by the loss
mask's count. (ModelOpt 0.47's `_dpace_position_weights` divides by sum(w) instead.) For DFlash 2
the selector's term gets its own D-PACE weights, from the selector's CE, as speculators'
`compute_selector_loss` does.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_mp.kernels.fused_ce import fused_ce_runs_on, row_cross_entropy
from dflash_mp.models.drafter import scale_logits

POSITION_WEIGHTS = ("decay", "dpace")

# Eager (CPU) chunks of fp32 logits stay under this many elements (lm_head_loss's reason).
_EAGER_CHUNK_ELEMENTS = 1 << 21


def dpace_alpha_of(train: Any) -> float | None:
    """The loss functions' `dpace_alpha` for a config's `train` section: None for the decay."""
    if train.position_weights not in POSITION_WEIGHTS:
        raise ValueError(
            f"train.position_weights={train.position_weights!r}: must be one of {POSITION_WEIGHTS}"
        )
    return float(train.dpace_alpha) if train.position_weights == "dpace" else None


def check_dpace_alpha(alpha: float) -> None:
    if not (isinstance(alpha, (int, float)) and 0.0 < alpha <= 1.0):
        raise ValueError(f"train.dpace_alpha={alpha!r}: must be in (0, 1], e.g. 0.5")


def dpace_weights(ce: Tensor, scored: Tensor, alpha: float) -> Tensor:
    """D-PACE weights [..., L] float32 (no gradient) from the CE [..., L] of consecutive positions of
    each block (block indices 1..Bs-1 along the last dimension) and which of them are scored (bool)."""
    check_dpace_alpha(alpha)
    with torch.no_grad():
        confidence = torch.exp(-ce.detach().float())
        smoothed = torch.where(scored, (1.0 - alpha) * confidence + alpha, torch.ones_like(confidence))
        survival = torch.cumprod(smoothed, dim=-1) * scored
        later_sum = torch.cumsum(survival.flip(-1), dim=-1).flip(-1)  # sum over j >= k
        return later_sum * scored


def scored_row_ce(
    rows: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_rows: int = 2048,
) -> Tensor:
    """fp32 CE [M] of hidden rows [M, H] through the head, with the loss's logit scaling; no
    gradient. One head matmul per chunk (the price of D-PACE: its weights need every position's CE
    before the weighted CE's gradient is taken); on CUDA the statistics pass of the fused CE."""
    out = torch.empty(rows.shape[0], dtype=torch.float32, device=rows.device)
    fused = fused_ce_runs_on(rows.device)
    if not fused:
        chunk_rows = min(chunk_rows, max(1, _EAGER_CHUNK_ELEMENTS // head_weight.shape[0]))
    with torch.no_grad():
        for start in range(0, rows.shape[0], chunk_rows):
            part = slice(start, start + chunk_rows)
            logits = F.linear(rows[part], head_weight)
            if fused:
                out[part] = row_cross_entropy(logits, labels[part], multiplier, softcap)
                continue
            x = scale_logits(logits.float(), multiplier, softcap)
            out[part] = torch.logsumexp(x, dim=-1) - x.gather(-1, labels[part, None])[:, 0]
    return out


def dpace_row_weights(
    rows: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    alpha: float,
    multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_rows: int = 2048,
) -> tuple[Tensor, Tensor]:
    """(D-PACE weights [M], the loss's denominator: the count of scored rows) for the scored rows
    [M, H] of the chunked LM-head loss, M = blocks * (Bs-1), and their labels [M]; `weights`
    [blocks, Bs-1] are the decay weights of those rows, whose positives say which are scored."""
    scored = weights > 0
    ce = scored_row_ce(rows, head_weight, labels, multiplier, softcap, chunk_rows)
    position = dpace_weights(ce.view_as(scored), scored, alpha)
    return position.reshape(-1), scored.sum().float()


def loss_row_weights(
    rows: Tensor,
    head_weight: Tensor,
    labels: Tensor,
    weights: Tensor,
    dpace_alpha: float | None,
    multiplier: float = 1.0,
    softcap: float | None = None,
    chunk_rows: int = 2048,
) -> tuple[Tensor, Tensor]:
    """(the weights [M] of the chunked LM-head loss's scored rows, the loss's denominator) for
    `weights` [B, N, Bs] from `block_labels`: the decay and sum(w) when `dpace_alpha` is None,
    else D-PACE from the rows' CE and the scored count (`dpace_row_weights`)."""
    if dpace_alpha is None:
        return weights[:, :, 1:].reshape(-1).float(), weights.float().sum()
    scored = weights[:, :, 1:].flatten(0, 1)
    return dpace_row_weights(rows, head_weight, labels, scored, dpace_alpha, multiplier, softcap, chunk_rows)
