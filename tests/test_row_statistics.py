"""The statistics pass (dflash_mp/kernels/row_statistics.py) against torch on fp32 copies: each row's
lse, CE, argmax (the first maximum, ties included) and argmax == label, for the biased logits and,
from the same read, the base without its bias (XPress) or a teacher's lse (DSpark); on CUDA or on
the CPU under Triton's interpreter (tests/test_triton_interpreter.py)."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.kernels.row_statistics import ChunkLogits, ce_with_base, row_statistics
from dflash_mp.models.drafter import scale_logits

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
ROWS, VOCAB, TILE = 7, 300, 64  # 300 columns: 4 whole tiles and a ragged one


def _logits(dtype: torch.dtype, multiplier: float, softcap: float | None, teacher: bool = False):
    """Rows with ties: row 1's raw maximum at 4 places (the base's argmax is the first), row 2's
    biased maximum at 3 places in different segments, row 3's label its argmax in both."""
    generator = torch.Generator().manual_seed(0)
    raw = torch.randn(ROWS, VOCAB, generator=generator) * 3
    bias = torch.randn(ROWS, VOCAB, generator=generator)
    labels = torch.randint(0, VOCAB, (ROWS,), generator=generator)
    raw[1, [250, 31, 140, 299]] = 20.0
    raw[2], bias[2] = 0.0, 0.0
    bias[2, [290, 70, 200]] = 5.0
    raw[3, 11], bias[3, 11], labels[3] = 25.0, 2.0, 11
    other = torch.randn(ROWS, VOCAB, generator=generator) * 2 if teacher else None
    cast = lambda t: None if t is None else t.to(dtype).to(DEVICE)  # noqa: E731
    return ChunkLogits(cast(raw), cast(bias), cast(other), labels.to(DEVICE), multiplier, softcap)


def _expected(x: ChunkLogits, with_bias: bool) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(lse, CE, argmax) of scale(raw) (+ bias) in fp32."""
    z = scale_logits(x.draft.float(), x.multiplier, x.softcap)
    if with_bias:
        z = z + x.bias.float()
    lse = torch.logsumexp(z, -1)
    return lse, lse - z.gather(-1, x.labels[:, None])[:, 0], z.argmax(-1)


@pytest.mark.triton
@pytest.mark.parametrize(
    ("dtype", "multiplier", "softcap"), [(torch.bfloat16, 1.0, None), (torch.float32, 0.7, 6.0)]
)
@pytest.mark.parametrize("segment_tiles", [1, 2, 100])  # 5 segments, 3 (the last ragged), one
def test_the_biased_pass_and_its_base_equal_torch(dtype, multiplier, softcap, segment_tiles) -> None:
    x = _logits(dtype, multiplier, softcap)
    biased, base = ce_with_base(x, TILE, segment_tiles)
    for got, with_bias in ((biased, True), (base, False)):
        lse, ce, argmax = _expected(x, with_bias)
        torch.testing.assert_close(got.stats.draft_lse, lse, rtol=1e-6, atol=1e-5)
        torch.testing.assert_close(got.ce, ce, rtol=1e-6, atol=1e-5)
        assert torch.equal(got.stats.argmax, argmax), (with_bias, got.stats.argmax, argmax)
    assert base.stats.argmax[1] == 31 and biased.stats.argmax[2] == 70  # the first of tied maxima
    terms, correct, stats, none = row_statistics(x, tile=TILE, segment_tiles=segment_tiles)
    assert none is None and stats.teacher_lse is None and not terms[:, 1:].any()
    assert torch.equal(terms[:, 0], biased.ce) and torch.equal(stats.argmax, biased.stats.argmax)
    assert torch.equal(correct, biased.stats.argmax == x.labels) and correct[3]


@pytest.mark.triton
def test_a_teachers_lse_comes_from_the_same_read() -> None:
    x = _logits(torch.float32, 0.5, None, teacher=True)
    terms, _, stats, _ = row_statistics(x, tile=TILE, segment_tiles=2)
    teacher = scale_logits(x.teacher.float(), x.multiplier, x.softcap)
    torch.testing.assert_close(stats.teacher_lse, torch.logsumexp(teacher, -1), rtol=1e-6, atol=1e-5)
    torch.testing.assert_close(terms[:, 0], _expected(x, True)[1], rtol=1e-6, atol=1e-5)


def test_the_base_needs_a_bias_and_no_teacher() -> None:
    x = _logits(torch.float32, 1.0, None, teacher=True)
    with pytest.raises(ValueError, match="a bias and no teacher"):
        ce_with_base(x)
    with pytest.raises(ValueError, match="a bias and no teacher"):
        ce_with_base(ChunkLogits(x.draft, None, None, x.labels))
