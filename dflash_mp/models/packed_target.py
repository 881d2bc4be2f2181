"""Packed rows through the frozen target: every document's features as if it ran alone.

A packed row (data.packing) holds several whole documents back to back; `document_ids` [B, S]
names them (models/packed_rows.py). One of two paths per target, chosen once from the structure
of the loaded decoder (`plan`):

- in the rows: positions restart at every document (position_ids), transformers' packed-sequence
  masks keep each document to itself (their sequence indices given, not read back from the
  device: target_graphs.packed_sequence_rows; the positions handed to the decoder's mask
  builders where its forward leaves them out, as gpt-oss's does), the sink attention kernel adds the documents to
  its block mask, and gated-deltanet layers empty their convolution and recurrent state at each
  document's first token (linear_attention.py; transformers' own forward of such a layer gets the
  same through its module's two functions, patched for the call). Static shapes and no host read:
  compiled layers and CUDA graphs take it as they take unpacked rows. For decoders whose every
  position-mixing module is one of these, and that pass the check of the first packed call with
  two documents in a row (packed_check.py: the later documents' features unmoved with the first
  document changed, and at the start of the row), which catches what the structure cannot show
  (the tiny Llama 4 of the family matrix on transformers 5.17 moves by half when its
  documents move).
- one row per document: any other decoder (a convolution, a state-space or other recurrent layer,
  remote code with masks of its own, an attention kernel that may ignore the masks). The documents
  are taken out into rows of their own [documents, longest], run as unpacked rows, and their
  features put back (zeros on the padding): exact for any causal decoder, at the price of one host
  read of the layout per call and shapes that change every call (so eager, no graphs).
"""

from __future__ import annotations

import functools
import inspect
import re
import sys
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass, field
from types import ModuleType

import torch
from torch import nn

from dflash_mp.models import linear_attention, target_flex_attention, target_graphs
from dflash_mp.models.packed_rows import document_positions, document_starts

# Layer types whose attention takes transformers' packed-sequence masks (linear_attention: only
# where its modules are gated deltanets handled here).
MASKED_LAYER_TYPES = frozenset({"full_attention", "sliding_attention", "chunked_attention"})
# Attention implementations that apply those masks. Not flash_attention_*: transformers finds
# packed rows there from position_ids for a batch of one row only.
MASKED_ATTENTION = frozenset({"eager", "sdpa", "flex_attention", target_flex_attention.SINK_ATTENTION})
# Modules that mix positions by what they are: torch's convolutions, recurrences and paddings, and
# classes whose name says convolution, state space or recurrence.
_MIXING_TORCH_MODULES = frozenset(
    {"torch.nn.modules.conv", "torch.nn.modules.rnn", "torch.nn.modules.padding"}
)
_MIXING_WORDS = (
    "conv", "mamba", "ssm", "mixer", "recurren", "rwkv", "retention", "lightning", "delta", "hyena", "lstm",
    "gru", "scan", "shift", "timemix",
)  # fmt: skip
_MIXING_PHRASES = (("linear", "attention"), ("state", "space"))
# Named as convolutions, but each position on its own: GPT-2's projections (a transposed Linear).
_POINTWISE = frozenset({"transformers.pytorch_utils.Conv1D"})
# What transformers' gated-deltanet forward runs through its module's globals (patched per call):
# the recurrence, and the convolution under the name of its version (5.25: causal_conv1d_forward,
# given the conv module; 5.17: causal_conv1d_fn, given its weights).
_RECURRENCE_FUNCTION = "torch_chunk_gated_delta_rule"
_CONV_FUNCTIONS = ("causal_conv1d_forward", "causal_conv1d_fn")
# masking_utils' builders of the masks that take packed sequences (from position_ids).
_MASK_BUILDERS = ("create_causal_mask", "create_sliding_window_causal_mask", "create_chunked_causal_mask")


