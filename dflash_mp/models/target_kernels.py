"""Which kernels the target forward runs, per layer kind, and the one kernel we add.

- Attention with learned sinks (gpt-oss), exact on flex_attention (models/target_flex_attention.py).
- Gated-deltanet linear attention (Qwen3.5, Qwen3-Next): transformers picks fla's Triton kernels
  itself when the `fla` package (`pip install 'dflash_mp[linear]'`, fla-core) imports, else a slow
  torch reference. Those layers are not compiled whole (compiled whole they ran slower than eager
  on an H200); their MLP and norms are, and without the `causal-conv1d` package their short
  causal convolution runs as K shifted multiply-adds compiled into one kernel (torch's depthwise
  conv1d took 0.44 ms a layer at S=3072 on an H200, 17% of a Qwen3.5-35B-A3B forward). A
  one-rank Qwen3.5 target on GPU with fla takes models/linear_attention.py's forward instead: the
  convolution on the projection's own layout, compiled with the q/k/v split, the q/k L2 norm and
  the gates, into fla's kernels with grouped value heads (no transposes, no copies).
- Packed rows (data.packing) of a target on SDPA: on flex_attention with a block mask per document
  (models/target_flex_attention.py), where SDPA's dense mask runs its masked kernel over every tile.
- Mixture-of-experts: transformers' grouped-GEMM experts (torch._grouped_mm) instead of a loop,
  with the combine of each token's top-k outputs as one pointwise kernel (models/moe_experts.py),
  where the model's experts take another implementation (transformers' own test); else (Llama 4's
  batched matmuls) the model's own.
- Mamba-2 / state-space mixers (NemotronH): transformers' own forward, on the `mamba-ssm` and
  `causal-conv1d` CUDA kernels where those packages import, else its torch fallback; packed rows
  run one row per document (models/packed_target.py).

`kernel_kinds` decides all of it from the config, the decoder's class and the machine: the doctor
says it before the model loads (`describe_kernels`), `use_fast_kernels` applies it.
"""

from __future__ import annotations

import functools
import importlib.util
import sys
import weakref
from typing import Any

import torch
from torch import nn

from dflash_mp.models import linear_attention, moe_experts
from dflash_mp.models.target_fields import expert_count, has_state_space
from dflash_mp.models.target_flex_attention import SINK_ATTENTION, register_flex_attention
from dflash_mp.models.target_structure import decoder_layers

# Measured on one H200, bf16, S=3072, HF's forward: what the missing extra costs (BENCHMARKS.md,
# "Target stage per family", its table's HF column and the note below it).
FLA_GAIN = "Qwen3.5-9B's forward takes 222 ms with the torch fallback, 106 ms with fla-core 0.6.0"


FAST_LINEAR_ATTENTION = "fla Triton kernels (GVA, fused short convolution)"


def linear_attention_kernels(fast_forward: bool = False) -> str:
    """What gated-deltanet layers run here: fla's Triton kernels or transformers' torch fallback;
    `fast_forward`: behind models/linear_attention.py's forward (one-rank Qwen3.5 on GPU)."""
    if importlib.util.find_spec("fla") is None:
        return f"torch fallback (install the `linear` extra, fla-core: {FLA_GAIN})"
    if fast_forward:
        return FAST_LINEAR_ATTENTION
    conv = "causal-conv1d" if _has_causal_conv1d() else "shifted multiply-adds, compiled"
    return f"fla Triton kernels (short convolution: {conv})"


def has_attention_sinks(config: Any) -> bool:
    """gpt-oss style learned per-head sinks in the softmax."""
    return getattr(config, "model_type", None) == "gpt_oss"


def has_linear_attention(config: Any) -> bool:
    """Gated-deltanet layers; not the Mamba mixers transformers also types "linear_attention"."""
    return "linear_attention" in (getattr(config, "layer_types", None) or []) and not has_state_space(config)


def is_moe(config: Any) -> bool:
    """Routed experts, under any name the project knows (target_fields.expert_count)."""
    return expert_count(config) > 0


def state_space_kernels(cuda: bool) -> str:
    """What transformers runs a Mamba-2 mixer on: its `use_kernel_func_from_hub_with_fallback`
    functions take the packages' CUDA kernels for CUDA inputs where they import, else torch."""
    if not cuda:
        return "transformers' torch forward (CPU)"
    found = {name: importlib.util.find_spec(name) is not None for name in ("mamba_ssm", "causal_conv1d")}
    if all(found.values()):
        return "mamba-ssm and causal-conv1d CUDA kernels"
    missing = " and ".join(name.replace("_", "-") for name, ok in found.items() if not ok)
    return f"transformers' torch fallback (install {missing} for the CUDA kernels)"


