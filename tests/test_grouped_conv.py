"""DFlash 2's convolution with its hand-written backward against autograd through the tensor ops."""

from __future__ import annotations

import pytest
import torch

from dflash_mp.kernels import grouped_conv
from dflash_mp.kernels.grouped_conv import GroupedConvolution, convolve_with_tensor_ops, triton
from dflash_mp.models.dflash2 import grouped_dynamic_convolve

needs_cuda = pytest.mark.skipif(
    not torch.cuda.is_available() or triton is None, reason="needs CUDA and Triton"
)

SHAPES = [
    (2, 72, 256, 2, 16, 16),
    (1, 45, 160, 3, 32, 8),
    (2, 40, 512, 2, 16, None),
    (1, 131, 96, 2, 32, 5),
    (1, 37, 64, 4, 16, 6),
]


def _inputs(batch, length, hidden, taps, group, dtype, device, seed=0):
    """values, the kernel projection's output (dynamic is a strided view of it, as in the model), base."""
    generator = torch.Generator().manual_seed(seed)
    values = torch.randn(batch, length, hidden, generator=generator).to(device, dtype).requires_grad_()
    projection = torch.randn(batch, length, 2 * taps * (hidden // group), generator=generator)
    base = torch.randn(taps, hidden, generator=generator).to(device).requires_grad_()
    return values, projection.to(device, dtype).requires_grad_(), base


def _dynamic(projection, values, taps, group):
    batch, length, hidden = values.shape
    return projection.view(batch, length, 2, taps, hidden // group)[..., 1, :, :]


def _compare(batch, length, hidden, taps, group, block, device, dtype=torch.float32, tolerance=1e-5):
    values, projection, base = _inputs(batch, length, hidden, taps, group, dtype, device)
    position = torch.arange(length, device=device) % (block or length)
    dynamic = _dynamic(projection, values, taps, group)
    expected = convolve_with_tensor_ops(values, dynamic, base, group, None if block is None else position)
    got = GroupedConvolution.apply(values, dynamic, base, position, group)
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    grad = torch.randn_like(expected)
    want = torch.autograd.grad(expected, (values, projection, base), grad)
    have = torch.autograd.grad(got, (values, projection, base), grad)
    for name, a, b in zip(("values", "dynamic", "base"), have, want, strict=True):
        assert a.dtype == b.dtype, name
        torch.testing.assert_close(
            a, b, rtol=tolerance, atol=10 * tolerance, msg=lambda m, n=name: f"d {n}: {m}"
        )


@pytest.mark.parametrize("batch,length,hidden,taps,group,block", SHAPES)
def test_hand_written_backward_equals_autograd_on_cpu(batch, length, hidden, taps, group, block) -> None:
    _compare(batch, length, hidden, taps, group, block, "cpu")


def test_only_the_gradients_asked_for_are_computed() -> None:
    values, projection, base = _inputs(1, 20, 64, 2, 16, torch.float32, "cpu")
    position = torch.arange(20) % 4
    out = GroupedConvolution.apply(values.detach(), _dynamic(projection, values, 2, 16), base, position, 16)
    (grad_projection,) = torch.autograd.grad(out.sum(), (projection,))
    assert grad_projection.shape == projection.shape and grad_projection.abs().sum() > 0


@pytest.mark.triton
@pytest.mark.parametrize(
    ("batch", "length", "hidden", "taps", "group"), [(1, 37, 64, 2, 16), (2, 20, 96, 4, 32)]
)
def test_the_triton_kernel_gradients_equal_the_tensor_ops(batch, length, hidden, taps, group) -> None:
    """The kernel's d dynamic and d base on small shapes (also on the CPU under Triton's interpreter)."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    generator = torch.Generator().manual_seed(taps)
    values, grad_out = (torch.randn(batch, length, hidden, generator=generator).to(device) for _ in range(2))
    position = torch.arange(length, device=device) % 5
    want = grouped_conv._kernel_grads(grad_out, values, position, taps, group)
    have = grouped_conv._triton_kernel_grads(grad_out, values, position, taps, group)
    for name, a, b in zip(("dynamic", "base"), have, want, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m, n=name: f"d {n}: {m}")


@pytest.mark.gpu
@needs_cuda
@pytest.mark.parametrize("batch,length,hidden,taps,group,block", [*SHAPES, (1, 4096, 4096, 2, 16, 16)])
def test_triton_kernel_gradients_equal_autograd_in_fp32(batch, length, hidden, taps, group, block) -> None:
    assert grouped_conv._triton_takes(torch.zeros(1, 1, hidden, device="cuda"), taps, group)
    _compare(batch, length, hidden, taps, group, block, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_kernels_wider_than_the_triton_pass_takes_keep_the_tensor_ops() -> None:
    assert not grouped_conv._triton_takes(torch.zeros(1, 1, 64, device="cuda"), 5, 16)
    _compare(1, 30, 64, 5, 16, 8, "cuda")


@pytest.mark.gpu
@needs_cuda
def test_bf16_gradients_are_close_to_fp32() -> None:
    values, projection, base = _inputs(1, 512, 1024, 2, 16, torch.bfloat16, "cuda", seed=3)
    position = torch.arange(512, device="cuda") % 16
    grad = torch.randn(1, 512, 1024, device="cuda")
    exact = torch.autograd.grad(
        convolve_with_tensor_ops(
            values.float(), _dynamic(projection.float(), values, 2, 16), base, 16, position
        ),
        (base,),
        grad,
    )[0]
    out = grouped_dynamic_convolve(values, _dynamic(projection, values, 2, 16), base, 16, position)
    assert out.dtype == torch.bfloat16
    got = torch.autograd.grad(out, (base,), grad.to(out.dtype))[0]
    torch.testing.assert_close(got, exact, rtol=2e-2, atol=2e-1)


@pytest.mark.gpu
@needs_cuda
def test_compiled_convolution_has_no_graph_break_and_matches_eager() -> None:
    values, projection, base = _inputs(2, 64, 256, 2, 16, torch.float32, "cuda", seed=5)
    position = torch.arange(64, device="cuda") % 16

    def side(values, projection, base):
        out = grouped_dynamic_convolve(values.sin(), _dynamic(projection, values, 2, 16), base, 16, position)
        return out.square().sum()

    eager_grads = torch.autograd.grad(side(values, projection, base), (values, projection, base))
    grads = torch.autograd.grad(
        torch.compile(side, fullgraph=True)(values, projection, base), (values, projection, base)
    )
    for a, b in zip(grads, eager_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
