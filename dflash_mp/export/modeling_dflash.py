"""The DFlash / DFlash 2 drafter behind `AutoModel.from_pretrained(export, trust_remote_code=True)`.

`dflash_mp.export` copies this file into every export as `modeling_dflash.py`, and config.json's
`auto_map` points `AutoModel` at `DFlashDraftModel` or `DFlash2DraftModel` here, the way the
published drafters ship their own modelling file. So it must stay self-contained: it imports only
torch and transformers, never dflash_mp.

The classes take the same arguments as the reference `dflash` package's (`forward(position_ids,
noise_embedding=..., target_hidden=..., past_key_values=..., use_cache=...)`, `compute_logits`,
`propose`) and load the same tensors: the block's noise embeddings (the target's embeddings of
the anchor and mask tokens, times `input_embedding_scale`) attend to the projected target
features followed by themselves, at their true positions, non-causal unless the config says
otherwise. The embedding and LM head are the target's and are not part of the export.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.qwen3.modeling_qwen3 import (
    Qwen3Config,
    Qwen3MLP,
    Qwen3PreTrainedModel,
    Qwen3RMSNorm,
    Qwen3RotaryEmbedding,
    rotate_half,
)


def draft_value(config: Qwen3Config, name: str, default=None):
    """A DFlash field: from `dflash_config`, else from the top level of config.json."""
    return (getattr(config, "dflash_config", None) or {}).get(name, getattr(config, name, default))


def visibility_mask(
    num_queries: int, num_keys: int, causal: bool, window: int | None, device: torch.device
) -> torch.Tensor:
    """[1, 1, Q, K] True where a query may attend; queries are the last Q of the K positions.

    A sliding window keeps keys with |query - key| < window (one-sided when causal)."""
    query = torch.arange(num_keys - num_queries, num_keys, device=device)[:, None]
    key = torch.arange(num_keys, device=device)[None, :]
    visible = torch.ones(num_queries, num_keys, dtype=torch.bool, device=device)
    if causal:
        visible &= key <= query
    if window is not None:
        visible &= query - key < window
        if not causal:
            visible &= key - query < window
    return visible[None, None]


class DFlashAttention(nn.Module):
    """Queries from the block; keys and values from [target features ; block], q/k RMS-normed."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.scaling = self.head_dim**-0.5
        heads, kv_heads, bias = config.num_attention_heads, config.num_key_value_heads, config.attention_bias
        self.q_proj = nn.Linear(config.hidden_size, heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(self.head_dim, eps=config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = layer_types[layer_idx] == "sliding_attention"
        # dflash_mp writes is_causal: false; without it a sliding layer is causal (the reference's rule).
        explicit = getattr(config, "is_causal", None)
        self.is_causal = sliding if explicit is None else bool(explicit)
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self,
        hidden_states: torch.Tensor,
        context: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        attention_mask: torch.Tensor | None,
        past_key_values=None,
    ) -> torch.Tensor:
        batch, num_queries = hidden_states.shape[:2]

        def split_heads(x: torch.Tensor) -> torch.Tensor:
            return x.view(batch, x.shape[1], -1, self.head_dim)

        keys_in = torch.cat([context, hidden_states], dim=1)
        q = self.q_norm(split_heads(self.q_proj(hidden_states))).transpose(1, 2)
        k = self.k_norm(split_heads(self.k_proj(keys_in))).transpose(1, 2)
        v = split_heads(self.v_proj(keys_in)).transpose(1, 2)
        # cos/sin cover [context ; block]; the queries are the block, i.e. the last rows.
        q = q * cos[:, :, -num_queries:] + rotate_half(q) * sin[:, :, -num_queries:]
        k = k * cos + rotate_half(k) * sin
        if past_key_values is not None:
            k, v = past_key_values.update(k, v, self.layer_idx)
        if attention_mask is None and (self.is_causal or self.sliding_window is not None):
            attention_mask = visibility_mask(
                num_queries, k.shape[2], self.is_causal, self.sliding_window, q.device
            )
        out = F.scaled_dot_product_attention(
            q, k, v, attn_mask=attention_mask, scale=self.scaling, enable_gqa=True
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, num_queries, -1))