@dataclass(frozen=True)
class PackingPlan:
    in_rows: bool  # documents stay in their packed rows; else one row per document
    reason: str
    mask_module: ModuleType | None = field(default=None, repr=False)  # the decoder's (its mask builders)
    deltanet_modules: tuple[ModuleType, ...] = field(default=(), repr=False)  # their functions patched
    widest_row: int | None = None  # wider rows go one row per document (`_widest_row`)

    def describe(self) -> str:
        where = "stay in their rows" if self.in_rows else "run one row per document"
        wider = f"; rows over {self.widest_row} tokens one row per document" if self.widest_row else ""
        return f"packed rows: documents {where} ({self.reason}{wider})"

    def in_rows_of(self, width: int) -> bool:
        """Whether rows `width` tokens wide keep their documents in the rows."""
        return self.in_rows and (self.widest_row is None or width <= self.widest_row)


def plan(decoder: nn.Module) -> PackingPlan:
    """How packed rows go through `decoder`, from its classes, config and attention kernel."""
    from transformers import masking_utils

    config = decoder.config
    cls = type(decoder)
    problems = []
    mask_module = sys.modules.get(cls.__module__)
    if not cls.__module__.startswith("transformers."):
        problems.append(f"{cls.__name__} is not transformers' own: its masks may not know documents")
    elif not any(getattr(mask_module, n, None) is getattr(masking_utils, n, None) for n in _MASK_BUILDERS):
        problems.append(f"{cls.__name__} does not build its masks with transformers' masking_utils")
    if "position_ids" not in inspect.signature(decoder.forward).parameters:
        problems.append(f"{cls.__name__} takes no position_ids")
    attention = getattr(config, "_attn_implementation", None)
    if attention not in MASKED_ATTENTION:
        problems.append(f"attention {attention!r} may not apply packed-sequence masks")
    layer_types = list(getattr(config, "layer_types", None) or [])
    unknown_types = sorted(set(layer_types) - MASKED_LAYER_TYPES - {"linear_attention"})
    if unknown_types:
        problems.append(f"layers of type {unknown_types}")
    deltanets, mixing = _position_mixers(decoder)
    if layer_types.count("linear_attention") > len(deltanets):
        problems.append(
            f"{layer_types.count('linear_attention')} linear-attention layers, {len(deltanets)} of them gated deltanets"
        )
    if mixing:
        problems.append(f"position-mixing modules of unknown document handling: {mixing[:3]}")
    if problems:
        return PackingPlan(False, "; ".join(problems))
    modules = tuple(dict.fromkeys(sys.modules[type(m).__module__] for m in deltanets))
    reason = f"{attention} attention with per-document masks" + (
        f", {len(deltanets)} gated-deltanet layers reset at each document" if deltanets else ""
    )
    widest = _widest_row(config)
    return PackingPlan(True, reason, mask_module, modules, widest)


def _widest_row(config) -> int | None:
    """The widest row whose position terms are all per document, None when every row's are.
    Llama 4's layers without RoPE scale their queries by the position in the row, not position_ids
    (transformers' attn_temperature_tuning), by a factor that stays 1 below floor_scale - 1."""
    if getattr(config, "attn_temperature_tuning", False) and 0 in (
        getattr(config, "no_rope_layers", None) or []
    ):
        return int(getattr(config, "floor_scale", 1)) - 1
    return None


def _position_mixers(decoder: nn.Module) -> tuple[list[nn.Module], list[str]]:
    """The gated deltanets handled here, and the modules that mix positions otherwise."""
    handled: list[nn.Module] = []
    mixing: list[str] = []
    inside: list[str] = []
    for name, module in decoder.named_modules():
        if any(name.startswith(prefix + ".") for prefix in inside):
            continue
        if handles_gated_deltanet(module):
            handled.append(module)
            inside.append(name)
        elif _mixes_positions(module):
            mixing.append(f"{name} ({type(module).__name__})")
    return handled, mixing


def _mixes_positions(module: nn.Module) -> bool:
    cls = type(module)
    if f"{cls.__module__}.{cls.__qualname__}" in _POINTWISE:
        return False
    if any(c.__module__ in _MIXING_TORCH_MODULES for c in cls.__mro__):
        return True
    # The words of the class name: GptOssModel is Gpt Oss Model (no "ssm"), Mamba2Mixer is Mamba2 Mixer.
    words = [w.lower() for w in re.findall(r"[A-Z]+(?![a-z])|[A-Z]?[a-z0-9]+", cls.__name__)]
    pairs = set(zip(words, words[1:], strict=False))
    return any(w.startswith(_MIXING_WORDS) for w in words) or any(p in pairs for p in _MIXING_PHRASES)


