"""XPress's loss runs a chunk of whole blocks at a time, each recomputed in the backward
(objective/xpress_loss.py `xpress_terms`): chunking changes neither the loss, its terms and stats
nor any gradient, and no [rows, V] tensor outlives its chunk."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from dflash_mp.models.drafter import scale_logits
from dflash_mp.models.xpress import XPressRefiner
from dflash_mp.objective import xpress_loss
from dflash_mp.objective.draft_blocks import DraftBlocks
from dflash_mp.objective.xpress_loss import XPressWeights, xpress_drafter_loss

VOCAB, HIDDEN, BLOCK, BATCH, ANCHORS, RANK, CHUNK = 301, 12, 4, 2, 5, 6, 3  # 10 blocks: chunks 3+3+3+1


class Drafter(nn.Module):
    """What `xpress_drafter_loss` reads of a drafter: its refiner and its logit scaling."""

    def __init__(self) -> None:
        super().__init__()
        self.refiner_head = XPressRefiner(HIDDEN, VOCAB, BLOCK, RANK, mlp_ratio=2)
        generator = torch.Generator().manual_seed(0)
        with torch.no_grad():  # every parameter random, the mixer too (its init is zero)
            for parameter in self.refiner_head.parameters():
                parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return scale_logits(head(hidden), 1.3, 20.0)


def _inputs() -> tuple[torch.Tensor, torch.Tensor, DraftBlocks]:
    g = torch.Generator().manual_seed(1)
    head = torch.randn(VOCAB, HIDDEN, generator=g)  # frozen, as the target's
    hidden = torch.randn(BATCH, ANCHORS * BLOCK, HIDDEN, generator=g)
    labels = torch.randint(0, VOCAB, (BATCH, ANCHORS, BLOCK), generator=g)
    scored = torch.rand(BATCH, ANCHORS, BLOCK, generator=g) < 0.7
    scored[..., 0] = False
    scored[0, 1] = False  # a block with nothing scored
    weights = torch.exp(-torch.arange(BLOCK).float() / 3.0) * scored
    before = torch.randint(0, VOCAB, (BATCH, ANCHORS), generator=g)
    return head, hidden, DraftBlocks(None, None, labels, weights, None, before_anchor=before)


def _run(weights: XPressWeights, chunk_blocks: int) -> tuple[torch.Tensor, dict, dict]:
    """(loss, stats + terms, gradients of the hidden states and every refiner parameter)."""
    drafter = Drafter()
    head, hidden, blocks = _inputs()
    hidden.requires_grad_()
    loss, stats = xpress_drafter_loss(drafter, hidden, head, blocks, weights, chunk_blocks=chunk_blocks)
    loss.backward()
    grads = {name: p.grad for name, p in drafter.refiner_head.named_parameters()}
    return loss, stats, {"hidden": hidden.grad, **grads}


WEIGHTS = [
    XPressWeights(),
    XPressWeights(dpace_alpha=0.4),
    XPressWeights(0.5, 2, 0.25, base_anchor_full_weight=True),
    XPressWeights(0.3, 3, 0.6, base_anchor_full_weight=True, dpace_alpha=0.4),
    XPressWeights(0.0, 3, 0.0),
]


@pytest.mark.parametrize(
    "weights", WEIGHTS, ids=["decay", "dpace", "full-anchor", "full-anchor-dpace", "tf-only"]
)
def test_chunks_equal_one_chunk(monkeypatch, weights: XPressWeights) -> None:
    blocks = BATCH * ANCHORS
    one_loss, one_stats, one_grads = _run(weights, chunk_blocks=blocks)
    loss, stats, grads = _run(weights, chunk_blocks=CHUNK)
    # Each term sums the chunks' per-position CE at once: the unchunked sum, to the bit.
    torch.testing.assert_close(loss, one_loss, rtol=0, atol=0)
    for key in ("correct", "count", "weight_sum", "xpress"):
        torch.testing.assert_close(stats[key], one_stats[key], rtol=0, atol=0)
    # Gradients accumulate over chunks: a different order of the same sums.
    for name, grad in one_grads.items():
        assert grad is not None and grads[name] is not None, name
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6)
    # Checkpointing changes nothing either: plain autograd over every block.
    monkeypatch.setattr(xpress_loss, "checkpoint", lambda fn, *args, **_: fn(*args))
    plain_loss, _, plain_grads = _run(weights, chunk_blocks=blocks)
    torch.testing.assert_close(plain_loss, one_loss, rtol=0, atol=0)
    for name, grad in plain_grads.items():
        torch.testing.assert_close(grad, one_grads[name], rtol=0, atol=1e-6)
    with torch.no_grad():  # and without a gradient the chunks run as they are
        drafter, (head, hidden, draft) = Drafter(), _inputs()
        no_grad_loss, _ = xpress_drafter_loss(drafter, hidden, head, draft, weights, chunk_blocks=CHUNK)
    torch.testing.assert_close(no_grad_loss, one_loss, rtol=0, atol=0)


def test_no_vocabulary_tensor_outlives_its_chunk(monkeypatch) -> None:
    seen = []
    original = xpress_loss._chunk_terms

    def recording(refiner, to_logits, base, *args):
        seen.append(base.shape[0])
        return original(refiner, to_logits, base, *args)

    monkeypatch.setattr(xpress_loss, "_chunk_terms", recording)
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _, _ = _run(XPressWeights(), chunk_blocks=CHUNK)
    # Forward, then each chunk recomputed in the backward: never more than CHUNK blocks at once.
    assert seen[:4] == [3, 3, 3, 1] and sorted(seen[4:]) == [1, 3, 3, 3] and max(seen) == CHUNK
    # Outside the chunks the graph keeps nothing the vocabulary's size (the checkpoints keep
    # only their inputs): the [rows, V] logits live only while their chunk runs.
    assert saved and not any(shape and shape[-1] == VOCAB for shape in saved), saved
    assert loss.item() > 0
    # Without checkpointing the same hook sees every pass's logits: the check can tell.
    monkeypatch.setattr(xpress_loss, "checkpoint", lambda fn, *args, **_: fn(*args))
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _run(XPressWeights(), chunk_blocks=CHUNK)
    assert any(shape and shape[-1] == VOCAB for shape in saved)
