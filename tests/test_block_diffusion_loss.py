"""Checks of the DFlash loss against slow, obviously-correct references: the decay-weighted CE, its
chunked form and the drafter loss (anchors and masks: test_block_diffusion.py)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from dflash_mp.objective.block_diffusion import drafter_loss
from dflash_mp.objective.draft_blocks import sample_anchors
from dflash_mp.objective.lm_head_loss import chunked_lm_head_loss, decay_weighted_ce, per_position_accuracy
from tests.block_problems import (
    BLOCK,
    COMPILED_FLEX_ATTENTION,
    HIDDEN,
    MASK_ID,
    NUM_FEATURE_LAYERS,
    VOCAB,
    loss_problem,
    make_sequences,
)

# flex_attention in eager mode (CPU) warns that it is unfused; that is expected in these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


# ----------------------------------------------------------------------------- loss


def test_decay_weighted_ce_matches_loop_reference() -> None:
    hidden, head, labels, weights = loss_problem(requires_grad=False)
    logits = (hidden @ head.T).view(2, 5, BLOCK, VOCAB)
    logits[0, 0, 1, int(labels[0, 0, 1])] += 100.0  # force at least one correct prediction
    weights[0, 0, 1] = 1.0
    loss, stats = decay_weighted_ce(logits, labels, weights)
    total, weight_sum = 0.0, 0.0
    correct, count = [0] * BLOCK, [0] * BLOCK
    for b, n, k in torch.cartesian_prod(torch.arange(2), torch.arange(5), torch.arange(BLOCK)).tolist():
        w = float(weights[b, n, k])
        row = logits[b, n, k].double()
        total += w * float(torch.logsumexp(row, 0) - row[labels[b, n, k]])
        weight_sum += w
        if w > 0:
            count[k] += 1
            correct[k] += int(row.argmax() == labels[b, n, k])
    assert loss.item() == pytest.approx(total / weight_sum, rel=1e-5)
    assert stats["correct"].tolist() == correct and stats["count"].tolist() == count
    assert sum(correct) > 0
    assert stats["weight_sum"].item() == pytest.approx(weight_sum, rel=1e-6)
    accuracy = per_position_accuracy(stats["correct"], stats["count"])
    assert accuracy == pytest.approx([c / max(n, 1) for c, n in zip(correct[1:], count[1:], strict=True)])


@pytest.mark.parametrize("chunk_tokens", [1, 7, 4096])
def test_chunked_loss_matches_unchunked(chunk_tokens: int) -> None:
    hidden, head, labels, weights = loss_problem()
    loss, stats = decay_weighted_ce((hidden @ head.T).view(2, 5, BLOCK, VOCAB), labels, weights)
    hidden_grad, head_grad = torch.autograd.grad(loss, (hidden, head))
    chunked, chunked_stats = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=chunk_tokens)
    chunked_hidden_grad, chunked_head_grad = torch.autograd.grad(chunked, (hidden, head))
    torch.testing.assert_close(chunked, loss)
    for name in ("correct", "count", "weight_sum"):
        torch.testing.assert_close(chunked_stats[name], stats[name])
    torch.testing.assert_close(chunked_hidden_grad, hidden_grad)
    torch.testing.assert_close(chunked_head_grad, head_grad)
    assert (chunked_hidden_grad.view(2, 5, BLOCK, HIDDEN)[weights == 0] == 0).all()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize(("multiplier", "softcap"), [(1.0, None), (0.5, 30.0)])
def test_the_eager_ce_and_gradient_are_the_compiled_expressions_to_the_bit(
    dtype: torch.dtype, multiplier: float, softcap: float | None
) -> None:
    """The CPU path's fewer passes (`_ce_and_grad_eager`) give exactly `_ce_and_grad`'s numbers."""
    from dflash_mp.objective.lm_head_loss import _ce_and_grad, _ce_and_grad_eager

    generator = torch.Generator().manual_seed(0)
    logits = (torch.randn(13, 1000, generator=generator) * 3).to(dtype)
    labels, scale = torch.randint(0, 1000, (13,), generator=generator), torch.rand(13, generator=generator)
    expected = _ce_and_grad(logits, labels, scale, multiplier, softcap)
    for got, want in zip(
        _ce_and_grad_eager(logits, labels, scale, multiplier, softcap), expected, strict=True
    ):
        assert got.dtype == want.dtype and torch.equal(got, want)


def test_chunked_loss_has_static_shapes_and_never_reads_the_device() -> None:
    hidden, head, labels, weights = (t.detach().to("meta") for t in loss_problem())
    hidden.requires_grad_(True)
    loss, stats = chunked_lm_head_loss(hidden, head, labels, weights, chunk_tokens=7)
    (hidden_grad,) = torch.autograd.grad(loss, hidden)
    assert loss.shape == () and hidden_grad.shape == hidden.shape
    assert stats["correct"].shape == stats["count"].shape == (BLOCK,)


def test_zero_weight_batch_gives_zero_loss_and_a_working_backward() -> None:
    hidden, head, labels, weights = loss_problem()
    weights.zero_()
    for loss, stats in (
        decay_weighted_ce((hidden @ head.T).view(2, 5, BLOCK, VOCAB), labels, weights),
        chunked_lm_head_loss(hidden, head, labels, weights),
    ):
        assert loss.item() == 0.0
        hidden_grad, head_grad = torch.autograd.grad(loss, (hidden, head), allow_unused=False)
        assert torch.isfinite(hidden_grad).all() and (hidden_grad == 0).all() and (head_grad == 0).all()
        assert stats["count"].sum() == 0
        assert per_position_accuracy(stats["correct"], stats["count"]) == [0.0] * (BLOCK - 1)


# ----------------------------------------------------------------------------- drafter_loss


class StandInDrafter(nn.Module):
    """One attention layer with the drafter's forward signature; keeps its last output for tests."""

    def __init__(
        self, block_size: int = BLOCK, mask_token_id: int = MASK_ID, max_positions: int = 128
    ) -> None:
        super().__init__()
        self.block_size, self.mask_token_id = block_size, mask_token_id
        self.fc = nn.Linear(NUM_FEATURE_LAYERS * HIDDEN, HIDDEN, bias=False)
        self.position = nn.Embedding(max_positions, HIDDEN)
        self.q, self.k, self.v = (nn.Linear(HIDDEN, HIDDEN) for _ in range(3))
        self.last_output: Tensor | None = None

    def forward(
        self,
        context_features: Tensor,
        block_embeddings: Tensor,
        context_positions: Tensor,
        block_positions: Tensor,
        mask: Tensor | BlockMask,
    ) -> Tensor:
        context = self.fc(context_features) + self.position(context_positions)
        blocks = block_embeddings + self.position(block_positions)
        keys_in = torch.cat([context, blocks], dim=1)
        heads = [
            x.unflatten(-1, (2, HIDDEN // 2)).transpose(1, 2)
            for x in (self.q(blocks), self.k(keys_in), self.v(keys_in))
        ]
        if isinstance(mask, BlockMask):
            # Eager flex_attention is a forward-only reference; CUDA runs the compiled kernel.
            attend = COMPILED_FLEX_ATTENTION if blocks.is_cuda else flex_attention
            attended = attend(*heads, block_mask=mask)
        else:
            attended = F.scaled_dot_product_attention(*heads, attn_mask=mask)
        self.last_output = blocks + attended.transpose(1, 2).flatten(2)
        return self.last_output


def drafter_problem(seed: int = 0) -> tuple[StandInDrafter, Tensor, Tensor, SimpleNamespace]:
    torch.manual_seed(seed)
    input_ids, loss_mask, lengths = make_sequences([40, 31], seq_len=40, seed=seed)
    batch = SimpleNamespace(
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        sample_ids=torch.tensor([100, 101]),
        epoch=2,
        hidden_states=torch.randn(2, 40, NUM_FEATURE_LAYERS * HIDDEN, requires_grad=True),
    )
    return StandInDrafter(), torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN), batch


def drafter_problem_on_cuda(seed: int) -> tuple[StandInDrafter, Tensor, Tensor, SimpleNamespace]:
    drafter, embed, head, batch = drafter_problem(seed)
    batch = SimpleNamespace(
        **{k: v.detach().cuda() if isinstance(v, Tensor) else v for k, v in vars(batch).items()}
    )
    return drafter.cuda(), embed.cuda(), head.cuda(), batch


LOSS_ARGS = {"seed": 3, "num_anchors": 6, "gamma": 7.0}


def test_drafter_loss_sees_no_context_at_or_after_any_anchor() -> None:
    drafter, embed, head, batch = drafter_problem()
    loss, stats = drafter_loss(drafter, embed, head, batch, attention="sdpa", **LOSS_ARGS)
    (feature_grad,) = torch.autograd.grad(loss, batch.hidden_states)
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, 3, 6)
    assert stats["count"].sum() > 0
    for row in range(2):
        last_anchor = int(anchors[row][valid[row]].max())
        # The last block sees features < its anchor, nothing sees the anchor's own features or later.
        assert (feature_grad[row, last_anchor:] == 0).all()
        assert (feature_grad[row, last_anchor - 1] != 0).any()


