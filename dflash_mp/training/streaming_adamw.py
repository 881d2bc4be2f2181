"""AdamW whose CUDA step streams each parameter once through one Triton pass.

The drafter's optimizer step is pure memory traffic: per fp32 parameter it reads the parameter,
its gradient and both moments and writes three of them back, 28 bytes. torch's fused AdamW
(multi_tensor_apply) moves them at ~3 TB/s on an H200, 10.0 ms per step at Qwen3-8B shape (1.05B
parameters); one pass per parameter with wide tiles takes 7.5 ms (~3.9 TB/s). The gradient
multiplier and whether the step applies at all are device tensors, so the trainer can queue the
update before it reads the step's numbers back (trainer.optimizer_step).

The state is torch.optim.AdamW's (per parameter: `step`, `exp_avg`, `exp_avg_sq`; `step` a CPU
tensor, so the bias corrections need no read from the GPU), and checkpoints load either way. The
update is AdamW's (decoupled weight decay, bias-corrected moments) in fp32. Where the Triton pass
does not apply (CPU, a parameter that is not fp32, no Triton) the step is torch's own AdamW on
the multiplied gradients, bit for bit what the trainer ran before.

With `working` (`dflash_mp.training.working_weights`) the optimized tensors are fp32 masters of bf16
working copies: a master without a gradient of its own takes its copy's bf16 gradient (read
widened, 2 bytes less per parameter), and the pass writes the new bf16 copy beside the master.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch import Tensor

try:  # Triton ships with CUDA builds of torch; CPU builds take torch's AdamW.
    import triton
    import triton.language as tl
except ImportError:  # pragma: no cover - depends on the torch build
    triton = None

_TILE = 4096  # elements per program: 16 per thread at 8 warps, four 16-byte loads per stream


class StreamingAdamW(torch.optim.AdamW):
    """torch.optim.AdamW (no amsgrad, not maximize) with `step(grad_multiplier=...)`.

    `grad_multiplier` (a 0-d device tensor) scales every gradient inside the update: the trainer's
    clip and loss rescale, applied without a pass of its own over the gradients.
    """

    def __init__(
        self,
        params: Iterable[Tensor],
        lr: float = 1e-3,
        betas: tuple[float, float] = (0.9, 0.999),
        eps: float = 1e-8,
        weight_decay: float = 1e-2,
        working: dict[int, Tensor] | None = None,
    ) -> None:
        """`working` maps id(master) to its working copy (`WorkingWeights.working_of`)."""
        super().__init__(params, lr=lr, betas=betas, eps=eps, weight_decay=weight_decay)
        self._counted: list[Tensor] = []  # the step counts the last Triton-path step advanced
        self.working = working or {}

    def gradient(self, param: Tensor) -> Tensor | None:
        """`param`'s gradient: its own, else (a master) its working copy's."""
        if param.grad is not None or id(param) not in self.working:
            return param.grad
        return self.working[id(param)].grad

    def gradients(self) -> list[Tensor]:
        """The gradients this step reads, in parameter order."""
        params = (p for group in self.param_groups for p in group["params"])
        return [grad for grad in map(self.gradient, params) if grad is not None]

    def zero_grad(self, set_to_none: bool = True) -> None:
        super().zero_grad(set_to_none)
        for copy in self.working.values():
            copy.grad = None

    def load_state_dict(self, state_dict: dict) -> None:
        """Also a checkpoint of fused AdamW, whose `step`s lie on the GPU: they are moved to the CPU."""
        super().load_state_dict(state_dict)
        self._counted = []
        for group in self.param_groups:
            group["fused"] = group["capturable"] = False
        for state in self.state.values():
            if isinstance(state.get("step"), Tensor) and state["step"].device.type != "cpu":
                state["step"] = state["step"].to("cpu", torch.float32)

    @torch.no_grad()
    def step(  # type: ignore[override]
        self, closure=None, grad_multiplier: Tensor | None = None, applies: Tensor | None = None
    ):
        """AdamW on `grad_multiplier` x the gradients, if `applies` (a 0-d tensor) is true.

        On the Triton path both stay on the device: the update is queued before anyone knows
        whether it applies, and the kernels skip it when not. The step counts advance at launch;
        a caller that then reads `applies` false calls `uncount_last_step`. Elsewhere `applies`
        is read on the host first (nothing is counted when it is false).
        """
        if closure is not None:
            raise ValueError("StreamingAdamW.step takes no closure")
        self._counted = []
        params = [p for group in self.param_groups for p in group["params"] if self.gradient(p) is not None]
        if not params:
            return None
        if not all(_streams(p, self.gradient(p)) for p in params):
            if applies is not None and not bool(applies):
                return None
            for param in params:  # torch's AdamW reads the masters' own gradients, in fp32
                if param.grad is None:
                    param.grad = self.gradient(param).float()
            if grad_multiplier is not None:
                torch._foreach_mul_([p.grad for p in params], grad_multiplier.to(params[0].grad.dtype))
            super().step()
            with torch.no_grad():
                for param in params:
                    if id(param) in self.working:
                        self.working[id(param)].copy_(param)
            return None
        # parameters, gradients, both moments, the working copies (the parameter where none)
        streams: tuple[list[Tensor], ...] = ([], [], [], [], [])
        groups = []
        for group in self.param_groups:
            if group["amsgrad"] or group["maximize"]:
                raise ValueError("StreamingAdamW: amsgrad and maximize are not supported")
            for param in (p for p in group["params"] if self.gradient(p) is not None):
                state = self.state[param]
                if not state:
                    state["step"] = torch.tensor(0.0, dtype=torch.float32)
                    state["exp_avg"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                    state["exp_avg_sq"] = torch.zeros_like(param, memory_format=torch.preserve_format)
                working = self.working.get(id(param), param)
                tensors = (param, self.gradient(param), state["exp_avg"], state["exp_avg_sq"], working)
                for stream, tensor in zip(streams, tensors, strict=True):
                    stream.append(tensor)
                self._counted.append(state["step"])
                groups.append(group)
        # Two host ops for all the counts, not two per parameter: this runs between steps.
        torch._foreach_add_(self._counted, 1)
        hyper = []
        for group, step in zip(groups, torch.stack(self._counted).tolist(), strict=True):
            beta1, beta2 = group["betas"]
            hyper.append(
                [
                    1 - group["lr"] * group["weight_decay"],
                    beta1,
                    beta2,
                    group["eps"],
                    group["lr"] / (1 - beta1**step),
                    math.sqrt(1 - beta2**step),
                ]
            )
        device = params[0].device
        multiplier = torch.ones(1, device=device) if grad_multiplier is None else grad_multiplier
        flag = torch.ones(1, device=device) if applies is None else applies
        streaming_adamw_pass(
            *streams,
            torch.tensor(hyper, dtype=torch.float32),
            multiplier.to(device, torch.float32).reshape(1),
            flag.to(device, torch.float32).reshape(1),
        )
        return None

    def uncount_last_step(self) -> None:
        """Take back the step counts of the last Triton-path step, which the device skipped."""
        if self._counted:
            torch._foreach_sub_(self._counted, 1)
        self._counted = []


def _streams(param: Tensor, grad: Tensor | None) -> bool:
    """The Triton pass takes CUDA fp32 parameters with dense contiguous gradients (fp32 or bf16)."""
    return (
        triton is not None
        and param.is_cuda
        and param.dtype == torch.float32
        and grad is not None
        and not grad.is_sparse
        and grad.dtype in (torch.float32, torch.bfloat16)
        and param.is_contiguous()
        and grad.is_contiguous()
    )


@torch.library.custom_op(
    "dflash_mp::streaming_adamw_pass", mutates_args=("params", "exp_avgs", "exp_avg_sqs", "workings")
)
def streaming_adamw_pass(
    params: list[Tensor],
    grads: list[Tensor],
    exp_avgs: list[Tensor],
    exp_avg_sqs: list[Tensor],
    workings: list[Tensor],
    hyper: Tensor,
    multiplier: Tensor,
    applies: Tensor,
) -> None:
    """One pass per parameter. `hyper` [n, 6] on the CPU holds, per parameter: 1 - lr *
    weight_decay, beta1, beta2, eps, lr / bias_correction1, sqrt(bias_correction2); `multiplier`
    (on the parameters' device) scales the gradients; where `applies` (likewise) is 0 nothing is
    written. `workings[i]` is params[i]'s working copy, written with the new value in its dtype
    (params[i] itself where it has none: nothing more is written). A registered op, so that
    profilers tie the kernels to it.

    One launch per parameter, not one over a table of all of them: pointers read from a table
    have no known alignment, and the unvectorised pass ran 2.6x slower on an H200 (19.8 vs 7.5 ms).
    """
    rows = zip(params, grads, exp_avgs, exp_avg_sqs, workings, hyper.tolist(), strict=True)
    for param, grad, exp_avg, exp_avg_sq, working, row in rows:  # `row` in the kernel's argument order
        numel = param.numel()
        _adamw_pass[(triton.cdiv(numel, _TILE),)](
            param, grad, exp_avg, exp_avg_sq, working, multiplier, applies, numel, *row,
            TILE=_TILE, WORKING=working is not param, num_warps=8,
        )  # fmt: skip


if triton is not None:

    @triton.jit
    def _adamw_pass(
        param_ptr,
        grad_ptr,
        exp_avg_ptr,
        exp_avg_sq_ptr,
        working_ptr,
        multiplier_ptr,
        applies_ptr,
        numel,
        decay,  # 1 - lr * weight_decay
        beta1,
        beta2,
        eps,
        step_size,  # lr / bias_correction1
        bias_correction2_sqrt,
        TILE: tl.constexpr,
        WORKING: tl.constexpr,
    ):
        if tl.load(applies_ptr) == 0:
            return
        offsets = tl.program_id(0).to(tl.int64) * TILE + tl.arange(0, TILE)
        inside = offsets < numel
        grad = tl.load(grad_ptr + offsets, mask=inside).to(tl.float32) * tl.load(multiplier_ptr)
        param = tl.load(param_ptr + offsets, mask=inside) * decay
        exp_avg = tl.load(exp_avg_ptr + offsets, mask=inside)
        exp_avg = exp_avg + (1 - beta1) * (grad - exp_avg)  # lerp toward the gradient, as torch's
        exp_avg_sq = beta2 * tl.load(exp_avg_sq_ptr + offsets, mask=inside) + (1 - beta2) * grad * grad
        denominator = tl.sqrt(exp_avg_sq) / bias_correction2_sqrt + eps
        param = param - step_size * exp_avg / denominator
        tl.store(param_ptr + offsets, param, mask=inside)
        if WORKING:
            rounded = param.to(working_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # as torch rounds
            tl.store(working_ptr + offsets, rounded, mask=inside)
        tl.store(exp_avg_ptr + offsets, exp_avg, mask=inside)
        tl.store(exp_avg_sq_ptr + offsets, exp_avg_sq, mask=inside)