def handles_gated_deltanet(module: nn.Module) -> bool:
    """A gated deltanet whose state is reset per document here: on linear_attention.py's forward,
    or on transformers' forward that runs its convolution and recurrence through the module-level
    functions (`_RECURRENCE_FUNCTION` and one of `_CONV_FUNCTIONS`, patched for a packed call)."""
    if linear_attention.uses_fast_forward(module):
        return True
    cls = type(module)
    if not cls.__name__.endswith("GatedDeltaNet") or not isinstance(
        getattr(module, "conv1d", None), nn.Conv1d
    ):
        return False
    called = _module_functions(cls)
    return _RECURRENCE_FUNCTION in called and bool(called & set(_CONV_FUNCTIONS))


def _module_functions(cls: type) -> set[str]:
    """The module-level callables of `cls`'s module that its forward calls by name."""
    code = getattr(inspect.unwrap(cls.forward), "__code__", None)
    defining = sys.modules.get(cls.__module__)
    names = code.co_names if code is not None else ()
    return {name for name in names if callable(getattr(defining, name, None))}


# ---------------------------------------------------------------- documents in their rows


@contextmanager
def documents_in_rows(
    decoder: nn.Module, rows: target_graphs.PackedRows, packing: PackingPlan
) -> Iterator[None]:
    """Within: `decoder`'s forward (given position_ids=rows.positions) keeps the documents apart."""
    # The sink kernel builds its block mask itself: transformers' masks stay plain for it.
    hf_masks = getattr(decoder.config, "_attn_implementation", None) != target_flex_attention.SINK_ATTENTION
    with ExitStack() as stack:
        stack.enter_context(target_graphs.packed_sequence_rows(rows, hf_masks=hf_masks))
        if hf_masks and packing.mask_module is not None:
            stack.enter_context(_masks_given_positions(packing.mask_module, rows.positions))
        for module in packing.deltanet_modules:
            stack.enter_context(_per_document_functions(module))
        yield


@contextmanager
def _masks_given_positions(module: ModuleType, positions: torch.Tensor) -> Iterator[None]:
    """Within: `module`'s mask builders get `positions` as position_ids where its forward passes none
    (transformers finds packed sequences, and remaps a mask's positions, from them alone)."""
    from transformers import masking_utils

    saved = {
        n: getattr(module, n)
        for n in _MASK_BUILDERS
        if getattr(module, n, None) is getattr(masking_utils, n, 0)
    }
    for name, build in saved.items():
        setattr(module, name, _given_positions(build, positions))
    try:
        yield
    finally:
        for name, build in saved.items():
            setattr(module, name, build)


def _given_positions(build: Callable, positions: torch.Tensor) -> Callable:
    index = list(inspect.signature(build).parameters).index("position_ids")

    @functools.wraps(build)
    def with_positions(*args, **kwargs):
        if len(args) <= index and kwargs.get("position_ids") is None:
            kwargs["position_ids"] = positions
        return build(*args, **kwargs)

    return with_positions


@contextmanager
def _per_document_functions(module: ModuleType) -> Iterator[None]:
    names = [
        _RECURRENCE_FUNCTION,
        *(name for name in _CONV_FUNCTIONS if callable(getattr(module, name, None))),
    ]
    saved = {name: getattr(module, name) for name in names}
    wrappers = {
        _RECURRENCE_FUNCTION: _per_document_recurrence,
        "causal_conv1d_forward": _per_document_conv,
        "causal_conv1d_fn": _per_document_conv_fn,
    }
    for name, original in saved.items():
        setattr(module, name, wrappers[name](original))
    try:
        yield
    finally:
        for name, value in saved.items():
            setattr(module, name, value)