def target_model_class(config: Any) -> type | None:
    """transformers' base-model class for `config`'s model_type (the decoder that runs its layers);
    None for a type transformers does not know (remote code). Imports its modelling module."""
    from transformers.models.auto.modeling_auto import MODEL_MAPPING_NAMES

    name = MODEL_MAPPING_NAMES.get(getattr(config, "model_type", None))
    if not isinstance(name, str):
        return None
    import transformers

    return getattr(transformers, name, None)


def takes_grouped_experts(model_class: type | None) -> bool | None:
    """Whether a model of `model_class` takes another experts implementation: transformers' own test
    (set_experts_implementation refuses the others); None where unknown (no class)."""
    if model_class is None:
        return None
    can_set = getattr(model_class, "_can_set_experts_implementation", None)
    return bool(can_set()) if can_set is not None else hasattr(model_class, "set_experts_implementation")


def takes_document_flex(config: Any) -> bool:
    """Whether packed rows of a target of `config` run flex_attention with a per-document block mask:
    on SDPA with a causal or windowed mask and no score transform the block mask cannot express
    (logit softcapping, chunked attention), and heads of one power-of-two width (the GPU shapes
    measured; MLA's wider queries than values and other widths keep SDPA's masks)."""
    layer_types = set(getattr(config, "layer_types", None) or [])
    heads = getattr(config, "num_attention_heads", None)
    head_dim = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else 0)
    return (
        # None: a config not yet built into a model, which transformers puts on SDPA
        (getattr(config, "_attn_implementation", None) or "sdpa") == "sdpa"
        and not getattr(config, "attn_logit_softcapping", None)
        and not getattr(config, "attention_chunk_size", None)
        and "chunked_attention" not in layer_types
        and not getattr(config, "kv_lora_rank", None)  # MLA
        and head_dim > 0
        and head_dim & (head_dim - 1) == 0
    )


SINK_FLEX = "flex_attention with sinks (exact lse rescale)"


def kernel_kinds(
    config: Any,
    model_class: type | None,
    cuda: bool,
    packed_rows: bool = False,
    fast_linear_attention: bool = False,
) -> dict[str, str]:
    """What a target of `config` (its text config), whose decoder is a `model_class`, runs after
    `use_fast_kernels`, per kind of layer it has: attention, and linear_attention, state_space,
    experts where it has them. `cuda`: its layers on a GPU; `packed_rows`: data.packing;
    `fast_linear_attention`: its gated deltanets on models/linear_attention.py's forward. From the
    config, the class and the installed packages only: no model is needed."""
    attention = str(getattr(config, "_attn_implementation", None) or "sdpa")
    if has_attention_sinks(config):
        attention = SINK_FLEX
    elif packed_rows and takes_document_flex(config):
        attention = DOCUMENT_FLEX
    kernels = {"attention": attention}
    if has_linear_attention(config):
        kernels["linear_attention"] = linear_attention_kernels(fast_forward=fast_linear_attention)
    if has_state_space(config):
        rows = "; packed rows: one row per document" if packed_rows else ""
        kernels["state_space"] = f"Mamba-2 on {state_space_kernels(cuda)}{rows}"
    if is_moe(config):
        grouped = takes_grouped_experts(model_class)
        if grouped is None:
            kernels["experts"] = "decided once it loads (remote code)"
        elif grouped:
            kernels["experts"] = (
                moe_experts.EXPERTS_IMPLEMENTATION if moe_experts.register() else "grouped_mm"
            )
        else:
            kernels["experts"] = f"{model_class.__name__}'s own"
    return kernels


def describe_kernels(config: Any, on_gpu: bool, packed_rows: bool = False) -> dict[str, str]:
    """The kernels a target of `config` (its text config) runs on this machine, before it loads:
    on GPU `kernel_kinds` (what `use_fast_kernels` applies), on CPU transformers' own paths."""
    model_class = target_model_class(config) if is_moe(config) else None
    # A tensor-parallel target keeps transformers' linear-attention forward (its ranks log what they run).
    fast = on_gpu and has_linear_attention(config) and linear_attention.fast_path_model(config)
    kernels = kernel_kinds(config, model_class, on_gpu, packed_rows and on_gpu, fast_linear_attention=fast)
    if not on_gpu and has_attention_sinks(config):
        kernels["attention"] = "eager with sinks (CPU)"
    return kernels


def format_kernels(kernels: dict[str, str]) -> str:
    return ", ".join(f"{kind}: {name}" for kind, name in kernels.items())


