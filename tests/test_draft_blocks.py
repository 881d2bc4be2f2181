"""A micro-batch's blocks, labels and mask: the compiled preparation against the eager one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from torch.nn.attention.flex_attention import BlockMask

from dflash_mp import draft_blocks as blocks_module
from dflash_mp.block_mask import flex_mask_tiles
from dflash_mp.draft_blocks import draft_blocks

BLOCK, MASK_ID = 4, 49
ARGS = {"seed": 3, "num_anchors": 40, "block_size": BLOCK, "mask_token_id": MASK_ID, "gamma": 7.0}


def _batch(seq_len: int = 300, epoch: int = 2, device: str = "cpu") -> SimpleNamespace:
    generator = torch.Generator().manual_seed(seq_len + epoch)
    loss_mask = (torch.rand(2, seq_len, generator=generator) > 0.3).long()
    loss_mask[:, :20] = 0  # a prompt
    batch = SimpleNamespace(
        input_ids=torch.randint(0, MASK_ID, (2, seq_len), generator=generator),
        loss_mask=loss_mask,
        lengths=torch.tensor([seq_len, seq_len - 37]),
        sample_ids=torch.tensor([11, 2**40 + 5]),
        epoch=epoch,
    )
    return SimpleNamespace(**{k: v.to(device) if torch.is_tensor(v) else v for k, v in vars(batch).items()})


def _mask_tensors(mask: BlockMask) -> list[torch.Tensor]:
    return [
        mask.kv_num_blocks,
        mask.kv_indices,
        mask.full_kv_num_blocks,
        mask.full_kv_indices,
        mask.q_num_blocks,
        mask.q_indices,
        mask.full_q_num_blocks,
        mask.full_q_indices,
    ]


def _assert_same_blocks(ours, theirs) -> None:
    for name in ("ids", "positions", "labels", "weights"):
        assert torch.equal(getattr(ours, name).cpu(), getattr(theirs, name).cpu()), name

    def masks(blocks) -> list[BlockMask]:
        return list(blocks.mask.values()) if isinstance(blocks.mask, dict) else [blocks.mask]

    for mine, other in zip(masks(ours), masks(theirs), strict=True):
        assert mine.seq_lengths == other.seq_lengths
        for a, b in zip(_mask_tensors(mine), _mask_tensors(other), strict=True):
            assert torch.equal(a.cpu(), b.cpu())


@pytest.mark.parametrize("window", [None, 37])
def test_the_query_tile_lists_are_those_blockmask_would_transpose(window) -> None:
    # The mask hands BlockMask both orientations; they must be what from_kv_blocks computes.
    anchors = torch.sort(torch.randint(1, 300, (2, 40), generator=torch.Generator().manual_seed(1))).values
    tiles = flex_mask_tiles(anchors, 300, BLOCK, window)
    reference = BlockMask.from_kv_blocks(
        tiles.kv_count, tiles.kv_indices, tiles.full_kv_count, tiles.full_kv_indices
    )
    for ours, theirs in [
        (tiles.q_count, reference.q_num_blocks),
        (tiles.q_indices, reference.q_indices),
        (tiles.full_q_count, reference.full_q_num_blocks),
        (tiles.full_q_indices, reference.full_q_indices),
    ]:
        assert ours.dtype == theirs.dtype and torch.equal(ours, theirs)


@pytest.mark.parametrize("window", [None, 37])
def test_the_preparation_traces_as_one_graph_with_the_eager_result(window) -> None:
    # On CUDA `draft_blocks` runs `_block_tensors` compiled; here dynamo traces it whole
    # (fullgraph: no break that would split it into many launches) and runs the traced graph.
    batch = _batch()
    eager = draft_blocks(batch, attention="flex", window=window, **ARGS)
    traced = torch.compile(blocks_module._block_tensors, backend="eager", fullgraph=True)
    decay = blocks_module.loss_decay(BLOCK, ARGS["gamma"])
    stream = blocks_module.epoch_stream(ARGS["seed"], batch.epoch)
    anchors, ids, positions, labels, weights, tiles, window_tiles = traced(
        batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids, stream, torch.arange(300),
        ARGS["num_anchors"], BLOCK, MASK_ID, decay, window,
    )  # fmt: skip
    mask = blocks_module.flex_mask_from_tiles(tiles, anchors, 300, BLOCK)
    if window is not None:
        window_mask = blocks_module.flex_mask_from_tiles(window_tiles, anchors, 300, BLOCK, window)
        mask = {"full_attention": mask, "sliding_attention": window_mask}
    _assert_same_blocks(blocks_module.DraftBlocks(ids, positions, labels, weights, mask), eager)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_compiled_on_cuda_it_equals_the_eager_preparation_on_cpu() -> None:
    # Two lengths and two epochs: the compiled graph goes dynamic and still agrees bit for bit.
    for seq_len, epoch in [(300, 2), (300, 3), (517, 3)]:
        for window in (None, 37):
            on_cpu = draft_blocks(_batch(seq_len, epoch), attention="flex", window=window, **ARGS)
            on_cuda = draft_blocks(_batch(seq_len, epoch, "cuda"), attention="flex", window=window, **ARGS)
            _assert_same_blocks(on_cuda, on_cpu)