def test_drafter_blocks_do_not_leak_into_each_other() -> None:
    drafter, embed, head, batch = drafter_problem()
    anchors, valid = sample_anchors(batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, 3, 6)
    assert valid[0, :3].all()
    earlier, block, later = (slice(n * BLOCK, (n + 1) * BLOCK) for n in range(3))  # blocks 0, 1, 2 of row 0
    anchor = int(anchors[0, 1])
    with torch.no_grad():
        drafter_loss(drafter, embed, head, batch, attention="sdpa", **LOSS_ARGS)
        reference = drafter.last_output.clone()

        # The future: target features at and after the anchor, tokens after it (later blocks' inputs).
        future = SimpleNamespace(**vars(batch))
        future.hidden_states = batch.hidden_states.clone()
        future.hidden_states[0, anchor:] += 1.0
        future.input_ids = batch.input_ids.clone()
        future.input_ids[0, anchor + 1 :] = (batch.input_ids[0, anchor + 1 :] + 1) % (VOCAB - 1)
        drafter_loss(drafter, embed, head, future, attention="sdpa", **LOSS_ARGS)
        torch.testing.assert_close(drafter.last_output[0, block], reference[0, block])
        assert not torch.allclose(drafter.last_output[0, later], reference[0, later], atol=1e-3)

        # Another block's own token (an earlier anchor's), its context features unchanged.
        other = SimpleNamespace(**vars(batch))
        other.input_ids = batch.input_ids.clone()
        other.input_ids[0, anchors[0, 0]] = (batch.input_ids[0, anchors[0, 0]] + 1) % (VOCAB - 1)
        drafter_loss(drafter, embed, head, other, attention="sdpa", **LOSS_ARGS)
        torch.testing.assert_close(drafter.last_output[0, block], reference[0, block])
        assert not torch.allclose(drafter.last_output[0, earlier], reference[0, earlier], atol=1e-3)


