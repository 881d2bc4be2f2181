"""train.attention=flash on CPU: everything around FlashAttention 4's kernels.

The kernels need a Hopper GPU (tests/test_gpu.py runs them against flex). Here `_KERNELS` is
swapped for a dense reference that reads the same inputs the kernels get: the tile lists of the
orientation each direction uses (key tiles per query tile forward, query tiles per key tile
backward), the padded int32 anchors and the element rule, so the layouts, the op registration,
the autograd wiring and torch.compile around the ops are checked against the sdpa path.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import flex_attention
from transformers import Qwen3Config

from dflash_mp.kernels import flash_attention
from dflash_mp.kernels.block_mask import FLEX_TILE, block_mask_mod, tile_block_mask
from dflash_mp.models import drafter as drafter_module
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.objective.block_diffusion import drafter_loss
from tests.block_problems import make_sequences

HIDDEN, VOCAB, BLOCK, SEQ_LEN = 64, 300, 16, 150
TARGET = Qwen3Config(
    hidden_size=HIDDEN,
    intermediate_size=128,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=16,
    vocab_size=VOCAB,
    max_position_embeddings=512,
    initializer_range=0.2,
)
# 12 anchors x 16 = 192 queries and 150 + 192 keys: several tiles each way, some partial.
LOSS_ARGS = {"seed": 3, "num_anchors": 12, "gamma": 7.0}


def tiny_problem(draft_layers: int = 2, **layer_options):
    torch.manual_seed(0)
    config = build_drafter_config(
        TARGET, draft_layers, [1, 2], block_size=BLOCK, mask_token_id=VOCAB - 1, **layer_options
    )
    drafter = DFlashDrafter(config)
    input_ids, loss_mask, lengths = make_sequences([SEQ_LEN, 131], seq_len=SEQ_LEN)
    batch = SimpleNamespace(
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        sample_ids=torch.tensor([7, 8]),
        epoch=1,
        hidden_states=torch.randn(2, SEQ_LEN, 2 * HIDDEN),
    )
    return drafter, torch.randn(VOCAB, HIDDEN), torch.randn(VOCAB, HIDDEN), batch


def _dense_from_tiles(counts, indices, full_counts, full_indices, rows: int, cols: int):
    """(listed partial tiles, full tiles) as [B, rows, cols] bool element masks."""

    def expand(count, index):
        batch, _, tile_rows = count.shape
        tiles = torch.zeros(batch, tile_rows, index.shape[-1] + 1, dtype=torch.bool)
        for b in range(batch):
            for r in range(tile_rows):
                tiles[b, r, index[b, 0, r, : count[b, 0, r]].long()] = True
        tiles = tiles[:, :, :-1]
        return tiles.repeat_interleave(FLEX_TILE, 1).repeat_interleave(FLEX_TILE, 2)[:, :rows, :cols]

    return expand(counts, indices), expand(full_counts, full_indices)


def _reference_mask(anchors, starts, tiles, block_size, queries, keys, transposed: bool):
    if transposed:  # backward lists: query tiles per key tile
        partial, full = _dense_from_tiles(*tiles, keys, queries)
        partial, full = partial.transpose(1, 2), full.transpose(1, 2)
    else:
        partial, full = _dense_from_tiles(*tiles, queries, keys)
    rule = block_mask_mod(anchors, keys - queries, block_size, starts=starts)
    b = torch.arange(anchors.shape[0])[:, None, None]
    allowed = rule(b, None, torch.arange(queries)[None, :, None], torch.arange(keys)[None, None, :])
    return (full | (partial & allowed))[:, None]  # [B, 1, Q, K]


def _probabilities(q, k, mask, scale):
    """Softmax weights [B, H, Q, K] and log-sum-exp [B, H, Q]; k's heads repeated for GQA."""
    k = k.repeat_interleave(q.shape[2] // k.shape[2], 2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k).mul(scale).masked_fill(~mask, float("-inf"))
    lse = scores.logsumexp(-1)
    return (scores - lse[..., None]).exp(), lse


def _reference_attention(q, k, v, mask, scale):
    probs, lse = _probabilities(q, k, mask, scale)
    groups = q.shape[2] // v.shape[2]
    return torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(groups, 2)), lse


