"""The loss matmuls' operands in autocast's dtype, cast once per micro-batch, and their products
summed in fp32 without a rounded copy (DSpark, XPress)."""

from __future__ import annotations

import torch
from torch import Tensor

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
    to the operands' dtype, no temporaries of total's size. Elsewhere the product in the operands'
    dtype is added (autograd's rounding under autocast)."""
    if (
        total.is_cuda
        and total.dtype == torch.float32
        and a.dtype in _FP32_OUTPUT_INPUTS
        and a.dtype == b.dtype
    ):
        return torch.addmm(total, a, b, out_dtype=torch.float32, out=total)
    return total.add_(a @ b)