def test_drafter_loss_flex_matches_sdpa_on_cpu_forward() -> None:
    drafter, embed, head, batch = drafter_problem(seed=1)
    with torch.no_grad():
        sdpa_loss, sdpa_stats = drafter_loss(drafter, embed, head, batch, attention="sdpa", **LOSS_ARGS)
        flex_loss, flex_stats = drafter_loss(drafter, embed, head, batch, attention="flex", **LOSS_ARGS)
    torch.testing.assert_close(flex_loss, sdpa_loss)
    assert torch.equal(flex_stats["count"], sdpa_stats["count"])
    with pytest.raises(ValueError, match="attention"):
        drafter_loss(drafter, embed, head, batch, attention="auto", **LOSS_ARGS)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_drafter_loss_flex_matches_sdpa_on_cuda_with_gradients() -> None:
    drafter, embed, head, batch = drafter_problem_on_cuda(seed=2)
    results = {}
    for attention in ("sdpa", "flex"):
        loss, _ = drafter_loss(drafter, embed, head, batch, attention=attention, **LOSS_ARGS)
        results[attention] = (loss, torch.autograd.grad(loss, list(drafter.parameters())))
    torch.testing.assert_close(results["flex"][0], results["sdpa"][0], atol=1e-4, rtol=1e-4)
    for flex_grad, sdpa_grad in zip(results["flex"][1], results["sdpa"][1], strict=True):
        torch.testing.assert_close(flex_grad, sdpa_grad, atol=1e-4, rtol=1e-4)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_anchors_on_cuda_equal_anchors_on_cpu() -> None:
    _, loss_mask, lengths = make_sequences([40, 33, 25], seq_len=40)
    ids = torch.tensor([10, 2**40 + 11, 12])
    on_cpu = sample_anchors(loss_mask, lengths, ids, epoch=3, seed=7, num_anchors=6)
    on_cuda = sample_anchors(loss_mask.cuda(), lengths.cuda(), ids.cuda(), epoch=3, seed=7, num_anchors=6)
    for cpu_tensor, cuda_tensor in zip(on_cpu, on_cuda, strict=True):
        assert torch.equal(cuda_tensor.cpu(), cpu_tensor)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_bf16_chunked_loss_matches_fp32_reference_on_cuda() -> None:
    hidden, head, labels, weights = loss_problem(requires_grad=False)
    hidden = hidden.cuda().requires_grad_(True)
    head, labels, weights = head.cuda(), labels.cuda(), weights.cuda()
    loss, stats = decay_weighted_ce((hidden @ head.T).view(2, 5, BLOCK, VOCAB), labels, weights)
    (hidden_grad,) = torch.autograd.grad(loss, hidden)
    hidden_bf16 = hidden.detach().bfloat16().requires_grad_(True)
    chunked, chunked_stats = chunked_lm_head_loss(
        hidden_bf16, head.bfloat16(), labels, weights, chunk_tokens=7
    )
    (chunked_grad,) = torch.autograd.grad(chunked, hidden_bf16)
    torch.testing.assert_close(chunked, loss, atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(chunked_grad.float(), hidden_grad, atol=2e-2, rtol=5e-2)
    assert torch.equal(chunked_stats["count"], stats["count"])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_a_warm_compiled_drafter_micro_step_never_waits_on_the_gpu() -> None:
    drafter, embed, head, batch = drafter_problem_on_cuda(seed=3)
    for warm in (True, False):
        # The first call compiles (which may synchronise); the second must not read the GPU back.
        torch.cuda.set_sync_debug_mode("warn" if warm else "error")
        try:
            loss, stats = drafter_loss(drafter, embed, head, batch, attention="flex", **LOSS_ARGS)
            loss.backward()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    assert torch.isfinite(loss).item() and stats["count"].sum().item() > 0
