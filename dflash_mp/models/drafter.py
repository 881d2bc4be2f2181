"""The DFlash (and DFlash 2) drafter as a training module (docs/DESIGN.md §3).

Parameter names, config keys and numerics follow the reference `dflash.model.DFlashDraftModel`, so an
export of this module loads there unchanged. Unlike the reference, one forward pass takes many blocks
at once: the caller passes every block of a sequence together with a block-sparse mask, and the
result equals running the reference once per block.

With `arch="dflash2"` (a config whose `dflash_config` carries the conv and selector fields) every
attention and MLP sublayer is wrapped in a grouped dynamic convolution and the drafter carries a
candidate selector (`dflash_mp.models.dflash2`), as `dflash.model.DFlash2DraftModel` does.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.nn.attention.flex_attention import BlockMask, flex_attention
from torch.utils.checkpoint import checkpoint
from transformers import Qwen3Config

from dflash_mp.kernels.block_mask import TileMask
from dflash_mp.kernels.flash_attention import flash_block_attention
from dflash_mp.models.block_rows import BlockRows, expand_rows, scored_rows
from dflash_mp.models.dflash2 import CandidateSelector, GroupedDynamicConv
from dflash_mp.models.drafter_config import SCALING_DEFAULTS, drafter_arch
from dflash_mp.models.dspark import ConfidenceHead, MarkovHead, build_heads
from dflash_mp.models.qwen3_layers import GatedMLP, RMSNorm, rotary_embedding, rotate_half
from dflash_mp.models.xpress import XPressRefiner

AttentionMask = torch.Tensor | BlockMask | TileMask


def scale_logits(logits: torch.Tensor, multiplier: float, softcap: float | None) -> torch.Tensor:
    """The reference's `compute_logits` after the head: logits * multiplier, then c * tanh(x / c)."""
    logits = logits * multiplier
    if softcap is not None and softcap > 0:
        logits = torch.tanh(logits / softcap) * softcap
    return logits


@functools.cache
def _compiled_flex_attention() -> Callable[..., torch.Tensor]:
    # Compiled on first use, once per process: eager flex_attention materialises the full score matrix.
    # Dynamic shapes: sequence lengths change every micro-batch, and each static recompile costs seconds.
    # Default kernel options: tile, warp, stage and TMA sweeps gained nothing, ROWS_GUARANTEED_SAFE
    # made every step non-finite on torch 2.11, and cuDNN in pieces was slower (BENCHMARKS.md).
    return torch.compile(flex_attention, dynamic=True)


def _rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    return x * cos + rotate_half(x) * sin


