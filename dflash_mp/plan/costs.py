"""What a target shape costs: parameters, FLOPs per sample and bytes on a GPU, for target and drafter.

FLOPs are counted as bench/ counts them (`setup.*.flops_counting` in its JSON), so a measured time
carries to another shape by the ratio of FLOPs at the same MFU. Bytes are weights from the shape
plus an activation estimate whose terms follow what stays alive at the peak; at the Qwen3-8B shape
they give 0.47 GB for the target and 7.2 GB for the drafter, against 0.48 and 6.7 GB measured
(bench/results/h200x2-qwen3-8b.json), and where the benchmark measured a peak the plan scales the
measured activation by these estimates instead of using them raw.

A target whose layers the dense formula does not describe (mixture of experts, linear attention,
state-space mixers, MLA) is counted on transformers' own model built on the meta device (no
memory): its parameters per layer, all of them for memory and the routed experts at top-k /
experts for FLOPs (shared experts run for every token). The experts and top-k are read under any
name models/target_fields.py knows (ERNIE's `moe_num_experts` and `moe_k` included). Its drafter
is the dense layer models/drafter_config.py builds for it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_mp.config.schema import default_target_layer_ids
from dflash_mp.models.target_fields import expert_count, experts_per_token, has_state_space
from dflash_mp.plan import PlanError

BF16 = 2
# Drafter training state per trainable parameter: fp32 weight, fp32 gradient, two fp32 AdamW moments.
TRAIN_STATE_BYTES = 16
# Rows of the LM head + cross-entropy chunk (bf16 logits and their fp32 gradient live together).
LOSS_CHUNK_ROWS = 2048
# Anchors sit in the response, on average three quarters into the sequence (the benchmark's data).
MEAN_ANCHOR_POSITION = 0.75
_MLA_KEYS = ("kv_lora_rank", "q_lora_rank")
_LINEAR_ATTENTION_KEYS = ("linear_num_key_heads", "linear_num_value_heads")  # Qwen3.5, Qwen3-Next


@dataclass(frozen=True)
class ModelShape:
    """The target's transformer shape (the drafter's layers copy it)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    intermediate: int
    vocab: int
    # Not recorded by the benchmark, so not compared: a target differing only here runs the bench's shape.
    tied_embeddings: bool = field(default=False, compare=False)
    attention_bias: bool = field(default=False, compare=False)
    name: str = field(default="", compare=False)
    # Counted (not the dense formula): parameters per target layer, the mean over its layers, all
    # of them and the active ones (routed experts at top-k / experts); 0 for a dense target, whose
    # `intermediate` is then its own MLP width and not only its drafter's.
    layer_params_all: int = 0
    layer_params_active: int = 0
    expert_width: int = 0  # a routed expert's intermediate width (a tensor-parallel split divides it)
    model_type: str = field(default="", compare=False)


@dataclass(frozen=True)
class Workload:
    """What one sample is: its length, anchors and block, the drafter's depth, the micro-batch."""

    seq_len: int
    num_anchors: int
    block_size: int
    draft_layers: int
    micro_batch: int = 1


def is_dense(config: dict[str, Any]) -> bool:
    """A decoder the dense formula counts: no experts, no linear attention or state space, no MLA."""
    layer_types = config.get("layer_types") or []
    special = any(config.get(key) for key in (*_MLA_KEYS, *_LINEAR_ATTENTION_KEYS))
    return not (
        special or expert_count(config) or has_state_space(config) or "linear_attention" in layer_types
    )


def shape_from_hf_config(config: dict[str, Any], name: str) -> ModelShape:
    """The target's shape from its HF config.json (the text config of a multimodal one)."""
    missing = [
        key
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
        if not isinstance(config.get(key), int)
    ]
    if is_dense(config) and not isinstance(config.get("intermediate_size"), int):
        missing.append("intermediate_size")
    if missing:
        raise PlanError(
            f"--target {name}: config.json lacks {', '.join(missing)} (not a decoder LLM config?)"
        )
    if not is_dense(config):
        return counted_shape(config, name)
    heads = config["num_attention_heads"]
    return ModelShape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=heads,
        kv_heads=config.get("num_key_value_heads") or heads,
        head_dim=config.get("head_dim") or config["hidden_size"] // heads,
        intermediate=config["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        attention_bias=bool(config.get("attention_bias", False)),
        name=name,
        model_type=str(config.get("model_type", "")),
    )


def counted_shape(config: dict[str, Any], name: str) -> ModelShape:
    """A mixture-of-experts, hybrid or MLA target, counted on its meta-device model."""
    import torch
    from transformers import AutoModel
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    from dflash_mp.models.drafter_config import drafter_geometry

    model_type = config.get("model_type")
    if model_type not in CONFIG_MAPPING:
        what = f"model_type {model_type!r} is not one transformers knows" if model_type else "no model_type"
        raise PlanError(
            f"--target {name}: config.json has {what}; the plan counts a mixture-of-experts, hybrid or "
            "MLA target's parameters on transformers' own model of that type"
        )
    hf_config = CONFIG_MAPPING[model_type].from_dict(config)
    with torch.device("meta"):
        layers = AutoModel.from_config(hf_config).layers
    experts, top_k = expert_count(hf_config), experts_per_token(hf_config)
    every = active = 0
    for param_name, param in layers.named_parameters():
        every += param.numel()
        routed = experts and ".experts." in param_name and param.dim() >= 2 and param.shape[0] == experts
        active += param.numel() * top_k // experts if routed else param.numel()
    drafter = drafter_geometry(config)
    width = (
        (getattr(hf_config, "moe_intermediate_size", None) or hf_config.intermediate_size) if experts else 0
    )
    return ModelShape(
        hidden=config["hidden_size"],
        layers=config["num_hidden_layers"],
        heads=drafter["num_attention_heads"],
        kv_heads=drafter["num_key_value_heads"],
        head_dim=drafter["head_dim"],
        intermediate=drafter["intermediate_size"],
        vocab=config["vocab_size"],
        tied_embeddings=bool(config.get("tie_word_embeddings", False)),
        name=name,
        layer_params_all=every // len(layers),
        layer_params_active=active // len(layers),
        expert_width=int(width or 0),
        model_type=str(model_type),
    )