def use_fast_kernels(decoder: nn.Module, packed_rows: bool = False) -> dict[str, str]:
    """Switch a built decoder to the fast kernels (same outputs); returns what it now runs.
    `packed_rows`: the decoder will run packed rows (data.packing), which take flex_attention."""
    config = decoder.config
    fast = False
    if has_linear_attention(config):
        # Per module: Qwen3.5's on CUDA with fla, unsharded; others keep transformers' forward.
        layers = [getattr(layer, "linear_attn", None) for layer in decoder_layers(decoder)]
        fast = any([linear_attention.use_fast_forward(m) for m in layers if m is not None])
    cuda = any(p.is_cuda for p in decoder.parameters())
    kernels = kernel_kinds(config, type(decoder), cuda, packed_rows, fast_linear_attention=fast)
    if kernels["attention"] in (SINK_FLEX, DOCUMENT_FLEX):  # the same kernel; sinks where the model has them
        register_flex_attention()
        config._attn_implementation = SINK_ATTENTION
    experts = kernels.get("experts")
    if experts in (moe_experts.EXPERTS_IMPLEMENTATION, "grouped_mm"):
        decoder.set_experts_implementation(experts)  # registered by kernel_kinds
    return kernels


DOCUMENT_FLEX = "flex_attention, block mask per document (packed rows)"


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
        if not linear_attention.use_fast_forward(linear):  # its convolution is compiled already
            route_short_convolution(linear)
        parts = [layer.mlp, layer.input_layernorm, layer.post_attention_layernorm]
        parts += [m for m in [getattr(linear, "norm", None)] if m is not None]
        for part in parts:
            part.compile(**compile_options)
        plans["mlp and norms"] += 1
    return {plan: n for plan, n in plans.items() if n}


# ---------------------------------------------------------------- short convolution (gated deltanet)


def _has_causal_conv1d() -> bool:
    return importlib.util.find_spec("causal_conv1d") is not None


def shifted_causal_conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, activation: str | None
) -> torch.Tensor:
    """Depthwise causal convolution of x [B, C, S] by weight [C, K]: out[..., t] = sum_j
    weight[:, j] * x[..., t - K + 1 + j], in fp32, as K shifted multiply-adds (memory-bound)."""
    from transformers.activations import ACT2FN

    k, s = weight.shape[-1], x.shape[-1]
    padded = torch.nn.functional.pad(x.float(), (k - 1, 0))
    w = weight.float()
    out = padded[..., 0:s] * w[:, 0, None]
    for j in range(1, k):
        out = out + padded[..., j : j + s] * w[:, j, None]
    if bias is not None:
        out = out + bias.float()[:, None]
    if activation is not None:
        out = ACT2FN[activation](out)
    return out.to(x.dtype)


@functools.cache
def _compiled_conv():
    return torch.compile(shifted_causal_conv, dynamic=True)


# The conv weights of the layers that take the compiled path, by storage address. transformers calls a
# module-level function with the weight as an argument, so the switch is made per weight: another
# model of the same class in the process (an HF reference, say) keeps transformers' own path.
_ROUTED_CONV_WEIGHTS: dict[int, weakref.ref] = {}
_FORWARD_FLAGS = {"use_cache", "output_attentions", "output_hidden_states", "return_dict", "position_ids"}


def _routed(original):
    @functools.wraps(original)
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        owner = _ROUTED_CONV_WEIGHTS.get(weight.data_ptr())
        # Anything beyond the forward's own flags (seq_idx, cu_seqlens of packed rows) keeps the original.
        packed = any(v is not None for k, v in kwargs.items() if k not in _FORWARD_FLAGS)
        if owner is None or owner() is None or packed:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        conv = _compiled_conv() if hidden_states.is_cuda else shifted_causal_conv
        return conv(hidden_states, weight, bias, activation)

    causal_conv1d_fn.dflash_original = original
    return causal_conv1d_fn


def route_short_convolution(linear: nn.Module) -> bool:
    """Send `linear`'s short convolution through `shifted_causal_conv` (compiled on GPU) where
    transformers would run its torch fallback; False where it has a better kernel or none to swap."""
    conv = getattr(linear, "conv1d", None)
    module = sys.modules.get(type(linear).__module__)
    current = getattr(module, "causal_conv1d_fn", None)
    if conv is None or current is None or _has_causal_conv1d():
        return False
    if not hasattr(current, "dflash_original"):
        module.causal_conv1d_fn = _routed(current)
    _ROUTED_CONV_WEIGHTS[conv.weight.data_ptr()] = weakref.ref(conv.weight)
    return True