class DFlashAttention(nn.Module):
    """Block queries attend to [projected context ; block] keys, all at their true positions."""

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.block_size = int(config.dflash_config["block_size"])
        self.head_dim = config.head_dim
        self.scaling = self.head_dim**-0.5
        bias = config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, config.num_attention_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, config.num_key_value_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(config.num_attention_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = RMSNorm(self.head_dim, eps=config.rms_norm_eps)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        compact: bool = False,
        drop_first: bool = False,
    ) -> torch.Tensor:
        """Attention output [B, Q, H] of the block rows `hidden_states` [B, Q, H]; `compact`: they
        are a `BlockRows` (block_rows.py) and Q = N*Bs; `drop_first`: the output leaves out each
        block's index 0 ([B, N*(Bs-1), H])."""
        q, k, v = self._project(hidden_states, context, compact)
        batch, num_queries = q.shape[:2]
        if isinstance(mask, TileMask):
            # FlashAttention 4 takes [B, tokens, heads, head_dim]: RoPE in that layout, no transposes.
            cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)
            q = _rope(q, cos[:, -num_queries:], sin[:, -num_queries:]).to(v.dtype)
            k = _rope(k, cos, sin).to(v.dtype)
            out = flash_block_attention(q, k, v, mask, self.scaling)
        else:
            q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, tokens, head_dim]
            # cos/sin cover [context ; block] positions; the queries are the block, i.e. the last rows.
            q = _rope(q, cos[:, :, -num_queries:], sin[:, :, -num_queries:])
            k = _rope(k, cos, sin)
            if isinstance(mask, BlockMask):
                out = _compiled_flex_attention()(
                    q, k, v, block_mask=mask, scale=self.scaling, enable_gqa=True
                )
            else:
                out = F.scaled_dot_product_attention(
                    q, k, v, attn_mask=mask, scale=self.scaling, enable_gqa=True
                )
            out = out.transpose(1, 2)
        out = out.reshape(batch, num_queries, -1)
        return self.o_proj(scored_rows(out, self.block_size) if drop_first else out)

    def _project(
        self, hidden_states: torch.Tensor | BlockRows, context: torch.Tensor, compact: bool
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q [B, Q, heads, head_dim] of the block rows; k, v [B, S+Q, kv_heads, head_dim] of
        [context ; block rows], normed (q, k) and before RoPE."""

        def heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(*x.shape[:2], -1, self.head_dim)

        if not compact:
            keys_in = torch.cat([context, hidden_states], dim=1)
            q = self.q_norm(heads(self.q_proj(hidden_states)))
            return q, self.k_norm(heads(self.k_proj(keys_in))), heads(self.v_proj(keys_in))
        # Row-wise projections and norms of the distinct rows, expanded after (block_rows.py).
        bs = self.block_size
        q = expand_rows(hidden_states.map(lambda x: self.q_norm(heads(self.q_proj(x)))), bs)
        k_block = expand_rows(hidden_states.map(lambda x: self.k_norm(heads(self.k_proj(x)))), bs)
        v_block = expand_rows(hidden_states.map(lambda x: heads(self.v_proj(x))), bs)
        k = torch.cat([self.k_norm(heads(self.k_proj(context))), k_block], dim=1)
        return q, k, torch.cat([heads(self.v_proj(context)), v_block], dim=1)


class DFlashDecoderLayer(nn.Module):
    """A pre-norm Qwen3 decoder layer whose attention also reads the target context.

    DFlash 2 wraps each sublayer in a convolution over block positions: h + Conv_1(f(Conv_0(x))).
    The context K/V are not convolved.
    """

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config)
        self.mlp = GatedMLP(config)
        self.input_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None
        if drafter_arch(config) == "dflash2":
            kernel, group = config.dflash_config["conv_kernel_size"], config.dflash_config["conv_group_size"]
            self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        mask: AttentionMask,
        position_in_block: torch.Tensor | None = None,
        compact: bool = False,
        drop_first: bool = False,
    ) -> torch.Tensor:
        """`compact`: `hidden_states` is a `BlockRows` (block_rows.py); `drop_first`: the output
        leaves out each block's index 0. Both for DFlash layers only (no convolutions)."""
        if self.attention_conv is None:
            normed = (
                hidden_states.map(self.input_layernorm) if compact else self.input_layernorm(hidden_states)
            )
            attended = self.self_attn(normed, context, cos, sin, mask, compact, drop_first)
            block_size = self.self_attn.block_size
            if compact:
                hidden_states = expand_rows(hidden_states, block_size)
            if drop_first:
                hidden_states = scored_rows(hidden_states, block_size)
            hidden_states = hidden_states + attended
            return hidden_states + self.mlp(self.post_attention_layernorm(hidden_states))
        if compact or drop_first:  # a convolution mixes a block's rows before and after each sublayer
            raise ValueError("compact and drop_first apply to DFlash layers, not DFlash 2's")
        normed = self.input_layernorm(hidden_states)
        # The convolutions take the normed input in the residual stream's dtype. Under autocast the
        # fp32 norm weight would make it fp32, where the reference's bf16 drafter convolves bf16;
        # fp32 also doubles what the convolution and its backward move (BENCHMARKS.md, "What
        # changed the numbers", DFlash 2). Without autocast this is a no-op.
        dtype = hidden_states.dtype
        convolved, after = self.attention_conv.prepare(normed.to(dtype), position_in_block)
        attended = self.self_attn(convolved, context, cos, sin, mask)
        hidden_states = hidden_states + self.attention_conv.finish(attended, after, position_in_block)
        normed = self.post_attention_layernorm(hidden_states).to(dtype)
        convolved, after = self.mlp_conv.prepare(normed, position_in_block)
        return hidden_states + self.mlp_conv.finish(self.mlp(convolved), after, position_in_block)


class DFlashDrafter(nn.Module):
    """DFlash draft layers over target features; state dict keys equal `DFlashDraftModel`'s.

    The token embedding and LM head belong to the frozen target and live outside this module.
    A DFlash 2 config adds the convolutions and `candidate_selector` (keys of `DFlash2DraftModel`);
    the selector runs on the head's logits outside `forward` (the loss and the decoding loop).
    """

    def __init__(self, config: Qwen3Config, seed: int = 0, gradient_checkpointing: bool = False) -> None:
        super().__init__()
        dflash = config.dflash_config
        self.config = config
        self.target_layer_ids: list[int] = list(dflash["target_layer_ids"])
        self.block_size: int = int(dflash["block_size"])
        self.mask_token_id: int = int(dflash["mask_token_id"])
        self.gradient_checkpointing = gradient_checkpointing
        self.layer_types: list[str] = list(
            config.layer_types or ["full_attention"] * config.num_hidden_layers
        )
        self.sliding_window: int | None = (
            config.sliding_window if "sliding_attention" in self.layer_types else None
        )
        # The reference reads these from dflash_config, else from the top level.
        scaling = {
            key: dflash.get(key, getattr(config, key, default)) for key, default in SCALING_DEFAULTS.items()
        }
        self.input_embedding_scale = float(scaling["input_embedding_scale"])
        self.output_multiplier = float(scaling["output_multiplier"])
        softcap = scaling["final_logit_softcapping"]
        self.final_logit_softcapping: float | None = float(softcap) if softcap else None
        self.layers = nn.ModuleList(DFlashDecoderLayer(config) for _ in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = rotary_embedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.arch = drafter_arch(config)
        self.candidate_selector: CandidateSelector | None = None
        if self.arch == "dflash2":
            self.candidate_selector = CandidateSelector(
                config.hidden_size,
                config.vocab_size,
                int(dflash["selector_rank"]),
                int(dflash["selector_top_k"]),
            )
        # XPress (models/xpress.py): a refiner on the draft logits; the layers are DFlash's.
        self.refiner_head: XPressRefiner | None = None
        self.num_jacobi_passes = 0
        if self.arch == "xpress":
            self.num_jacobi_passes = int(dflash["num_jacobi_passes"])
            self.refiner_head = XPressRefiner(
                config.hidden_size,
                config.vocab_size,
                self.block_size,
                int(dflash["xpress_rank"]),
                int(dflash["xpress_mlp_ratio"]),
            )
        # DSpark (models/dspark.py): a Markov logit bias and a confidence head on the DFlash layers.
        self.markov_head: MarkovHead | None = None
        self.confidence_head: ConfidenceHead | None = None
        self.sample_from_anchor = False
        self.confidence_with_markov = False
        if self.arch == "dspark":
            self.markov_head, self.confidence_head = build_heads(
                dflash, config.vocab_size, config.hidden_size
            )
            self.sample_from_anchor = bool(dflash["sample_from_anchor"])
            self.confidence_with_markov = bool(dflash["confidence_head_with_markov"])
        self.init_weights(torch.Generator().manual_seed(seed))

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """HF Qwen3 init (normal(0, initializer_range) linears, zero biases, unit norms) from `generator`.

        Parameters are drawn in module order from one CPU generator, so every drafter rank that passes
        the same seed starts from identical weights regardless of its device. The DFlash 2 modules
        draw nothing until the DFlash weights are done, so one seed gives a DFlash and a DFlash 2
        drafter the same DFlash weights; the convolutions start as the identity and the selector
        as a no-op, so at step 0 both compute the same thing.
        """
        std = self.config.initializer_range
        added = {
            id(inner)
            for module in self.modules()
            if isinstance(
                module, (GroupedDynamicConv, CandidateSelector, XPressRefiner, MarkovHead, ConfidenceHead)
            )
            for inner in module.modules()
        }
        for module in self.modules():
            if id(module) in added:
                continue
            if isinstance(module, nn.Linear):
                weight = torch.empty(module.weight.shape, dtype=torch.float32)
                module.weight.copy_(weight.normal_(0.0, std, generator=generator))
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
        for module in self.modules():
            if isinstance(module, GroupedDynamicConv):
                module.reset_to_identity()
        if self.candidate_selector is not None:
            self.candidate_selector.init_weights(std, generator)
        if self.refiner_head is not None:
            self.refiner_head.init_weights(generator)
        for head in (self.markov_head, self.confidence_head):
            if head is not None:
                head.init_weights(std, generator)

    def logits(self, hidden: torch.Tensor, head: nn.Module) -> torch.Tensor:
        """The draft logits of hidden states through the target's head, as the reference computes them."""
        return scale_logits(head(hidden), self.output_multiplier, self.final_logit_softcapping)

    def compile_layers(self, **compile_options: Any) -> None:
        """torch.compile each decoder layer ("regional compilation").

        A few compiled graphs serve all layers (in training: layer 0, on compact rows whose input
        needs no gradient, the middle layers and the last one, without each block's index 0), so a
        cold start compiles those layers' forward and backward instead of the whole unrolled
        drafter; fusion inside a layer, where the elementwise work is, is the same. The few ops
        around the layers (fc, two norms, RoPE tables) stay eager.
        """
        for layer in self.layers:
            layer.compile(**compile_options)

    @property
    def skips_repeated_rows(self) -> bool:
        """Whether `forward` computes a first layer on compact rows and a last layer without each
        block's index 0 (block_rows.py); DFlash 2's convolutions mix a block's rows first."""
        return self.arch == "dflash"

    def forward(
        self,
        context_features: torch.Tensor,
        block_embeddings: torch.Tensor | BlockRows,
        context_positions: torch.Tensor,
        block_positions: torch.Tensor,
        mask: AttentionMask | Mapping[str, AttentionMask],
        scored_rows_only: bool = False,
    ) -> torch.Tensor:
        """Hidden states [B, Q, H] (after the final norm) for the block tokens; with
        `scored_rows_only`, [B, N*(Bs-1), H]: without each block's index 0, which the loss never scores.

        context_features [B, S, K*H] are the concatenated target layer outputs; block_embeddings
        [B, Q, H] the target's embeddings of the block tokens, or a `BlockRows` of back-to-back
        blocks of Bs (anchor token, then mask tokens), which spares the first layer the repeated
        rows; positions are the tokens' true positions.
        `mask` is a boolean [B, 1, Q, S+Q] tensor (True = may attend; keys are context first, then the
        block), a flex_attention BlockMask over the same [Q, S+Q] layout or a TileMask (FlashAttention 4;
        `dflash_mp.kernels.block_mask`); or a mapping from layer
        type ("full_attention", "sliding_attention") to such a mask, each layer taking its type's.
        """
        context = self.hidden_norm(self.fc(context_features))
        positions = torch.cat([context_positions, block_positions], dim=1)
        compact = isinstance(block_embeddings, BlockRows)
        # The tables take the block embeddings' dtype (bf16 in training), as the reference's do.
        cos, sin = self.rotary_emb(block_embeddings.first if compact else block_embeddings, positions)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        hidden_states = block_embeddings
        if compact and not self.skips_repeated_rows:
            hidden_states, compact = expand_rows(block_embeddings, self.block_size), False
        # Blocks lie back to back (training) or alone (decoding): row q is at index q % Bs of its block.
        position_in_block = None
        if self.arch == "dflash2":
            position_in_block = torch.arange(block_positions.shape[1], device=block_positions.device)
            position_in_block = position_in_block % self.block_size
        last = len(self.layers) - 1
        for index, (layer, layer_type) in enumerate(zip(self.layers, self.layer_types, strict=True)):
            layer_mask = mask[layer_type] if isinstance(mask, Mapping) else mask
            rows = (
                compact and index == 0,  # compact input rows
                scored_rows_only and self.skips_repeated_rows and index == last,  # drop index 0
            )
            if self.gradient_checkpointing and self.training:
                hidden_states = checkpoint(
                    layer,
                    hidden_states,
                    context,
                    cos,
                    sin,
                    layer_mask,
                    position_in_block,
                    *rows,
                    use_reentrant=False,
                )
            else:
                hidden_states = layer(hidden_states, context, cos, sin, layer_mask, position_in_block, *rows)
        hidden_states = self.norm(hidden_states)
        if scored_rows_only and not self.skips_repeated_rows:
            hidden_states = scored_rows(hidden_states, self.block_size)
        return hidden_states
