"""Our training drafter against the reference `dflash.model.DFlashDraftModel` (docs/DESIGN.md §3).

The drafter is exported, loaded by the reference, and both are run on the same inputs. The
multi-block case shows that one block-sparse training pass equals per-block reference inference.
"""

from __future__ import annotations

import pytest
import torch
from dflash.model import DFlashDraftModel, build_target_layer_ids
from torch.nn.attention.flex_attention import create_block_mask, flex_attention
from transformers import Qwen3Config

from dflash_mp.export.hf import export_drafter
from dflash_mp.models import drafter as drafter_module
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

HIDDEN = 64
BLOCK = 4
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=300,
    max_position_embeddings=256,
    # Larger than HF's 0.02 so attention, not the residual stream, dominates the output.
    initializer_range=0.2,
)


def _drafter() -> DFlashDrafter:
    layer_ids = build_target_layer_ids(TARGET.num_hidden_layers, 2)
    config = build_drafter_config(TARGET, 2, layer_ids, block_size=BLOCK, mask_token_id=299)
    drafter = DFlashDrafter(config, seed=0)
    # Init leaves every norm at 1; random norms make a misplaced norm visible in the outputs.
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    return drafter.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[DFlashDrafter, DFlashDraftModel]:
    drafter = _drafter()
    export_dir = export_drafter(drafter, tmp_path_factory.mktemp("parity") / "export", dtype=None)
    reference, info = DFlashDraftModel.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert reference.target_layer_ids == drafter.target_layer_ids
    assert (reference.block_size, reference.mask_token_id) == (drafter.block_size, drafter.mask_token_id)
    return drafter, reference.eval()


