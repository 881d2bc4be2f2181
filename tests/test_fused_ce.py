"""The fused CE passes against `_ce_and_grad`, the expressions they replace (on CUDA, or on the CPU
under Triton's interpreter: tests/test_triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.kernels import fused_ce
from dflash_mp.objective.lm_head_loss import _ce_and_grad

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def _chunk(rows: int, vocab: int, dtype: torch.dtype, seed: int = 0):
    generator = torch.Generator().manual_seed(seed)
    logits = (torch.randn(rows, vocab, generator=generator) * 4).to(dtype)
    labels = torch.randint(0, vocab, (rows,), generator=generator)
    scale = torch.rand(rows, generator=generator)
    scale[1] = 0.0  # a row that does not count
    # Ties for the maximum: row 0 has it at three places, in the first tile and twice in the second.
    logits[0, 100] = logits[0, 4200] = logits[0, 4900] = 100.0
    labels[0] = 100
    labels[2] = int(logits[2].float().argmax())  # a row it gets right
    return logits.to(DEVICE), labels.to(DEVICE), scale.to(DEVICE)


@pytest.mark.triton
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.25, 30.0)])
def test_loss_gradient_and_argmax_equal_the_expressions(dtype, multiplier, softcap) -> None:
    # 4096 columns a tile: 6001 columns are a whole tile and a ragged one, and six empty slices.
    logits, labels, scale = _chunk(5, 6001, dtype)
    loss, grad, correct = _ce_and_grad(logits.clone(), labels, scale, multiplier, softcap)
    fused_loss, fused_grad, fused_correct = fused_ce.ce_and_grad_in_place(
        logits, labels, scale, multiplier, softcap
    )
    assert fused_grad.data_ptr() == logits.data_ptr() and fused_grad.dtype == dtype  # overwritten
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    # One rounding of the same fp32 value: a bf16 gradient may differ by its last bit.
    tolerance = {"rtol": 1e-2, "atol": 1e-6} if dtype == torch.bfloat16 else {"rtol": 1e-5, "atol": 1e-7}
    torch.testing.assert_close(fused_grad.float(), grad.float(), **tolerance)
    assert torch.equal(fused_correct, correct)
    assert fused_correct[0] and fused_correct[2]  # the tie resolves to the first index, as argmax
    assert not fused_grad[1].any()  # zero scale, zero gradient


@pytest.mark.triton
def test_a_non_finite_logit_makes_the_loss_non_finite() -> None:
    # The trainer skips a step whose loss is not finite: the pass must not hide a NaN.
    logits, labels, scale = _chunk(3, 5000, torch.bfloat16, seed=1)
    logits[1, 17] = float("nan")
    loss, _, _ = fused_ce.ce_and_grad_in_place(logits, labels, scale)
    assert not torch.isfinite(loss)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_at_qwen3_vocab_it_equals_the_compiled_expressions() -> None:
    from dflash_mp.objective.lm_head_loss import _compiled_ce_and_grad

    logits, labels, scale = _chunk(64, 151936, torch.bfloat16, seed=2)
    loss, grad, correct = _compiled_ce_and_grad()(logits.clone(), labels, scale)
    fused_loss, fused_grad, fused_correct = fused_ce.ce_and_grad_in_place(logits, labels, scale)
    torch.testing.assert_close(fused_loss, loss, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused_grad.float(), grad.float(), rtol=1e-2, atol=1e-6)
    assert torch.equal(fused_correct, correct)


@pytest.mark.triton
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.25, 30.0)])
def test_row_cross_entropy_is_each_rows_loss_and_leaves_the_logits(multiplier, softcap) -> None:
    # D-PACE's confidences (objective/position_weights.py): the statistics pass alone, scale 1.
    from dflash_mp.models.drafter import scale_logits

    logits, labels, _ = _chunk(5, 6001, torch.bfloat16, seed=2)
    before = logits.clone()
    ce = fused_ce.row_cross_entropy(logits, labels, multiplier, softcap)
    assert torch.equal(logits, before) and ce.dtype == torch.float32
    x = scale_logits(before.float(), multiplier, softcap)
    expected = torch.logsumexp(x, -1) - x.gather(-1, labels[:, None])[:, 0]
    torch.testing.assert_close(ce, expected, rtol=1e-5, atol=1e-5)
