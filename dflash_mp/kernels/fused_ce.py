"""The cross-entropy of a chunk of logits and its gradient in two Triton passes (CUDA).

`lm_head_loss._LinearCrossEntropy` takes the gradient of the CE while a chunk of logits
[rows, vocab] exists. The least that can be moved is one read of the logits for each row's
statistics (log-normaliser, argmax, the label's logit) and one read and write for the gradient:
at Qwen3-8B shape (7680 scored rows, vocab 151936, bf16) 7 GB, ~1.8 ms at the H200's bandwidth.
Inductor's kernel for the same expressions (`lm_head_loss._ce_and_grad`) reads the logits in
several passes and took 3.6 ms per step. Here the statistics are one online-softmax pass per row
(the running maximum and the sum of exponentials rescaled as the maximum grows), and the gradient
overwrites the logits it is computed from, so a chunk needs no second [rows, vocab] buffer: 1.24 +
1.19 ms per step. The gradient pass runs at ~3.9 TB/s; the statistics pass at ~1.9 TB/s, held up
by the tile reductions inside its loop (BENCHMARKS.md says what was tried).

The numbers are `_ce_and_grad`'s: logits times `multiplier`, then soft-capped c * tanh(x / c)
when `softcap` is set, the loss scaled per row, the gradient in the logits' dtype, the argmax the
first index of the maximum (as torch.argmax).
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; elsewhere lm_head_loss uses `_ce_and_grad`.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

# Columns per loop iteration of a row's statistics and per program of the gradient pass: 16 per
# thread at 8 warps.
_TILE = 4096


def fused_ce_runs_on(device: torch.device) -> bool:
    """Whether `ce_and_grad_in_place` runs on `device` (CUDA with Triton)."""
    return triton is not None and device.type == "cuda"


def ce_and_grad_in_place(
    logits: Tensor, labels: Tensor, scale: Tensor, multiplier: float = 1.0, softcap: float | None = None
) -> tuple[Tensor, Tensor, Tensor]:
    """(sum(scale * CE), d(that)/d(logits), argmax == label) for logits [M, V]; the gradient is
    written over `logits`, which the caller gives up."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError(f"ce_and_grad_in_place: logits of strides {logits.stride()}, need rows contiguous")
    log_normaliser = torch.empty(rows, dtype=torch.float32, device=logits.device)
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    correct = torch.empty(rows, dtype=torch.bool, device=logits.device)
    if rows == 0:
        return row_loss.sum(), logits, correct
    labels, scale = labels.contiguous(), scale.float().contiguous()
    capped = softcap is not None and softcap > 0
    cap = float(softcap) if capped else 1.0
    shared = (vocab, logits.stride(0), float(multiplier), cap)
    options = {"SOFTCAP": capped, "TILE": _TILE, "num_warps": 8}
    _row_statistics[(rows,)](logits, labels, scale, log_normaliser, row_loss, correct, *shared, **options)
    _gradient[(rows, triton.cdiv(vocab, _TILE))](logits, labels, scale, log_normaliser, *shared, **options)
    return row_loss.sum(), logits, correct


def row_cross_entropy(
    logits: Tensor, labels: Tensor, multiplier: float = 1.0, softcap: float | None = None
) -> Tensor:
    """fp32 CE [M] of each row of logits [M, V] as `ce_and_grad_in_place` reads them, without a
    gradient and leaving `logits` as they are: its statistics pass alone (D-PACE's confidences)."""
    rows, vocab = logits.shape
    if logits.stride(-1) != 1:
        raise ValueError(f"row_cross_entropy: logits of strides {logits.stride()}, need rows contiguous")
    row_loss = torch.empty(rows, dtype=torch.float32, device=logits.device)
    if rows == 0:
        return row_loss
    labels = labels.contiguous()
    scale = torch.ones(rows, dtype=torch.float32, device=logits.device)
    log_normaliser = torch.empty(rows, dtype=torch.float32, device=logits.device)
    correct = torch.empty(rows, dtype=torch.bool, device=logits.device)
    capped = softcap is not None and softcap > 0
    shared = (vocab, logits.stride(0), float(multiplier), float(softcap) if capped else 1.0)
    options = {"SOFTCAP": capped, "TILE": _TILE, "num_warps": 8}
    _row_statistics[(rows,)](logits, labels, scale, log_normaliser, row_loss, correct, *shared, **options)
    return row_loss