def _reference_gradients(grad_out, q, k, v, out, mask, scale):
    """The attention backward in closed form (the op runs below autograd, so no autograd.grad)."""
    probs, _ = _probabilities(q, k, mask, scale)
    groups = q.shape[2] // k.shape[2]
    k_rep, v_rep = k.repeat_interleave(groups, 2), v.repeat_interleave(groups, 2)
    grad_probs = torch.einsum("bqhd,bkhd->bhqk", grad_out, v_rep)
    row_dot = (grad_out * out).sum(-1).transpose(1, 2)[..., None]  # [B, H, Q, 1]
    grad_scores = probs * (grad_probs - row_dot) * scale
    dq = torch.einsum("bhqk,bkhd->bqhd", grad_scores, k_rep)
    dk = torch.einsum("bhqk,bqhd->bkhd", grad_scores, q).unflatten(2, (k.shape[2], groups)).sum(3)
    dv = torch.einsum("bhqk,bqhd->bkhd", probs, grad_out).unflatten(2, (v.shape[2], groups)).sum(3)
    return dq, dk, dv


class DenseKernels:
    """Stands in for FA4: same arguments, dense math; counts the calls."""

    def __init__(self):
        self.calls = {"forward": 0, "backward": 0}

    def forward(self, q, k, v, anchors, starts, tiles, block_size, scale):
        self.calls["forward"] += 1
        mask = _reference_mask(anchors, starts, tiles, block_size, q.shape[1], k.shape[1], transposed=False)
        return _reference_attention(q, k, v, mask, scale)

    def backward(self, grad_out, q, k, v, out, lse, anchors, starts, tiles, block_size, scale):
        self.calls["backward"] += 1
        mask = _reference_mask(anchors, starts, tiles, block_size, q.shape[1], k.shape[1], transposed=True)
        return _reference_gradients(grad_out, q, k, v, out, mask, scale)


@pytest.fixture
def dense_kernels(monkeypatch):
    kernels = DenseKernels()
    monkeypatch.setattr(flash_attention._KERNELS, "forward", kernels.forward)
    monkeypatch.setattr(flash_attention._KERNELS, "backward", kernels.backward)
    return kernels


