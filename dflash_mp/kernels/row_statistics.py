"""Pass 1 over one chunk of logits (CUDA, Triton): each row's log-normaliser, first maximum and CE.

Per chunk of m rows: the draft logits z = scale(raw) + bias (scale: times `multiplier`, then
c * tanh(x / c) when `softcap` is set, in fp32 from the matmuls' outputs, bf16 in training), and
beside them either a teacher's t = scale(teacher) (DSpark: fused_dspark.py reads both lse) or the
base z_0 = scale(raw) without the bias (XPress: its teacher-forced pass and its base anchor from one
read of raw and bias). Column segments split a row over several programs (a chunk has few rows:
880 at Qwen3's vocabulary, too few programs to fill the GPU one row each), each keeping the online
max and sum of exponentials and, per lane, the first maximum; one more launch merges a chunk's
segments into each row's lse, argmax (the lowest column holding the maximum, as torch.argmax) and
CE = lse - z[label]. The merge is one kernel, not a dozen small torch ops a pass: XPress runs five
passes a chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; elsewhere the losses take their torch paths.
    import triton
    import triton.language as tl

    from dflash_mp.kernels.fused_ce import scaled_tile  # the logits as every loss reads them
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

# The fastest of a sweep on an H100 at [880, 151936] bf16 (BENCHMARKS.md, "Drafter heads"): 1024-
# column tiles in 16-tile segments (10 a row), 4 warps for one stream of logits and 8 for two; a
# biased pass reads ~2.8 TB/s (bench/loss_passes.py), where 4096 x 8 with 8 warps read ~2.4.
_TILE = 1024  # columns per loop iteration
_SEGMENT_TILES = 16  # tiles per segment of a row
_MERGE_ROWS = 64  # rows per program of the segments' merge


def vocabulary_kernels_run_on(device: torch.device) -> bool:
    """Whether these kernels and fused_dspark.py's run on `device` (CUDA with Triton)."""
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


def kernel_arguments(x: ChunkLogits, tile: int) -> tuple[tuple, dict]:
    """The kernels' common arguments: pointers, sizes, strides, scaling, and their constexprs."""
    tensors = [x.draft, x.bias, x.teacher]
    for tensor in tensors:
        if tensor is not None and (tensor.shape != x.draft.shape or tensor.stride(-1) != 1):
            raise ValueError(f"fused loss pass: logits {tuple(tensor.shape)} of strides {tensor.stride()}")
    capped = x.softcap is not None and x.softcap > 0
    pointers = [x.draft if tensor is None else tensor for tensor in tensors]  # absent: never read
    strides = [0 if tensor is None else tensor.stride(0) for tensor in tensors]
    args = (*pointers, x.draft.shape[1], *strides, float(x.multiplier), float(x.softcap) if capped else 1.0)
    flags = {"SOFTCAP": capped, "BIAS": x.bias is not None, "TEACHER": x.teacher is not None, "TILE": tile}
    return args, flags


@dataclass(frozen=True)
class RowCE:
    """One pass's statistics without a teacher: fp32 CE [m] and what its gradient reads."""

    ce: Tensor
    stats: ChunkStatistics


def row_statistics(
    x: ChunkLogits, base: bool = False, tile: int | None = None, segment_tiles: int | None = None
) -> tuple[Tensor, Tensor, ChunkStatistics, RowCE | None]:
    """(fp32 terms [m, 3] with the CE in column 0 (the others 0), argmax(z) == label [m], z's lse
    and argmax with the teacher's lse, the base's CE and statistics if `base`): two launches."""
    rows, vocab = x.draft.shape
    device = x.draft.device
    args, flags = kernel_arguments(x, tile or _TILE)
    segment_columns = (tile or _TILE) * (segment_tiles or _SEGMENT_TILES)
    segments = triton.cdiv(vocab, segment_columns)
    second = x.teacher is not None or base
    parts = torch.empty(rows, segments, 4, dtype=torch.float32, device=device)
    best_at = torch.empty(rows, segments, 2, dtype=torch.int32, device=device)
    label_logits = torch.empty(rows, 2, dtype=torch.float32, device=device)
    labels = x.labels.contiguous()
    terms = torch.zeros(rows, 3, dtype=torch.float32, device=device)
    lse = torch.empty(2 if second else 1, rows, dtype=torch.float32, device=device)
    first = torch.empty(2 if base else 1, rows, dtype=torch.int64, device=device)
    base_ce = torch.empty(rows if base else 0, dtype=torch.float32, device=device)
    correct = torch.empty(rows, dtype=torch.bool, device=device)
    if rows:
        _row_statistics[(rows, segments)](
            *args, labels, parts, best_at, label_logits, segment_columns, **flags, BASE=base,
            num_warps=8 if second else 4,
        )  # fmt: skip
        _merged_statistics[(triton.cdiv(rows, _MERGE_ROWS),)](
            parts, best_at, label_logits, labels, lse, first, terms, base_ce, correct, rows, segments,
            vocab, SECOND=second, BASE=base, SEGMENTS=triton.next_power_of_2(segments), ROWS=_MERGE_ROWS,
        )  # fmt: skip
    stats = ChunkStatistics(lse[0], lse[1] if x.teacher is not None else None, None, first[0])
    if not base:
        return terms, correct, stats, None
    return terms, correct, stats, RowCE(base_ce, ChunkStatistics(lse[1], None, None, first[1]))


