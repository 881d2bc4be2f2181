"""DSpark's vocabulary work on one chunk of rows in three Triton passes (CUDA).

`objective/dspark_rows.py` takes, per chunk of m rows, the draft logits z = scale(raw) + bias and
the teacher's t = scale(teacher) (scale: times `multiplier`, then c * tanh(x / c) when `softcap`
is set, in fp32 from the matmuls' outputs), q = softmax(z), p = softmax(t) and

    CE = lse(z) - z[label],  KL = sum p (log p - log q),  TV = 1 - sum min(p, q),
    dz = c_ce (q - onehot) + c_kl (q - p) + c_tv q (Q_S - m_v),  Q_S = sum q m_v,

m_v = 1 where q_v < p_v, 1/2 at a tie (torch.minimum's backward), else 0. The per-row weights c
[m, 3] need every row's terms first (D-PACE weighs a term by its values over the block), and
KL, TV and Q_S need both log-normalisers, so three reads of the logits are the least:

1. row_statistics.py: per row and column segment, the online max and sum of exponentials of z and
   t, z's first maximum and its index, z[label]; one more launch merges the segments.
2. `_row_divergence`: per row and segment, with log q = z - lse(z) and log p = t - lse(t), the
   sums of p (log p - log q), min(p, q) and q m_v; summed in torch.
3. `_gradient`: per row and tile, dz over the Markov bias's buffer (its dtype: what the Markov
   gradients read) and dz times scale's derivative (the multiplier, soft-capping's 1 - tanh^2) over
   the draft's raw logits (their dtype: what the hidden gradient reads).

The kernels read the matmuls' outputs as they are (bf16 in training) and compute in fp32: no fp32
copy of a [m, V] tensor exists, and the gradients overwrite buffers the caller gives up. q and p
are exponentials of z - lse(z) and t - lse(t) alike, so equal rows give equal q and p (ties) bit for
bit. Without a teacher only pass 1 (z alone) and the CE's gradient run. Bytes moved per chunk, in
units of one [m, V] tensor of the matmuls' dtype: passes 1 and 2 read z and t (and the bias), pass
3 reads them and writes one (two where scale's derivative is not 1: the gradients of the draft's
logits and of the bias then differ): 7 without the Markov head, 10 with it; 3 and 5 without a
teacher. At Qwen3-8B's shape (8192 rows a step, V = 151936, bf16: 2.5 GB a unit) 25 GB a step with
the Markov head, ~8.5 ms at 3 TB/s, against ~29 eager fp32 passes in the torch path (not yet measured).

Column segments split a row over several programs in passes 1 and 2 (row_statistics.py's reason).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dflash_mp.kernels.row_statistics import (
    ChunkLogits,
    ChunkStatistics,
    kernel_arguments,
    row_statistics,
)

try:  # Triton ships with CUDA builds of torch; elsewhere dspark_rows takes its torch path.
    import triton
    import triton.language as tl

    from dflash_mp.kernels.fused_ce import scaled_tile  # the logits as both losses read them
    from dflash_mp.kernels.row_statistics import _draft_logits
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_TILE = 4096  # columns per loop iteration (pass 2) and per program (pass 3), as fused_ce.py
_SEGMENT_TILES = 8  # tiles per segment of a row in pass 2: 5 segments at vocab 151936


def dspark_terms(
    x: ChunkLogits, tile: int | None = None, segment_tiles: int | None = None
) -> tuple[Tensor, Tensor, ChunkStatistics]:
    """(fp32 terms [m, 3]: CE, KL, TV (0 and 0 without a teacher), argmax(z) == label [m], what
    `dspark_grad_in_place` reads): passes 1 and 2, the logits left as they are. A tile and segment
    size given (tests) are both passes'; by default each pass takes its own."""
    rows, vocab = x.draft.shape
    device = x.draft.device
    if rows == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty.view(0, 3), empty.bool(), ChunkStatistics(empty, None, None, empty.long())
    terms, correct, stats, _ = row_statistics(x, False, tile, segment_tiles)
    if x.teacher is None:
        return terms, correct, stats
    tile, segment_tiles = tile or _TILE, segment_tiles or _SEGMENT_TILES
    args, flags = kernel_arguments(x, tile)
    segment_columns = tile * segment_tiles
    segments = triton.cdiv(vocab, segment_columns)
    sums = torch.empty(rows, segments, 3, dtype=torch.float32, device=device)
    grid = (rows, segments)
    draft_lse, teacher_lse = stats.draft_lse, stats.teacher_lse
    _row_divergence[grid](*args, draft_lse, teacher_lse, sums, segment_columns, **flags, num_warps=8)
    kl, overlap, accepted = sums.sum(1).unbind(-1)
    terms[:, 1] = kl
    terms[:, 2] = 1.0 - overlap
    return terms, correct, ChunkStatistics(draft_lse, teacher_lse, accepted.contiguous(), stats.argmax)


