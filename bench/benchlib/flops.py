"""Useful-FLOP counts of the target forward and the drafter step (the MFU numerators)."""

from __future__ import annotations

from dflash_mp.config import RootConfig
from dflash_mp.data import MicroBatch
from dflash_mp.draft_blocks import block_labels, sample_anchors
from dflash_mp.models.target import TargetFeatureExtractor

from .shapes import Shape
from .synthetic import count_params

TARGET_FLOPS_COUNTING = (
    "per sequence: 2 * P * S (P = parameters of the decoder layers run, embedding lookup excluded) "
    "+ causal attention 2 * 2 * S^2 * heads * head_dim * layers_run / 2"
)

DRAFTER_FLOPS_COUNTING = (
    "train = 3 x (forward without the LM head) + 2 x LM head: the head is frozen, so its backward is "
    "the input gradient only (no weight gradient). forward per micro-batch = "
    "draft layers' q/o projections and MLP over all N*Bs query tokens "
    "+ k/v projections over the S context + N*Bs block tokens "
    "+ fc over the S context tokens (K*H -> H) "
    "+ block-sparse attention actually needed: 4 * heads * head_dim * sum over valid anchors of Bs * (anchor + Bs) "
    "(each block sees the context before its anchor and its own Bs tokens) per layer "
    "+ LM head 2 * H * V over the tokens with loss weight > 0. "
    "Counted on the resident micro-batch (the anchors the trainer draws for it); "
    "not counted: norms, RoPE, softmax, the optimizer"
)


def target_flops_per_seq(extractor: TargetFeatureExtractor, shape: Shape) -> dict:
    layers = extractor.decoder.layers
    params = count_params(layers)
    s = shape.seq_len
    matmul = 2 * params * s
    attention = 2 * 2 * s * s * shape.heads * shape.head_dim * len(layers) / 2
    return {
        "per_seq": matmul + attention,
        "params_used": params,
        "layers_run": len(layers),
        "linear": matmul,
        "attention": attention,
        "counting": TARGET_FLOPS_COUNTING,
    }


def drafter_flops_per_micro_batch(shape: Shape, cfg: RootConfig, batch: MicroBatch) -> dict:
    """Useful FLOPs of one drafter micro-step on `batch` (see DRAFTER_FLOPS_COUNTING)."""
    h, nh, nkv, hd, inter = shape.hidden, shape.heads, shape.kv_heads, shape.head_dim, shape.intermediate
    num_layers, k_layers, bs, n = (
        shape.draft_layers,
        len(shape.layer_ids),
        shape.block_size,
        shape.num_anchors,
    )
    b, s = batch.input_ids.shape
    anchors, valid = sample_anchors(
        batch.loss_mask, batch.lengths, batch.sample_ids, batch.epoch, cfg.train.seed, n
    )
    _, weights = block_labels(
        batch.input_ids, batch.loss_mask, batch.lengths, anchors, valid, bs, cfg.train.gamma
    )
    q = n * bs
    per_layer_linear = b * (
        2 * q * h * nh * hd  # q_proj
        + 2 * 2 * (s + q) * h * nkv * hd  # k_proj, v_proj over context + block tokens
        + 2 * q * nh * hd * h  # o_proj
        + 2 * 3 * q * h * inter  # gate, up, down
    )
    attended_pairs = int((((anchors + bs) * valid).sum()) * bs)
    per_layer_attention = 4 * nh * hd * attended_pairs
    fc = 2 * b * s * k_layers * h * h
    scored = int((weights > 0).sum())
    lm_head = 2 * scored * h * shape.vocab
    forward = num_layers * (per_layer_linear + per_layer_attention) + fc + lm_head
    return {
        "forward": forward,
        "train": 3 * (forward - lm_head) + 2 * lm_head,
        # What the previous counting (3 x forward, head included) gave, to compare runs across it.
        "train_head_as_trainable": 3 * forward,
        "layers_linear": num_layers * per_layer_linear,
        "layers_attention": num_layers * per_layer_attention,
        "fc": fc,
        "lm_head": lm_head,
        "query_tokens": b * q,
        "context_tokens": b * s,
        "valid_anchors": int(valid.sum()),
        "scored_tokens": scored,
        "attended_pairs_per_layer": attended_pairs,
        "dense_pairs_per_layer": b * q * (s + q),
        "counting": DRAFTER_FLOPS_COUNTING,
    }
