"""DSpark's and XPress's fused loss kernels at the Qwen3-8B chunk (vocabulary 151936, rank 256,
880-row chunks, bf16 autocast) keep to the fused path: a kernel that compiles at the small shapes
of the other tests can still exceed a GPU's shared memory at these, and the first chunk's check
would then turn the torch path on for the whole run (about twice the step)."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.models.xpress import XPressRefiner
from dflash_mp.objective import dspark_rows, xpress_rows
from dflash_mp.objective.dspark_rows import RowLossOptions, dspark_row_loss
from dflash_mp.objective.xpress_rows import XPressRowOptions, xpress_row_loss

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
VOCAB, HIDDEN, RANK, BLOCK, CHUNKS = 151936, 512, 256, 16, 2


def _finite(*tensors: torch.Tensor) -> bool:
    return all(t is not None and bool(torch.isfinite(t).all()) for t in tensors)


def dspark_step(device: str, vocab: int = VOCAB, rank: int = RANK) -> tuple[torch.Tensor, ...]:
    """One DSpark row loss and backward over CHUNKS default chunks; (loss, gradients)."""
    g = torch.Generator(device=device).manual_seed(0)
    rows = CHUNKS * dspark_rows.chunk_rows_of(vocab, BLOCK)
    hidden, markov = (
        torch.randn(rows, n, device=device, generator=g).requires_grad_() for n in (HIDDEN, rank)
    )
    teacher = torch.randn(rows, HIDDEN, device=device, generator=g)
    head = (0.05 * torch.randn(vocab, HIDDEN, device=device, generator=g)).to(torch.bfloat16)
    w2 = (0.05 * torch.randn(vocab, rank, device=device, generator=g)).requires_grad_()
    labels = torch.randint(0, vocab, (rows,), device=device, generator=g)
    weights = torch.rand(rows, device=device, generator=g)
    options = RowLossOptions((1.0, 1.0, 1.0), BLOCK)
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, *_ = dspark_row_loss(hidden, markov, teacher, labels, head, w2, weights, options)
    loss.backward()
    return loss, hidden.grad, markov.grad, w2.grad


def xpress_step(device: str, vocab: int = VOCAB, rank: int = RANK) -> tuple[torch.Tensor, ...]:
    """One XPress row loss (three Jacobi rounds, the base anchor) and backward over CHUNKS chunks."""
    torch.manual_seed(0)
    refiner = XPressRefiner(HIDDEN, vocab, BLOCK, rank, mlp_ratio=2).to(device)
    blocks = CHUNKS * dspark_rows.chunk_rows_of(vocab, BLOCK) // BLOCK
    states = torch.randn(blocks, BLOCK, HIDDEN, device=device, requires_grad=True)
    head = (0.05 * torch.randn(vocab, HIDDEN, device=device)).to(torch.bfloat16)
    labels = torch.randint(0, vocab, (blocks, BLOCK), device=device)
    mask = torch.ones(blocks, BLOCK, dtype=torch.bool, device=device)
    mask[:, 0] = False
    targets = (labels, labels[:, 0], mask, mask.float())
    with torch.autocast(device, dtype=torch.bfloat16):
        loss, _, _ = xpress_row_loss(
            refiner, states, head, targets, XPressRowOptions(3, 0.3, 0.6, False, None)
        )
    loss.backward()
    return loss, states.grad, *(p.grad for p in refiner.latent_parameters())


def test_dspark_keeps_the_fused_kernels_at_the_qwen3_8b_chunk(monkeypatch) -> None:
    monkeypatch.setattr(dspark_rows, "_fused_error", None)
    monkeypatch.setattr(dspark_rows, "_fused_checked", False)  # this process's first chunk: checked
    outputs = dspark_step("cuda")
    assert dspark_rows._fused_checked and dspark_rows._fused_error is None, dspark_rows._fused_error
    assert _finite(*outputs)


def test_xpress_keeps_the_fused_kernels_at_the_qwen3_8b_chunk(monkeypatch) -> None:
    monkeypatch.setattr(xpress_rows, "_fused_error", None)
    monkeypatch.setattr(xpress_rows, "_fused_tried", False)
    outputs = xpress_step("cuda")
    assert xpress_rows._fused_tried and xpress_rows._fused_error is None, xpress_rows._fused_error
    assert _finite(*outputs)
