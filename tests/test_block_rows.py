"""A DFlash drafter's first layer on compact rows and its last layer without each block's index 0
(dflash_mp/models/block_rows.py) give what the full rows give, forward and backward."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from transformers import Qwen3Config

from dflash_mp.kernels.block_mask import dense_block_mask
from dflash_mp.models.block_rows import BlockRows, expand_rows, scored_rows
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.objective.block_diffusion import drafter_loss
from dflash_mp.objective.draft_blocks import context_positions

HIDDEN, BLOCK, MASK_ID, VOCAB = 32, 4, 99, 100
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=64,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=8,
    vocab_size=VOCAB,
    max_position_embeddings=128,
    initializer_range=0.2,
)
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 8, "selector_rank": 4, "selector_top_k": 5}


def _drafter(layers: int, arch: str = "dflash", checkpointing: bool = False) -> DFlashDrafter:
    config = build_drafter_config(
        TARGET, layers, [1, 2], BLOCK, MASK_ID, arch=arch, dflash2=DFLASH2 if arch == "dflash2" else None
    )
    drafter = DFlashDrafter(config, seed=0, gradient_checkpointing=checkpointing)
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():  # random norms, so that a norm applied to the wrong rows shows
        for name, param in drafter.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn(param.shape, generator=generator))
    return drafter


def _inputs(batch: int = 2, context_len: int = 12, blocks: int = 3):
    generator = torch.Generator().manual_seed(5)
    features = torch.randn(batch, context_len, 2 * HIDDEN, generator=generator)
    first = torch.randn(batch, blocks, HIDDEN, generator=generator)
    mask_row = torch.randn(1, 1, HIDDEN, generator=generator).expand(batch, 1, HIDDEN)
    anchors = torch.tensor([[2, 5, 9], [1, 4, 11]])[:batch, :blocks]
    block_positions = (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1)
    mask = dense_block_mask(anchors, context_len, BLOCK)
    args = (context_positions(batch, context_len), block_positions, mask)
    return features, BlockRows(first, mask_row), args


def _random_batch(
    generator, max_id: int, lengths: list[int], feature_width: int, epoch: int
) -> SimpleNamespace:
    """Two sequences as long as the first length: random ids below `max_id`, all response."""
    seq_len = lengths[0]
    return SimpleNamespace(
        input_ids=torch.randint(0, max_id, (2, seq_len), generator=generator),
        loss_mask=torch.ones(2, seq_len, dtype=torch.uint8),
        lengths=torch.tensor(lengths),
        sample_ids=torch.tensor([3, 4]),
        epoch=epoch,
        hidden_states=torch.randn(2, seq_len, feature_width, generator=generator),
    )


def test_compact_rows_expand_to_the_full_layout_and_the_scored_rows_leave_index_0_out() -> None:
    first = torch.arange(6.0).view(1, 3, 2)  # 3 blocks, feature width 2
    mask = torch.tensor([[[-1.0, -2.0]]])
    full = expand_rows(BlockRows(first, mask), block_size=3)
    expected = torch.tensor(
        [[0, 1], [-1, -2], [-1, -2], [2, 3], [-1, -2], [-1, -2], [4, 5], [-1, -2], [-1, -2]]
    )
    assert torch.equal(full, expected[None].float())
    assert torch.equal(scored_rows(full, 3), torch.tensor([[-1.0, -2.0]]).expand(6, 2)[None])


@pytest.mark.parametrize(("layers", "checkpointing"), [(3, False), (1, False), (2, True)])
def test_compact_first_layer_and_scored_last_layer_equal_the_full_rows(
    layers: int, checkpointing: bool
) -> None:
    drafter = _drafter(layers, checkpointing=checkpointing).train()
    features, rows, args = _inputs()
    full_input = expand_rows(rows, BLOCK)

    full = scored_rows(drafter(features, full_input, *args), BLOCK)
    full_grads = torch.autograd.grad(full.square().sum(), list(drafter.parameters()))
    spared = drafter(features, rows, *args, scored_rows_only=True)
    spared_grads = torch.autograd.grad(spared.square().sum(), list(drafter.parameters()))

    assert spared.shape == (2, 3 * (BLOCK - 1), HIDDEN)
    torch.testing.assert_close(spared, full, rtol=1e-5, atol=1e-5)
    for (name, _), a, b in zip(drafter.named_parameters(), spared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=name)  # sums in another order
    # Without scored_rows_only the compact input gives every row, index 0 included.
    torch.testing.assert_close(drafter(features, rows, *args), drafter(features, full_input, *args))


def test_a_dflash2_drafter_expands_compact_rows_and_drops_index_0_after_its_last_layer() -> None:
    drafter = _drafter(2, arch="dflash2").eval()
    assert not drafter.skips_repeated_rows  # its convolutions mix a block's rows first
    features, rows, args = _inputs()
    with torch.no_grad():
        full = drafter(features, expand_rows(rows, BLOCK), *args)
        torch.testing.assert_close(
            drafter(features, rows, *args, scored_rows_only=True), scored_rows(full, BLOCK)
        )
    with pytest.raises(ValueError, match="DFlash layers"):
        drafter.layers[0](rows, features, None, None, None, None, compact=True)


def test_drafter_loss_spares_the_repeated_rows_with_the_same_loss_and_gradients(monkeypatch) -> None:
    drafter = _drafter(2).train()
    generator = torch.Generator().manual_seed(7)
    embed, head = (
        torch.randn(VOCAB, HIDDEN, generator=generator),
        torch.randn(VOCAB, HIDDEN, generator=generator),
    )
    batch = _random_batch(generator, VOCAB - 1, [40, 33], 2 * HIDDEN, epoch=1)
    args = {"seed": 0, "num_anchors": 5, "gamma": 7.0, "attention": "sdpa"}
    calls = []
    forward = DFlashDrafter.forward

    def recording_forward(self, features, block_embeddings, *rest, **kwargs):
        calls.append((type(block_embeddings).__name__, kwargs.get("scored_rows_only", False)))
        return forward(self, features, block_embeddings, *rest, **kwargs)

    monkeypatch.setattr(DFlashDrafter, "forward", recording_forward)
    spared_loss, spared_stats = drafter_loss(drafter, embed, head, batch, **args)
    spared_grads = torch.autograd.grad(spared_loss, list(drafter.parameters()))
    monkeypatch.setattr(DFlashDrafter, "skips_repeated_rows", False)  # the full rows, as before
    full_loss, full_stats = drafter_loss(drafter, embed, head, batch, **args)
    full_grads = torch.autograd.grad(full_loss, list(drafter.parameters()))

    assert calls == [("BlockRows", True), ("Tensor", False)]
    torch.testing.assert_close(spared_loss, full_loss, rtol=1e-5, atol=1e-6)
    assert torch.equal(spared_stats["count"], full_stats["count"]) and spared_stats["count"].sum() > 0
    for a, b in zip(spared_grads, full_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-6)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_compiled_bf16_drafter_spares_rows_on_cuda_with_the_same_loss_and_gradients(monkeypatch) -> None:
    """As trained: bf16, compiled layers, FlashAttention 4 where it runs (else flex), block 16."""
    from dflash_mp.kernels.flash_attention import flash_unusable_reason

    attention = "flash" if flash_unusable_reason(torch.device("cuda")) is None else "flex"
    target = Qwen3Config(
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        vocab_size=1000,
        max_position_embeddings=1024,
        initializer_range=0.05,
    )
    config = build_drafter_config(target, 3, [1, 2], 16, 999)
    generator = torch.Generator().manual_seed(3)
    batch = _random_batch(generator, 998, [300, 250], 512, epoch=0)
    batch = SimpleNamespace(
        **{k: v.cuda() if isinstance(v, torch.Tensor) else v for k, v in vars(batch).items()}
    )
    batch.hidden_states = batch.hidden_states.bfloat16()
    embed = (0.05 * torch.randn(1000, 256, generator=generator)).cuda().bfloat16()
    head = (0.05 * torch.randn(1000, 256, generator=generator)).cuda().bfloat16()
    results = {}
    for spare in (True, False):
        monkeypatch.setattr(DFlashDrafter, "skips_repeated_rows", spare)
        drafter = DFlashDrafter(config, seed=0).cuda().bfloat16()
        drafter.compile_layers()
        # A second anchor count recompiles the layers with that size dynamic (as other sizes would).
        for anchors in (24, 20):
            loss, stats = drafter_loss(
                drafter, embed, head, batch, seed=0, num_anchors=anchors, gamma=7.0, attention=attention
            )
            grads = torch.autograd.grad(loss, list(drafter.parameters()))
            results[spare, anchors] = loss.float(), stats["count"], [g.float() for g in grads]
    for anchors in (24, 20):
        spared_loss, spared_count, spared_grads = results[True, anchors]
        full_loss, full_count, full_grads = results[False, anchors]
        assert torch.equal(spared_count, full_count) and spared_count.sum() > 0
        torch.testing.assert_close(spared_loss, full_loss, rtol=1e-2, atol=1e-3)
        for (name, _), a, b in zip(drafter.named_parameters(), spared_grads, full_grads, strict=True):
            # bf16 kernels over other row counts: compare each gradient's direction and size
            cosine = F.cosine_similarity(a.flatten(), b.flatten(), dim=0)
            assert cosine > 0.99 and (a.norm() / b.norm() - 1).abs() < 0.02, (anchors, name)
