"""DFlash block attention on FlashAttention 4's CuTe kernels (`train.attention=flash`).

The same mask as flex_attention's (`dflash_mp.kernels.block_mask`): flex's tile lists say which
(128 x 128) tiles are skipped, computed whole, or masked element by element, and a CuTe mask rule
(query q of block n sees context key j < a_n and the keys of its own block) decides the masked
ones. On Hopper these are FA3-class warp-specialised kernels: per layer at Qwen3-8B shape, forward
and backward take half of flex's time on this mask (BENCHMARKS.md). The package is `flash-attn-4` (it brings
`nvidia-cutlass-dsl`); nothing here imports it until a GPU run asks for this path.

The kernels are wrapped as two torch custom ops with a registered autograd, so a compiled drafter
layer keeps one graph around them. `_KERNELS` holds the two calls the ops make; the CPU tests swap
in a dense reference to check everything around the kernels (layouts, tiles, autograd, compile).
"""

from __future__ import annotations

import functools
import importlib.util
import inspect
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from dflash_mp.kernels.block_mask import FLEX_TILE, TileMask

PACKAGE_HINT = (
    "install FlashAttention 4 (`pip install -e '.[flash]'`; on CUDA 13 also "
    "`pip install 'nvidia-cutlass-dsl[cu13]'`), or set train.attention=flex"
)
# The keyword arguments this module passes to FA4's (private) entry points; checked before use, so
# that another release of the package is refused with a message rather than failing mid-step.
_FORWARD_ARGUMENTS = {"softmax_scale", "mask_mod", "aux_tensors", "block_sparse_tensors", "return_lse"}
_BACKWARD_ARGUMENTS = {"softmax_scale", "mask_mod", "aux_tensors", "block_sparse_tensors"}


def flash_available() -> bool:
    """True when FlashAttention 4's CuTe interface can be found (the package is optional)."""
    try:
        return importlib.util.find_spec("flash_attn.cute") is not None
    except ImportError:
        return False


def flash_unusable_reason(device: torch.device) -> str | None:
    """Why `train.attention=flash` cannot run on `device`, or None when it can."""
    if device.type != "cuda":
        return f"it needs a CUDA GPU (device {device}); use flex on GPUs, sdpa on CPU"
    major, minor = torch.cuda.get_device_capability(device)
    if major < 9:
        return f"it needs a Hopper or newer GPU, this one is compute capability {major}.{minor}; use flex"
    if not flash_available():
        return f"flash_attn.cute is not installed; {PACKAGE_HINT}"
    try:
        from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch
        from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd
    except Exception as error:  # a broken install (CUDA libraries, cutlass DSL) fails at import
        return f"importing flash_attn.cute failed ({type(error).__name__}: {error}); {PACKAGE_HINT}"
    missing = sorted(
        (_FORWARD_ARGUMENTS - set(inspect.signature(_flash_attn_fwd).parameters))
        | (_BACKWARD_ARGUMENTS - set(inspect.signature(_flash_attn_bwd).parameters))
        | ({"block_size"} - set(BlockSparseTensorsTorch._fields))
    )
    if missing:
        return f"this flash-attn-4 release lacks {missing} (tested with 4.0.0b36); {PACKAGE_HINT}"
    return None


def check_flash_supported(device: torch.device) -> None:
    """Raise a ValueError naming the fix when `train.attention=flash` cannot run on `device`."""
    reason = flash_unusable_reason(device)
    if reason is not None:
        raise ValueError(f"train.attention=flash: {reason}")


def query_block(q_idx, block_size):
    """The block n = q // Bs a query belongs to (whose anchor and start the rule reads)."""
    return q_idx // block_size


def mask_rule(q_idx, kv_idx, anchor, start, context_len, block_size, zero):
    """Whether query `q_idx` attends key `kv_idx`: the DFlash rule in integer arithmetic only, the
    one FA4's kernels run (`cute_mask_rule` calls it on CuTe SSA values while tracing) and the CPU
    tests evaluate on plain integers.

    Keys are [context 0..S-1 ; block tokens] (S = `context_len`). Query q of block
    n = query_block(q) sees context key j iff start <= j < anchor (block n's: the anchor, and where a
    packed row's document begins, else 0), and key S + t iff t lies in its own block:
    0 <= t - n * Bs < Bs (a range test, so no division of negative numbers). Operators only (no
    `and`, `if`): they are what a traced SSA value supports. `zero` is 0 in the callers' type.
    """
    in_block = kv_idx - context_len - query_block(q_idx, block_size) * block_size
    return ((kv_idx < anchor) & (kv_idx >= start)) | ((in_block >= zero) & (in_block < block_size))


@functools.cache
def cute_mask_rule(block_size: int) -> Callable:
    """`mask_rule` as a CuTe DSL mask_mod, compiled into FA4's kernels (block size fixed): it reads
    block n's anchor and start from the two aux tensors (int32 [B, A])."""
    import cutlass
    import cutlass.cute as cute
    from flash_attn.cute import utils

    @cute.jit
    def dflash_mask(batch, head, q_idx, kv_idx, seqlen_info, aux_tensors):
        anchors, starts = aux_tensors[0], aux_tensors[1]
        size = utils.scalar_to_ssa(block_size, cutlass.Int32)
        block = query_block(q_idx, size)
        anchor = utils.scalar_to_ssa(anchors[batch[0], block[0]], cutlass.Int32)
        start = utils.scalar_to_ssa(starts[batch[0], block[0]], cutlass.Int32)
        context_len = utils.scalar_to_ssa(seqlen_info.seqlen_k - seqlen_info.seqlen_q, cutlass.Int32)
        zero = utils.scalar_to_ssa(0, cutlass.Int32)
        return mask_rule(q_idx, kv_idx, anchor, start, context_len, size, zero)

    return dflash_mask


