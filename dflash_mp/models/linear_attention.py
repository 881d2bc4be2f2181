"""A faster forward for transformers' Qwen3.5 gated-deltanet layers, for the frozen target on GPU.

transformers' forward transposes the qkv projection to [B, C, S] for the short causal convolution
and back, splits q, k, v as strided views that fla's `input_guard` then copies to contiguous
ones, and runs each gate as its own small kernels (at Qwen3.5-35B-A3B's layer shape, S=3072, one
H200: 0.86 ms a layer against 0.59 here; BENCHMARKS.md, "Target stage per family"). Here the
convolution runs along dim 1 of the projection's own [B, S, C] output, and one function
(`prepare`, compiled on CUDA whether or not the layers are, like flex attention) writes q and k
L2-normalised (two passes fewer in fla) and v, contiguous, with g and beta; fla's
`chunk_gated_delta_rule` takes the value heads grouped over the key heads (GVA) as they are. The
gate g is computed in `prepare` with transformers' formula (in fp32) rather than in fla's kernel
(`use_gate_in_kernel`): the same numbers as transformers' path, and fla's FlashQLA backend
(Hopper, where installed) refuses the in-kernel gate.

Same module, same parameters (the four input projections stay four GEMMs: fusing them would need
one weight tensor the parameters are views of, which loading and tensor parallelism do not keep).
The switch is per module instance (`use_fast_forward` binds the forward on it), so another model
of the same class in the process keeps transformers' path. Only for what the target runs: the whole
sequence at once, no cache, no padding mask; any other call goes to transformers' own forward.
No host reads: the forward stays CUDA-graph capturable.

Packed rows (several documents per row, `target_graphs.packed_rows()`): the convolution drops the
taps that reach before a token's document, and each document's first token gets the log-decay
`DOCUMENT_RESET` (its exp is 0 in fp32), which empties the recurrent state there in any exact form
of the recurrence (fla's chunked kernels, transformers' torch one). Static shapes and no host read,
so a packed forward is captured like any other; the decays inside a document are the document's
own up to the fp32 rounding of the chunk-local cumulative sums that now carry the reset.
"""

from __future__ import annotations

import functools
import importlib
import types
from collections.abc import Callable
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_mp.models import target_graphs

# Core = (q, k [B,S,H,Dk] L2-normalised, v [B,S,HV,Dv], g [B,S,HV] fp32, beta [B,S,HV]) -> [B,S,HV,Dv]
Core = Callable[..., torch.Tensor]

FAST_CLASSES = {
    "Qwen3_5GatedDeltaNet": "transformers.models.qwen3_5.modeling_qwen3_5",
    "Qwen3_5MoeGatedDeltaNet": "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
}
# Configs (top-level and text) whose linear-attention layers are FAST_CLASSES.
FAST_MODEL_TYPES = ("qwen3_5", "qwen3_5_text", "qwen3_5_moe", "qwen3_5_moe_text")
_PARTS = ("in_proj_qkv", "in_proj_z", "in_proj_b", "in_proj_a", "conv1d", "norm", "out_proj")
# Flags a forward may carry that change nothing here; any other keyword set (cu_seq_lens_q and
# seq_idx of packed rows, say) sends the call to transformers' forward.
_INERT_KWARGS = {"use_cache", "output_attentions", "output_hidden_states", "return_dict", "position_ids"}
L2NORM_EPS = 1e-6  # transformers' l2norm and fla's l2norm_fwd alike
# exp(-128 - x) underflows to 0 in fp32 for any x >= 0 (every log-decay is <= 0); a larger reset
# would only round the cumulative sums that carry it more coarsely.
DOCUMENT_RESET = -128.0


def causal_conv_along_sequence(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor | None = None
) -> torch.Tensor:
    """Depthwise causal convolution of x [B, S, C] by weight [C, K] along S, in fp32:
    out[:, t] = sum_j weight[:, j] * x[:, t - K + 1 + j] (+ bias), as K shifted multiply-adds
    (memory-bound; compiled, they and what reads them become one pass over x). `positions` [B, S]
    (packed rows): a tap reaching before the token's document reads zero, as one before t=0 does."""
    k, s = weight.shape[-1], x.shape[1]
    padded = F.pad(x.float(), (0, 0, k - 1, 0))  # K-1 zero rows before t=0
    w = weight.float()
    out = None
    for j in range(k):
        tap = padded[:, j : j + s] * w[:, j]
        if positions is not None and j < k - 1:  # tap j reads t - (K-1-j)
            tap = torch.where((positions >= k - 1 - j)[..., None], tap, 0.0)
        out = tap if out is None else out + tap
    return out if bias is None else out + bias.float()


