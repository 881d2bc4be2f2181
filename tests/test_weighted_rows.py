"""weighted_row_sum (the selector backward's sum over the K candidates' head rows) against a gather."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.kernels import weighted_rows
from dflash_mp.kernels.weighted_rows import weighted_row_sum

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or weighted_rows.triton is None, reason="needs CUDA and Triton"
)


def _inputs(vocab, hidden, rows, picks, dtype, device, seed=0):
    generator = torch.Generator().manual_seed(seed)
    table = torch.randn(vocab, hidden, generator=generator).to(device, dtype)
    ids = torch.randint(0, vocab, (rows, picks), generator=generator).to(device)
    weights = torch.randn(rows, picks, generator=generator).to(device)
    return table, ids, weights


def _gathered(table, ids, weights):
    """The fp32 reference: the [rows, K, H] gather that the kernel avoids keeping."""
    return (weights.float()[..., None] * table.float()[ids]).sum(1)


def test_cpu_sum_equals_the_gather_and_keeps_the_table_dtype() -> None:
    table, ids, weights = _inputs(300, 72, 11, 16, torch.float32, "cpu")
    ids[0] = ids[0, 0]  # one row picks the same id K times: every pick counts
    got = weighted_row_sum(table, ids, weights)
    assert got.dtype == table.dtype and got.shape == (11, 72)
    torch.testing.assert_close(got, _gathered(table, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.triton
def test_the_triton_sum_of_a_few_rows_equals_the_gather() -> None:
    """The kernel on small shapes (also on the CPU under Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    table, ids, weights = _inputs(513, 300, 9, 5, torch.float32, device)
    got = weighted_rows._triton_weighted_row_sum(table, ids, weights)
    torch.testing.assert_close(got, _gathered(table, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize(
    "vocab,hidden,rows,picks", [(1000, 4096, 37, 16), (513, 1100, 9, 5), (2000, 64, 4, 1)]
)
def test_triton_sum_equals_the_gather_in_fp32(vocab, hidden, rows, picks) -> None:
    table, ids, weights = _inputs(vocab, hidden, rows, picks, torch.float32, "cuda")
    got = weighted_row_sum(table, ids, weights)
    torch.testing.assert_close(got, _gathered(table, ids, weights), rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@needs_cuda
def test_triton_sum_in_bf16_accumulates_in_fp32() -> None:
    table, ids, weights = _inputs(4000, 4096, 64, 16, torch.bfloat16, "cuda", seed=1)
    got = weighted_row_sum(table, ids, weights)
    assert got.dtype == torch.bfloat16
    exact = _gathered(table, ids, weights)
    # One bf16 rounding of the fp32 sum, no more: the error is within half an ulp of the result.
    assert ((got.float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()


@pytest.mark.gpu
@needs_cuda
def test_a_strided_table_takes_the_fallback_and_agrees() -> None:
    table, ids, weights = _inputs(200, 128, 8, 16, torch.float32, "cuda", seed=2)
    strided = table.t().contiguous().t()  # same values, stride(-1) != 1
    got = weighted_row_sum(strided, ids, weights)
    torch.testing.assert_close(got, _gathered(table, ids, weights), rtol=1e-5, atol=1e-5)


def test_cpu_sum_keeps_fp32_weights_against_a_bf16_table() -> None:
    # As the Triton kernel: the weights stay fp32 (a bf16 copy would round 1 + 2^-10 to 1 and the
    # two picks below would cancel to 0), the sum is fp32 and is rounded to bf16 once.
    table = torch.ones(3, 8, dtype=torch.bfloat16)
    ids = torch.tensor([[0, 1], [1, 2]])
    weights = torch.tensor([[1.0 + 2**-10, -1.0], [0.3, 0.7]])
    got = weighted_row_sum(table, ids, weights)
    assert got.dtype == torch.bfloat16
    assert torch.equal(got, _gathered(table, ids, weights).to(torch.bfloat16))
    table, ids, weights = _inputs(300, 72, 11, 16, torch.bfloat16, "cpu", seed=3)
    exact = _gathered(table, ids, weights)
    assert ((weighted_row_sum(table, ids, weights).float() - exact).abs() <= exact.abs() * 2**-8 + 1e-6).all()
