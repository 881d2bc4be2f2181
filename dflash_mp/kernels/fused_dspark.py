"""DSpark's vocabulary work on one chunk of rows in three Triton passes (CUDA).

`objective/dspark_rows.py` takes, per chunk of m rows, the draft logits z = scale(raw) + bias and
the teacher's t = scale(teacher) (scale: times `multiplier`, then c * tanh(x / c) when `softcap`
is set, in fp32 from the matmuls' outputs), q = softmax(z), p = softmax(t) and

    CE = lse(z) - z[label],  KL = sum p (log p - log q),  TV = 1 - sum min(p, q),
    dz = c_ce (q - onehot) + c_kl (q - p) + c_tv q (Q_S - m_v),  Q_S = sum q m_v,

m_v = 1 where q_v < p_v, 1/2 at a tie (torch.minimum's backward), else 0. The per-row weights c
[m, 3] need every row's terms first (D-PACE weighs a term by its values over the block), and
KL, TV and Q_S need both log-normalisers, so three reads of the logits are the least:

1. `_row_statistics`: per row and column segment, the online max and sum of exponentials of z and
   t, z's first maximum and its index, z[label]; the segments' partials are merged in torch.
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

Column segments split a row over several programs in passes 1 and 2: a chunk has few rows (880 at
Qwen3's vocabulary), too few programs to fill the GPU one row each. Untuned: the tile and segment
sizes are fused_ce.py's tile and a guess, to be measured on the device.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; elsewhere dspark_rows takes its torch path.
    import triton
    import triton.language as tl

    from dflash_mp.kernels.fused_ce import scaled_tile  # the logits as both losses read them
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_TILE = 4096  # columns per loop iteration (passes 1, 2) and per program (pass 3), as fused_ce.py
_SEGMENT_TILES = 8  # tiles per segment of a row in passes 1 and 2: 5 segments at vocab 151936


def fused_dspark_runs_on(device: torch.device) -> bool:
    """Whether `dspark_terms` and `dspark_grad_in_place` run on `device` (CUDA with Triton)."""
    return triton is not None and device.type == "cuda"


@dataclass(frozen=True)
class ChunkLogits:
    """One chunk's [m, V] matmul outputs (rows contiguous; any float dtypes) and how they scale."""

    draft: Tensor  # hidden @ head.T, before scaling
    bias: Tensor | None  # the Markov bias, added after scaling (None: no Markov head)
    teacher: Tensor | None  # teacher @ head.T, before scaling (None: CE only)
    labels: Tensor  # [m]
    multiplier: float = 1.0
    softcap: float | None = None


@dataclass(frozen=True)
class ChunkStatistics:
    """What the gradient pass reads besides the logits: fp32 [m] log-normalisers and Q_S."""

    draft_lse: Tensor
    teacher_lse: Tensor | None
    accepted: Tensor | None  # Q_S = sum_v q_v m_v
    argmax: Tensor | None = None  # [m] int64: z's first maximum (XPress's next Jacobi guess)


def _shared(x: ChunkLogits, tile: int) -> tuple[tuple, dict]:
    """The kernels' common arguments: pointers, sizes, strides, scaling, and their constexprs."""
    tensors = [x.draft, x.bias, x.teacher]
    for tensor in tensors:
        if tensor is not None and (tensor.shape != x.draft.shape or tensor.stride(-1) != 1):
            raise ValueError(f"fused DSpark: logits {tuple(tensor.shape)} of strides {tensor.stride()}")
    capped = x.softcap is not None and x.softcap > 0
    pointers = [x.draft if tensor is None else tensor for tensor in tensors]  # absent: never read
    strides = [0 if tensor is None else tensor.stride(0) for tensor in tensors]
    args = (*pointers, x.draft.shape[1], *strides, float(x.multiplier), float(x.softcap) if capped else 1.0)
    flags = {"SOFTCAP": capped, "BIAS": x.bias is not None, "TEACHER": x.teacher is not None, "TILE": tile}
    return args, flags


def _merged_log_normaliser(maxima: Tensor, sums: Tensor) -> Tensor:
    """lse [m] from the segments' running maxima and sums of exp(x - max) [m, S]."""
    top = maxima.amax(1, keepdim=True)
    return (top + (sums * torch.exp(maxima - top)).sum(1, keepdim=True).log())[:, 0]


