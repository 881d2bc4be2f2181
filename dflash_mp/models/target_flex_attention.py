"""The target's attention on flex_attention, registered with transformers as one more attention
implementation (SINK_ATTENTION) with a mask hook that builds the block mask (target_kernels picks it).

- Attention with learned sinks (gpt-oss). transformers runs it only on its eager path (it refuses
  SDPA), which materialises every S x S score matrix. A sink logit s_h per head joins each row's
  softmax as one more column whose value is zero, so with lse the log-sum-exp of the row's real
  scores: softmax_with_sink(scores) @ V = (softmax(scores) @ V) * sigmoid(lse - s_h). flex_attention
  returns lse beside the output, and takes the sliding window as a BlockMask: exact, on a fused kernel.
- Packed rows (data.packing) of a target on SDPA: SDPA takes the per-document mask as a dense
  tensor and runs its masked kernel over every tile, the causal half and the other documents'
  included. On GPU they run this kernel instead, its block mask causal or windowed within each
  document, which skips the tiles no query may see.
"""

from __future__ import annotations

import functools
from typing import Any

import torch
from torch import nn
from torch.nn.attention.flex_attention import flex_attention

from dflash_mp.models import target_graphs

SINK_ATTENTION = "dflash_sink_flex"


@functools.cache
def _compiled_flex():
    # Wrapped on first GPU use: torch.compile itself imports inductor (about 1 CPU-second in every
    # process that imports this module). Static shapes first, dynamic once the sequence length changes.
    return torch.compile(flex_attention)


@functools.cache
def _flex_outside_graphs():
    return torch.compiler.disable(flex_attention)


def register_flex_attention() -> None:
    """transformers' attention and mask interfaces take SINK_ATTENTION (idempotent)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SINK_ATTENTION, sink_attention_forward)
    AttentionMaskInterface.register(SINK_ATTENTION, sink_block_mask)


def sink_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
):
    """transformers' mask hook for SINK_ATTENTION: its causal or sliding-window mask as a BlockMask.

    Built outside the compiled layers, from one mask function per window: transformers makes a new
    mask function every forward, and a compiled layer handed a new one would compile again. Packed
    rows (`target_graphs.packed_rows()`, whose masks transformers leaves plain): the window's mask
    within each document, read from a buffer that keeps its address, so the mask function stays one.
    """
    from torch.nn.attention.flex_attention import create_block_mask

    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("sink attention takes no padding mask: the target runs unpadded rows")
    if q_offset or kv_offset or q_length != kv_length:
        raise NotImplementedError("sink attention runs the whole sequence at once (no KV cache)")
    # Causal, or causal within a window: the last query row says which.
    zero = torch.zeros((), dtype=torch.long)
    allowed = int(mask_function(zero, zero, torch.tensor(q_length - 1), torch.arange(kv_length)).sum())
    window = allowed if allowed < kv_length else None
    rows = target_graphs.packed_rows()
    if rows is not None:
        documents = _document_buffer(rows.index)
        return create_block_mask(
            _packed_mask_mod(window, documents), batch_size, None, q_length, kv_length, device=device
        )
    key = (batch_size, q_length, str(device), window)
    if key not in _BLOCK_MASKS:
        if len(_BLOCK_MASKS) >= 8:  # keep the latest few sequence lengths
            _BLOCK_MASKS.pop(next(iter(_BLOCK_MASKS)))
        _BLOCK_MASKS[key] = create_block_mask(
            _mask_mod(window), batch_size, None, q_length, kv_length, device=device
        )
    return _BLOCK_MASKS[key]


_BLOCK_MASKS: dict[tuple, Any] = {}
_DOCUMENT_BUFFERS: dict[tuple, torch.Tensor] = {}


def _document_buffer(index: torch.Tensor) -> torch.Tensor:
    """`index` copied into the buffer of its shape and device (in place: a CUDA graph replays the
    copy). One per packed input shape, kept for the process: captured graphs read them."""
    key = (tuple(index.shape), str(index.device))
    if key not in _DOCUMENT_BUFFERS:
        _DOCUMENT_BUFFERS[key] = torch.empty_like(index)
    return _DOCUMENT_BUFFERS[key].copy_(index)


@functools.cache
def _packed_mask_mod(window: int | None, documents: torch.Tensor):
    inner = _mask_mod(window)

    def packed(batch, head, q_idx, kv_idx):
        return inner(batch, head, q_idx, kv_idx) & (documents[batch, q_idx] == documents[batch, kv_idx])

    return packed


@functools.cache
def _mask_mod(window: int | None):
    def causal(batch, head, q_idx, kv_idx):
        return q_idx >= kv_idx

    def sliding(batch, head, q_idx, kv_idx):
        return (q_idx >= kv_idx) & (q_idx - kv_idx < window)

    return causal if window is None else sliding


def _flex(device: torch.device):
    """flex_attention compiled (its fused kernel) on GPU; as is (a reference path) on CPU, where
    inductor cannot return the lse, so a compiled CPU layer runs it outside its graph."""
    if device.type != "cuda":
        return _flex_outside_graphs()
    # Inside a compiled layer dynamo captures flex_attention itself.
    return flex_attention if torch.compiler.is_compiling() else _compiled_flex()


def _flex_with_lse(query, key, value, block_mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.attention.flex_attention as flex_module

    flex = _flex(query.device)
    common = dict(block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    if hasattr(flex_module, "AuxRequest"):  # torch >= 2.9
        out, aux = flex(query, key, value, return_aux=flex_module.AuxRequest(lse=True), **common)
        return out, aux.lse
    return flex(query, key, value, return_lse=True, **common)


def sink_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [B, H, S, D] in, [B, S, H, D] out, sinks applied exactly."""
    if dropout:
        raise ValueError("sink attention is for the frozen target: no attention dropout")
    if kwargs.get("softcap"):
        raise NotImplementedError("flex attention here applies no logit softcapping (takes_document_flex)")
    out, lse = _flex_with_lse(query, key, value, attention_mask, scaling)
    if s_aux is not None:
        # softmax over [scores, s] = softmax(scores) * exp(lse) / (exp(lse) + exp(s)) = ... * sigmoid(lse - s)
        keep = torch.sigmoid(lse.float() - s_aux.float().view(1, -1, 1)).unsqueeze(-1)
        out = (out.float() * keep).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None