class GroupedDynamicConv(nn.Module):
    """DFlash 2's depthwise convolution over the block's rows, with a per-row, per-group kernel
    correction predicted from the sublayer's normed input. Side 0 runs before the sublayer, side 1
    after it; a tap that reaches before the first row reads zeros."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, values: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        """values [B, L, D], dynamic [B, L, K, D/G], base [K, D]."""
        batch, length, _ = values.shape
        grouped = values.view(batch, length, self.groups, self.group_size)
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            earlier = F.pad(grouped, (0, 0, 0, 0, tap, 0))[:, :length]  # row t reads row t - tap
            static = base[tap].view(self.groups, self.group_size).to(values.dtype)
            out = out + static * earlier + dynamic[:, :, tap, :, None] * earlier
        return out.view_as(values)

    def prepare(self, normed: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(side 0 applied to `normed`, side 1's dynamic kernel)."""
        dynamic = self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.kernel_size, self.groups)
        return self._convolve(normed, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, sublayer_output: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(sublayer_output, dynamic, self.base_kernel[1])


class DFlashDecoderLayer(nn.Module):
    """Pre-norm attention and MLP; DFlash 2 wraps each sublayer in a convolution."""

    def __init__(self, config: Qwen3Config, layer_idx: int, convolved: bool) -> None:
        super().__init__()
        self.self_attn = DFlashAttention(config, layer_idx)
        self.mlp = Qwen3MLP(config)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.attention_conv = self.mlp_conv = None
        if convolved:
            kernel, group = (
                int(draft_value(config, "conv_kernel_size")),
                int(draft_value(config, "conv_group_size")),
            )
            self.attention_conv = GroupedDynamicConv(config.hidden_size, kernel, group)
            self.mlp_conv = GroupedDynamicConv(config.hidden_size, kernel, group)

    @staticmethod
    def _around(conv: GroupedDynamicConv | None, sublayer, normed: torch.Tensor) -> torch.Tensor:
        if conv is None:
            return sublayer(normed)
        convolved, dynamic = conv.prepare(normed)
        return conv.finish(sublayer(convolved), dynamic)

    def forward(self, hidden_states, context, cos, sin, attention_mask=None, past_key_values=None):
        def attend(x: torch.Tensor) -> torch.Tensor:
            return self.self_attn(x, context, cos, sin, attention_mask, past_key_values)

        normed = self.input_layernorm(hidden_states)
        hidden_states = hidden_states + self._around(self.attention_conv, attend, normed)
        normed = self.post_attention_layernorm(hidden_states)
        return hidden_states + self._around(self.mlp_conv, self.mlp, normed)


class CandidateSelector(nn.Module):
    """DFlash 2's low-rank scores of each top-K candidate given the previous pick:
    s_t(a, b) = logit_t(b) + <A[a] * W h_t, B[b]>. Codebooks are bare parameters, as exported."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def select(self, hidden, logits, anchor_ids, temperature: float = 0.0):
        """Walk the block from the anchor: (tokens [B, T], candidates [B, T, K], q [B, T, K] or None)."""
        unary, candidates = logits.topk(self.top_k, dim=-1, sorted=False)
        projected = self.hidden_projection(hidden)
        previous, picks, q_rows = anchor_ids, [], []
        for t in range(hidden.shape[1]):
            query = self.predecessor_codebook[previous] * projected[:, t]
            scores = unary[:, t] + torch.einsum(
                "br,bkr->bk", query, self.successor_codebook[candidates[:, t]]
            )
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(q, 1)[:, 0]
                q_rows.append(q)
            else:
                index = scores.argmax(-1)
            previous = candidates[:, t].gather(-1, index[:, None])[:, 0]
            picks.append(previous)
        return torch.stack(picks, dim=1), candidates, torch.stack(q_rows, dim=1) if q_rows else None


class DFlashDraftModel(Qwen3PreTrainedModel):
    """DFlash draft layers over the concatenated hidden states of the target's `target_layer_ids`."""

    config_class = Qwen3Config
    _no_split_modules = ["DFlashDecoderLayer"]
    convolved = False

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        target_layer_ids = draft_value(config, "target_layer_ids")
        if not target_layer_ids:
            raise ValueError("config.json has no dflash_config.target_layer_ids: re-export the drafter")
        self.target_layer_ids = [int(i) for i in target_layer_ids]
        self.block_size = int(draft_value(config, "block_size", 16))
        self.mask_token_id = draft_value(config, "mask_token_id")
        self.layers = nn.ModuleList(
            DFlashDecoderLayer(config, i, self.convolved) for i in range(config.num_hidden_layers)
        )
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary_emb = Qwen3RotaryEmbedding(config)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        if self.convolved:
            self.candidate_selector = CandidateSelector(
                config.hidden_size,
                config.vocab_size,
                int(draft_value(config, "selector_rank")),
                int(draft_value(config, "selector_top_k")),
            )
        self.post_init()

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        **kwargs,
    ) -> torch.Tensor:
        """Hidden states [B, T, H] after the final norm for the block's noise embeddings [B, T, H].

        target_hidden [B, S, K*H]: the target layers' outputs, concatenated on the last axis;
        position_ids [B, S+T]: the positions of the target tokens, then the block's."""
        context = self.hidden_norm(self.fc(target_hidden))
        cos, sin = self.rotary_emb(noise_embedding, position_ids)
        cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads
        hidden_states = noise_embedding
        for layer in self.layers:
            hidden_states = layer(hidden_states, context, cos, sin, attention_mask, past_key_values)
        return self.norm(hidden_states)

    def compute_logits(self, hidden: torch.Tensor, output_head: nn.Module) -> torch.Tensor:
        """The target head's logits, times `output_multiplier`, soft-capped at `final_logit_softcapping`."""
        logits = output_head(hidden) * float(draft_value(self.config, "output_multiplier", 1.0))
        softcap = draft_value(self.config, "final_logit_softcapping")
        if softcap is not None and float(softcap) > 0:
            logits = torch.tanh(logits / float(softcap)) * float(softcap)
        return logits


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash 2: convolutions around every sublayer and a candidate selector over the head's top-K."""

    convolved = True

    def propose(self, hidden, anchor_ids, output_head, temperature: float = 0.0):
        """(tokens, candidates, q) for block positions 1.. from their hidden states."""
        return self.candidate_selector.select(
            hidden, self.compute_logits(hidden, output_head), anchor_ids, temperature
        )
