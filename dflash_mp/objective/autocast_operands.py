"""The loss matmuls' operands in autocast's dtype, cast once per micro-batch, their products summed
in fp32 without a rounded copy, and products over the vocabulary into a few columns split so that
they fill the GPU (DSpark, XPress)."""

from __future__ import annotations

import functools
import logging
import math

import torch
from torch import Tensor

_log = logging.getLogger(__name__)
_fp32_output_error: str | None = None  # this torch's refusal of an fp32 total: the portable path since
_split_error: str | None = None  # this torch's refusal of an fp32-output batched GEMM: one GEMM since
_FP32_OUTPUT_INPUTS = (torch.bfloat16, torch.float16)  # what cuBLAS's fp32-output GEMM takes
_SPLIT_MIN_PIECE = 4096  # the shortest inner dimension a split piece keeps (its tiles' K loop)
_SPLIT_ALIGN = 64  # each piece's first column stays 16-byte aligned, as tensor-core GEMMs want
_SPLIT_WAVES = 4  # output tiles to aim for, in multiples of the GPU's SMs (fewer, longer waves idle more)
_GEMM_TILE = 128  # the output tile edge counted for a product's parallelism


def in_autocast_dtype(*tensors: Tensor | None) -> tuple[Tensor | None, ...]:
    """The matmuls' operands in autocast's dtype when it is on (training), else as they are. Cast
    once per micro-batch, so that no chunk copies the frozen bf16 head to the fp32 hidden states'
    dtype and autocast back again (two head-sized copies per matmul); the numbers are those of
    autocast's own casts."""
    device = next(t for t in tensors if t is not None).device.type
    if not torch.is_autocast_enabled(device):
        return tensors
    dtype = torch.get_autocast_dtype(device)
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def add_product_(total: Tensor, a: Tensor, b: Tensor) -> Tensor:
    """total += a @ b, total fp32 (a weight's gradient summed over chunks). On CUDA with bf16 or
    fp16 operands one GEMM adds its fp32 accumulators to total (`out_dtype`): no product rounded
    to the operands' dtype, no temporaries of total's size. Elsewhere, or where this torch refuses
    an fp32 total beside low-precision operands (older releases: a warning, once), the product in
    the operands' dtype is added (autograd's rounding under autocast)."""
    fused = total.is_cuda and total.dtype == torch.float32 and a.dtype in _FP32_OUTPUT_INPUTS
    if fused and a.dtype == b.dtype and _fp32_output_error is None:
        try:
            return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        except RuntimeError as error:  # its checks run before any work: total is as it was
            _refuse_fp32_output(error)
    return total.add_(a @ b)


def _refuse_fp32_output(error: RuntimeError) -> None:
    global _fp32_output_error
    _fp32_output_error = str(error)
    _log.warning("fp32-output GEMMs are off, products summed via rounded ones: %s", error)


def _refuse_split(error: RuntimeError) -> None:
    global _split_error
    _split_error = str(error)
    _log.warning("vocabulary-long products run as one GEMM: this torch has no fp32-output bmm: %s", error)


def split_error() -> str | None:
    """Why `long_inner_product` stopped splitting in this process (None: it did not)."""
    return _split_error


def fp32_output_error() -> str | None:
    """Why `add_product_` stopped using fp32-output GEMMs in this process (None: it did not)."""
    return _fp32_output_error


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count


def split_pieces(a: Tensor, b: Tensor) -> int:
    """How many pieces of the inner dimension `long_inner_product` sums (1: one GEMM). A product
    such as [880, V] @ [V, 256] (a chunk's gradient into a rank-256 feature) has 14 output tiles
    for an H100's 132 SMs, each walking all of V: 1.4 ms in a profile, about 47 TFLOP/s."""
    if not a.is_cuda or a.dtype not in _FP32_OUTPUT_INPUTS or a.dtype != b.dtype or _split_error:
        return 1
    (rows, inner), columns = a.shape, b.shape[1]
    tiles = math.ceil(rows / _GEMM_TILE) * math.ceil(columns / _GEMM_TILE)
    wanted = math.ceil(_SPLIT_WAVES * _multiprocessors(a.device) / tiles)
    return max(1, min(wanted, inner // _SPLIT_MIN_PIECE))


def long_inner_product(a: Tensor, b: Tensor, pieces: int | None = None) -> Tensor:
    """a [m, k] @ b [k, n] in a's dtype, for a long k and a small m x n: k cut into `pieces`
    (default `split_pieces`) equal, aligned pieces run as one strided-batched GEMM over views of a
    and b (no copies), their fp32 partial products summed, the rest of k added. The sum differs
    from one GEMM's only in the order of fp32 additions."""
    pieces = split_pieces(a, b) if pieces is None else pieces
    inner = a.shape[1]
    piece = inner // pieces // _SPLIT_ALIGN * _SPLIT_ALIGN if pieces > 1 else 0
    if piece == 0:
        return a @ b
    split = pieces * piece
    left = a[:, :split].unflatten(1, (pieces, piece)).transpose(0, 1)  # [pieces, m, piece]
    right = b[:split].unflatten(0, (pieces, piece))  # [pieces, piece, n]
    if a.is_cuda and a.dtype in _FP32_OUTPUT_INPUTS:
        if _split_error is not None:
            return a @ b
        try:
            total = torch.bmm(left, right, out_dtype=torch.float32).sum(0)
        except RuntimeError as error:  # checked before any work
            _refuse_split(error)
            return a @ b
    else:  # the CPU (tests): partial products in the operands' dtype
        total = torch.bmm(left, right).float().sum(0)
    if split < inner:
        add_product_(total, a[:, split:], b[split:])
    return total.to(a.dtype)
