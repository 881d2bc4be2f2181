"""XPress's gradient pass over all of a chunk's CE passes at once (CUDA; objective/xpress_rows.py).

A chunk of n rows has the head's raw logits [n, V] and P biased passes (the teacher-forced one and
the Jacobi rounds), each z_p = scale(raw) + bias_p, plus the base anchor's z = scale(raw) alone.
Once every pass's log-normaliser lse_p and row weights c_p are known (fused_dspark.py's statistics
pass, then the D-PACE or decay weights), each pass's CE gradient is

    dz_p = c_p (exp(z_p - lse_p) - onehot(label)),

which the readout's gradients read per biased pass, and their sum times scale's derivative (the
multiplier, soft-capping's 1 - tanh^2) is what the hidden states' gradient reads. One kernel reads
raw and every bias once, writes each dz_p over its bias (the matmul dtype) and the sum, computed in
fp32, over raw: 2P + 2 [n, V] tensors moved, against 6P + 6 for a gradient pass per pass and then
a sum over a base slot of zeros.
"""

from __future__ import annotations

from torch import Tensor

try:  # Triton ships with CUDA builds of torch; elsewhere xpress_rows takes its torch path.
    import triton
    import triton.language as tl

    from dflash_mp.kernels.fused_ce import scaled_tile
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_TILE = 2048  # columns per program: P + 1 tiles of the logits live at once


def xpress_gradients_in_place(
    raw: Tensor,
    biases: Tensor,
    labels: Tensor,
    log_normalisers: Tensor,
    weights: Tensor,
    multiplier: float = 1.0,
    softcap: float | None = None,
    tile: int = _TILE,
) -> Tensor:
    """For raw logits [n, V], the biased passes' biases [P, n, V] and each pass's fp32 lse and row
    weights [P or P + 1, n] (a last row for the base anchor, the pass without a bias): writes each
    dz_p over its bias and the raw logits' gradient over `raw` (module docstring); returns raw."""
    passes, rows, vocab = biases.shape
    if raw.shape != (rows, vocab) or raw.stride(-1) != 1 or biases.stride(-1) != 1:
        raise ValueError(
            f"fused XPress: raw {tuple(raw.shape)}, biases {tuple(biases.shape)} (rows contiguous)"
        )
    if log_normalisers.shape != weights.shape or log_normalisers.shape[0] not in (passes, passes + 1):
        raise ValueError(f"fused XPress: lse {tuple(log_normalisers.shape)}, weights {tuple(weights.shape)}")
    if passes * biases.stride(0) >= 2**31:
        raise ValueError(
            f"fused XPress: {passes} passes of {biases.stride(0)} elements overflow int32 offsets"
        )
    if rows == 0:
        return raw
    capped = softcap is not None and softcap > 0
    grid = (rows, triton.cdiv(vocab, tile))
    _passes_gradient[grid](
        raw, biases, labels.contiguous(), log_normalisers.float().contiguous(), weights.float().contiguous(),
        vocab, rows, raw.stride(0), biases.stride(0), biases.stride(1), float(multiplier),
        float(softcap) if capped else 1.0,
        SOFTCAP=capped, PASSES=passes, BASE=log_normalisers.shape[0] > passes, TILE=tile, num_warps=8,
    )  # fmt: skip
    return raw


if triton is not None:

    @triton.jit
    def _passes_gradient(
        raw_ptr, bias_ptr, labels_ptr, lse_ptr, weights_ptr, vocab, rows, raw_stride, pass_stride,
        bias_stride, multiplier, cap,
        SOFTCAP: tl.constexpr, PASSES: tl.constexpr, BASE: tl.constexpr, TILE: tl.constexpr,
    ):  # fmt: skip
        row = tl.program_id(0).to(tl.int64)
        index = tl.program_id(1) * TILE + tl.arange(0, TILE)
        inside = index < vocab
        raw_pointers = raw_ptr + row * raw_stride + index
        raw = tl.load(raw_pointers, mask=inside, other=0.0)
        base, tanh = scaled_tile(raw, multiplier, cap, SOFTCAP)
        is_label = (index == tl.load(labels_ptr + row)).to(tl.float32)
        total = tl.zeros([TILE], tl.float32)
        for p in tl.static_range(PASSES):
            # p * pass_stride in int32: the wrapper refuses more (a chunk holds <= 2^26 elements).
            pointers = bias_ptr + p * pass_stride + row * bias_stride + index
            z = base + tl.load(pointers, mask=inside, other=0.0).to(tl.float32)
            c = tl.load(weights_ptr + p * rows + row)
            grad = c * (tl.exp(z - tl.load(lse_ptr + p * rows + row)) - is_label)
            tl.store(pointers, grad.to(pointers.dtype.element_ty), mask=inside)
            total += grad
        if BASE:
            c = tl.load(weights_ptr + PASSES * rows + row)
            total += c * (tl.exp(base - tl.load(lse_ptr + PASSES * rows + row)) - is_label)
        if SOFTCAP:
            total = total * (1.0 - tanh * tanh)
        tl.store(raw_pointers, (total * multiplier).to(raw.dtype), mask=inside)