if triton is not None:

    @triton.jit
    def scaled_tile(raw, multiplier, cap, SOFTCAP: tl.constexpr):
        """The logits as the loss reads them, fp32, and tanh(x / cap) (1.0 without the cap)."""
        x = raw.to(tl.float32) * multiplier
        tanh = 1.0
        if SOFTCAP:
            # tanh from exp: no tanh in tl on every backend; exp overflowing to inf gives 1 exactly.
            tanh = 1.0 - 2.0 / (tl.exp(2.0 * x / cap) + 1.0)
            x = cap * tanh
        return x, tanh

    @triton.jit
    def _row_statistics(
        logits_ptr,
        labels_ptr,
        scale_ptr,
        log_normaliser_ptr,
        row_loss_ptr,
        correct_ptr,
        vocab,
        row_stride,
        multiplier,
        cap,
        SOFTCAP: tl.constexpr,
        TILE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        row_ptr = logits_ptr + row * row_stride
        columns = tl.arange(0, TILE)
        running_max = tl.max(tl.full([TILE], float("-inf"), tl.float32), 0)
        running_sum = tl.sum(tl.zeros([TILE], tl.float32), 0)
        best = tl.full([TILE], float("-inf"), tl.float32)  # per lane: the first maximum it saw
        best_at = tl.zeros([TILE], tl.int32)
        for start in range(0, vocab, TILE):
            index = start + columns
            inside = index < vocab
            x, _ = scaled_tile(tl.load(row_ptr + index, mask=inside, other=0.0), multiplier, cap, SOFTCAP)
            x = tl.where(inside, x, float("-inf"))
            better = x > best  # strict: a lane keeps its earliest maximum
            best = tl.where(better, x, best)
            best_at = tl.where(better, index, best_at)
            new_max = tl.maximum(running_max, tl.max(x, 0))
            running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(tl.exp(x - new_max), 0)
            running_max = new_max
        log_normaliser = running_max + tl.log(running_sum)
        top = tl.max(best, 0)
        first_top = tl.min(tl.where(best == top, best_at, vocab), 0)  # the earliest lane's, as argmax
        label = tl.load(labels_ptr + row)
        label_logit, _ = scaled_tile(tl.load(row_ptr + label), multiplier, cap, SOFTCAP)
        tl.store(log_normaliser_ptr + row, log_normaliser)
        tl.store(row_loss_ptr + row, tl.load(scale_ptr + row) * (log_normaliser - label_logit))
        tl.store(correct_ptr + row, first_top == label)

    @triton.jit
    def _gradient(
        logits_ptr,
        labels_ptr,
        scale_ptr,
        log_normaliser_ptr,
        vocab,
        row_stride,
        multiplier,
        cap,
        SOFTCAP: tl.constexpr,
        TILE: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        index = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = index < vocab
        pointers = logits_ptr + row * row_stride + index
        raw = tl.load(pointers, mask=inside, other=0.0)
        x, tanh = scaled_tile(raw, multiplier, cap, SOFTCAP)
        is_label = (index == tl.load(labels_ptr + row)).to(tl.float32)
        grad = (tl.exp(x - tl.load(log_normaliser_ptr + row)) - is_label) * tl.load(scale_ptr + row)
        if SOFTCAP:
            grad = grad * (1.0 - tanh * tanh)
        tl.store(pointers, (grad * multiplier).to(raw.dtype), mask=inside)