def _rows_for(hidden: torch.Tensor, sequence_dim: int) -> target_graphs.PackedRows | None:
    rows = target_graphs.packed_rows()
    if rows is not None and rows.positions.shape != (hidden.shape[0], hidden.shape[sequence_dim]):
        raise ValueError(f"packed rows {list(rows.positions.shape)} for a tensor {list(hidden.shape)}")
    return rows


def _per_document_conv(original: Callable) -> Callable:
    def causal_conv1d_forward(conv1d, hidden_states, cache=None, *args, activation=None, **kwargs):
        rows = _rows_for(hidden_states, 2) if cache is None else None
        if rows is None:
            return original(conv1d, hidden_states, cache, *args, activation=activation, **kwargs)
        return per_document_conv(hidden_states, conv1d.weight, conv1d.bias, activation, rows.positions)

    return causal_conv1d_forward


def _per_document_conv_fn(original: Callable) -> Callable:
    def causal_conv1d_fn(hidden_states, weight, bias=None, activation=None, **kwargs):
        rows = _rows_for(hidden_states, 2)
        if rows is None:
            return original(hidden_states, weight, bias, activation=activation, **kwargs)
        # [B, C, S] in and out, the depthwise weight [C, K].
        return per_document_conv(hidden_states, weight, bias, activation, rows.positions)

    return causal_conv1d_fn


def _per_document_recurrence(original: Callable) -> Callable:
    def torch_chunk_gated_delta_rule(query, key, value, g, beta, *args, **kwargs):
        rows = _rows_for(g, 1) if kwargs.get("initial_state") is None else None
        if rows is not None:
            g = linear_attention.reset_at_document_starts(g, rows.positions)
        return original(query, key, value, g, beta, *args, **kwargs)

    return torch_chunk_gated_delta_rule


def per_document_conv(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None,
    activation: str | None,
    positions: torch.Tensor,
) -> torch.Tensor:
    """transformers' depthwise causal convolution of x [B, C, S] (weight [C, 1, K]) and its
    activation, each document of `positions` [B, S] on its own (in fp32, returned in x's dtype)."""
    silu = activation in ("silu", "swish")
    out = (_compiled_conv() if x.is_cuda else _conv)(x, weight, bias, positions, silu)
    if activation is not None and not silu:
        from transformers.activations import ACT2FN

        out = ACT2FN[activation](out)
    return out.to(x.dtype).transpose(1, 2)


def _conv(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None, positions: torch.Tensor, silu: bool
):
    out = linear_attention.causal_conv_along_sequence(
        x.transpose(1, 2), weight.reshape(weight.shape[0], -1), bias, positions
    )
    return torch.nn.functional.silu(out) if silu else out


@functools.cache
def _compiled_conv():
    return torch.compile(_conv, dynamic=True)


# ---------------------------------------------------------------- one row per document


def per_document_forward(
    forward_rows: Callable[[torch.Tensor], torch.Tensor], input_ids: torch.Tensor, document_ids: torch.Tensor
) -> torch.Tensor:
    """`forward_rows` (unpacked rows -> [N, L, F]) over each document of `input_ids` [B, S] in a
    row of its own, the features put back where the documents are ([B, S, F], zero on padding)."""
    ids = document_ids.cpu()  # the one host read: the layout sets the shapes
    real = ids >= 0
    starts = document_starts(ids) & real
    number = (starts.flatten().cumsum(0) - 1).view_as(ids)
    rows, cols = real.nonzero(as_tuple=True)
    document, position = number[rows, cols], document_positions(ids)[rows, cols]
    if document.numel() == 0:  # padding only
        return forward_rows(input_ids).zero_()
    shape = (int(document.max()) + 1, int(position.max()) + 1)
    rows, cols, document, position = (t.to(input_ids.device) for t in (rows, cols, document, position))
    unpacked = input_ids.new_zeros(shape)  # right padding: a causal decoder never reads it
    unpacked[document, position] = input_ids[rows, cols]
    features = forward_rows(unpacked)
    out = features.new_zeros((*input_ids.shape, features.shape[-1]))
    out[rows, cols] = features[document, position]
    return out