def dspark_grad_in_place(
    x: ChunkLogits,
    stats: ChunkStatistics,
    weights: Tensor,
    draft_grad: bool = True,
    bias_grad: bool = True,
    tile: int = _TILE,
) -> tuple[Tensor | None, Tensor | None]:
    """Pass 3 for the row weights c [m, 3] (ce, kl, tv): (dz times scale's derivative written over
    `x.draft` if `draft_grad`, dz written over `x.bias` if `bias_grad` and there is a bias, else
    None); the caller gives those buffers up. Where scale's derivative is 1 (no multiplier, no
    soft-cap) and both are wanted in one dtype they are equal: written once, over `x.draft`,
    returned twice."""
    bias_grad = bias_grad and x.bias is not None
    unscaled = x.multiplier == 1.0 and not (x.softcap is not None and x.softcap > 0)
    if draft_grad and bias_grad and unscaled and x.draft.dtype == x.bias.dtype:
        draft, _ = dspark_grad_in_place(x, stats, weights, True, False, tile)
        return draft, draft
    rows, vocab = x.draft.shape
    if rows and (draft_grad or bias_grad):
        args, flags = kernel_arguments(x, tile)
        lse = stats.draft_lse
        teacher_lse = lse if stats.teacher_lse is None else stats.teacher_lse  # never read then
        accepted = lse if stats.accepted is None else stats.accepted
        grid = (rows, triton.cdiv(vocab, tile))
        _gradient[grid](
            *args, x.labels.contiguous(), lse, teacher_lse, accepted, weights.float().contiguous(),
            **flags, WRITE_DRAFT=draft_grad, WRITE_BIAS=bias_grad, num_warps=8,
        )  # fmt: skip
    return (x.draft if draft_grad else None), (x.bias if bias_grad else None)


if triton is not None:

    @triton.jit
    def _probabilities(z, t, lse, teacher_lse):
        """(q, p, log q, log p) of the draft's and teacher's fp32 logits, both taken alike."""
        log_q = z - lse
        log_p = t - teacher_lse
        return tl.exp(log_q), tl.exp(log_p), log_q, log_p

    @triton.jit
    def _accepting(q, p):
        """m_v: 1 where q < p, 1/2 at a tie (torch.minimum's backward splits it), else 0."""
        return tl.where(q < p, 1.0, tl.where(q == p, 0.5, 0.0))

    @triton.jit
    def _row_divergence(
        draft_ptr, bias_ptr, teacher_ptr, vocab, draft_stride, bias_stride, teacher_stride,
        multiplier, cap, lse_ptr, teacher_lse_ptr, sums_ptr, segment_columns,
        SOFTCAP: tl.constexpr, BIAS: tl.constexpr, TEACHER: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        low = segment * segment_columns
        high = tl.minimum(low + segment_columns, vocab)
        draft_row = draft_ptr + row * draft_stride
        bias_row = bias_ptr + row * bias_stride
        teacher_row = teacher_ptr + row * teacher_stride
        lse = tl.load(lse_ptr + row)
        teacher_lse = tl.load(teacher_lse_ptr + row)
        columns = tl.arange(0, TILE)
        kl = tl.zeros([TILE], tl.float32)  # per lane, summed once at the end
        overlap = tl.zeros([TILE], tl.float32)
        accepted = tl.zeros([TILE], tl.float32)
        for start in range(low, high, TILE):
            index = start + columns
            inside = index < high
            z, _, _ = _draft_logits(draft_row, bias_row, index, inside, multiplier, cap, SOFTCAP, BIAS)
            t, _ = scaled_tile(tl.load(teacher_row + index, mask=inside, other=0.0), multiplier, cap, SOFTCAP)
            q, p, log_q, log_p = _probabilities(z, t, lse, teacher_lse)
            q = tl.where(inside, q, 0.0)
            p = tl.where(inside, p, 0.0)
            kl += tl.where(p > 0.0, p * (log_p - log_q), 0.0)  # xlogy's 0 where p is
            overlap += tl.minimum(q, p)
            accepted += q * _accepting(q, p)
        out = sums_ptr + (row * tl.num_programs(1) + segment) * 3
        tl.store(out, tl.sum(kl, 0))
        tl.store(out + 1, tl.sum(overlap, 0))
        tl.store(out + 2, tl.sum(accepted, 0))

    @triton.jit
    def _gradient(
        draft_ptr, bias_ptr, teacher_ptr, vocab, draft_stride, bias_stride, teacher_stride,
        multiplier, cap, labels_ptr, lse_ptr, teacher_lse_ptr, accepted_ptr, weights_ptr,
        SOFTCAP: tl.constexpr, BIAS: tl.constexpr, TEACHER: tl.constexpr, TILE: tl.constexpr,
        WRITE_DRAFT: tl.constexpr, WRITE_BIAS: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        index = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = index < vocab
        draft_row = draft_ptr + row * draft_stride
        bias_row = bias_ptr + row * bias_stride
        z, tanh, raw = _draft_logits(draft_row, bias_row, index, inside, multiplier, cap, SOFTCAP, BIAS)
        c_ce = tl.load(weights_ptr + row * 3)
        is_label = (index == tl.load(labels_ptr + row)).to(tl.float32)
        if TEACHER:
            t, _ = scaled_tile(
                tl.load(teacher_ptr + row * teacher_stride + index, mask=inside, other=0.0),
                multiplier, cap, SOFTCAP,
            )  # fmt: skip
            q, p, _, _ = _probabilities(z, t, tl.load(lse_ptr + row), tl.load(teacher_lse_ptr + row))
            c_kl = tl.load(weights_ptr + row * 3 + 1)
            c_tv = tl.load(weights_ptr + row * 3 + 2)
            accepted = tl.load(accepted_ptr + row)
            grad = c_ce * (q - is_label) + c_kl * (q - p) + c_tv * q * (accepted - _accepting(q, p))
        else:
            grad = c_ce * (tl.exp(z - tl.load(lse_ptr + row)) - is_label)
        if WRITE_BIAS:
            bias_pointers = bias_row + index
            tl.store(bias_pointers, grad.to(bias_pointers.dtype.element_ty), mask=inside)
        if WRITE_DRAFT:
            if SOFTCAP:
                grad = grad * (1.0 - tanh * tanh)
            tl.store(draft_row + index, (grad * multiplier).to(raw.dtype), mask=inside)