def dspark_terms(
    x: ChunkLogits, tile: int = _TILE, segment_tiles: int = _SEGMENT_TILES
) -> tuple[Tensor, Tensor, ChunkStatistics]:
    """(fp32 terms [m, 3]: CE, KL, TV (0 and 0 without a teacher), argmax(z) == label [m], what
    `dspark_grad_in_place` reads): passes 1 and 2, the logits left as they are."""
    rows, vocab = x.draft.shape
    device = x.draft.device
    if rows == 0:
        empty = torch.empty(0, dtype=torch.float32, device=device)
        return empty.view(0, 3), empty.bool(), ChunkStatistics(empty, None, None, empty.long())
    args, flags = _shared(x, tile)
    segment_columns = tile * segment_tiles
    segments = triton.cdiv(vocab, segment_columns)
    parts = torch.empty(rows, segments, 5, dtype=torch.float32, device=device)
    best_at = torch.empty(rows, segments, dtype=torch.int32, device=device)
    label_logit = torch.empty(rows, dtype=torch.float32, device=device)
    labels = x.labels.contiguous()
    terms = torch.zeros(rows, 3, dtype=torch.float32, device=device)
    grid = (rows, segments)
    _row_statistics[grid](*args, labels, parts, best_at, label_logit, segment_columns, **flags, num_warps=8)
    draft_lse = _merged_log_normaliser(parts[..., 0], parts[..., 1])
    top = parts[..., 4].amax(1, keepdim=True)  # z's first maximum: the lowest index holding it
    first = torch.where(parts[..., 4] == top, best_at, vocab).amin(1).long()
    correct = first == labels
    terms[:, 0] = draft_lse - label_logit
    if x.teacher is None:
        return terms, correct, ChunkStatistics(draft_lse, None, None, first)
    teacher_lse = _merged_log_normaliser(parts[..., 2], parts[..., 3])
    sums = torch.empty(rows, segments, 3, dtype=torch.float32, device=device)
    _row_divergence[grid](*args, draft_lse, teacher_lse, sums, segment_columns, **flags, num_warps=8)
    kl, overlap, accepted = sums.sum(1).unbind(-1)
    terms[:, 1] = kl
    terms[:, 2] = 1.0 - overlap
    return terms, correct, ChunkStatistics(draft_lse, teacher_lse, accepted.contiguous(), first)


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
        args, flags = _shared(x, tile)
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
    def _draft_logits(draft_row, bias_row, index, inside, multiplier, cap, SOFTCAP, BIAS):
        """(z = scale(raw) + bias in fp32, tanh for scale's derivative, raw as loaded)."""
        raw = tl.load(draft_row + index, mask=inside, other=0.0)
        z, tanh = scaled_tile(raw, multiplier, cap, SOFTCAP)
        if BIAS:
            z += tl.load(bias_row + index, mask=inside, other=0.0).to(tl.float32)
        return z, tanh, raw

    @triton.jit
    def _online(running_max, running_sum, x):
        """The running max and sum of exp(x - max) after a tile x (-inf outside the row)."""
        new_max = tl.maximum(running_max, tl.max(x, 0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
        return new_max, running_sum

    @triton.jit
    def _row_statistics(
        draft_ptr, bias_ptr, teacher_ptr, vocab, draft_stride, bias_stride, teacher_stride,
        multiplier, cap, labels_ptr, parts_ptr, best_at_ptr, label_logit_ptr, segment_columns,
        SOFTCAP: tl.constexpr, BIAS: tl.constexpr, TEACHER: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        low = segment * segment_columns
        high = tl.minimum(low + segment_columns, vocab)
        draft_row = draft_ptr + row * draft_stride
        bias_row = bias_ptr + row * bias_stride
        teacher_row = teacher_ptr + row * teacher_stride
        columns = tl.arange(0, TILE)
        z_max = tl.max(tl.full([TILE], float("-inf"), tl.float32), 0)
        z_sum = tl.sum(tl.zeros([TILE], tl.float32), 0)
        t_max, t_sum = z_max, z_sum
        best = tl.full([TILE], float("-inf"), tl.float32)  # per lane: the first maximum it saw
        best_at = tl.zeros([TILE], tl.int32)
        for start in range(low, high, TILE):
            index = start + columns
            inside = index < high
            z, _, _ = _draft_logits(draft_row, bias_row, index, inside, multiplier, cap, SOFTCAP, BIAS)
            z = tl.where(inside, z, float("-inf"))
            better = z > best  # strict: a lane keeps its earliest maximum
            best = tl.where(better, z, best)
            best_at = tl.where(better, index, best_at)
            z_max, z_sum = _online(z_max, z_sum, z)
            if TEACHER:
                t, _ = scaled_tile(
                    tl.load(teacher_row + index, mask=inside, other=0.0), multiplier, cap, SOFTCAP
                )
                t_max, t_sum = _online(t_max, t_sum, tl.where(inside, t, float("-inf")))
        top = tl.max(best, 0)
        out = parts_ptr + (row * tl.num_programs(1) + segment) * 5
        tl.store(out, z_max)
        tl.store(out + 1, z_sum)
        tl.store(out + 2, t_max)
        tl.store(out + 3, t_sum)
        tl.store(out + 4, top)
        first_top = tl.min(tl.where(best == top, best_at, vocab), 0)  # the earliest lane's, as argmax
        tl.store(best_at_ptr + row * tl.num_programs(1) + segment, first_top)
        label = tl.load(labels_ptr + row)
        label_logit, _, _ = _draft_logits(draft_row, bias_row, label, True, multiplier, cap, SOFTCAP, BIAS)
        tl.store(label_logit_ptr + row, label_logit, mask=segment == 0)

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
