"""bf16 working copies of the drafter's matmul weights, with fp32 masters that the optimizer updates.

Under bf16 autocast a layer with fp32 weights casts every matmul weight to bf16 in the forward and
every weight gradient (a bf16 matmul result) back to fp32 in the backward: at Qwen3-8B shape
(1.05B parameters) 12.6 GB of memory traffic per step (6 bytes a parameter each way), a few ms on
an H200. Here the modules hold
the bf16 copies themselves, so neither cast runs; the fp32 masters live beside them, the
optimizer updates the masters from the bf16 gradients and writes the new bf16 copies in the same
pass (`StreamingAdamW(working=...)`).

The numbers are the ones fp32 weights under autocast give: the forward multiplies by
bf16(master), as autocast's cast did, and a weight gradient is the same bf16 matmul result,
widened to fp32 exactly where autograd widened it before: gradients summed over micro-batches
(`after_backward` folds each micro-batch's into an fp32 sum) and over data-parallel drafters
(`fp32_allreduce_hook` reduces in fp32) are fp32 sums, as before. Only matmul weights
(the attention and MLP projections, `fc`) get working copies; norms, and the DFlash 2
convolutions and selector, keep computing from fp32. Checkpoints and exports see the masters
(the module's state_dict and load_state_dict are hooked), so nothing on disk changes.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import torch
import torch.distributed as dist
from torch import Tensor, nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks


class WorkingWeights:
    def __init__(self, drafter: nn.Module, dtype: torch.dtype = torch.bfloat16) -> None:
        """Give `drafter`'s matmul weights working copies in `dtype` (in place: the Parameter objects
        stay, their data becomes the copies) and keep their fp32 values as masters."""
        self.master_of: dict[nn.Parameter, Tensor] = {}
        self._master_by_name: dict[str, Tensor] = {}
        for name, param in _matmul_parameters(drafter):
            master = param.detach().clone()
            param.data = master.to(dtype)
            self.master_of[param] = master
            self._master_by_name[name] = master
        self.working_of = {id(master): param for param, master in self.master_of.items()}
        self._folded = False  # whether the masters hold gradients of earlier micro-batches
        # Functions, not bound methods: torch marks the hook function with an attribute.
        drafter.register_state_dict_post_hook(lambda _, state, prefix, __: self._masters_into(state, prefix))
        drafter.register_load_state_dict_pre_hook(
            lambda _, state, prefix, *__: self._load_masters(state, prefix)
        )

    def optimizer_parameters(self, parameters: Iterator[nn.Parameter]) -> list[Tensor]:
        """The tensors the optimizer updates, in the module's order: masters where there are copies."""
        return [self.master_of.get(param, param) for param in parameters]

    # ------------------------------------------------------------------ gradients

    def after_backward(self, last_of_step: bool, data_parallel: bool) -> None:
        """Fold the micro-batch's bf16 gradients into fp32 sums on the masters, unless the optimizer
        can read them as they are: the step's only micro-batch without data parallelism (the fast
        path), or the last one with it (`fp32_allreduce_hook` folds and reduces them)."""
        if last_of_step and (data_parallel or not self._folded):
            self._folded = False
            return
        for param, master in self.master_of.items():
            if param.grad is None:
                continue
            if master.grad is None:
                master.grad = param.grad.float()
            else:
                master.grad.add_(param.grad)
            param.grad = None
        self._folded = not last_of_step

    # Unannotated bucket and result: DDP compares a hook's annotations with the real classes, and
    # this module's annotations are strings (postponed evaluation).
    def fp32_allreduce_hook(self, group: dist.ProcessGroup | None, bucket):
        """DDP comm hook: the mean over drafters in fp32, as with fp32 weights (divide, then sum).

        A bucket of bf16 gradients is widened and the fp32 sums of earlier micro-batches (on the
        masters) added first; the reduced fp32 values go to the masters' gradients and the bucket
        returns zeros, so the optimizer reads the masters'. fp32 buckets take DDP's default."""
        buffer = bucket.buffer()
        if buffer.dtype == torch.float32:
            return default_hooks.allreduce_hook(group, bucket)
        wide = buffer.float()
        parts = []
        offset = 0
        for param in bucket.parameters():
            part = wide[offset : offset + param.numel()].view_as(param)
            master = self.master_of[param]
            if master.grad is not None:  # sums of earlier micro-batches come first, as autograd added
                part.copy_(master.grad.add_(part))
            parts.append((master, part))
            offset += param.numel()
        wide.div_(dist.get_world_size(group))

        def finish(future: torch.futures.Future) -> Tensor:
            for master, part in parts:
                master.grad = part
            return buffer.zero_()

        return dist.all_reduce(wide, group=group, async_op=True).get_future().then(finish)

    # ------------------------------------------------------------------ the masters elsewhere

    @contextmanager
    def masters_in_place(self) -> Iterator[None]:
        """The module computes with the fp32 masters inside (evaluation without autocast)."""
        working = {param: param.data for param in self.master_of}
        try:
            for param, master in self.master_of.items():
                param.data = master
            yield
        finally:
            for param, data in working.items():
                param.data = data

    def _masters_into(self, state_dict: dict, prefix: str) -> None:
        for name, master in self._master_by_name.items():
            if prefix + name in state_dict:
                state_dict[prefix + name] = master.detach()

    def _load_masters(self, state_dict: dict, prefix: str) -> None:
        with torch.no_grad():
            for name, master in self._master_by_name.items():
                if prefix + name in state_dict:
                    master.copy_(state_dict[prefix + name])


def _matmul_parameters(drafter: nn.Module) -> Iterator[tuple[str, nn.Parameter]]:
    """(state-dict name, parameter) of the nn.Linear modules that only run under autocast's cast to
    bf16: `fc` and every decoder layer's attention and MLP projections."""
    roots = ["fc"] + [
        f"layers.{index}.{part}" for index in range(len(drafter.layers)) for part in ("self_attn", "mlp")
    ]
    for root in roots:
        for name, module in drafter.get_submodule(root).named_modules(prefix=root):
            if isinstance(module, nn.Linear):
                yield from module.named_parameters(prefix=name, recurse=False)
