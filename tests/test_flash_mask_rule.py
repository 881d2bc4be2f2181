"""FlashAttention 4's DFlash mask rule on CPU: the CuTe mask_mod FA4 compiles
(`cute_mask_rule`) evaluated element by element against the dense mask, and the integer rule it
shares with this test (`mask_rule`), with anchors and document starts on tile edges.

Without a GPU there is no CuTe DSL to trace, so the mask_mod runs with stand-ins for the three
modules it imports: `cute.jit` leaves the function as it is and a "TensorSSA" is a one-element
numpy int32 array, which supports the same operators (`//`, `*`, `-`, comparisons, `&`, `|`) and
the `[0]` indexing the kernel uses. Every line of the CuTe function then runs as written.
"""

from __future__ import annotations

import sys
import types
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from dflash_mp.kernels.block_mask import dense_block_mask, tile_block_mask
from dflash_mp.kernels.flash_attention import cute_mask_rule, mask_rule, query_block
from tests.test_block_mask_tiles import edge_anchors, edge_starts


@pytest.fixture
def traced_rule(monkeypatch):
    """cute_mask_rule(block_size) built against stand-ins for cutlass, cute and flash_attn's utils
    (and dropped from its cache after the test, so no real build ever sees it)."""
    cutlass = types.ModuleType("cutlass")
    cute = types.ModuleType("cutlass.cute")
    flash_attn = types.ModuleType("flash_attn")
    flash_cute = types.ModuleType("flash_attn.cute")
    utils = types.ModuleType("flash_attn.cute.utils")
    cutlass.Int32, cutlass.cute = np.int32, cute
    cute.jit = lambda function: function
    utils.scalar_to_ssa = lambda value, dtype: np.array([value], dtype=dtype)
    flash_attn.cute, flash_cute.utils = flash_cute, utils
    modules = {
        "cutlass": cutlass,
        "cutlass.cute": cute,
        "flash_attn": flash_attn,
        "flash_attn.cute": flash_cute,
        "flash_attn.cute.utils": utils,
    }
    for name, module in modules.items():
        monkeypatch.setitem(sys.modules, name, module)
    cute_mask_rule.cache_clear()
    yield cute_mask_rule
    cute_mask_rule.cache_clear()


def kernel_mask(rule, anchors: torch.Tensor, starts: torch.Tensor | None, context_len: int, block_size: int):
    """[B, Q, S+Q] bool: the mask_mod called once per (batch, query, key) on the aux tensors FA4
    gets (TileMask's padded int32 anchors and starts, zeros when not packed)."""
    mask = tile_block_mask(anchors, context_len, block_size, starts)
    aux = [
        mask.anchors.numpy(),
        (mask.starts if starts is not None else torch.zeros_like(mask.anchors)).numpy(),
    ]
    batch, queries = anchors.shape[0], anchors.shape[1] * block_size
    keys = context_len + queries
    info = SimpleNamespace(seqlen_k=keys, seqlen_q=queries)

    def ssa(value: int) -> np.ndarray:
        return np.array([value], dtype=np.int32)

    head = ssa(0)
    return torch.tensor(
        [
            [
                [bool(rule(ssa(b), head, ssa(q), ssa(k), info, aux)[0]) for k in range(keys)]
                for q in range(queries)
            ]
            for b in range(batch)
        ]
    )


@pytest.mark.parametrize(
    ("context_len", "block_size", "num_anchors", "packed"),
    [(140, 8, 6, False), (140, 8, 6, True), (130, 3, 10, True), (257, 16, 3, False)],
)
def test_the_cute_mask_mod_is_the_dense_mask_with_anchors_on_tile_edges(
    traced_rule, context_len: int, block_size: int, num_anchors: int, packed: bool
) -> None:
    rule = traced_rule(block_size)
    for seed in range(2):
        anchors = edge_anchors(2, num_anchors, block_size, context_len, seed)
        starts = edge_starts(anchors, block_size, seed) if packed else None
        expected = dense_block_mask(anchors, context_len, block_size, starts=starts)[:, 0]
        got = kernel_mask(rule, anchors, starts, context_len, block_size)
        wrong = (got != expected).nonzero()[:3].tolist()
        assert not wrong, f"(batch, query, key) {wrong}: anchors {anchors.tolist()}, starts {starts}"


def test_the_integer_rule_is_the_dense_mask_on_random_rows() -> None:
    """mask_rule on broadcast integer tensors, as flex's rule is evaluated, over random shapes."""
    generator = torch.Generator().manual_seed(0)
    for trial in range(30):
        context_len = int(torch.randint(2, 400, (1,), generator=generator))
        block_size = int(torch.randint(1, 20, (1,), generator=generator))
        num_anchors = int(torch.randint(1, 30, (1,), generator=generator))
        anchors = torch.randint(0, context_len, (2, num_anchors), generator=generator).sort(-1).values
        starts = edge_starts(anchors, block_size, trial) if trial % 2 else torch.zeros_like(anchors)
        queries = torch.arange(num_anchors * block_size)[None, :, None]
        keys = torch.arange(context_len + num_anchors * block_size)[None, None, :]
        blocks = query_block(queries, block_size).expand(2, -1, 1)[..., 0]
        anchor, start = anchors.gather(1, blocks)[..., None], starts.gather(1, blocks)[..., None]
        got = mask_rule(queries, keys, anchor, start, context_len, block_size, 0)
        expected = dense_block_mask(anchors, context_len, block_size, starts=starts)[:, 0]
        assert torch.equal(got, expected), (trial, anchors, starts)
