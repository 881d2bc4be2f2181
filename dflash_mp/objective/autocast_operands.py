"""The operands of a loss's matmuls in autocast's dtype, cast once per micro-batch (DSpark, XPress)."""

from __future__ import annotations

import torch
from torch import Tensor


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
