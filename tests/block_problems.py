"""Small problems shared by the training-math tests: sequences, anchors, masks and a loss problem."""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn.attention.flex_attention import flex_attention

VOCAB, HIDDEN, NUM_FEATURE_LAYERS, BLOCK, MASK_ID = 50, 32, 2, 4, 49

# The compiled flex attention both math test modules use on CUDA.
COMPILED_FLEX_ATTENTION = torch.compile(flex_attention)


def make_sequences(lengths: list[int], seq_len: int, seed: int = 0) -> tuple[Tensor, Tensor, Tensor]:
    """Right-padded ids and a loss mask with a prompt, then response/non-response stretches."""
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, VOCAB - 1, (len(lengths), seq_len), generator=generator)
    loss_mask = torch.zeros(len(lengths), seq_len, dtype=torch.uint8)
    for row, length in enumerate(lengths):
        loss_mask[row, length // 3 : length] = 1
        loss_mask[row, length // 2 : length // 2 + 2] = 0  # a second turn's user tokens
        input_ids[row, length:] = 0
    return input_ids, loss_mask, torch.tensor(lengths)


def eligible_anchors(loss_mask: Tensor, row: int, length: int) -> list[int]:
    """Response positions with context before them whose next token is a response token too."""
    return [p for p in range(1, length - 1) if loss_mask[row, p] and loss_mask[row, p + 1]]


def brute_force_mask(anchors: Tensor, context_len: int, block_size: int) -> Tensor:
    batch, num_anchors = anchors.shape
    num_queries = num_anchors * block_size
    mask = torch.zeros(batch, 1, num_queries, context_len + num_queries, dtype=torch.bool)
    for b in range(batch):
        for q in range(num_queries):
            for kv in range(context_len + num_queries):
                block = q // block_size
                if kv < context_len:
                    mask[b, 0, q, kv] = kv < int(anchors[b, block])
                else:
                    mask[b, 0, q, kv] = (kv - context_len) // block_size == block
    return mask


def random_anchors(batch: int, num_anchors: int, context_len: int, seed: int = 0) -> Tensor:
    generator = torch.Generator().manual_seed(seed)
    anchors = torch.randint(0, context_len - 1, (batch, num_anchors), generator=generator).sort(-1).values
    anchors[:, -2:] = 0  # invalid slots
    return anchors


def loss_problem(seed: int = 0, requires_grad: bool = True) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """hidden [2, 5*BLOCK, H], head [V, H], labels/weights [2, 5, BLOCK] with real zero weights."""
    generator = torch.Generator().manual_seed(seed)
    hidden = torch.randn(2, 5 * BLOCK, HIDDEN, generator=generator, requires_grad=requires_grad)
    head = torch.randn(VOCAB, HIDDEN, generator=generator, requires_grad=requires_grad)
    labels = torch.randint(0, VOCAB, (2, 5, BLOCK), generator=generator)
    weights = torch.rand(2, 5, BLOCK, generator=generator) * (
        torch.rand(2, 5, BLOCK, generator=generator) > 0.3
    )
    weights[..., 0] = 0
    return hidden, head, labels, weights
