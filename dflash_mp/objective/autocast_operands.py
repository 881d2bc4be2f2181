"""The loss matmuls' operands in autocast's dtype, cast once per micro-batch, and their products
summed in fp32 without a rounded copy (DSpark, XPress)."""

from __future__ import annotations

import logging

import torch
from torch import Tensor

_log = logging.getLogger(__name__)
_fp32_output_error: str | None = None  # this torch's refusal of an fp32 total: the portable path since
_FP32_OUTPUT_INPUTS = (torch.bfloat16, torch.float16)  # what cuBLAS's fp32-output GEMM takes


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
    global _fp32_output_error
    fused = total.is_cuda and total.dtype == torch.float32 and a.dtype in _FP32_OUTPUT_INPUTS
    if fused and a.dtype == b.dtype and _fp32_output_error is None:
        try:
            return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
        except RuntimeError as error:  # its checks run before any work: total is as it was
            _fp32_output_error = str(error)
            _log.warning("fp32-output GEMMs are off, gradients summed via a rounded product: %s", error)
    return total.add_(a @ b)


def fp32_output_error() -> str | None:
    """Why `add_product_` stopped using fp32-output GEMMs in this process (None: it did not)."""
    return _fp32_output_error