def layer_params(s: ModelShape) -> int:
    """One decoder layer: q/k/v/o projections, gated MLP, two RMSNorms and the q/k norms."""
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    attention = 2 * s.hidden * q_width + 2 * s.hidden * kv_width
    if s.attention_bias:
        attention += q_width + 2 * kv_width
    return attention + 3 * s.hidden * s.intermediate + 2 * s.hidden + 2 * s.head_dim


def target_layer_params(s: ModelShape, active: bool = False) -> int:
    """One target layer: counted where the shape was, else the dense formula."""
    counted = s.layer_params_active if active else s.layer_params_all
    return counted or layer_params(s)


def target_params(s: ModelShape) -> int:
    """The whole target, embedding and (untied) LM head included: its size on disk in bf16 / 2."""
    head = 0 if s.tied_embeddings else s.vocab * s.hidden
    return s.vocab * s.hidden + s.layers * target_layer_params(s) + s.hidden + head


def target_layers_run(s: ModelShape, w: Workload) -> int:
    """The target runs up to its last layer feeding the drafter (DFlash's default layer spacing)."""
    return max(default_target_layer_ids(s.layers, w.draft_layers)) + 1


def target_flops(s: ModelShape, layers_run: int, seq_len: int) -> float:
    """2 x (active) parameters run x tokens, plus causal attention over the layers run."""
    linear = 2 * layers_run * target_layer_params(s, active=True) * seq_len
    attention = 2 * seq_len**2 * s.heads * s.head_dim * layers_run
    return float(linear + attention)


def target_flops_per_sample(s: ModelShape, w: Workload) -> float:
    return target_flops(s, target_layers_run(s, w), w.seq_len)


def drafter_trainable_params(s: ModelShape, w: Workload) -> int:
    """Draft layers, the fc from the concatenated target features and its norm, the final norm.

    The embedding and LM head are the target's, frozen.
    """
    features = w.draft_layers * s.hidden
    return w.draft_layers * layer_params(s) + features * s.hidden + 2 * s.hidden


def drafter_flops_per_sample(s: ModelShape, w: Workload) -> float:
    """A DFlash drafter step's FLOPs per sample, counted as the benchmark counts them
    (bench/benchlib/flops.py): forward + weight gradients + the input gradients that are needed
    (none into the frozen features; the frozen LM head's only), the first layer's q/k/v over the
    distinct block rows, the last layer's o_proj and MLP without each block's index 0."""
    query = w.num_anchors * w.block_size
    first_rows, last_rows = w.num_anchors + 1, w.num_anchors * (w.block_size - 1)
    q_width, kv_width = s.heads * s.head_dim, s.kv_heads * s.head_dim
    q_row, kv_row = 2 * s.hidden * q_width, 2 * 2 * s.hidden * kv_width
    out_row = 2 * q_width * s.hidden + 2 * 3 * s.hidden * s.intermediate
    linear = w.draft_layers * (query * (q_row + out_row) + (w.seq_len + query) * kv_row)
    first_qkv = first_rows * (q_row + kv_row)
    linear += first_qkv - query * (q_row + kv_row) - (query - last_rows) * out_row
    attention = w.draft_layers * 4 * q_width * query * (MEAN_ANCHOR_POSITION * w.seq_len + w.block_size)
    fc = 2 * w.seq_len * w.draft_layers * s.hidden * s.hidden
    head = 2 * s.hidden * s.vocab * w.num_anchors * (w.block_size - 1)
    return float(3 * linear + 3 * attention + 2 * fc + 2 * head)


def target_weight_bytes(s: ModelShape, w: Workload, tensor_parallel: int = 1) -> float:
    """Embedding (kept whole on every rank) + the layers run, split over the replica's ranks."""
    layers = target_layers_run(s, w) * target_layer_params(s)
    return float(BF16 * (s.vocab * s.hidden + layers / tensor_parallel))


def target_activation_bytes(s: ModelShape, w: Workload, tensor_parallel: int = 1) -> float:
    """Captured features and their concatenation (replicated) + one layer's transients (sharded by TP)."""
    features = 2 * w.draft_layers * s.hidden
    transient = s.hidden + (s.heads + 2 * s.kv_heads) * s.head_dim / tensor_parallel
    transient += 2 * s.intermediate / tensor_parallel
    return float(BF16 * w.micro_batch * w.seq_len * (features + transient))


def drafter_static_bytes(s: ModelShape, w: Workload) -> float:
    """Training state of the trainable parameters + the frozen bf16 embedding and LM head."""
    frozen = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    return float(TRAIN_STATE_BYTES * drafter_trainable_params(s, w) + BF16 * frozen)


def drafter_activation_bytes(s: ModelShape, w: Workload) -> float:
    """Saved activations of the draft layers over the query tokens, the received features, one loss chunk."""
    query = w.num_anchors * w.block_size
    per_token = 4 * s.hidden + 2 * s.heads * s.head_dim + 2 * s.kv_heads * s.head_dim + 3 * s.intermediate
    layers = BF16 * w.draft_layers * query * per_token
    features = 2 * BF16 * w.seq_len * w.draft_layers * s.hidden
    loss_chunk = LOSS_CHUNK_ROWS * s.vocab * (BF16 + 4)
    return float(w.micro_batch * (layers + features) + loss_chunk)
