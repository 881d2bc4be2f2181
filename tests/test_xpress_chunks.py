"""XPress's loss runs a chunk of whole blocks at a time, each recomputed in the backward
(objective/xpress_loss.py `xpress_terms`): chunking changes neither the loss, its terms and stats
nor any gradient, and no [rows, V] tensor outlives its chunk."""

from __future__ import annotations

import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from dflash_mp.models.drafter import scale_logits
from dflash_mp.models.xpress import XPressRefiner
from dflash_mp.objective import xpress_loss
from dflash_mp.objective.draft_blocks import DraftBlocks
from dflash_mp.objective.xpress_loss import XPressWeights, xpress_drafter_loss
from tests.test_dspark_rows import _Outputs

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

    output_multiplier, final_logit_softcapping = 1.3, 20.0

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        return scale_logits(head(hidden), self.output_multiplier, self.final_logit_softcapping)


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


def _run(
    weights: XPressWeights, chunk_blocks: int, reference: bool = False, device: str = "cpu"
) -> tuple[torch.Tensor, dict, dict]:
    """(loss, stats + terms, gradients of the hidden states and every refiner parameter) of
    `xpress_drafter_loss`, or (`reference`) of `xpress_terms` over the same blocks through autograd."""
    drafter = Drafter().to(device)
    head, hidden, blocks = _inputs()
    head, hidden = head.to(device), hidden.to(device)
    moved = (blocks.labels.to(device), blocks.weights.to(device), blocks.before_anchor.to(device))
    blocks = blocks._replace(labels=moved[0], weights=moved[1], before_anchor=moved[2])
    hidden.requires_grad_()
    if reference:
        loss, stats = _reference_loss(drafter, hidden, head, blocks, weights, chunk_blocks)
    else:
        loss, stats = xpress_drafter_loss(
            drafter, hidden, head, blocks, weights, chunk_rows=chunk_blocks * BLOCK
        )
    loss.backward()
    grads = {name: p.grad for name, p in drafter.refiner_head.named_parameters()}
    return loss, stats, {"hidden": hidden.grad, **grads}


def _reference_loss(drafter, hidden, head, blocks, weights, chunk_blocks):
    """`xpress_terms` (checkpointed chunks, autograd) on what `xpress_drafter_loss` reads."""
    flat = (-1, BLOCK)
    mask = blocks.weights > 0
    loss, terms, correct = xpress_loss.xpress_terms(
        drafter.refiner_head,
        hidden.reshape(-1, BLOCK, HIDDEN),
        hidden.reshape(-1, BLOCK, HIDDEN),
        blocks.labels.reshape(flat),
        blocks.before_anchor.reshape(-1),
        mask.reshape(flat),
        torch.where(mask, blocks.weights, 0.0).reshape(flat),
        weights,
        to_logits=lambda h: drafter.logits(h, lambda x: F.linear(x, head)),
        chunk_blocks=chunk_blocks,
    )
    packed = torch.stack([terms.get(name, torch.zeros(())) for name in xpress_loss.XPRESS_TERMS])
    stats = {"correct": correct.sum(0), "count": mask.reshape(flat).sum(0), "xpress": packed}
    return loss, stats


WEIGHTS = [
    XPressWeights(),
    XPressWeights(dpace_alpha=0.4),
    XPressWeights(0.5, 2, 0.25, base_anchor_full_weight=True),
    XPressWeights(0.3, 3, 0.6, base_anchor_full_weight=True, dpace_alpha=0.4),
    XPressWeights(0.0, 3, 0.0),
]
IDS = ["decay", "dpace", "full-anchor", "full-anchor-dpace", "tf-only"]


