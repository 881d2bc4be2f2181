"""The check of a target's first packed call with two documents in a row (models/packed_target.py).

Structure alone cannot show that documents in a row stay apart: a transformers version whose masks
or position terms ignore the packed positions, a layer that keeps state across documents. So the
in-rows forward runs twice more on that batch, at the same shape (no new compile or graph), and
the documents after each row's first must keep their features.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from dflash_mp.models.packed_rows import document_index

# How far a later document's features may move while nothing it reads changed. With the first
# document changed, the same kernels run at the same offsets (only tiling or MoE grouping may
# differ); moved to the row's start, the offsets differ and bf16 rounding compounds over the layers
# (1-3% on deep random targets). A crossing or a position term off by the document's offset moves
# them by tens of percent.
_UNMOVED = {torch.float32: 1e-4, torch.float64: 1e-8}
_UNMOVED_LOW_PRECISION = {"changed": 2e-2, "moved": 1e-1}


# Packed calls that may find no row with two documents before the check gives up looking.
CALLS_TO_WAIT = 16


class NothingToCheck(Exception):
    """No row of the batch holds two documents."""


def crossing(
    forward: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    input_ids: torch.Tensor,
    document_ids: torch.Tensor,
    features: torch.Tensor,
    vocab_size: int,
) -> str | None:
    """Why documents in the rows are not apart on this decoder, or None when they are, from two
    more calls of `forward` (the in-rows forward) at the same shape. The documents after each row's
    first must keep their `features` (1) with the first document's tokens changed (nothing crosses
    into them) and (2) moved to the row's start, the first document after them (their positions
    restart). Structure alone cannot show this: a transformers version whose masks or position
    terms ignore the packed positions, a layer that keeps state across documents.
    Raises NothingToCheck when no row holds two documents."""
    real = document_ids >= 0
    first = (document_index(document_ids) == 0) & real
    later = real & ~first
    if not bool(later.any()):
        raise NothingToCheck
    changed = torch.where(first, (input_ids + 1) % vocab_size, input_ids)
    error = _moved(forward(changed, document_ids)[later], features[later])
    if error > _unmoved(features.dtype, "changed"):
        return f"the later documents' features moved by {error:.2g} (relative) when only the first document changed"
    # Later documents first, then the first one, then the padding (a stable sort keeps each in order).
    order = torch.sort(torch.where(later, 0, torch.where(first, 1, 2)), dim=1, stable=True).indices
    moved = forward(input_ids.gather(1, order), document_ids.gather(1, order))
    at_start = later.gather(1, order)
    expected = features.gather(1, order[..., None].expand_as(features))
    error = _moved(moved[at_start], expected[at_start])
    if error > _unmoved(features.dtype, "moved"):
        return f"the later documents' features moved by {error:.2g} (relative) at the start of their rows"
    return None


def _unmoved(dtype: torch.dtype, how: str) -> float:
    return _UNMOVED.get(dtype, _UNMOVED_LOW_PRECISION[how])


def _moved(after: torch.Tensor, before: torch.Tensor) -> float:
    before = before.float()
    return float((after.float() - before).norm() / before.norm().clamp_min(torch.finfo(torch.float32).tiny))