def ce_with_base(
    x: ChunkLogits, tile: int | None = None, segment_tiles: int | None = None
) -> tuple[RowCE, RowCE]:
    """The CE of z = scale(raw) + bias and of the base z_0 = scale(raw) alone (x has a bias and no
    teacher), from one read of raw and bias: XPress's teacher-forced pass and its base anchor."""
    if x.bias is None or x.teacher is not None:
        raise ValueError("ce_with_base: the logits need a bias and no teacher")
    terms, _, stats, base = row_statistics(x, True, tile, segment_tiles)
    return RowCE(terms[:, 0], stats), base


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
    def _lane_online(lane_max, lane_sum, lane_first, x, index):
        """Per lane, after a tile x (-inf outside the row): the running max, the sum of
        exp(x - max), the column of the first maximum. Reduced once per segment, not per tile."""
        new_max = tl.maximum(lane_max, x)
        lane_first = tl.where(x > lane_max, index, lane_first)  # strict: a lane keeps its earliest
        grown = lane_sum * tl.exp(lane_max - new_max) + tl.exp(x - new_max)
        return new_max, tl.where(new_max == float("-inf"), 0.0, grown), lane_first

    @triton.jit
    def _segment(lane_max, lane_sum, lane_first, vocab):
        """The segment's max, sum of exp(x - max) and first maximum's column from its lanes'."""
        top = tl.max(lane_max, 0)
        total = tl.sum(tl.where(lane_max == float("-inf"), 0.0, lane_sum * tl.exp(lane_max - top)), 0)
        return top, total, tl.min(tl.where(lane_max == top, lane_first, vocab), 0)

    @triton.jit
    def _row_statistics(
        draft_ptr, bias_ptr, teacher_ptr, vocab, draft_stride, bias_stride, teacher_stride,
        multiplier, cap, labels_ptr, parts_ptr, best_at_ptr, label_logit_ptr, segment_columns,
        SOFTCAP: tl.constexpr, BIAS: tl.constexpr, TEACHER: tl.constexpr, TILE: tl.constexpr,
        BASE: tl.constexpr,
    ):  # fmt: skip
        """Per row and segment: z's max, sum of exp(z - max) and first maximum, the teacher's max
        and sum (or with BASE those of z without its bias, with its first maximum); z[label] (and
        the base's)."""
        row = tl.program_id(0).to(tl.int64)
        segment = tl.program_id(1)
        low = segment * segment_columns
        high = tl.minimum(low + segment_columns, vocab)
        draft_row = draft_ptr + row * draft_stride
        bias_row = bias_ptr + row * bias_stride
        teacher_row = teacher_ptr + row * teacher_stride
        columns = tl.arange(0, TILE)
        z_max = tl.full([TILE], float("-inf"), tl.float32)
        z_sum = tl.zeros([TILE], tl.float32)
        z_first = tl.zeros([TILE], tl.int32)
        t_max, t_sum, t_first = z_max, z_sum, z_first
        for start in range(low, high, TILE):
            index = start + columns
            inside = index < high
            x, _ = scaled_tile(tl.load(draft_row + index, mask=inside, other=0.0), multiplier, cap, SOFTCAP)
            z = x
            if BIAS:
                z += tl.load(bias_row + index, mask=inside, other=0.0).to(tl.float32)
            z_max, z_sum, z_first = _lane_online(
                z_max, z_sum, z_first, tl.where(inside, z, float("-inf")), index
            )
            if TEACHER:
                t, _ = scaled_tile(
                    tl.load(teacher_row + index, mask=inside, other=0.0), multiplier, cap, SOFTCAP
                )
                t_max, t_sum, t_first = _lane_online(
                    t_max, t_sum, t_first, tl.where(inside, t, float("-inf")), index
                )  # fmt: skip
            if BASE:
                t_max, t_sum, t_first = _lane_online(
                    t_max, t_sum, t_first, tl.where(inside, x, float("-inf")), index
                )  # fmt: skip
        out = parts_ptr + (row * tl.num_programs(1) + segment) * 4
        at = best_at_ptr + (row * tl.num_programs(1) + segment) * 2
        top, total, first = _segment(z_max, z_sum, z_first, vocab)
        tl.store(out, top)
        tl.store(out + 1, total)
        tl.store(at, first)
        label = tl.load(labels_ptr + row)
        label_logit, _, raw = _draft_logits(draft_row, bias_row, label, True, multiplier, cap, SOFTCAP, BIAS)
        tl.store(label_logit_ptr + row * 2, label_logit, mask=segment == 0)
        if TEACHER or BASE:
            top, total, first = _segment(t_max, t_sum, t_first, vocab)
            tl.store(out + 2, top)
            tl.store(out + 3, total)
            tl.store(at + 1, first)  # a teacher's: never read
        if BASE:
            base_logit, _ = scaled_tile(raw, multiplier, cap, SOFTCAP)
            tl.store(label_logit_ptr + row * 2 + 1, base_logit, mask=segment == 0)

    @triton.jit
    def _merged_log_normaliser(maxima_ptrs, sums_ptrs, valid):
        """lse [ROWS] from the segments' running maxima and sums of exp(x - max) [ROWS, SEGMENTS]."""
        maxima = tl.load(maxima_ptrs, mask=valid, other=float("-inf"))
        top = tl.max(maxima, 1)
        sums = tl.load(sums_ptrs, mask=valid, other=0.0)
        return top + tl.log(tl.sum(tl.where(valid, sums * tl.exp(maxima - top[:, None]), 0.0), 1))

    @triton.jit
    def _merged_first_maximum(tops_ptrs, best_at_ptrs, valid, vocab):
        """The row's first maximum's column: the lowest column among the segments holding the top."""
        tops = tl.load(tops_ptrs, mask=valid, other=float("-inf"))
        best_at = tl.load(best_at_ptrs, mask=valid, other=vocab)
        top = tl.max(tops, 1)
        return tl.min(tl.where(valid & (tops == top[:, None]), best_at, vocab), 1).to(tl.int64)

    @triton.jit
    def _merged_statistics(
        parts_ptr, best_at_ptr, label_logit_ptr, labels_ptr, lse_ptr, first_ptr, terms_ptr,
        base_ce_ptr, correct_ptr, rows, segments, vocab,
        SECOND: tl.constexpr, BASE: tl.constexpr, SEGMENTS: tl.constexpr, ROWS: tl.constexpr,
    ):  # fmt: skip
        """One launch for a chunk's rows (not a dozen small torch ops): each row's lse, first
        maximum and CE from `_row_statistics`' segments, and the teacher's lse or the base's."""
        row = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        live = row < rows
        valid = live[:, None] & (tl.arange(0, SEGMENTS)[None, :] < segments)
        cell = row[:, None].to(tl.int64) * segments + tl.arange(0, SEGMENTS)[None, :]
        parts = parts_ptr + cell * 4
        lse = _merged_log_normaliser(parts, parts + 1, valid)
        first = _merged_first_maximum(parts, best_at_ptr + cell * 2, valid, vocab)
        tl.store(lse_ptr + row, lse, mask=live)
        tl.store(first_ptr + row, first, mask=live)
        tl.store(terms_ptr + row * 3, lse - tl.load(label_logit_ptr + row * 2, mask=live), mask=live)
        tl.store(correct_ptr + row, first == tl.load(labels_ptr + row, mask=live), mask=live)
        if SECOND:
            second_lse = _merged_log_normaliser(parts + 2, parts + 3, valid)
            tl.store(lse_ptr + rows + row, second_lse, mask=live)
            if BASE:
                base_first = _merged_first_maximum(parts + 2, best_at_ptr + cell * 2 + 1, valid, vocab)
                tl.store(first_ptr + rows + row, base_first, mask=live)
                base_ce = second_lse - tl.load(label_logit_ptr + row * 2 + 1, mask=live)
                tl.store(base_ce_ptr + row, base_ce, mask=live)
