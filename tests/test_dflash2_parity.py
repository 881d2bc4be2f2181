"""The DFlash 2 drafter against the reference `dflash.model.DFlash2DraftModel`.

Our drafter is exported, loaded by the reference, and both run on the same inputs with every
DFlash 2 parameter random (a fresh drafter's identity convolutions and zero successor codebook
would hide misplaced taps and swapped codebooks). The training layout (blocks back to back in one
sequence) must equal one reference call per block, which needs the block-boundary masking of the
convolution.
"""

from __future__ import annotations

import json

import pytest
import torch
from dflash.model import DFlash2DraftModel
from safetensors.torch import load_file
from transformers import Qwen3Config

from dflash_mp.export.hf import export_drafter, load_exported_drafter
from dflash_mp.models import dflash2 as dflash2_module
from dflash_mp.models.dflash2 import GroupedDynamicConv
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config

HIDDEN = 64
BLOCK = 4
VOCAB = 300
LAYER_IDS = [1, 3]
DFLASH2 = {"conv_kernel_size": 3, "conv_group_size": 16, "selector_rank": 8, "selector_top_k": 5}
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=6,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def _config(arch: str = "dflash2", **dflash2: int) -> Qwen3Config:
    return build_drafter_config(
        TARGET, 2, LAYER_IDS, block_size=BLOCK, mask_token_id=299, arch=arch, dflash2={**DFLASH2, **dflash2}
    )


