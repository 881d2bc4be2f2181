"""A weight gradient's sum over chunks (`add_product_`, DSpark's w2, XPress's readout): in place,
and on CUDA summed in fp32 without the product rounded to bf16 first."""

from __future__ import annotations

import pytest
import torch

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
    error, rounded_error = ((x.double() - exact).abs().max().item() for x in (total, rounded))
    assert error < 1e-4 < rounded_error
