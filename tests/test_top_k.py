"""The DFlash 2 candidates' two-stage top-K against torch.topk, and its GPU group-maximum kernel."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.kernels.top_k import _triton_group_maxima, group_maxima, top_k_ids, triton


@pytest.mark.parametrize("vocab", [100, 1000, 128 * 17 + 5, 4096])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_two_stage_top_k_finds_what_topk_finds(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = (3 * torch.randn(33, vocab, generator=generator)).to(dtype)
    if dtype == torch.bfloat16:  # ties: plenty at bf16 precision; pin some at the very top
        logits[:, 7] = logits[:, 5] = logits.max(-1).values
    ids = top_k_ids(logits, 16)
    expected = logits.topk(16, dim=-1)
    # Same values in the same (descending) order; the ids themselves only where no value ties.
    assert torch.equal(logits.gather(-1, ids), expected.values)
    assert all(row.unique().numel() == 16 for row in ids)  # distinct ids, tied or not
    if dtype == torch.float32:
        assert torch.equal(ids, expected.indices)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_triton_group_maxima_equal_torch_amax(dtype: torch.dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(0)
    wide = torch.randn(77, 128 * 1187 + 200, generator=generator, device="cuda").to(dtype)
    logits = wide[:, : 128 * 1187 + 37]  # a row stride wider than the row, an incomplete last group
    expected = logits[:, : 128 * 1187].unflatten(-1, (1187, 128)).amax(-1)
    assert torch.equal(group_maxima(logits, 128), expected)
    assert torch.equal(_triton_group_maxima(logits, 128), expected)
    ids = top_k_ids(logits, 16)
    assert torch.equal(logits.gather(-1, ids), logits.topk(16, dim=-1).values)


@pytest.mark.triton
def test_the_triton_group_maxima_of_a_few_rows_equal_torch_amax() -> None:
    """The kernel on a few rows (also on the CPU under Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    wide = torch.randn(5, 128 * 9 + 200, generator=torch.Generator().manual_seed(1)).to(device)
    logits = wide[:, : 128 * 9 + 37]  # a row stride wider than the row, an incomplete last group
    expected = logits[:, : 128 * 9].unflatten(-1, (9, 128)).amax(-1)
    assert torch.equal(_triton_group_maxima(logits, 128), expected)
