"""Checks of the DFlash training math against slow, obviously-correct references."""

from __future__ import annotations

import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from dflash_mp.kernels.block_mask import block_mask_mod, dense_block_mask, flex_block_mask
from dflash_mp.objective.block_diffusion import (
    chunked_lm_head_loss,
    decay_weighted_ce,
    drafter_loss,
    per_position_accuracy,
)
from dflash_mp.objective.draft_blocks import block_inputs, block_labels, context_positions, sample_anchors

VOCAB, HIDDEN, NUM_FEATURE_LAYERS, BLOCK, MASK_ID = 50, 32, 2, 4, 49

COMPILED_FLEX_ATTENTION = torch.compile(flex_attention)

# flex_attention in eager mode (CPU) warns that it is unfused; that is expected in these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


def make_sequences(lengths: list[int], seq_len: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ids and a loss mask with a prompt, then response/non-response stretches."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (len(lengths), seq_len), generator=generator)
    loss_mask = torch.zeros(len(lengths), seq_len, dtype=torch.uint8)
    for row, length in enumerate(lengths):
        loss_mask[row, length // 3 : length] = 1
        loss_mask[row, length // 2 : length // 2 + 2] = 0  # a second turn's user tokens
        input_ids[row, length:] = 0
    return input_ids, loss_mask, torch.tensor(lengths)


def eligible_anchors(loss_mask: Tensor, row: int, length: int) -> list[int]:
    """Response positions with context before them whose next token is a response token too."""
    return [p for p in range(1, length - 1) if loss_mask[row, p] and loss_mask[row, p + 1]]


def brute_force_mask(anchors: Tensor, context_len: int, block_size: int) -> Tensor:
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    mask = torch.zeros(batch, 1, num_queries, context_len + num_queries, dtype=torch.bool)
    for b in range(batch):
        for q in range(num_queries):
            for kv in range(context_len + num_queries):
                block = q // block_size
                if kv < context_len:
                    mask[b, 0, q, kv] = kv < int(anchors[b, block])
                else:
                    mask[b, 0, q, kv] = (kv - context_len) // block_size == block
    return mask


def random_anchors(batch: int, num_anchors: int, context_len: int, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, context_len - 1, (batch, num_anchors), generator=generator).sort(-1).values
    anchors[:, -2:] = 0  # invalid slots
    return anchors


# ----------------------------------------------------------------------------- anchors


def test_anchors_depend_only_on_seed_epoch_and_sample() -> None:
    input_ids, loss_mask, lengths = make_sequences([40, 33, 25], seq_len=40)
    ids = torch.tensor([10, 11, 12])
    anchors, valid = sample_anchors(loss_mask, lengths, ids, epoch=3, seed=7, num_anchors=6)
    again, _ = sample_anchors(loss_mask, lengths, ids, epoch=3, seed=7, num_anchors=6)
    assert torch.equal(anchors, again)
    # Sample 12 and 10 again, in another order, another batch width (more padding).
    regrouped_mask = F.pad(loss_mask[[2, 0]], (0, 9))
    regrouped, regrouped_valid = sample_anchors(
        regrouped_mask, lengths[[2, 0]], ids[[2, 0]], epoch=3, seed=7, num_anchors=6
    )
    assert torch.equal(regrouped, anchors[[2, 0]])
    assert torch.equal(regrouped_valid, valid[[2, 0]])
    next_epoch, _ = sample_anchors(loss_mask, lengths, ids, epoch=4, seed=7, num_anchors=6)
    other_seed, _ = sample_anchors(loss_mask, lengths, ids, epoch=3, seed=8, num_anchors=6)
    assert not torch.equal(next_epoch, anchors)
    assert not torch.equal(other_seed, anchors)


def test_anchors_are_eligible_sorted_distinct_and_as_many_as_possible() -> None:
    input_ids, loss_mask, lengths = make_sequences([40, 12, 30, 6], seq_len=40)
    loss_mask[2] = 0  # a sequence with no response: no anchors at all
    loss_mask[3, :6] = 1  # all response: only 1..4 are eligible (0 has no context, 5 no response after it)
    anchors, valid = sample_anchors(
        loss_mask, lengths, torch.tensor([0, 1, 2, 3]), epoch=0, seed=0, num_anchors=8
    )
    assert anchors.shape == valid.shape == (4, 8)
    for row in range(4):
        length = int(lengths[row])
        eligible = set(eligible_anchors(loss_mask, row, length))
        count = int(valid[row].sum())
        assert count == min(8, len(eligible))
        assert valid[row, :count].all() and not valid[row, count:].any()
        chosen = anchors[row, :count].tolist()
        assert chosen == sorted(set(chosen))
        assert set(chosen) <= eligible
        assert (anchors[row, count:] == 0).all()
    assert 0 < int(valid[1].sum()) < 8  # the short sequence really had fewer eligible than N
    assert anchors[3, :4].tolist() == [1, 2, 3, 4]


def test_anchors_cover_every_eligible_position_across_epochs() -> None:
    _, loss_mask, lengths = make_sequences([40], seq_len=40)
    eligible = set(eligible_anchors(loss_mask, 0, 40))
    seen: set[int] = set()
    for epoch in range(60):
        anchors, valid = sample_anchors(loss_mask, lengths, torch.tensor([5]), epoch, seed=1, num_anchors=4)
        seen |= set(anchors[valid].tolist())
    assert seen == eligible


def test_no_anchor_on_a_turn_final_token() -> None:
    """A turn's last response token (its end-of-turn) has nothing of its turn left to predict."""
    loss_mask = torch.zeros(1, 30, dtype=torch.uint8)
    loss_mask[0, 5:12] = 1  # first answer, <|im_end|> at 11
    loss_mask[0, 18:30] = 1  # second answer, <|im_end|> at 29 (the last token)
    seen: set[int] = set()
    for epoch in range(200):
        anchors, valid = sample_anchors(loss_mask, torch.tensor([30]), torch.tensor([3]), epoch, 0, 4)
        seen |= set(anchors[valid].tolist())
    assert seen == set(range(5, 11)) | set(range(18, 29))


def test_anchors_are_uniform_over_eligible_positions_and_use_every_id_bit() -> None:
    _, loss_mask, lengths = make_sequences([40], seq_len=40)
    eligible = eligible_anchors(loss_mask, 0, 40)
    counts = torch.zeros(40)
    epochs, per_draw = 3000, 4
    for epoch in range(epochs):
        anchors, _ = sample_anchors(
            loss_mask, lengths, torch.tensor([5]), epoch, seed=1, num_anchors=per_draw
        )
        counts[anchors[0]] += 1
    expected = epochs * per_draw / len(eligible)
    # Binomial spread: a 6-sigma band around the expected count of every eligible position.
    sigma = math.sqrt(expected * (1 - 1 / len(eligible)))
    assert (counts[eligible] - expected).abs().max() < 6 * sigma, counts[eligible]
    assert counts.sum() == counts[eligible].sum()
    # Sample ids that differ only above bit 32 still draw different anchors.
    low, high = (
        sample_anchors(loss_mask, lengths, torch.tensor([i]), 0, seed=1, num_anchors=per_draw)[0]
        for i in (7, 7 + 2**40)
    )
    assert not torch.equal(low, high)


def test_anchor_sampling_has_static_shapes_and_never_reads_the_device() -> None:
    # Meta tensors have shapes but no values: .cpu(), .item(), nonzero() or a Generator fed from
    # tensor values would raise, so this passing means no host synchronisation on a GPU either.
    _, loss_mask, lengths = make_sequences([40, 12], seq_len=40)
    meta = torch.device("meta")
    anchors, valid = sample_anchors(
        loss_mask.to(meta),
        lengths.to(meta),
        torch.tensor([1, 2], device=meta),
        epoch=0,
        seed=0,
        num_anchors=50,
    )
    assert anchors.shape == valid.shape == (2, 50)
    assert anchors.dtype == torch.long and valid.dtype == torch.bool


# ----------------------------------------------------------------------------- blocks and labels


def test_block_inputs_put_anchor_token_then_masks_at_true_positions() -> None:
    input_ids, _, _ = make_sequences([20, 20], seq_len=20)
    anchors = torch.tensor([[3, 9, 0], [1, 2, 17]])
    block_ids, block_positions = block_inputs(input_ids, anchors, BLOCK, MASK_ID)
    assert block_ids.shape == block_positions.shape == (2, 3 * BLOCK)
    for b in range(2):
        for n in range(3):
            for k in range(BLOCK):
                expected_id = int(input_ids[b, anchors[b, n]]) if k == 0 else MASK_ID
                assert block_ids[b, n * BLOCK + k] == expected_id
                assert block_positions[b, n * BLOCK + k] == anchors[b, n] + k
    assert torch.equal(context_positions(2, 5), torch.arange(5).expand(2, 5))


def test_block_labels_match_loop_reference() -> None:
    input_ids, loss_mask, lengths = make_sequences([30, 10], seq_len=30)
    # All response: 8 eligible anchors for 12 slots, and the invalid slots' anchor 0 would see
    # response tokens at 1..3 if validity were ignored.
    loss_mask[1, :10] = 1
    anchors, valid = sample_anchors(loss_mask, lengths, torch.tensor([3, 4]), epoch=0, seed=0, num_anchors=12)
    gamma = 2.5
    labels, weights = block_labels(input_ids, loss_mask, lengths, anchors, valid, BLOCK, gamma)
    assert labels.shape == weights.shape == (2, 12, BLOCK)
    assert labels.min() >= 0 and labels.max() < VOCAB
    for b in range(2):
        for n in range(12):
            for k in range(BLOCK):
                position = int(anchors[b, n]) + k
                scored = (
                    bool(valid[b, n]) and k >= 1 and position < lengths[b] and bool(loss_mask[b, position])
                )
                expected = math.exp(-(k - 1) / gamma) if scored else 0.0
                assert weights[b, n, k].item() == pytest.approx(expected)
                if scored:
                    assert labels[b, n, k] == input_ids[b, position]  # token at anchor+k, not anchor+k+1
    assert (~valid).any() and (weights[~valid] == 0).all() and (weights[..., 0] == 0).all()
    assert (weights > 0).any() and (weights[..., 1:] == 0).any()  # both branches exercised


# ----------------------------------------------------------------------------- mask


def test_dense_mask_matches_brute_force() -> None:
    anchors = random_anchors(batch=2, num_anchors=6, context_len=20)
    mask = dense_block_mask(anchors, context_len=20, block_size=BLOCK)
    assert mask.dtype == torch.bool and mask.shape == (2, 1, 6 * BLOCK, 20 + 6 * BLOCK)
    assert torch.equal(mask, brute_force_mask(anchors, 20, BLOCK))
    assert mask.any(-1).all()  # no empty row, invalid anchors included: no NaN in softmax


def test_flex_mask_matches_dense_mask() -> None:
    anchors = random_anchors(batch=2, num_anchors=6, context_len=20)
    mask_mod = block_mask_mod(anchors, 20, BLOCK)
    # flex evaluates mask_mod under vmap, one scalar index at a time.
    assert torch.equal(
        create_mask(mask_mod, 2, 1, 6 * BLOCK, 20 + 6 * BLOCK, device="cpu"),
        brute_force_mask(anchors, 20, BLOCK),
    )


@pytest.mark.parametrize(
    ("context_len", "block_size", "num_anchors", "has_full_tiles"),
    [(300, 16, 40, True), (256, 16, 24, True), (1000, 12, 70, True), (129, 3, 50, False)],
)
def test_flex_mask_tiles_are_exactly_those_that_attend(
    context_len: int, block_size: int, num_anchors: int, has_full_tiles: bool
) -> None:
    # At the BlockMask's tile granularity (128 x 128): a tile is listed iff any pair in it attends,
    # and listed as full (no mask_mod applied) iff every pair in it attends.
    anchors = random_anchors(batch=3, num_anchors=num_anchors, context_len=context_len, seed=context_len)
    anchors[2] = torch.arange(1, num_anchors + 1) * (context_len // num_anchors)  # evenly spread, all valid
    dense = dense_block_mask(anchors, context_len, block_size)
    block_mask = flex_block_mask(anchors, context_len, block_size)
    q_tiles, kv_tiles = math.ceil(dense.shape[2] / 128), math.ceil(dense.shape[3] / 128)
    padding = (0, kv_tiles * 128 - dense.shape[3], 0, q_tiles * 128 - dense.shape[2])
    # Padding rows/keys are never computed: they neither make a tile attend nor stop it being full.
    tiles = F.pad(dense, padding, value=False).view(3, 1, q_tiles, 128, kv_tiles, 128)
    full_tiles = F.pad(dense, padding, value=True).view(3, 1, q_tiles, 128, kv_tiles, 128)
    assert torch.equal(block_mask.to_dense().bool(), tiles.any(5).any(3))
    full = BlockMask.from_kv_blocks(block_mask.full_kv_num_blocks, block_mask.full_kv_indices)
    assert torch.equal(full.to_dense().bool(), full_tiles.all(5).all(3))
    assert bool(full.to_dense().any()) == has_full_tiles


@pytest.mark.parametrize("window", [None, 37])
def test_the_query_tile_lists_are_those_blockmask_would_transpose(window) -> None:
    # The mask lists them itself instead of BlockMask.from_kv_blocks; they must be what it computes.
    anchors = torch.sort(torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(1))).values
    mask = flex_block_mask(anchors, 300, 4, window)
    reference = BlockMask.from_kv_blocks(
        mask.kv_num_blocks, mask.kv_indices, mask.full_kv_num_blocks, mask.full_kv_indices
    )
    assert window is not None or mask.full_q_num_blocks.any()  # full tiles to list (none in a window)
    for ours, theirs in [
        (mask.q_num_blocks, reference.q_num_blocks),
        (mask.q_indices, reference.q_indices),
        (mask.full_q_num_blocks, reference.full_q_num_blocks),
        (mask.full_q_indices, reference.full_q_indices),
    ]:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


def attention_inputs(
    batch: int, heads: int, num_queries: int, num_keys: int, device: str = "cpu"
) -> list[Tensor]:
    generator = torch.Generator(device).manual_seed(0)
    return [
        torch.randn(batch, heads, length, 32, generator=generator, device=device)
        for length in (num_queries, num_keys, num_keys)
    ]


@pytest.mark.parametrize(("context_len", "block_size", "num_anchors"), [(50, BLOCK, 10), (1000, 12, 70)])
def test_flex_attention_matches_sdpa_on_cpu_forward(
    context_len: int, block_size: int, num_anchors: int
) -> None:
    anchors = random_anchors(batch=2, num_anchors=num_anchors, context_len=context_len)
    anchors[1] = torch.arange(1, num_anchors + 1) * (context_len // num_anchors)  # full tiles (none skipped)
    num_queries = num_anchors * block_size
    query, key, value = attention_inputs(2, 2, num_queries, context_len + num_queries)
    block_mask = flex_block_mask(anchors, context_len, block_size)
    flex_out = flex_attention(query, key, value, block_mask=block_mask)
    sdpa_out = F.scaled_dot_product_attention(
        query, key, value, attn_mask=dense_block_mask(anchors, context_len, block_size)
    )
    torch.testing.assert_close(flex_out, sdpa_out, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_compiled_flex_matches_sdpa_forward_and_backward_on_cuda(dtype: torch.dtype) -> None:
    context_len, num_anchors, block_size = 300, 32, 16
    anchors = random_anchors(2, num_anchors, context_len).cuda()
    inputs = attention_inputs(2, 4, num_anchors * block_size, context_len + num_anchors * block_size, "cuda")
    reference = [x.clone().requires_grad_() for x in inputs]  # fp32 SDPA is the reference for both dtypes
    tested = [x.to(dtype).requires_grad_() for x in inputs]
    grad_out = torch.randn_like(inputs[0])
    sdpa_out = F.scaled_dot_product_attention(
        *reference, attn_mask=dense_block_mask(anchors, context_len, block_size)
    )
    sdpa_out.backward(grad_out)
    flex_out = COMPILED_FLEX_ATTENTION(*tested, block_mask=flex_block_mask(anchors, context_len, block_size))
    flex_out.backward(grad_out.to(dtype))
    tolerance = {"atol": 2e-4, "rtol": 2e-4} if dtype == torch.float32 else {"atol": 3e-2, "rtol": 3e-2}
    torch.testing.assert_close(flex_out.float(), sdpa_out, **tolerance)
    for flex_input, sdpa_input in zip(tested, reference, strict=True):
        torch.testing.assert_close(flex_input.grad.float(), sdpa_input.grad, **tolerance)


# ----------------------------------------------------------------------------- loss


def loss_problem(seed: int = 0, requires_grad: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [2, 5*BLOCK, H], head [V, H], labels/weights [2, 5, BLOCK] with real zero weights."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5 * BLOCK, HIDDEN, generator=generator, requires_grad=requires_grad)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, requires_grad=requires_grad)
    labels = torch.randint(0, VOCAB, (2, 5, BLOCK), generator=generator)
    weights = torch.rand(2, 5, BLOCK, generator=generator) * (
        torch.rand(2, 5, BLOCK, generator=generator) > 0.3
    )
    weights[..., 0] = 0
    return hidden, head, labels, weights


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
    from dflash_mp.objective.block_diffusion import _ce_and_grad, _ce_and_grad_eager

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