def test_tile_mask_pads_anchors_to_whole_query_tiles() -> None:
    anchors = torch.tensor([[3, 9, 20]])
    mask = tile_block_mask(anchors, context_len=40, block_size=16)
    assert mask.anchors.dtype == torch.int32 and mask.block_size == 16
    assert mask.anchors.shape == (1, FLEX_TILE // 16)  # 3 blocks are 48 queries: one tile
    assert mask.anchors.tolist() == [[3, 9, 20, 20, 20, 20, 20, 20]]


@pytest.mark.parametrize("mode", ["eager", "compiled", "checkpointed"])
def test_flash_path_matches_sdpa_loss_and_gradients(dense_kernels, mode: str) -> None:
    """The whole drafter loss with attention=flash equals sdpa's, values and every gradient.

    Compiled: only the flash drafter compiles (sdpa stays eager: aot_eager runs the same ops), with
    one layer, whose graph is a first layer on compact rows and a last one without each block's
    index 0 at once: one dynamic compile, forward and backward, of the op (a third of the CPU)."""
    draft_layers = 1 if mode == "compiled" else 2
    results = {}
    for attention in ("sdpa", "flash"):
        drafter, embed, head, batch = tiny_problem(draft_layers)
        if mode == "compiled" and attention == "flash":
            drafter.compile_layers(backend="aot_eager", dynamic=True)
        drafter.gradient_checkpointing = mode == "checkpointed"
        loss, _ = drafter_loss(drafter, embed, head, batch, attention=attention, **LOSS_ARGS)
        loss.backward()
        grads = {name: p.grad.clone() for name, p in drafter.named_parameters() if p.grad is not None}
        results[attention] = (loss.detach(), grads)
    (sdpa_loss, sdpa_grads), (flash_loss, flash_grads) = results["sdpa"], results["flash"]
    torch.testing.assert_close(flash_loss, sdpa_loss, rtol=1e-5, atol=1e-6)
    assert flash_grads.keys() == sdpa_grads.keys() and flash_grads
    for name, grad in sdpa_grads.items():
        torch.testing.assert_close(flash_grads[name], grad, rtol=1e-4, atol=1e-6, msg=name)
    layers = len(drafter.layers)
    recomputed = layers if mode == "checkpointed" else 0  # the forward again in the backward
    assert dense_kernels.calls == {"forward": layers + recomputed, "backward": layers}


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_sliding_layers_keep_flex_under_flash(dense_kernels, monkeypatch) -> None:
    """A sliding-attention layer takes flex's BlockMask (FA4's rule has no window); forward only,
    in eager flex: on CPU it has no backward."""
    monkeypatch.setattr(drafter_module, "_compiled_flex_attention", lambda: flex_attention)
    layers = {"layer_types": ["sliding_attention", "full_attention"], "sliding_window": 40}
    losses = []
    for attention in ("sdpa", "flash"):
        drafter, embed, head, batch = tiny_problem(**layers)
        with torch.no_grad():
            losses.append(drafter_loss(drafter, embed, head, batch, attention=attention, **LOSS_ARGS)[0])
    torch.testing.assert_close(losses[1], losses[0], rtol=1e-5, atol=1e-6)
    assert dense_kernels.calls == {"forward": 1, "backward": 0}  # the full-attention layer only


def test_flash_needs_a_hopper_gpu_and_the_package() -> None:
    with pytest.raises(ValueError, match="needs a CUDA GPU"):
        flash_attention.check_flash_supported(torch.device("cpu"))


def _flash_runs_here() -> bool:
    return (
        torch.cuda.is_available()
        and torch.cuda.get_device_capability()[0] >= 9
        and flash_attention.flash_available()
    )


def _compare_with_fp32_sdpa(context_len: int) -> None:
    """FA4 with the CuTe rule against fp32 SDPA on the dense mask, at the tolerance bf16 flex meets
    (test_block_diffusion.py). Flex itself is not run here: compiling it for more shapes in one process
    pushed flex_attention past dynamo's recompile limit, and later GPU tests got its eager fallback."""
    from dflash_mp.kernels.block_mask import dense_block_mask
    from tests.block_problems import random_anchors

    num_anchors, block_size, heads, kv_heads, head_dim = 37, 16, 8, 2, 128
    queries, keys = num_anchors * block_size, context_len + num_anchors * block_size
    anchors = random_anchors(2, num_anchors, context_len).cuda()
    torch.manual_seed(0)
    q = torch.randn(2, queries, heads, head_dim, device="cuda")
    k, v = (torch.randn(2, keys, kv_heads, head_dim, device="cuda") for _ in range(2))
    grad_out = torch.randn_like(q)
    scale = head_dim**-0.5
    dense = dense_block_mask(anchors, context_len, block_size)

    def sdpa(q, k, v):
        q, k, v = (x.transpose(1, 2) for x in (q, k, v))
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=dense, scale=scale, enable_gqa=True)
        return out.transpose(1, 2)

    def run(attend, dtype):
        inputs = [x.detach().to(dtype).requires_grad_() for x in (q, k, v)]
        out = attend(*inputs)
        out.backward(grad_out.to(dtype))
        return [out.float()] + [x.grad.float() for x in inputs]

    reference = run(sdpa, torch.float32)
    tile_mask = tile_block_mask(anchors, context_len, block_size)
    flash = run(
        lambda q, k, v: flash_attention.flash_block_attention(q, k, v, tile_mask, scale), torch.bfloat16
    )
    for name, ref, flash_value in zip(("out", "dq", "dk", "dv"), reference, flash, strict=True):
        torch.testing.assert_close(flash_value, ref, atol=3e-2, rtol=3e-2, msg=name)


