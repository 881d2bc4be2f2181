"""Checks of the DFlash training math against slow, obviously-correct references: anchors, blocks
and labels, the attention mask (the loss: test_block_diffusion_loss.py)."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.flex_attention import BlockMask, create_mask, flex_attention

from dflash_mp.kernels.block_mask import block_mask_mod, dense_block_mask, flex_block_mask
from dflash_mp.objective.draft_blocks import block_inputs, block_labels, context_positions, sample_anchors
from tests.block_problems import (
    BLOCK,
    COMPILED_FLEX_ATTENTION,
    MASK_ID,
    VOCAB,
    brute_force_mask,
    eligible_anchors,
    make_sequences,
    random_anchors,
)

# flex_attention in eager mode (CPU) warns that it is unfused; that is expected in these tests.
pytestmark = pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")


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
