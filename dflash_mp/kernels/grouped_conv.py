"""DFlash 2's grouped dynamic convolution (`dflash2.py`): tensor ops forward, a hand-written backward.

Compiled, the forward in plain tensor ops is cheap: inductor fuses it into the RMSNorm before it
and the cast after it. Its autograd backward is not: the kernel gradients are a sum over each
group's channels (per token) and a sum over all tokens (per channel) of the same product dy * x,
which inductor computes in separate kernels, each reading dy and x again. Here:

    d values   in tensor ops, so that inductor fuses it into the neighbouring backward kernels;
    d dynamic, d base   one Triton pass on CUDA over dy and x (every tap, up to four; both sums),
                        the per-channel sum left as per-program partials and added up after (so
                        the result does not depend on scheduling); tensor ops elsewhere.

All sums are fp32; the gradients take their inputs' dtypes. Row t of [B, L, D] sits at
`position[t]` in its block and tap o reads row t - o only when that position is >= o.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU builds take the tensor-op sums.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_ROWS = 8  # rows per tile: dy, the shifted values and a channel-sum tile per tap, fp32 [8, 128] each
_TILES = 8  # tiles per program, down the rows: 8 x fewer partial channel sums than one tile each
_MAX_TAPS = 4  # the kernel carries one channel-sum accumulator per tap; wider kernels take tensor ops
_COLUMNS = 128  # channels per program: whole groups of any power-of-two size up to 128


def convolve_with_tensor_ops(
    values: Tensor, dynamic: Tensor, base: Tensor, group_size: int, position_in_block: Tensor | None
) -> Tensor:
    """The convolution in plain tensor ops (autograd's backward): see `dflash2.grouped_dynamic_convolve`."""
    batch, length, hidden = values.shape
    groups = hidden // group_size
    grouped = values.view(batch, length, groups, group_size)
    output = torch.zeros_like(grouped)
    for offset in range(base.shape[0]):
        shifted = grouped if offset == 0 else F.pad(grouped[:, :-offset], (0, 0, 0, 0, offset, 0))
        if offset > 0 and position_in_block is not None:
            inside = (position_in_block >= offset).to(values.dtype)
            shifted = shifted * inside[None, :, None, None]
        kernel = base[offset].view(1, 1, groups, group_size).to(values.dtype)
        output = output + (kernel + dynamic[:, :, offset, :, None]) * shifted
    return output.view(batch, length, hidden)


class GroupedConvolution(torch.autograd.Function):
    """Conv(values)[t, c] = sum_o open_o(t) (base[o, c] + dynamic[t, o, c // G]) values[t - o, c]."""

    @staticmethod
    def forward(ctx, values: Tensor, dynamic: Tensor, base: Tensor, position: Tensor, group_size: int):
        ctx.save_for_backward(values, dynamic, base, position)
        ctx.group_size = group_size
        return convolve_with_tensor_ops(values, dynamic, base, group_size, position)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        values, dynamic, base, position = ctx.saved_tensors
        group_size = ctx.group_size
        grad_values = grad_dynamic = grad_base = None
        if ctx.needs_input_grad[0]:
            grad_values = _values_grad(grad_out, dynamic, base, position, group_size).to(values.dtype)
        if ctx.needs_input_grad[1] or ctx.needs_input_grad[2]:
            kernel_sums = (
                _triton_kernel_grads if _triton_takes(values, base.shape[0], group_size) else _kernel_grads
            )
            grad_dynamic, grad_base = kernel_sums(grad_out, values, position, base.shape[0], group_size)
            grad_dynamic, grad_base = grad_dynamic.to(dynamic.dtype), grad_base.to(base.dtype)
        return grad_values, grad_dynamic, grad_base, None, None


def _open(position: Tensor, tap: int) -> Tensor:
    """[1, L, 1] float: 1 where row t may read row t - tap."""
    return (position >= tap).float()[None, :, None]


def _shift(tensor: Tensor, tap: int) -> Tensor:
    """Row t of the result is row t - tap of `tensor` (zeros before the start): [B, L, ...]."""
    return tensor if tap == 0 else F.pad(tensor[:, :-tap], (0, 0, tap, 0))


def _values_grad(
    grad_out: Tensor, dynamic: Tensor, base: Tensor, position: Tensor, group_size: int
) -> Tensor:
    """d values[t] = sum_o (open_o w_o dy)[t + o], with w_o[t] = base[o] + dynamic[t, o] per group."""
    grad = grad_out.float()
    total = None
    for tap in range(base.shape[0]):
        weight = base[tap].float() + dynamic[:, :, tap].float().repeat_interleave(group_size, dim=-1)
        term = weight * grad * _open(position, tap)
        # Row t + tap's term lands on row t: shift up by `tap`, zeros past the end.
        term = term if tap == 0 else F.pad(term[:, tap:], (0, 0, 0, tap))
        total = term if total is None else total + term
    return total


def _kernel_grads(
    grad_out: Tensor, values: Tensor, position: Tensor, taps: int, group_size: int
) -> tuple[Tensor, Tensor]:
    """(d dynamic [B, L, K, D/G], d base [K, D]) in fp32 tensor ops."""
    batch, length, hidden = values.shape
    per_group, per_channel = [], []
    for tap in range(taps):
        product = grad_out.float() * _shift(values.float(), tap) * _open(position, tap)
        per_group.append(product.view(batch, length, hidden // group_size, group_size).sum(-1))
        per_channel.append(product.sum((0, 1)))
    return torch.stack(per_group, dim=2), torch.stack(per_channel)


def _triton_takes(values: Tensor, taps: int, group_size: int) -> bool:
    """CUDA with Triton, at most _MAX_TAPS taps, and groups a power of two no wider than a program's columns."""
    return (
        triton is not None
        and values.is_cuda
        and taps <= _MAX_TAPS
        and group_size <= _COLUMNS
        and group_size & (group_size - 1) == 0
        and values.shape[-1] % group_size == 0
    )


@torch.library.custom_op("dflash_mp::grouped_conv_kernel_grads", mutates_args=())
def _triton_kernel_grads(
    grad_out: Tensor, values: Tensor, position: Tensor, taps: int, group_size: int
) -> tuple[Tensor, Tensor]:
    grad_out, values = grad_out.contiguous(), values.contiguous()
    batch, length, hidden = values.shape
    groups = hidden // group_size
    rows = batch * length
    row_programs = triton.cdiv(rows, _ROWS * _TILES)
    grad_dynamic = torch.empty(batch, length, taps, groups, dtype=torch.float32, device=values.device)
    partials = torch.empty(row_programs, taps, hidden, dtype=torch.float32, device=values.device)
    _kernel_grads_kernel[(row_programs, triton.cdiv(groups, _COLUMNS // group_size))](
        grad_out, values, position, grad_dynamic, partials, rows, length, hidden, groups,
        TAPS=taps, GROUP=group_size, ROWS=_ROWS, TILES=_TILES, GROUPS_PER_PROGRAM=_COLUMNS // group_size,
    )  # fmt: skip
    return grad_dynamic, partials.sum(0)


@_triton_kernel_grads.register_fake
def _(
    grad_out: Tensor, values: Tensor, position: Tensor, taps: int, group_size: int
) -> tuple[Tensor, Tensor]:
    batch, length, hidden = values.shape
    return (
        values.new_empty(batch, length, taps, hidden // group_size, dtype=torch.float32),
        values.new_empty(taps, hidden, dtype=torch.float32),
    )


if triton is not None:

    @triton.jit
    def _kernel_grads_kernel(
        grad_out_ptr, values_ptr, position_ptr, grad_dynamic_ptr, partials_ptr,
        num_rows, length, hidden, num_groups,
        TAPS: tl.constexpr, GROUP: tl.constexpr, ROWS: tl.constexpr, TILES: tl.constexpr,
        GROUPS_PER_PROGRAM: tl.constexpr,
    ):  # fmt: skip
        # [ROWS, groups, GROUP] tiles, TILES of them down the rows. Per tile dy is read once and
        # every tap's shifted values after it (row t - o is mostly in cache from the tile before).
        # The group sum is over the last axis, stored per row; the channel sum is carried per tap
        # as a whole tile across the tiles (elementwise adds) and reduced over its rows once at
        # the end (one accumulator per tap: at most _MAX_TAPS).
        row_block = tl.program_id(0)
        groups = tl.program_id(1) * GROUPS_PER_PROGRAM + tl.arange(0, GROUPS_PER_PROGRAM)
        columns = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
        group_ok = groups < num_groups
        sum0 = tl.zeros((ROWS, GROUPS_PER_PROGRAM, GROUP), dtype=tl.float32)
        sum1 = tl.zeros((ROWS, GROUPS_PER_PROGRAM, GROUP), dtype=tl.float32)
        sum2 = tl.zeros((ROWS, GROUPS_PER_PROGRAM, GROUP), dtype=tl.float32)
        sum3 = tl.zeros((ROWS, GROUPS_PER_PROGRAM, GROUP), dtype=tl.float32)
        for tile in range(TILES):
            rows = (row_block * TILES + tile) * ROWS + tl.arange(0, ROWS)
            row_ok = rows < num_rows
            here = row_ok[:, None, None] & group_ok[None, :, None]
            offsets = rows.to(tl.int64)[:, None, None] * hidden + columns[None, :, :]
            position = tl.load(position_ptr + rows % length, mask=row_ok, other=0)
            grad_out = tl.load(grad_out_ptr + offsets, mask=here, other=0.0).to(tl.float32)
            for tap in tl.static_range(TAPS):
                reads = here & (position >= tap)[:, None, None]
                shifted = tl.load(values_ptr + offsets - tap * hidden, mask=reads, other=0.0).to(tl.float32)
                product = grad_out * shifted
                tl.store(
                    grad_dynamic_ptr
                    + (rows.to(tl.int64)[:, None] * TAPS + tap) * num_groups
                    + groups[None, :],
                    tl.sum(product, axis=2),
                    mask=row_ok[:, None] & group_ok[None, :],
                )
                if tap == 0:
                    sum0 += product
                elif tap == 1:
                    sum1 += product
                elif tap == 2:
                    sum2 += product
                else:
                    sum3 += product
        partials = partials_ptr + row_block * TAPS * hidden + columns
        tl.store(partials, tl.sum(sum0, axis=0), mask=group_ok[:, None])
        if TAPS > 1:
            tl.store(partials + hidden, tl.sum(sum1, axis=0), mask=group_ok[:, None])
        if TAPS > 2:
            tl.store(partials + 2 * hidden, tl.sum(sum2, axis=0), mask=group_ok[:, None])
        if TAPS > 3:
            tl.store(partials + 3 * hidden, tl.sum(sum3, axis=0), mask=group_ok[:, None])
