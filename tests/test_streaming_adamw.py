"""StreamingAdamW: torch's AdamW where Triton does not apply, its Triton pass where it does."""

from __future__ import annotations

import copy

import pytest
import torch

from dflash_mp.training import streaming_adamw
from dflash_mp.training.streaming_adamw import StreamingAdamW

# The Triton pass runs on CUDA, or on the CPU under Triton's interpreter (tests/test_triton_interpreter.py).
KERNEL_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HYPER = {"lr": 3e-3, "betas": (0.9, 0.95), "eps": 1e-8, "weight_decay": 0.1}


def _problem(device: str, seed: int = 0) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Parameters of ragged sizes (one under a tile, one over several) and three steps of gradients."""
    generator = torch.Generator().manual_seed(seed)
    shapes = [(3, 5), (4096 * 2 + 17,), (33, 257)]
    params = [torch.randn(shape, generator=generator).to(device) for shape in shapes]
    grads = [[torch.randn(shape, generator=generator).to(device) for shape in shapes] for _ in range(3)]
    return params, grads


def test_without_the_triton_pass_it_is_torch_adamw_on_the_multiplied_gradient() -> None:
    params, grads = _problem("cpu")
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    optimizer, reference = StreamingAdamW(ours, **HYPER), torch.optim.AdamW(theirs, **HYPER)
    for step_grads in grads:
        multiplier = torch.tensor(0.37)
        for p, q, g in zip(ours, theirs, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g * multiplier
        optimizer.step(grad_multiplier=multiplier)
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        assert torch.equal(p, q)


@pytest.mark.parametrize(
    "device",
    [
        "cpu",
        pytest.param(
            "cuda",
            marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
        ),
    ],
)
def test_a_step_that_does_not_apply_changes_nothing_once_uncounted(device: str) -> None:
    # CPU: `applies` is read first. CUDA: the update is queued and skipped on the device, the
    # counts advance at launch and `uncount_last_step` takes them back.
    params, grads = _problem(device, seed=4)
    ours = [p.clone().requires_grad_() for p in params]
    optimizer = StreamingAdamW(ours, **HYPER)
    for p, g in zip(ours, grads[0], strict=True):
        p.grad = g.clone()
    optimizer.step()
    state = {
        name: [optimizer.state[p][name].clone() for p in ours] for name in ("step", "exp_avg", "exp_avg_sq")
    }
    weights = [p.detach().clone() for p in ours]
    for p, g in zip(ours, grads[1], strict=True):
        p.grad = g.clone()
    optimizer.step(
        grad_multiplier=torch.tensor(2.0, device=device), applies=torch.tensor(False, device=device)
    )
    optimizer.uncount_last_step()
    assert all(torch.equal(p, w) for p, w in zip(ours, weights, strict=True))
    for name, values in state.items():
        assert all(torch.equal(optimizer.state[p][name], v) for p, v in zip(ours, values, strict=True)), name
    optimizer.step(applies=torch.tensor(True, device=device))  # and the next one does apply
    assert not any(torch.equal(p, w) for p, w in zip(ours, weights, strict=True))
    assert all(float(optimizer.state[p]["step"]) == 2 for p in ours)


def test_a_fused_adamw_checkpoint_loads_and_continues() -> None:
    # Fused AdamW keeps `step` on the parameters' device; loaded here it moves to the CPU, where
    # the bias corrections read it without a device sync, and the run goes on as AdamW's would.
    params, grads = _problem("cpu", seed=1)
    fused = [p.clone().requires_grad_() for p in params]
    fused_optimizer = torch.optim.AdamW(fused, fused=True, **HYPER)
    for p, g in zip(fused, grads[0], strict=True):
        p.grad = g.clone()
    fused_optimizer.step()
    ours = [p.detach().clone().requires_grad_() for p in fused]
    optimizer = StreamingAdamW(ours, **HYPER)
    optimizer.load_state_dict(copy.deepcopy(fused_optimizer.state_dict()))  # as if read from disk
    assert all(not group["fused"] for group in optimizer.param_groups)
    assert all(state["step"].device.type == "cpu" for state in optimizer.state.values())
    for p, q, g in zip(ours, fused, grads[1], strict=True):
        p.grad, q.grad = g.clone(), g.clone()
    optimizer.step()
    fused_optimizer.step()
    for p, q in zip(ours, fused, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert float(optimizer.state[ours[0]]["step"]) == 2


@pytest.mark.triton
def test_the_triton_pass_is_adamw_in_float64_to_float32_rounding() -> None:
    params, grads = _problem(KERNEL_DEVICE, seed=2)
    exact = [p.double() for p in params]
    moments = [(torch.zeros_like(p), torch.zeros_like(p)) for p in exact]
    states = [(torch.zeros_like(p), torch.zeros_like(p)) for p in params]
    beta1, beta2 = HYPER["betas"]
    lr, eps, decay = HYPER["lr"], HYPER["eps"], HYPER["weight_decay"]
    multiplier = torch.tensor([0.5], device=KERNEL_DEVICE)
    rates = [lr * (i + 1) for i in range(len(params))]  # each parameter reads its own row of `hyper`
    for step, step_grads in enumerate(grads, start=1):
        hyper = [
            [1 - r * decay, beta1, beta2, eps, r / (1 - beta1**step), (1 - beta2**step) ** 0.5] for r in rates
        ]
        streaming_adamw.streaming_adamw_pass(
            params,
            step_grads,
            [m for m, _ in states],
            [v for _, v in states],
            params,  # no working copies
            torch.tensor(hyper),
            multiplier,
            torch.ones(1, device=KERNEL_DEVICE),
        )
        for i, grad in enumerate(step_grads):
            g = 0.5 * grad.double()
            m, v = moments[i]
            m.mul_(beta1).add_(g, alpha=1 - beta1)
            v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
            denominator = (v / (1 - beta2**step)).sqrt() + eps
            exact[i] = exact[i] * (1 - rates[i] * decay) - rates[i] / (1 - beta1**step) * m / denominator
    for param, reference, (m, v), (exact_m, exact_v) in zip(params, exact, states, moments, strict=True):
        torch.testing.assert_close(param.double(), reference, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(m.double(), exact_m, rtol=1e-5, atol=1e-7)
        torch.testing.assert_close(v.double(), exact_v, rtol=1e-5, atol=1e-9)
    # A step that does not apply (decided on the device) writes nothing.
    before = [t.clone() for t in params + [m for m, _ in states] + [v for _, v in states]]
    streaming_adamw.streaming_adamw_pass(
        params,
        grads[0],
        [m for m, _ in states],
        [v for _, v in states],
        params,
        torch.tensor(hyper),
        multiplier,
        torch.zeros(1, device=KERNEL_DEVICE),
    )
    after = params + [m for m, _ in states] + [v for _, v in states]
    assert all(torch.equal(a, b) for a, b in zip(after, before, strict=True))


@pytest.mark.triton
def test_with_working_copies_the_pass_reads_bf16_gradients_and_writes_the_copies() -> None:
    # Against the same pass on the widened gradients: the masters bit for bit, the copies their rounding.
    params, grads = _problem(KERNEL_DEVICE, seed=5)
    wide, narrow = [p.clone() for p in params], [p.clone() for p in params]
    copies = [p.bfloat16() for p in params]
    moments = {name: [[torch.zeros_like(p) for p in params] for _ in range(2)] for name in ("wide", "narrow")}
    hyper = torch.tensor([[1 - 3e-4, 0.9, 0.95, 1e-8, 3e-3 / 0.1, 0.05**0.5]] * len(params))
    one = torch.ones(1, device=KERNEL_DEVICE)
    for step_grads in grads[:2]:
        narrow_grads = [g.bfloat16() for g in step_grads]
        streaming_adamw.streaming_adamw_pass(
            wide, [g.float() for g in narrow_grads], *moments["wide"], wide, hyper, one * 0.5, one
        )
        streaming_adamw.streaming_adamw_pass(
            narrow, narrow_grads, *moments["narrow"], copies, hyper, one * 0.5, one
        )
    for master, reference, working in zip(narrow, wide, copies, strict=True):
        assert torch.equal(master, reference)
        assert working.dtype == torch.bfloat16
        if KERNEL_DEVICE == "cuda":  # round to nearest even, as torch; Triton's interpreter truncates
            assert torch.equal(working, reference.bfloat16())
        else:
            torch.testing.assert_close(working.float(), reference, rtol=2**-7, atol=0)


def test_masters_of_working_copies_step_as_adamw_on_the_widened_gradients() -> None:
    # CPU: torch's AdamW on the masters, then the copies rounded from them.
    params, grads = _problem("cpu", seed=6)
    masters = [p.clone() for p in params]
    copies = [p.bfloat16().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    optimizer = StreamingAdamW(
        masters, **HYPER, working={id(m): c for m, c in zip(masters, copies, strict=True)}
    )
    reference = torch.optim.AdamW(theirs, **HYPER)
    for step_grads in grads:
        for working, q, g in zip(copies, theirs, step_grads, strict=True):
            working.grad = g.bfloat16()
            q.grad = g.bfloat16().float() * 0.5
        assert [g.dtype for g in optimizer.gradients()] == [torch.bfloat16] * len(params)
        optimizer.step(grad_multiplier=torch.tensor(0.5))
        reference.step()
        optimizer.zero_grad()
        assert all(c.grad is None and m.grad is None for c, m in zip(copies, masters, strict=True))
    for master, q, working in zip(masters, theirs, copies, strict=True):
        assert torch.equal(master, q) and torch.equal(working, q.detach().bfloat16())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or streaming_adamw.triton is None, reason="needs CUDA")
def test_on_cuda_it_matches_fused_adamw_over_steps() -> None:
    params, grads = _problem("cuda", seed=3)
    ours = [p.clone().requires_grad_() for p in params]
    theirs = [p.clone().requires_grad_() for p in params]
    optimizer, reference = StreamingAdamW(ours, **HYPER), torch.optim.AdamW(theirs, fused=True, **HYPER)
    for step_grads in grads:
        for p, q, g in zip(ours, theirs, step_grads, strict=True):
            p.grad, q.grad = g.clone(), g * 0.25
        optimizer.step(grad_multiplier=torch.tensor(0.25, device="cuda"))
        reference.step()
    for p, q in zip(ours, theirs, strict=True):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    assert all(state["step"].device.type == "cpu" for state in optimizer.state.values())