def _tile_lists(counts: Tensor, indices: Tensor, full_counts: Tensor, full_indices: Tensor):
    from flash_attn.cute.block_sparsity import BlockSparseTensorsTorch

    return BlockSparseTensorsTorch(
        counts, indices, full_counts, full_indices, block_size=(FLEX_TILE, FLEX_TILE)
    )


def _fa4_forward(q, k, v, anchors, starts, tiles, block_size, scale):
    from flash_attn.cute.interface import _flash_attn_fwd

    out, lse, *_ = _flash_attn_fwd(
        q,
        k,
        v,
        softmax_scale=scale,
        mask_mod=cute_mask_rule(block_size),
        aux_tensors=[anchors, starts],
        block_sparse_tensors=_tile_lists(*tiles),
        return_lse=True,
    )
    return out, lse


def _fa4_backward(grad_out, q, k, v, out, lse, anchors, starts, tiles, block_size, scale):
    from flash_attn.cute.interface import _flash_attn_bwd

    dq, dk, dv = _flash_attn_bwd(
        q,
        k,
        v,
        out,
        grad_out,
        lse,
        softmax_scale=scale,
        mask_mod=cute_mask_rule(block_size),
        aux_tensors=[anchors, starts],
        block_sparse_tensors=_tile_lists(*tiles),
    )
    return dq, dk, dv


@dataclass
class _Kernels:
    # forward(q, k, v, anchors, starts, kv tiles, block_size, scale) -> (out, lse [B, H, Q] fp32)
    forward: Callable = _fa4_forward
    # backward(grad_out, q, k, v, out, lse, anchors, starts, q tiles, block_size, scale) -> (dq, dk, dv)
    backward: Callable = _fa4_backward


_KERNELS = _Kernels()


@torch.library.custom_op("dflash_mp::flash_block_attention", mutates_args=())
def _attention_op(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    anchors: Tensor,
    starts: Tensor,
    kv_counts: Tensor,
    kv_indices: Tensor,
    full_kv_counts: Tensor,
    full_kv_indices: Tensor,
    q_counts: Tensor,
    q_indices: Tensor,
    full_q_counts: Tensor,
    full_q_indices: Tensor,
    block_size: int,
    scale: float,
) -> tuple[Tensor, Tensor]:
    # The query-side lists are inputs only so that the backward can have them.
    tiles = (kv_counts, kv_indices, full_kv_counts, full_kv_indices)
    out, lse = _KERNELS.forward(q, k, v, anchors, starts, tiles, block_size, scale)
    return out.contiguous(), lse.contiguous()  # the layouts the fake promises (no copy from FA4)


@_attention_op.register_fake
def _(q, k, v, anchors, starts, *tiles_and_settings):
    batch, queries, heads, _ = q.shape
    out = q.new_empty(batch, queries, heads, v.shape[-1])
    return out, q.new_empty(batch, heads, queries, dtype=torch.float32)


@torch.library.custom_op("dflash_mp::flash_block_attention_backward", mutates_args=())
def _attention_backward_op(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    anchors: Tensor,
    starts: Tensor,
    q_counts: Tensor,
    q_indices: Tensor,
    full_q_counts: Tensor,
    full_q_indices: Tensor,
    block_size: int,
    scale: float,
) -> tuple[Tensor, Tensor, Tensor]:
    tiles = (q_counts, q_indices, full_q_counts, full_q_indices)
    grads = _KERNELS.backward(
        grad_out.contiguous(), q, k, v, out, lse, anchors, starts, tiles, block_size, scale
    )
    return tuple(grad.contiguous() for grad in grads)


@_attention_backward_op.register_fake
def _(grad_out, q, k, v, *saved_and_settings):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _setup_context(ctx, inputs, output) -> None:
    q, k, v, anchors, starts = inputs[:5]
    q_tiles = inputs[9:13]
    block_size, scale = inputs[13:]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, anchors, starts, *q_tiles)
    ctx.block_size, ctx.scale = block_size, scale
    ctx.mark_non_differentiable(lse)


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, lse, anchors, starts, *q_tiles = ctx.saved_tensors
    dq, dk, dv = _attention_backward_op(
        grad_out, q, k, v, out, lse, anchors, starts, *q_tiles, ctx.block_size, ctx.scale
    )
    return (dq, dk, dv) + (None,) * 12


_attention_op.register_autograd(_backward, setup_context=_setup_context)


def flash_block_attention(q: Tensor, k: Tensor, v: Tensor, mask: TileMask, scale: float) -> Tensor:
    """Attention output [B, Q, H, D] of q [B, Q, H, D] over k, v [B, S+Q, H_kv, D] (context, then blocks).

    q, k and v must share a 16-bit dtype (FA4 takes bf16 or fp16); each gets its gradient.
    """
    tiles = mask.tiles
    out, _ = _attention_op(
        q.contiguous(),
        k.contiguous(),
        v.contiguous(),
        mask.anchors,
        mask.starts if mask.starts is not None else torch.zeros_like(mask.anchors),
        tiles.kv_num_blocks,
        tiles.kv_indices,
        tiles.full_kv_num_blocks,
        tiles.full_kv_indices,
        tiles.q_num_blocks,
        tiles.q_indices,
        tiles.full_q_num_blocks,
        tiles.full_q_indices,
        mask.block_size,
        scale,
    )
    return out
