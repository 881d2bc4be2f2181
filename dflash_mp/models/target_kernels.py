"""Which kernels the target forward runs, per layer kind, and the one kernel we add.

- Attention with learned sinks (gpt-oss). transformers runs it only on its eager path (it refuses
  SDPA), which materialises every S x S score matrix. A sink logit s_h per head joins each row's
  softmax as one more column whose value is zero, so with lse the log-sum-exp of the row's real
  scores: softmax_with_sink(scores) @ V = (softmax(scores) @ V) * sigmoid(lse - s_h). flex_attention
  returns lse beside the output, and takes the sliding window as a BlockMask: exact, on a fused kernel.
- Gated-deltanet linear attention (Qwen3.5, Qwen3-Next): transformers picks fla's Triton kernels
  itself when the `fla` package (`pip install 'dflash_mp[linear]'`, fla-core) imports, else a slow
  torch reference. Those layers are not compiled whole (torch.compile around fla's kernels was
  slower than eager, docs/TARGETS.md); their MLP and norms are.
- Mixture-of-experts: transformers' grouped-GEMM experts (torch._grouped_mm) instead of a loop.
"""

from __future__ import annotations

import importlib.util
from typing import Any

import torch
from torch import nn

SINK_ATTENTION = "dflash_sink_flex"

# Measured on one H200, bf16, S=3072 (docs/TARGETS.md): what a missing extra costs.
FLA_GAIN = "Qwen3.5-9B's forward takes 222 ms with the torch fallback, 111 ms with fla-core 0.6.0"


def linear_attention_kernels() -> str:
    """What gated-deltanet layers run here: fla's Triton kernels or transformers' torch fallback."""
    if importlib.util.find_spec("fla") is None:
        return f"torch fallback (install the `linear` extra, fla-core: {FLA_GAIN})"
    conv = "causal-conv1d" if importlib.util.find_spec("causal_conv1d") else "torch conv1d"
    return f"fla Triton kernels (short convolution: {conv})"


def has_attention_sinks(config: Any) -> bool:
    """gpt-oss style learned per-head sinks in the softmax."""
    return getattr(config, "model_type", None) == "gpt_oss"


def has_linear_attention(config: Any) -> bool:
    return "linear_attention" in (getattr(config, "layer_types", None) or [])


def is_moe(config: Any) -> bool:
    return any(getattr(config, key, None) for key in ("num_experts", "num_local_experts", "n_routed_experts"))


def describe_kernels(config: Any, on_gpu: bool) -> dict[str, str]:
    """The kernels a target of `config` (its text config) runs with `use_fast_kernels` on this machine."""
    kernels = {"attention": "sdpa"}
    if has_attention_sinks(config):
        kernels["attention"] = (
            "flex_attention with sinks (exact lse rescale)" if on_gpu else "eager with sinks (CPU)"
        )
    if has_linear_attention(config):
        kernels["linear_attention"] = linear_attention_kernels()
    if is_moe(config):
        kernels["experts"] = "grouped_mm"
    return kernels


def format_kernels(kernels: dict[str, str]) -> str:
    return ", ".join(f"{kind}: {name}" for kind, name in kernels.items())


def use_fast_kernels(decoder: nn.Module) -> dict[str, str]:
    """Switch a built decoder to the fast kernels (same outputs); returns what it now runs."""
    config = decoder.config
    if has_attention_sinks(config):
        _register_sink_attention()
        config._attn_implementation = SINK_ATTENTION
    if is_moe(config) and hasattr(decoder, "set_experts_implementation"):
        decoder.set_experts_implementation("grouped_mm")
    kernels = {"attention": _ATTENTION_NAMES.get(config._attn_implementation, config._attn_implementation)}
    if has_linear_attention(config):
        kernels["linear_attention"] = linear_attention_kernels()
    if is_moe(config):
        kernels["experts"] = str(getattr(config, "_experts_implementation", None) or "eager")
    return kernels


_ATTENTION_NAMES = {SINK_ATTENTION: "flex_attention with sinks (exact lse rescale)"}


def compile_layers(layers: nn.ModuleList, **compile_options: Any) -> dict[str, int]:
    """torch.compile what gains from it: whole layers, but only the MLP and norms of a layer
    whose linear attention runs fla's Triton kernels. Returns how many layers took each plan."""
    plans = {"whole layer": 0, "mlp and norms": 0}
    for layer in layers:
        linear = getattr(layer, "linear_attn", None)
        if linear is None:
            layer.compile(**compile_options)
            plans["whole layer"] += 1
            continue
        parts = [layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        parts += [m for m in [getattr(linear, "norm", None)] if m is not None]
        for part in parts:
            part.compile(**compile_options)
        plans["mlp and norms"] += 1
    return {plan: n for plan, n in plans.items() if n}


# ---------------------------------------------------------------- attention with sinks


def _register_sink_attention() -> None:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(SINK_ATTENTION, sink_attention_forward)
    AttentionMaskInterface.register(SINK_ATTENTION, sink_block_mask)


def sink_block_mask(
    batch_size: int,
    q_length: int,
    kv_length: int,
    q_offset: int = 0,
    kv_offset: int = 0,
    mask_function: Any = None,
    attention_mask: torch.Tensor | None = None,
    device: torch.device | str = "cpu",
    **kwargs: Any,
):
    """transformers' mask hook for SINK_ATTENTION: its causal or sliding-window mask as a BlockMask
    (built once per forward per layer kind, outside the compiled layers)."""
    from torch.nn.attention.flex_attention import create_block_mask

    if attention_mask is not None and not bool(attention_mask.all()):
        raise NotImplementedError("sink attention takes no padding mask: the target runs unpadded rows")
    if q_offset or kv_offset:
        raise NotImplementedError("sink attention runs the whole sequence at once (no KV cache)")
    return create_block_mask(mask_function, batch_size, None, q_length, kv_length, device=device)


_compiled_flex = None


def _flex(device: torch.device):
    """flex_attention compiled (its fused kernel) on GPU; as is (a reference path) on CPU, where
    inductor cannot return the lse: a compiled CPU layer runs it outside its graph."""
    global _compiled_flex
    from torch.nn.attention.flex_attention import flex_attention

    if device.type != "cuda":
        return torch.compiler.disable(flex_attention)
    if _compiled_flex is None:
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


def _flex_with_lse(query, key, value, block_mask, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    import torch.nn.attention.flex_attention as flex_module

    flex = _flex(query.device)
    common = dict(block_mask=block_mask, scale=scale, enable_gqa=query.shape[1] != key.shape[1])
    if hasattr(flex_module, "AuxRequest"):  # torch >= 2.9
        out, aux = flex(query, key, value, return_aux=flex_module.AuxRequest(lse=True), **common)
        return out, aux.lse
    return flex(query, key, value, return_lse=True, **common)


def sink_attention_forward(
    module: nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Any,
    scaling: float,
    dropout: float = 0.0,
    s_aux: torch.Tensor | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers' attention interface: [B, H, S, D] in, [B, S, H, D] out, sinks applied exactly."""
    if dropout:
        raise ValueError("sink attention is for the frozen target: no attention dropout")
    out, lse = _flex_with_lse(query, key, value, attention_mask, scaling)
    if s_aux is not None:
        # softmax over [scores, s] = softmax(scores) * exp(lse) / (exp(lse) + exp(s)) = ... * sigmoid(lse - s)
        keep = torch.sigmoid(lse.float() - s_aux.float().view(1, -1, 1)).unsqueeze(-1)
        out = (out.float() * keep).to(query.dtype)
    return out.transpose(1, 2).contiguous(), None