def reset_at_document_starts(g: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """The log-decays g [B, S, H] with DOCUMENT_RESET at each document's first token but a row's
    first (whose state is empty already: a row of one document keeps its own numbers)."""
    starts = positions == 0
    starts[:, 0] = False
    return g.masked_fill(starts[..., None], DOCUMENT_RESET)


def prepare(
    mixed_qkv: torch.Tensor,
    a: torch.Tensor,
    b: torch.Tensor,
    conv_weight: torch.Tensor,
    conv_bias: torch.Tensor | None,
    A_log: torch.Tensor,
    dt_bias: torch.Tensor,
    num_k_heads: int,
    head_k_dim: int,
    head_v_dim: int,
    positions: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """q, k [B, S, H, Dk] (L2-normalised per head) and v [B, S, HV, Dv], contiguous in the input's
    dtype, g (fp32) and beta [B, S, HV], from the projections qkv [B, S, C] and a, b [B, S, HV];
    `positions` [B, S]: packed rows, each document convolved and decayed on its own."""
    batch, seq, channels = mixed_qkv.shape
    key_dim = num_k_heads * head_k_dim
    sizes = [key_dim, key_dim, channels - 2 * key_dim]
    weights = conv_weight.reshape(channels, -1).split(sizes)
    biases = conv_bias.split(sizes) if conv_bias is not None else [None] * 3

    def heads(i: int, dim: int, normalize: bool) -> torch.Tensor:
        # Each of q, k, v convolved from its own channels (a shared fp32 result of the whole
        # convolution would be one more buffer) and stored contiguous (fla copies a strided view).
        x = causal_conv_along_sequence(mixed_qkv.split(sizes, dim=-1)[i], weights[i], biases[i], positions)
        x = F.silu(x).to(mixed_qkv.dtype).reshape(batch, seq, -1, dim)
        if normalize:  # the L2 norm fla would run as two more passes: from the rounded values, in fp32
            x32 = x.float()
            x = (x32 * torch.rsqrt((x32 * x32).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)
        return x.contiguous()

    beta = b.sigmoid()
    # transformers' formula: fp32, so that A_log.exp() cannot overflow in half precision
    g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
    if positions is not None:
        g = reset_at_document_starts(g, positions)
    return heads(0, head_k_dim, True), heads(1, head_k_dim, True), heads(2, head_v_dim, False), g, beta


@functools.cache
def _compiled_prepare():
    # On first GPU use (torch.compile imports inductor). Static shapes first, dynamic once the
    # sequence length changes; the head sizes are constants of the model.
    return torch.compile(prepare)


@functools.cache
def _fla_chunk() -> Callable | None:
    """fla's chunk_gated_delta_rule, or None where fla (or its Triton) does not import."""
    try:
        return importlib.import_module("fla.ops.gated_delta_rule").chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - any failed import means transformers' path stays
        return None


def fla_core(q, k, v, g, beta) -> torch.Tensor:
    """fla's chunked kernels: GVA natively (value head h reads key head h // (HV // H)), g in log
    space, beta after its sigmoid, scale Dk**-0.5 (its default, as transformers calls it)."""
    out, _ = _fla_chunk()(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
    return out


def torch_core(q, k, v, g, beta) -> torch.Tensor:
    """The reference on CPU: q and k repeated to the value heads (the GVA mapping, explicitly),
    then transformers' own chunked recurrence (its torch fallback for CPU tensors)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import torch_chunk_gated_delta_rule

    groups = v.shape[2] // q.shape[2]
    if groups > 1:
        q, k = q.repeat_interleave(groups, dim=2), k.repeat_interleave(groups, dim=2)
    out, _ = torch_chunk_gated_delta_rule(q, k, v, g=g, beta=beta, use_qk_l2norm_in_kernel=False)
    return out


def gated_deltanet_forward(
    module: nn.Module,
    hidden_states: torch.Tensor,
    core: Core,
    prepare_fn: Callable = prepare,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """`module`'s output for `hidden_states` [B, S, hidden] (whole sequences, no cache or mask;
    `positions` [B, S]: packed rows)."""
    batch, seq, _ = hidden_states.shape
    q, k, v, g, beta = prepare_fn(
        module.in_proj_qkv(hidden_states),
        module.in_proj_a(hidden_states),
        module.in_proj_b(hidden_states),
        module.conv1d.weight,
        module.conv1d.bias,
        module.A_log,
        module.dt_bias,
        module.num_k_heads,
        module.head_k_dim,
        module.head_v_dim,
        positions,
    )
    z = module.in_proj_z(hidden_states)
    out = core(q, k, v, g, beta)
    # transformers' gated RMSNorm per value head (its module: compile_layers compiles it), out_proj
    out = module.norm(out.reshape(-1, module.head_v_dim), z.reshape(-1, module.head_v_dim))
    return module.out_proj(out.reshape(batch, seq, -1))


def _fast_forward(self, hidden_states, *args, **kwargs):
    """Bound on a switched module: the fast path for the target's calls, transformers' otherwise.
    Any argument set beyond the inert flags (the cache, named `cache` or `cache_params` by
    transformers' versions, a padding mask, packed-row lengths) goes to transformers' forward as given."""
    if args or any(value is not None for key, value in kwargs.items() if key not in _INERT_KWARGS):
        return type(self).forward(self, hidden_states, *args, **kwargs)
    prepare_fn = _compiled_prepare() if hidden_states.is_cuda else prepare
    rows = target_graphs.packed_rows()
    positions = None if rows is None else rows.positions
    if positions is not None and positions.shape != hidden_states.shape[:2]:
        raise ValueError(f"packed rows {list(positions.shape)} for hidden states {list(hidden_states.shape)}")
    return gated_deltanet_forward(self, hidden_states, self.dflash_core, prepare_fn, positions)


def why_not(module: nn.Module) -> str | None:
    """Why `module` cannot take the fast forward whatever the machine (None: it can): another
    class, an unexpected layout, sharded (tensor-parallel) or offloaded parameters."""
    cls = type(module)
    if FAST_CLASSES.get(cls.__name__) != cls.__module__:
        return f"{cls.__module__}.{cls.__name__} is not transformers' Qwen3.5 gated deltanet"
    missing = [n for n in (*_PARTS, "A_log", "dt_bias") if not hasattr(module, n)]
    if missing:
        return f"{cls.__name__} lacks {missing}"
    m = module
    if m.activation not in ("silu", "swish"):
        return f"the convolution's activation {m.activation!r} is not SiLU"
    if m.num_v_heads % m.num_k_heads:
        return f"{m.num_v_heads} value heads do not group over {m.num_k_heads} key heads"
    hidden, key_dim, value_dim = m.hidden_size, m.num_k_heads * m.head_k_dim, m.num_v_heads * m.head_v_dim
    expected = {
        "in_proj_qkv.weight": (2 * key_dim + value_dim, hidden),
        "in_proj_z.weight": (value_dim, hidden),
        "in_proj_b.weight": (m.num_v_heads, hidden),
        "in_proj_a.weight": (m.num_v_heads, hidden),
        "conv1d.weight": (2 * key_dim + value_dim, 1, m.conv_kernel_size),
        "A_log": (m.num_v_heads,),
        "dt_bias": (m.num_v_heads,),
        "norm.weight": (m.head_v_dim,),
        "out_proj.weight": (hidden, value_dim),
    }
    params = dict(m.named_parameters())
    wrong = [n for n, shape in expected.items() if n not in params or tuple(params[n].shape) != shape]
    # A sharded parameter is a DTensor (or a local shard, caught by its shape above).
    sharded = [n for n, p in params.items() if type(p.data) is not torch.Tensor]
    if wrong or sharded:
        return f"parameters not whole plain tensors (tensor-parallel?): {(wrong + sharded)[:4]}"
    if any(hasattr(sub, "_hf_hook") for sub in m.modules()):
        return "accelerate hooks (offloading) on the module"
    return None


def fast_path_model(config: Any) -> bool:
    """Whether a target of `config` has gated-deltanet layers of FAST_CLASSES (the doctor's view)."""
    return getattr(config, "model_type", None) in FAST_MODEL_TYPES


def fast_path_applies(module: nn.Module) -> bool:
    """The production switch: the class and layout fit, fla imports, the parameters are on CUDA."""
    return why_not(module) is None and _on_cuda(module) and _fla_chunk() is not None


def _on_cuda(module: nn.Module) -> bool:
    return all(p.is_cuda for p in module.parameters())


def uses_fast_forward(module: nn.Module) -> bool:
    return getattr(module.__dict__.get("forward"), "__func__", None) is _fast_forward


def use_fast_forward(module: nn.Module, core: Core | None = None) -> bool:
    """Bind the fast forward on this instance where `fast_path_applies` (fla's kernels), or with
    `core` (a reference, tests) wherever the layout fits; True if the module now runs it."""
    if uses_fast_forward(module):
        return True
    if core is None:
        if not fast_path_applies(module):
            return False
        core = fla_core
    elif why_not(module) is not None:
        return False
    module.dflash_core = core
    module.forward = types.MethodType(_fast_forward, module)
    return True