@pytest.mark.gpu
@pytest.mark.skipif(not _flash_runs_here(), reason="needs a Hopper GPU and flash-attn-4")
def test_fa4_kernels_match_fp32_attention_and_compile_once_for_all_lengths() -> None:
    from flash_attn.cute.interface import _flash_attn_bwd, _flash_attn_fwd

    _compare_with_fp32_sdpa(700)  # context and queries not a multiple of the tile
    compiled = len(_flash_attn_fwd.compile_cache.cache), len(_flash_attn_bwd.compile_cache.cache)
    _compare_with_fp32_sdpa(1024)
    # Sequence lengths change every micro-batch: a new length must not compile new kernels.
    assert (len(_flash_attn_fwd.compile_cache.cache), len(_flash_attn_bwd.compile_cache.cache)) == compiled


def test_doctor_says_which_attention_runs_and_refuses_a_flash_that_cannot(monkeypatch) -> None:
    from dflash_mp.launch import doctor

    assert not doctor.check_attention("flash", "auto", uses_gpu=False).ok
    assert doctor.check_attention("auto", "auto", uses_gpu=False).message == "sdpa (CPU)"
    monkeypatch.setattr(
        flash_attention, "flash_unusable_reason", lambda device: "flash_attn.cute is not installed"
    )
    refused = doctor.check_attention("flash", "auto", uses_gpu=True)
    assert not refused.ok and "not installed" in refused.message
    fallback = doctor.check_attention("auto", "auto", uses_gpu=True)
    assert fallback.ok and fallback.message.startswith("flex") and "not installed" in fallback.message
    monkeypatch.setattr(flash_attention, "flash_unusable_reason", lambda device: None)
    assert doctor.check_attention("auto", "auto", uses_gpu=True).message == "flash (FlashAttention 4)"
    assert not doctor.check_attention("flash", "float32", uses_gpu=True).ok
    assert doctor.check_attention("flex", "auto", uses_gpu=True).message == "flex"


def test_auto_attention_takes_flash_only_where_it_runs(monkeypatch) -> None:
    from dflash_mp.config import precision
    from tests.drafters import embedded_config

    cfg = embedded_config()
    assert precision.resolve_precision(cfg, torch.device("cpu"))[1] == "sdpa"
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(precision, "flash_unusable_reason", lambda device: None)
    assert precision.resolve_precision(cfg, cuda)[1] == "flash"
    assert precision.resolve_precision(embedded_config("train.dtype=float32"), cuda)[1] == "flex"
    monkeypatch.setattr(precision, "flash_unusable_reason", lambda device: "not installed")
    assert precision.resolve_precision(cfg, cuda)[1] == "flex"


def test_flash_on_cpu_or_in_fp32_is_refused_before_any_work() -> None:
    from dflash_mp.config.validation import ConfigError, validate
    from tests.drafters import embedded_config

    for override in ("train.device=cpu", "train.dtype=float32"):
        with pytest.raises(
            ConfigError, match=r"train.attention=flash .* use train.attention=flex \(GPU\) or sdpa"
        ):
            validate(embedded_config("train.attention=flash", override), world_size=3)
    validate(embedded_config("train.attention=flash"), world_size=3)


def test_tile_lists_have_row_major_strides_even_one_tile_wide() -> None:
    """FA4 refused (on the GPU) a backward list of a single query tile whose last stride was 2."""
    mask = tile_block_mask(torch.tensor([[5, 30, 60]]), context_len=200, block_size=16)  # 1 x 2 tiles
    tiles = mask.tiles
    lists = (tiles.kv_num_blocks, tiles.kv_indices, tiles.full_kv_num_blocks, tiles.full_kv_indices)
    lists += (tiles.q_num_blocks, tiles.q_indices, tiles.full_q_num_blocks, tiles.full_q_indices)
    assert tiles.q_indices.shape[-1] == 1
    for tensor in lists:
        assert tensor.stride() == torch.empty(tensor.shape).stride(), tensor.shape
