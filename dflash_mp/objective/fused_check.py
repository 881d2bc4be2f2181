"""The check of a process's first fused chunk against the torch path (DSpark's and XPress's losses).

The Triton kernels are tested under Triton's interpreter on the CPU; compiled for a device they
could still go wrong, and a wrong gradient trains silently. So the first chunk runs both ways, keeps
the torch path's numbers, and a fused path that stands off them (or raises) turns itself off with a
warning, and is listed in `slow_paths`: the trainer's metrics record and the progress line name it
for the rest of the run, since the torch path takes about twice the step.
"""

from __future__ import annotations

import logging

import torch
from torch import Tensor

# How far the fused numbers may stand from the torch path's: the kernels round their gradients to
# the logits' dtype (bf16 in training) at another point; a wrong kernel is off by far more.
FUSED_AGREES = 1e-2


def relative_error(actual: Tensor, expected: Tensor) -> float:
    expected = expected.float()
    return float(
        (actual.float() - expected).norm() / expected.norm().clamp_min(torch.finfo(torch.float32).tiny)
    )


def disagreement(pairs: list[tuple[Tensor, Tensor]]) -> str | None:
    """None where every (fused, torch) pair agrees within `FUSED_AGREES`, else what to warn of."""
    error = max(relative_error(mine, theirs) for mine, theirs in pairs)
    if error <= FUSED_AGREES:
        return None
    return f"its first chunk differs from the torch path's by {error:.2g} (relative)"


_slow_paths: dict[str, str] = {}  # what turned itself off in this process: why


def turn_off(name: str, problem: str, log: logging.Logger) -> None:
    """Warn that `name` (e.g. "XPress's fused loss kernels") runs its torch path from now on, and
    list it in `slow_paths`."""
    _slow_paths[name] = problem
    log.warning("%s are off, the torch path from now on: %s", name, problem)


def slow_paths() -> dict[str, str]:
    """{name: why} of every fused path this process turned off."""
    return dict(_slow_paths)
