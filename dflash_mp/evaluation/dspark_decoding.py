"""How a DSpark drafter proposes a block (decoding.py calls it; docs/drafter.md: DSpark).

The backbone runs the block once, in parallel, as DFlash's does; the Markov head then turns its
logits into a left-to-right chain: position k's logits get the bias of the token proposed at k-1
(the block's first token before the first proposal), and the token is picked there, by argmax or
by a sample of softmax(logits / T) cut by top-k/top-p, before position k+1 is biased. This is the
sequential sampling of the references' inference (ModelOpt's `pseudo_speculative_generate`, vLLM's
DSpark proposer); rejection sampling is exact for these chained q because each proposal was drawn
from the q it is judged by.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING

import torch
from torch import Tensor, nn

if TYPE_CHECKING:
    from dflash_mp.models.drafter import DFlashDrafter


def drafts_per_block(drafter: nn.Module) -> int:
    """Proposals per full block: Bs for a DSpark drafter that samples from the anchor (position k
    proposes x[p+k+1]), else Bs - 1 (index 0 holds the known token)."""
    return drafter.block_size if getattr(drafter, "sample_from_anchor", False) else drafter.block_size - 1


def dspark_propose(
    drafter: DFlashDrafter,
    hidden: Tensor,
    head: nn.Module,
    first_token: int,
    temperature: float,
    generator: torch.Generator | None,
    sampling_probs: Callable[[Tensor, float, int, float], Tensor],
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[list[int], Tensor | None]:
    """Proposals of a block whose drafter hidden states are `hidden` [size, H] (row 0 at the block's
    first token), and with temperature > 0 the distribution each was drawn from, [n, V]
    (`sampling_probs(logits, T, top_k, top_p)`: decoding.py's cut, the target's too)."""
    markov = drafter.markov_head
    base = drafter.logits(hidden.to(head.weight.dtype), head)
    first = torch.tensor([first_token], device=hidden.device)
    previous, state = first, None
    tokens, probs = [], []
    for k in range(hidden.shape[0]):
        logits = base[k : k + 1]
        if markov is not None:  # the rnn state also runs over the anchor's row, as in training
            features, state = markov.step(markov.embed(previous), hidden[k : k + 1], state)
            logits = logits + markov.bias(features).to(logits.dtype)
        if k == 0 and not drafter.sample_from_anchor:
            continue  # the block's first token is known: row 0 proposes nothing, x[p] stays the predecessor
        if temperature <= 0:
            token = logits.argmax(-1)
        else:
            q = sampling_probs(logits, temperature, top_k, top_p)
            token = torch.multinomial(q, 1, generator=generator)[:, 0]
            probs.append(q[0])
        tokens.append(int(token))
        previous = token
    return tokens, torch.stack(probs) if probs else None