@pytest.mark.parametrize("weights", WEIGHTS, ids=IDS)
def test_the_loss_and_its_gradients_equal_the_autograd_reference(weights: XPressWeights) -> None:
    """The gradient taken in the forward (objective/xpress_rows.py) against autograd through
    `xpress_terms` (tests/test_xpress_parity.py holds that equal to speculators' XPress)."""
    loss, stats, grads = _run(weights, chunk_blocks=CHUNK)
    ref_loss, ref_stats, ref_grads = _run(weights, chunk_blocks=CHUNK, reference=True)
    torch.testing.assert_close(loss, ref_loss, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(stats["xpress"], ref_stats["xpress"], rtol=1e-6, atol=1e-6)
    for key in ("correct", "count"):
        assert torch.equal(stats[key], ref_stats[key]), key
    for name, grad in ref_grads.items():
        assert grad is not None and grads[name] is not None, name
        assert grad.abs().max() > 0, name
        torch.testing.assert_close(grads[name], grad, rtol=1e-4, atol=1e-6, msg=lambda m, n=name: f"{n}: {m}")


@pytest.mark.parametrize("weights", WEIGHTS[:2], ids=IDS[:2])
def test_chunks_equal_one_chunk(weights: XPressWeights) -> None:
    blocks = BATCH * ANCHORS
    one_loss, one_stats, one_grads = _run(weights, chunk_blocks=blocks)
    loss, stats, grads = _run(weights, chunk_blocks=CHUNK)
    # Each term sums the chunks' per-position CE at once: the unchunked sum, to the bit.
    torch.testing.assert_close(loss, one_loss, rtol=0, atol=0)
    for key in ("correct", "count", "weight_sum", "xpress"):
        torch.testing.assert_close(stats[key], one_stats[key], rtol=0, atol=0)
    # Gradients accumulate over chunks: a different order of the same sums.
    for name, grad in one_grads.items():
        torch.testing.assert_close(grads[name], grad, rtol=0, atol=1e-6)
    with torch.no_grad():  # and without a gradient the same value
        drafter, (head, hidden, draft) = Drafter(), _inputs()
        no_grad_loss, _ = xpress_drafter_loss(drafter, hidden, head, draft, weights, chunk_rows=CHUNK * BLOCK)
    torch.testing.assert_close(no_grad_loss, one_loss, rtol=0, atol=0)


def test_the_loss_copies_no_host_scalar_to_the_device(monkeypatch) -> None:
    """On CUDA a tensor made from host data is a pageable copy that waits for the GPU's queue: the
    loss fills its scalars on the device instead."""
    made = []
    for name in ("tensor", "as_tensor"):
        original = getattr(torch, name)
        monkeypatch.setattr(torch, name, lambda *a, _o=original, **k: made.append(a) or _o(*a, **k))
    _run(WEIGHTS[3], chunk_blocks=CHUNK)
    assert made == []


def test_the_refiner_runs_one_graph_for_every_pass_of_every_chunk(monkeypatch) -> None:
    """Each pass's latent runs without a graph and one batched recompute takes all their gradients:
    one dense embedding gradient a step, not one per pass and chunk (each a [V, r] fp32 sum)."""
    calls = []
    original = XPressRefiner.latent

    def latent(self, prev_ids, cache):
        calls.append((torch.is_grad_enabled(), prev_ids.shape[0]))
        return original(self, prev_ids, cache)

    monkeypatch.setattr(XPressRefiner, "latent", latent)
    weights = WEIGHTS[3]  # 3 Jacobi rounds: 4 biased passes per chunk
    _run(weights, chunk_blocks=CHUNK)
    with_graph = [blocks for grad, blocks in calls if grad]
    passes = 1 + weights.consistency_passes
    assert with_graph == [passes * BATCH * ANCHORS], calls
    assert len(calls) == passes * 4 + 1  # 4 chunks (3+3+3+1 blocks), then the batched recompute


def test_no_vocabulary_tensor_is_kept_for_the_backward(monkeypatch) -> None:
    saved = []

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss, _, _ = _run(XPressWeights(), chunk_blocks=CHUNK)
    # The [rows, V] logits live only while their chunk runs; the readout's gradient is [V, r].
    assert saved and not any(shape and shape[-1] == VOCAB for shape in saved), saved
    assert loss.item() > 0
    # Autograd through the passes (the reference without checkpoints) keeps them: the check can tell.
    monkeypatch.setattr(xpress_loss, "checkpoint", lambda fn, *args, **_: fn(*args))
    saved.clear()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        _run(XPressWeights(), chunk_blocks=BATCH * ANCHORS, reference=True)
    assert any(shape and shape[-1] == VOCAB for shape in saved)


@pytest.mark.parametrize("fault", [None, "raises", "disagrees"])
def test_the_first_fused_chunk_is_checked_against_the_torch_path(monkeypatch, caplog, fault) -> None:
    """The process's first fused chunk runs beside the torch path, whose numbers it keeps. A fused
    path that raises or disagrees is turned off with one warning; one that agrees takes the later
    chunks. Its try wrote over its raw logits and into scratch sums: neither reaches the result."""
    from dflash_mp.objective import xpress_rows, xpress_vocabulary

    expected = _run(XPressWeights(), chunk_blocks=CHUNK)
    monkeypatch.setattr(xpress_rows, "_fused_error", None)
    monkeypatch.setattr(xpress_rows, "_fused_tried", False)
    monkeypatch.setattr(xpress_rows, "vocabulary_kernels_run_on", lambda device: True)
    calls = []

    class Fused(xpress_vocabulary.TorchVocabulary):
        """The torch path standing in for the kernels, writing over the raw logits as they do."""

        def raw_gradient(self, dz):
            calls.append(1)
            grad = super().raw_gradient(dz)
            self.raw.fill_(float("nan"))
            if fault == "raises":
                raise RuntimeError("no compiler")
            return grad * 1.1 if fault == "disagrees" else grad

    monkeypatch.setattr(xpress_rows, "FusedVocabulary", Fused)
    with caplog.at_level("WARNING", logger=xpress_rows.__name__):
        got = _run(XPressWeights(), chunk_blocks=CHUNK)
    warnings = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(calls) == (1 if fault else 4)  # four chunks: the checked one, then fused or not
    assert len(warnings) == (1 if fault else 0)
    if fault:
        assert ("no compiler" if fault == "raises" else "differs") in xpress_rows._fused_error
        assert "torch path from now on" in warnings[0]
    else:
        assert xpress_rows._fused_error is None
    torch.testing.assert_close(got[0], expected[0], rtol=0, atol=0)
    for name, grad in expected[2].items():
        torch.testing.assert_close(got[2][name], grad, rtol=0, atol=0, msg=lambda m, n=name: f"{n}: {m}")


def test_under_autocast_the_loss_runs_in_bf16_without_an_fp32_head() -> None:
    """Training's setting: bf16 autocast, fp32 hidden states, the frozen head in bf16. The head is
    never copied to fp32, and the loss and gradients are autograd's through `xpress_terms` within
    bf16's rounding."""
    results = []
    for reference in (False, True):
        drafter = Drafter()
        head, hidden, blocks = _inputs()
        head = head.bfloat16()
        hidden.requires_grad_()
        with torch.autocast("cpu", dtype=torch.bfloat16), _Outputs() as outputs:
            if reference:
                loss, _ = _reference_loss(drafter, hidden, head, blocks, XPressWeights(), CHUNK)
            else:
                loss, _ = xpress_drafter_loss(
                    drafter, hidden, head, blocks, XPressWeights(), chunk_rows=CHUNK * BLOCK
                )
        if not reference:
            assert ((VOCAB, HIDDEN), torch.float32) not in outputs.seen
        loss.backward()
        results.append((loss.detach(), hidden.grad, drafter.refiner_head.readout.weight.grad))
    (loss, hidden_grad, readout_grad), (ref_loss, ref_hidden, ref_readout) = results
    assert torch.isfinite(loss) and loss > 0
    torch.testing.assert_close(loss, ref_loss, rtol=2e-2, atol=0)
    for got, expected in ((hidden_grad, ref_hidden), (readout_grad, ref_readout)):
        error = (got - expected).norm() / expected.norm()
        assert error < 3e-2, error
