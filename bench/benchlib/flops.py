"""Useful-FLOP counts of the target forward and the drafter step (the MFU numerators)."""

from __future__ import annotations

from dflash_mp.config.schema import RootConfig
from dflash_mp.data import MicroBatch
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.objective.draft_blocks import block_labels, sample_anchors

from .shapes import Shape
from .synthetic import count_params

TARGET_FLOPS_COUNTING = (
    "per sequence: 2 * P * S (P = parameters of the decoder layers run, embedding lookup excluded) "
    "+ causal attention 2 * 2 * S^2 * heads * head_dim * layers_run / 2"
)

DRAFTER_FLOPS_COUNTING = (
    "train = forward + backward, each matmul's backward being its weight gradient (same FLOPs as "
    "its forward) plus its input gradient (same again) where the input needs one: not for fc (its "
    "input is the frozen target's features); the frozen LM head has the input gradient only; "
    "attention's backward is 2x its forward. forward per micro-batch = "
    "draft layers' q/o projections and MLP over all N*Bs query tokens "
    "+ k/v projections over the S context + N*Bs block tokens "
    "+ fc over the S context tokens (K*H -> H) "
    "+ block-sparse attention actually needed: 4 * heads * head_dim * sum over valid anchors of Bs * (anchor + Bs) "
    "(each block sees the context before its anchor and its own Bs tokens) per layer "
    "+ LM head 2 * H * V over the tokens with loss weight > 0; "
    "a DFlash drafter (not DFlash 2) computes the first layer's q/k/v once per distinct block row "
    "(N anchors + 1 mask row, not N*Bs) and the last layer's o_proj and MLP without each block's "
    "index 0 (the loss never scores it), and is counted so. "
    "Counted on the resident micro-batch (the anchors the trainer draws for it); "
    "not counted: norms, RoPE, softmax, the optimizer"
)


def target_flops_per_seq(extractor: TargetFeatureExtractor, shape: Shape) -> dict:
    layers = extractor.decoder.layers
    params = count_params(layers)
    s = shape.seq_len
    matmul = 2 * params * s
    attention = 2 * 2 * s * s * shape.target.heads * shape.target.head_dim * len(layers) / 2
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
    h, nh, nkv, hd, inter = (
        shape.target.hidden,
        shape.target.heads,
        shape.target.kv_heads,
        shape.target.head_dim,
        shape.target.intermediate,
    )
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
    # Per row of a layer's input: q_proj; k_proj + v_proj; o_proj + MLP (2 FLOPs per multiply-add).
    q_per_row, kv_per_row = 2 * h * nh * hd, 2 * 2 * h * nkv * hd
    out_per_row = 2 * nh * hd * h + 2 * 3 * h * inter
    spares = cfg.model.arch == "dflash"  # block_rows.py: DFlash 2's convolutions mix rows first
    first_rows = b * (n + 1) if spares else b * q  # the rows the first layer projects
    last_rows = b * n * (bs - 1) if spares else b * q  # the rows the last layer's o_proj and MLP take
    all_rows_layer = b * (q * (q_per_row + out_per_row) + (s + q) * kv_per_row)
    first_block_qkv = first_rows * (q_per_row + kv_per_row)
    layers_linear = num_layers * all_rows_layer - b * q * (q_per_row + kv_per_row) + first_block_qkv
    layers_linear -= (b * q - last_rows) * out_per_row
    attended_pairs = int((((anchors + bs) * valid).sum()) * bs)
    per_layer_attention = 4 * nh * hd * attended_pairs
    fc = 2 * b * s * k_layers * h * h
    scored = int((weights > 0).sum())
    lm_head = 2 * scored * h * shape.target.vocab
    attention = num_layers * per_layer_attention
    forward = layers_linear + attention + fc + lm_head
    # Backward: weight and input gradients of the layers' matmuls (the first layer's q/k/v too: its
    # norm's weight needs the gradient of the normed rows); fc's weight gradient only (frozen
    # features in); the head's input gradient only.
    backward = 2 * layers_linear + 2 * attention + fc + lm_head
    # The counting before 2026-12-02 (3x forward but the head's 2x, every row), to compare runs across it.
    forward_all_rows = num_layers * (all_rows_layer + per_layer_attention) + fc + lm_head
    return {
        "forward": forward,
        "train": forward + backward,
        "train_previous_counting": 3 * (forward_all_rows - lm_head) + 2 * lm_head,
        # What the counting before that gave (3 x forward, head included).
        "train_head_as_trainable": 3 * forward_all_rows,
        "layers_linear": layers_linear,
        "layers_attention": attention,
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
