"""What train.dtype, train.attention, train.compile and train.cuda_graphs resolve to on a device ("auto"
included)."""

from __future__ import annotations

import torch

from dflash_mp.config.schema import RootConfig
from dflash_mp.kernels.flash_attention import flash_unusable_reason


def resolve_precision(cfg: RootConfig, device: torch.device) -> tuple[torch.dtype, str, bool]:
    """(hidden-state dtype, attention kernel, compile?) with "auto" resolved for `device`."""
    on_gpu = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32}.get(
        cfg.train.dtype, torch.bfloat16
    )
    attention = cfg.train.attention
    if attention == "auto":
        # FlashAttention 4 where it runs (BENCHMARKS.md: the step's attention 23 -> 15 ms), else flex.
        flash = dtype == torch.bfloat16 and on_gpu and flash_unusable_reason(device) is None
        attention = "flash" if flash else ("flex" if on_gpu else "sdpa")
    compile_flag = str(cfg.train.compile).lower()
    return dtype, attention, (on_gpu if compile_flag == "auto" else compile_flag == "true")


def resolve_cuda_graphs(cfg: RootConfig, device: torch.device, tensor_parallel: bool) -> bool:
    """Whether the target forward replays CUDA graphs: train.cuda_graphs with "auto" resolved. A
    tensor-parallel replica runs eagerly (its collectives are not captured)."""
    return device.type == "cuda" and not tensor_parallel and str(cfg.train.cuda_graphs).lower() != "false"
