"""A weight gradient's sum over chunks (`add_product_`, DSpark's w2, XPress's readout): in place,
and on CUDA summed in fp32 without the product rounded to bf16 first."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.objective import autocast_operands
from dflash_mp.objective.autocast_operands import add_product_


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