def _inputs(batch: int, context_len: int, num_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(batch * 100 + context_len)
    context = torch.randn(batch, context_len, 2 * HIDDEN, generator=generator)
    blocks = torch.randn(batch, num_blocks * BLOCK, HIDDEN, generator=generator)
    return context, blocks


@pytest.mark.parametrize("batch", [1, 2])
def test_single_block_matches_reference(models: tuple[DFlashDrafter, DFlashDraftModel], batch: int) -> None:
    drafter, reference = models
    context_len = 7
    context, block = _inputs(batch, context_len)
    with torch.no_grad():
        expected = reference(
            target_hidden=context,
            noise_embedding=block,
            position_ids=torch.arange(context_len + BLOCK)[None],
            attention_mask=None,
        )
        context_positions = torch.arange(context_len).expand(batch, -1)
        block_positions = torch.arange(context_len, context_len + BLOCK).expand(batch, -1)
        see_all = torch.ones(batch, 1, BLOCK, context_len + BLOCK, dtype=torch.bool)
        ours = drafter(context, block, context_positions, block_positions, see_all)
        no_context = see_all.clone()
        no_context[..., :context_len] = False
        blind = drafter(context, block, context_positions, block_positions, no_context)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
    # The comparison is only meaningful if the context actually changes the output.
    assert not torch.allclose(blind, expected, atol=1e-3)


# Per sequence: the anchors of its blocks, unsorted and overlapping in positions like real training.
ANCHORS = [[9, 3, 6], [2, 11, 5]]
CONTEXT_LEN = 14


def _multi_block_inputs() -> tuple[torch.Tensor, ...]:
    """Context for all positions, every block in one sequence, true positions and the block-sparse mask."""
    context, blocks = _inputs(len(ANCHORS), CONTEXT_LEN, num_blocks=len(ANCHORS[0]))
    anchors = torch.tensor(ANCHORS)
    block_positions = (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1)
    block_index = torch.arange(len(ANCHORS[0])).repeat_interleave(BLOCK)
    query_anchor = anchors.repeat_interleave(BLOCK, dim=1)  # [B, Q]
    sees_context = torch.arange(CONTEXT_LEN)[None, None, :] < query_anchor[:, :, None]
    sees_block = (block_index[:, None] == block_index[None, :]).expand(len(ANCHORS), -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]  # [B, 1, Q, S+Q]
    context_positions = torch.arange(CONTEXT_LEN).expand(len(ANCHORS), -1)
    return context, blocks, context_positions, block_positions, mask


def _per_block_reference(
    reference: DFlashDraftModel, context: torch.Tensor, blocks: torch.Tensor
) -> torch.Tensor:
    outputs = []
    for row, anchors in enumerate(ANCHORS):
        for n, anchor in enumerate(anchors):
            outputs.append(
                reference(
                    target_hidden=context[row : row + 1, :anchor],
                    noise_embedding=blocks[row : row + 1, n * BLOCK : (n + 1) * BLOCK],
                    position_ids=torch.arange(anchor + BLOCK)[None],
                    attention_mask=None,
                )
            )
    return torch.cat(outputs, dim=1).view(len(ANCHORS), -1, HIDDEN)


def test_multi_block_pass_equals_per_block_reference(models: tuple[DFlashDrafter, DFlashDraftModel]) -> None:
    drafter, reference = models
    context, blocks, context_positions, block_positions, mask = _multi_block_inputs()
    with torch.no_grad():
        expected = _per_block_reference(reference, context, blocks)
        ours = drafter(context, blocks, context_positions, block_positions, mask)
    torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


def test_compiled_layers_give_the_same_outputs_and_gradients() -> None:
    # "eager" backend: dynamo's tracing and AOT-free replay on CPU, so what regional compilation
    # changes (graph capture, one graph shared by every layer) is checked without a GPU.
    context, blocks, context_positions, block_positions, mask = _multi_block_inputs()
    # Four draft layers over the same two target layers as the inputs.
    layer_ids = build_target_layer_ids(TARGET.num_hidden_layers, 2)
    config = build_drafter_config(TARGET, 4, layer_ids, block_size=BLOCK, mask_token_id=299)
    results = []
    for compiled in (False, True):
        drafter = DFlashDrafter(config, seed=0).train()
        torch._dynamo.reset()
        counters = torch._dynamo.utils.counters
        counters.clear()
        if compiled:
            drafter.compile_layers(backend="eager", fullgraph=True)
        out = drafter(context, blocks, context_positions, block_positions, mask)
        out.square().sum().backward()
        results.append((out.detach(), [p.grad for p in drafter.parameters()]))
        if compiled:
            # Two graphs for four layers: the first layer's input (embeddings) needs no gradient.
            assert counters["stats"]["unique_graphs"] == 2, dict(counters["stats"])
    torch._dynamo.reset()
    (eager, eager_grads), (compiled_out, compiled_grads) = results
    torch.testing.assert_close(compiled_out, eager, atol=1e-6, rtol=1e-6)
    for compiled_grad, eager_grad in zip(compiled_grads, eager_grads, strict=True):
        torch.testing.assert_close(compiled_grad, eager_grad, atol=1e-6, rtol=1e-6)


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_block_mask_path_equals_dense_path(
    models: tuple[DFlashDrafter, DFlashDraftModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Eager flex_attention runs on CPU (forward only); the compiled kernel is checked by the GPU test.
    monkeypatch.setattr(drafter_module, "_compiled_flex_attention", lambda: flex_attention)
    drafter, _ = models
    context, blocks, context_positions, block_positions, mask = _multi_block_inputs()
    block_mask = create_block_mask(
        lambda b, h, q, kv: mask[b, 0, q, kv], len(ANCHORS), None, *mask.shape[-2:], device="cpu"
    )
    with torch.no_grad():
        dense = drafter(context, blocks, context_positions, block_positions, mask)
        flex = drafter(context, blocks, context_positions, block_positions, block_mask)
    torch.testing.assert_close(flex, dense, atol=1e-5, rtol=1e-5)


@pytest.mark.gpu
def test_compiled_flex_matches_dense_on_gpu() -> None:
    device = torch.device("cuda")
    drafter = _drafter().to(device).train()
    drafter.gradient_checkpointing = True
    context, blocks, context_positions, block_positions, mask = (t.to(device) for t in _multi_block_inputs())
    block_mask = create_block_mask(
        lambda b, h, q, kv: mask[b, 0, q, kv], len(ANCHORS), None, *mask.shape[-2:], device=device
    )
    # A random projection: a plain sum of squares after the final RMSNorm would be nearly constant.
    projection = torch.randn(blocks.shape, generator=torch.Generator().manual_seed(2)).to(device)
    results = []
    for attention_mask in (mask, block_mask):
        drafter.zero_grad()
        out = drafter(context, blocks, context_positions, block_positions, attention_mask)
        (out * projection).sum().backward()
        results.append((out.detach(), [p.grad.clone() for p in drafter.parameters()]))
    (dense, dense_grads), (flex, flex_grads) = results
    torch.testing.assert_close(flex, dense, atol=1e-4, rtol=1e-4)
    for flex_grad, dense_grad in zip(flex_grads, dense_grads, strict=True):
        torch.testing.assert_close(flex_grad, dense_grad, atol=1e-4, rtol=1e-3)
