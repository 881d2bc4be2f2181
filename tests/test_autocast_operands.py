"""A weight gradient's sum over chunks (`add_product_`, DSpark's w2, XPress's readout): in place,
and on CUDA summed in fp32 without the product rounded to bf16 first. A product over the vocabulary
into a few columns (`long_inner_product`, DSpark's Markov features, XPress's latents): split into
pieces of the vocabulary, the same product."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.objective import autocast_operands
from dflash_mp.objective.autocast_operands import add_product_, long_inner_product, split_pieces


def _operands(device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(0)
    total = torch.randn(96, 8, generator=g).to(device)
    a = torch.randn(96, 300, generator=g).bfloat16().to(device)
    b = torch.randn(300, 8, generator=g).bfloat16().to(device)
    return total, a, b


def test_on_the_cpu_the_bf16_product_is_added_in_place() -> None:
    total, a, b = _operands("cpu")
    expected = total + (a @ b).float()
    pointer = total.data_ptr()
    assert add_product_(total, a, b) is total and total.data_ptr() == pointer
    assert torch.equal(total, expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_on_cuda_the_product_is_summed_in_fp32_in_place() -> None:
    total, a, b = _operands("cuda")
    exact = total.double() + a.double() @ b.double()
    rounded = total + (a @ b).float()  # the product rounded to bf16 first
    pointer = total.data_ptr()
    assert add_product_(total, a, b) is total and total.data_ptr() == pointer
    if autocast_operands.fp32_output_error() is not None:  # this torch refused: the portable sum
        assert torch.equal(total, rounded)
        pytest.skip(
            f"this torch has no fp32-output GEMM beside an fp32 total: {autocast_operands.fp32_output_error()}"
        )
    error, rounded_error = ((x.double() - exact).abs().max().item() for x in (total, rounded))
    assert error < 1e-4 < rounded_error


def test_a_torch_that_refuses_the_fp32_output_gemm_falls_back_once_with_a_warning(
    monkeypatch, caplog
) -> None:
    """Older torch releases refuse an fp32 `self` beside bf16 operands: the sum goes on, in the
    operands' dtype, and a warning says why, once."""
    calls = []

    def refusing_addmm(*args, **kwargs):
        calls.append(1)
        raise RuntimeError("self and mat2 must have the same dtype")

    monkeypatch.setattr(autocast_operands, "_fp32_output_error", None)
    monkeypatch.setattr(autocast_operands.torch, "addmm", refusing_addmm)
    total, a, b = _operands("cpu")
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the CUDA branch on the CPU
    expected = total + (a @ b).float()
    with caplog.at_level("WARNING", logger=autocast_operands.__name__):
        for _ in range(2):
            add_product_(total, a, b)
    expected += (a @ b).float()
    assert torch.equal(total, expected) and len(calls) == 1
    assert "same dtype" in autocast_operands.fp32_output_error() and caplog.text.count("fp32-output") == 1


@pytest.mark.parametrize("pieces", [1, 3, 4, 7])
def test_the_split_product_is_the_product(pieces: int) -> None:
    """Pieces of 64 columns and a remainder (460 = 7 x 64 + 12 at 7 pieces, 3 x 128 + 76 at 3):
    one fp32 sum of the partial products, equal to the product up to the order of additions."""
    g = torch.Generator().manual_seed(1)
    a, b = torch.randn(40, 460, generator=g), torch.randn(460, 24, generator=g)
    split = long_inner_product(a, b, pieces)
    assert split.shape == (40, 24) and split.dtype == a.dtype
    torch.testing.assert_close(split, a @ b, rtol=1e-5, atol=1e-5)
    low = long_inner_product(a.bfloat16(), b.bfloat16(), pieces)
    assert low.dtype == torch.bfloat16
    torch.testing.assert_close(low.float(), a.bfloat16().float() @ b.bfloat16().float(), rtol=1e-2, atol=0.2)


def test_the_pieces_fill_the_gpu_only_where_the_output_is_small(monkeypatch) -> None:
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    monkeypatch.setattr(autocast_operands, "_multiprocessors", lambda device: 132)  # an H100's SMs
    vocab = 151936

    def pieces(rows: int, inner: int, columns: int, dtype=torch.bfloat16) -> int:
        return split_pieces(
            torch.empty(rows, inner, dtype=dtype, device="meta"),
            torch.empty(inner, columns, dtype=dtype, device="meta"),
        )

    assert pieces(880, vocab, 256) == 37  # 14 output tiles: up to 4 waves of 132 SMs, pieces >= 4096
    assert pieces(3520, vocab, 256) == 10  # XPress's four passes at once: 56 tiles
    assert pieces(880, vocab, 65536) == 1  # many tiles already
    assert pieces(880, 6000, 256) == 1  # too short to split
    assert pieces(880, vocab, 256, torch.float32) == 1  # not a bf16 / fp16 GEMM
    monkeypatch.undo()
    assert (
        split_pieces(torch.ones(880, 9000, dtype=torch.bfloat16), torch.ones(9000, 4, dtype=torch.bfloat16))
        == 1
    )


def test_a_torch_without_the_fp32_output_batched_gemm_runs_one_gemm(monkeypatch, caplog) -> None:
    """The CPU has no fp32-output bmm: with the CUDA branch taken there, the refusal is a real one.
    The product is then one GEMM's, a warning says why once, and `add_product_` is not affected."""
    monkeypatch.setattr(autocast_operands, "_split_error", None)
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))
    g = torch.Generator().manual_seed(2)
    a, b = torch.randn(16, 512, generator=g).bfloat16(), torch.randn(512, 8, generator=g).bfloat16()
    with caplog.at_level("WARNING", logger=autocast_operands.__name__):
        first, second = (long_inner_product(a, b, 4) for _ in range(2))
    assert torch.equal(first, a @ b) and torch.equal(second, a @ b)
    assert caplog.text.count("fp32-output bmm") == 1 and autocast_operands.split_error() is not None
    assert split_pieces(a, b) == 1 and autocast_operands.fp32_output_error() is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on the device machine)")
def test_on_cuda_the_split_product_is_as_accurate_as_one_gemm() -> None:
    """DSpark's Markov-feature gradient at the Qwen3-8B shape: split, and no less accurate."""
    g = torch.Generator().manual_seed(3)
    a = (torch.randn(880, 151936, generator=g) / 50).bfloat16().cuda()
    b = (torch.randn(151936, 256, generator=g) / 50).bfloat16().cuda()
    assert split_pieces(a, b) > 1
    exact = a.double() @ b.double()
    split, single = long_inner_product(a, b), a @ b
    if autocast_operands.split_error() is not None:
        pytest.skip(f"this torch has no fp32-output bmm: {autocast_operands.split_error()}")
    errors = [(x.double() - exact).abs().max().item() for x in (split, single)]
    assert errors[0] <= 1.5 * errors[1], errors
