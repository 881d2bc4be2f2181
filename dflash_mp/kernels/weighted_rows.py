"""Weighted sums of table rows picked by id: out[m] = sum_k weights[m, k] * table[ids[m, k]].

The DFlash 2 selector's backward needs this with the target's LM head as the table (152k rows of
4096 on Qwen3-8B) and 16 candidates per row. `F.embedding_bag` computes it, but on an H200 it reads
the rows at about a sixth of the memory bandwidth (0.7 ms for 3584 x 16 rows of 8 KB); the Triton
kernel here keeps all K row loads of a tile in flight at once. Elsewhere one gathered row per
candidate at a time. Sums are fp32; the result takes the table's dtype.
"""

from __future__ import annotations

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_ROWS = 4  # output rows per program
_COLUMNS = 1024  # columns per program: 2 KB of a bf16 row per load


def weighted_row_sum(table: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    """[M, H] in table's dtype, from table [V, H], ids [M, K] and weights [M, K]."""
    if triton is not None and table.is_cuda and table.stride(-1) == 1:
        return _triton_weighted_row_sum(table, ids, weights)
    # As the kernel: fp32 weights and sum, one rounding to the table's dtype (embedding_bag would
    # need the weights in a bf16 table's dtype, or a fp32 copy of the whole table).
    total = torch.zeros(ids.shape[0], table.shape[1], dtype=torch.float32, device=table.device)
    for pick in range(ids.shape[1]):
        total += weights[:, pick, None].float() * table[ids[:, pick]].float()
    return total.to(table.dtype)


def _triton_weighted_row_sum(table: Tensor, ids: Tensor, weights: Tensor) -> Tensor:
    ids, weights = ids.contiguous(), weights.contiguous()
    rows, picks = ids.shape
    hidden = table.shape[1]
    out = torch.empty(rows, hidden, dtype=table.dtype, device=table.device)
    grid = (triton.cdiv(rows, _ROWS), triton.cdiv(hidden, _COLUMNS))
    _weighted_row_sum_kernel[grid](
        table, ids, weights, out, rows, hidden, table.stride(0), PICKS=picks, ROWS=_ROWS, COLUMNS=_COLUMNS
    )
    return out


if triton is not None:

    @triton.jit
    def _weighted_row_sum_kernel(
        table_ptr, ids_ptr, weights_ptr, out_ptr, num_rows, hidden, table_stride,
        PICKS: tl.constexpr, ROWS: tl.constexpr, COLUMNS: tl.constexpr,
    ):  # fmt: skip
        rows = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
        columns = tl.program_id(1) * COLUMNS + tl.arange(0, COLUMNS)
        row_ok, column_ok = rows < num_rows, columns < hidden
        tile_ok = row_ok[:, None] & column_ok[None, :]
        total = tl.zeros((ROWS, COLUMNS), dtype=tl.float32)
        for pick in tl.static_range(PICKS):
            row_id = tl.load(ids_ptr + rows * PICKS + pick, mask=row_ok, other=0).to(tl.int64)
            weight = tl.load(weights_ptr + rows * PICKS + pick, mask=row_ok, other=0.0).to(tl.float32)
            picked = tl.load(
                table_ptr + row_id[:, None] * table_stride + columns[None, :], mask=tile_ok, other=0.0
            )
            total += weight[:, None] * picked.to(tl.float32)
        offsets = rows.to(tl.int64)[:, None] * hidden + columns[None, :]
        tl.store(out_ptr + offsets, total.to(out_ptr.dtype.element_ty), mask=tile_ok)