def _randomised(drafter: DFlashDrafter) -> DFlashDrafter:
    """Every norm, convolution and codebook random, so that no part can hide behind its init."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, param in drafter.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if "norm" in name:
                param.copy_(1 + 0.3 * noise)
            elif "base_kernel" in name:
                param.copy_(0.5 * noise)
            elif "kernel_projection" in name or "codebook" in name:
                param.copy_(0.3 * noise)
    return drafter.eval()


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> tuple[DFlashDrafter, DFlash2DraftModel]:
    drafter = _randomised(DFlashDrafter(_config(), seed=0))
    export_dir = export_drafter(drafter, tmp_path_factory.mktemp("dflash2") / "export", dtype=None)
    reference, info = DFlash2DraftModel.from_pretrained(
        export_dir, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    return drafter, reference.eval()


def test_export_follows_the_dflash2_checkpoint_contract(
    models: tuple[DFlashDrafter, DFlash2DraftModel], tmp_path
) -> None:
    drafter, reference = models
    out = export_drafter(drafter, tmp_path / "export")
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"]
    assert config["is_causal"] is False
    assert {key: config["dflash_config"][key] for key in DFLASH2} == DFLASH2
    assert config["vocab_size"] == VOCAB
    keys = set(load_file(out / "model.safetensors"))
    assert (
        "candidate_selector.predecessor_codebook" in keys and "candidate_selector.successor_codebook" in keys
    )
    assert not any(key.endswith("codebook.weight") for key in keys)
    assert {
        f"layers.{i}.{conv}.base_kernel" for i in range(2) for conv in ("attention_conv", "mlp_conv")
    } <= keys
    assert not any("embed_tokens" in key or "lm_head" in key for key in keys)
    # The reference read every tensor we wrote, the codebooks included.
    torch.testing.assert_close(
        reference.candidate_selector.successor_codebook.weight, drafter.candidate_selector.successor_codebook
    )
    again = load_exported_drafter(out)
    assert again.arch == "dflash2" and set(again.state_dict()) == set(drafter.state_dict())


@pytest.mark.parametrize("batch", [1, 2])
def test_single_block_hidden_states_match_reference(
    models: tuple[DFlashDrafter, DFlash2DraftModel], batch: int
) -> None:
    drafter, reference = models
    generator = torch.Generator().manual_seed(batch)
    for context_len in (3, 9):
        context = torch.randn(batch, context_len, 2 * HIDDEN, generator=generator)
        block = torch.randn(batch, BLOCK, HIDDEN, generator=generator)
        with torch.no_grad():
            expected = reference(
                target_hidden=context,
                noise_embedding=block,
                position_ids=torch.arange(context_len + BLOCK)[None],
            )
            ours = drafter(
                context,
                block,
                torch.arange(context_len).expand(batch, -1),
                torch.arange(context_len, context_len + BLOCK).expand(batch, -1),
                torch.ones(batch, 1, BLOCK, context_len + BLOCK, dtype=torch.bool),
            )
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)


ANCHORS = [[9, 3, 6], [2, 11, 5]]
CONTEXT_LEN = 14


def _training_layout() -> tuple[torch.Tensor, ...]:
    generator = torch.Generator().manual_seed(7)
    context = torch.randn(len(ANCHORS), CONTEXT_LEN, 2 * HIDDEN, generator=generator)
    blocks = torch.randn(len(ANCHORS), len(ANCHORS[0]) * BLOCK, HIDDEN, generator=generator)
    anchors = torch.tensor(ANCHORS)
    block_positions = (anchors[:, :, None] + torch.arange(BLOCK)).flatten(1)
    block_index = torch.arange(len(ANCHORS[0])).repeat_interleave(BLOCK)
    sees_context = (
        torch.arange(CONTEXT_LEN)[None, None, :] < anchors.repeat_interleave(BLOCK, dim=1)[:, :, None]
    )
    sees_block = (block_index[:, None] == block_index[None, :]).expand(len(ANCHORS), -1, -1)
    mask = torch.cat([sees_context, sees_block], dim=-1)[:, None]
    return context, blocks, torch.arange(CONTEXT_LEN).expand(len(ANCHORS), -1), block_positions, mask


def _per_block_reference(
    reference: DFlash2DraftModel, context: torch.Tensor, blocks: torch.Tensor
) -> torch.Tensor:
    outputs = [
        reference(
            target_hidden=context[row : row + 1, :anchor],
            noise_embedding=blocks[row : row + 1, n * BLOCK : (n + 1) * BLOCK],
            position_ids=torch.arange(anchor + BLOCK)[None],
        )
        for row, anchors in enumerate(ANCHORS)
        for n, anchor in enumerate(anchors)
    ]
    return torch.cat(outputs, dim=1).view(len(ANCHORS), -1, HIDDEN)


def test_training_layout_equals_one_reference_call_per_block(
    models: tuple[DFlashDrafter, DFlash2DraftModel], monkeypatch: pytest.MonkeyPatch
) -> None:
    drafter, reference = models
    inputs = _training_layout()
    with torch.no_grad():
        expected = _per_block_reference(reference, *inputs[:2])
        ours = drafter(*inputs)
        torch.testing.assert_close(ours, expected, atol=1e-5, rtol=1e-5)
        # Without the block-boundary mask the taps read the previous block: other numbers.
        monkeypatch.setattr(drafter, "block_size", 10**6)
        unmasked = drafter(*inputs)
    assert not torch.allclose(unmasked, expected, atol=1e-3)


def test_selector_walk_picks_the_reference_propose_tokens(
    models: tuple[DFlashDrafter, DFlash2DraftModel],
) -> None:
    drafter, reference = models
    generator = torch.Generator().manual_seed(3)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    head.weight.data = torch.randn(VOCAB, HIDDEN, generator=generator)
    hidden = torch.randn(6, BLOCK - 1, HIDDEN, generator=generator)
    anchors = torch.randint(0, VOCAB, (6,), generator=generator)
    with torch.no_grad():
        expected, expected_candidates, _ = reference.propose(hidden, anchors, head, 0.0)
        tokens, candidates, q = drafter.candidate_selector.walk(hidden, head(hidden), anchors)
        unary_only = head(hidden).argmax(-1)
    assert torch.equal(tokens, expected) and q is None
    assert torch.equal(candidates.sort(-1).values, expected_candidates.sort(-1).values)
    assert not torch.equal(tokens, unary_only)  # the pair scores changed some picks

    # Sampled: the same q over the same candidates (compared by candidate id: the order may differ).
    with torch.no_grad():
        _, ref_candidates, ref_q = reference.propose(hidden, anchors, head, 0.7)
        _, ours_candidates, ours_q = drafter.candidate_selector.walk(hidden, head(hidden), anchors, 0.7)
    # q depends on the sampled predecessors; compare at the first position, where it is the anchor's.
    ref_order, ours_order = ref_candidates[:, 0].argsort(-1), ours_candidates[:, 0].argsort(-1)
    torch.testing.assert_close(ours_q[:, 0].gather(-1, ours_order), ref_q[:, 0].gather(-1, ref_order))
    torch.testing.assert_close(ours_q.sum(-1), torch.ones(6, BLOCK - 1))


def test_fresh_dflash2_drafter_computes_what_its_dflash_weights_compute() -> None:
    dflash = DFlashDrafter(_config("dflash"), seed=5).eval()
    dflash2 = DFlashDrafter(_config(), seed=5).eval()
    assert all(isinstance(layer.attention_conv, GroupedDynamicConv) for layer in dflash2.layers)
    # The same seed gives the same DFlash weights: the DFlash 2 modules draw after them.
    shared = dflash.state_dict()
    for name, tensor in shared.items():
        torch.testing.assert_close(dflash2.state_dict()[name], tensor, atol=0, rtol=0)
    inputs = _training_layout()
    with torch.no_grad():
        torch.testing.assert_close(dflash2(*inputs), dflash(*inputs), atol=0, rtol=0)
        # Also in training precision: fp32 weights, bf16 residual stream under autocast.
        context, blocks, *rest = inputs
        with torch.autocast("cpu", dtype=torch.bfloat16):
            bf16_inputs = (context.bfloat16(), blocks.bfloat16(), *rest)
            torch.testing.assert_close(dflash2(*bf16_inputs), dflash(*bf16_inputs), atol=0, rtol=0)
    selector = dflash2.candidate_selector
    assert selector.successor_codebook.abs().sum() == 0 and selector.predecessor_codebook.std() > 0
    logits = torch.randn(2, BLOCK - 1, VOCAB)
    tokens, _, _ = selector.walk(torch.randn(2, BLOCK - 1, HIDDEN), logits, torch.tensor([1, 2]))
    assert torch.equal(tokens, logits.argmax(-1))  # a no-op: the unary argmax


def test_under_autocast_the_convolutions_take_the_residual_dtype(monkeypatch) -> None:
    # Training keeps fp32 weights under bf16 autocast, where an fp32 norm weight makes the normed
    # input fp32; the reference's bf16 drafter convolves bf16 (and bf16 moves half the bytes).
    seen = []
    convolve = dflash2_module.grouped_dynamic_convolve

    def recording(values, *args):
        seen.append(values.dtype)
        return convolve(values, *args)

    monkeypatch.setattr(dflash2_module, "grouped_dynamic_convolve", recording)
    drafter = _randomised(DFlashDrafter(_config(), seed=0))
    context, blocks, *rest = _training_layout()
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        hidden = drafter(context.bfloat16(), blocks.bfloat16(), *rest)
    assert hidden.isfinite().all()
    assert seen == [torch.bfloat16] * 4 * len(drafter.layers)  # both sides of both sublayers


def test_bad_dflash2_settings_are_named() -> None:
    with pytest.raises(ValueError, match="conv_group_size 24 must divide hidden_size 64"):
        _config(conv_group_size=24)
    with pytest.raises(ValueError, match="selector_top_k 301 exceeds vocab_size 300"):
        _config(selector_top_k=301)
    with pytest.raises(ValueError, match="arch 'dflash3'"):
        _config("dflash3")


def test_selector_walk_in_bf16_picks_the_reference_propose_tokens(tmp_path) -> None:
    drafter = _randomised(DFlashDrafter(_config(), seed=0))
    export_dir = export_drafter(drafter, tmp_path / "export")  # bf16, as training exports
    reference = DFlash2DraftModel.from_pretrained(export_dir, dtype=torch.bfloat16).eval()
    ours = load_exported_drafter(export_dir).eval()
    generator = torch.Generator().manual_seed(4)
    head = torch.nn.Linear(HIDDEN, VOCAB, bias=False).to(torch.bfloat16)
    head.weight.data = torch.randn(VOCAB, HIDDEN, generator=generator).bfloat16()
    # Many rows: picks that fp32 scoring of bf16 values would decide otherwise are then certain.
    hidden = torch.randn(1000, BLOCK - 1, HIDDEN, generator=generator).bfloat16()
    anchors = torch.randint(0, VOCAB, (1000,), generator=generator)
    with torch.no_grad():
        expected, _, _ = reference.propose(hidden, anchors, head, 0.0)
        tokens, _, _ = ours.candidate_selector.walk(hidden, head(hidden), anchors)
    assert torch.equal(tokens, expected)
