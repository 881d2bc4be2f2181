"""The XPress fields' checks (model.arch=xpress; docs/drafter.md, XPress), for `validate`."""

from __future__ import annotations

import math
from typing import Any


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def xpress_problems(cfg: Any) -> list[str]:
    """What is wrong with the model.xpress_* fields and num_jacobi_passes when model.arch=xpress."""
    m = cfg.model
    if m.arch != "xpress":
        return []
    problems = []
    for name in ("xpress_rank", "xpress_mlp_ratio"):
        value = getattr(m, name)
        if not (isinstance(value, int) and value >= 1):
            problems.append(
                f"model.{name}={value!r}: must be an integer >= 1 (released checkpoints: 256 and 2)"
            )
    for name, hint in (
        ("num_jacobi_passes", "0 proposes the drafter's own argmax; the released checkpoints use 6"),
        ("xpress_consistency_passes", "0 trains without Jacobi rounds; the reference uses 3"),
    ):
        value = getattr(m, name)
        if not (isinstance(value, int) and value >= 0):
            problems.append(f"model.{name}={value!r}: must be an integer >= 0 ({hint})")
    for name in ("xpress_consistency_weight", "xpress_base_anchor_weight"):
        value = getattr(m, name)
        if not (_number(value) and value >= 0):
            problems.append(f"model.{name}={value!r}: must be a number >= 0 (0 leaves that term out)")
    if not isinstance(m.xpress_base_anchor_full_weight, bool):
        problems.append(
            f"model.xpress_base_anchor_full_weight={m.xpress_base_anchor_full_weight!r}: true or false"
        )
    return problems
