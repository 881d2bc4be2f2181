"""XPress's causal refiner (docs/drafter.md, XPress): a per-position logit bias on the DFlash draft.

Each block position reads its own drafter hidden state, the mean hidden state of its block and
the embedding of the token before it, fuses them in a rank-r space, mixes positions with a
lower-triangular (causal) mixer and reads the result out as a bias over the vocabulary. The
parameter names and the math are those of `speculators.models.xpress.XPressRefinerHead`, so
weights move between the two as they are (tests/test_xpress_parity.py).

Because position k's bias depends only on the tokens at positions < k, the block is resolved by
Jacobi iteration: start from the drafter's argmax, then K times re-feed the previous pass's argmax.
Training unrolls the same recurrence (`dflash_mp.objective.xpress_loss`).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.nn.functional as F
from torch import nn


class XPressRefiner(nn.Module):
    """The refiner head; `block_bias(prev, hidden_cache(h))` is the bias [N, Bs, V] of blocks [N, Bs]."""

    causal_tril: torch.Tensor

    def __init__(self, hidden_size: int, vocab_size: int, block_size: int, rank: int, mlp_ratio: int) -> None:
        super().__init__()
        if rank < 1 or mlp_ratio < 1:
            raise ValueError(f"XPress needs rank >= 1 and mlp_ratio >= 1, got {rank} and {mlp_ratio}")
        self.rank, self.block_size = rank, block_size
        self.token_embed = nn.Embedding(vocab_size, rank)
        self.down_h = nn.Linear(hidden_size, rank, bias=False)
        self.down_g = nn.Linear(hidden_size, rank, bias=False)
        self.in_proj = nn.Linear(3 * rank, rank, bias=False)
        # Per rank channel, mix_l[c, k, j] weighs position j's latent into position k (j <= k only).
        self.mix_l = nn.Parameter(torch.zeros(rank, block_size, block_size))
        self.mlp_gate = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_up = nn.Linear(rank, rank * mlp_ratio, bias=False)
        self.mlp_down = nn.Linear(rank * mlp_ratio, rank, bias=False)
        self.readout = nn.Linear(rank, vocab_size, bias=False)
        self.register_buffer("causal_tril", torch.tril(torch.ones(block_size, block_size)), persistent=False)

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        """The reference's init: normal(0, 0.02) projections and embedding, the mixer at zero."""
        for module in self.modules():
            if isinstance(module, (nn.Linear, nn.Embedding)):
                weight = torch.empty(module.weight.shape, dtype=torch.float32)
                module.weight.copy_(weight.normal_(0.0, 0.02, generator=generator))
        self.mix_l.zero_()

    def hidden_cache(self, hidden: torch.Tensor) -> torch.Tensor:
        """[N, Bs, 2r]: each position's projected hidden state beside its block mean's. It does not
        depend on the previous tokens, so the Jacobi passes share it."""
        hidden = hidden.to(self.down_h.weight.dtype)
        summary = hidden.mean(dim=1, keepdim=True).expand_as(hidden)
        return torch.cat([self.down_h(hidden), self.down_g(summary)], dim=-1)

    def latent(self, prev_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The rank-r state [N, Bs, r] that `readout` maps to the bias, given prev_ids [N, Bs]."""
        embedded = self.token_embed(prev_ids.long()).to(cache.dtype)
        x = self.in_proj(torch.cat([cache, embedded], dim=-1))
        mixer = self.mix_l * self.causal_tril.to(self.mix_l.dtype)
        x = x + torch.einsum("ckj,njc->nkc", mixer, x)
        return x + self.mlp_down(F.silu(self.mlp_gate(x)) * self.mlp_up(x))

    def block_bias(self, prev_ids: torch.Tensor, cache: torch.Tensor) -> torch.Tensor:
        """The logit bias [N, Bs, V] given the token before each position, prev_ids [N, Bs]."""
        return self.readout(self.latent(prev_ids, cache))

    def latent_parameters(self) -> list[nn.Parameter]:
        """The parameters `latent` reads (not `readout`, nor the hidden cache's projections)."""
        modules = (self.token_embed, self.in_proj, self.mlp_gate, self.mlp_up, self.mlp_down)
        return [module.weight for module in modules] + [self.mix_l]


def previous_tokens(block: torch.Tensor, before_anchor: torch.Tensor) -> torch.Tensor:
    """[N, Bs]: the token before each block position; block [N, Bs] holds the anchor at index 0,
    before_anchor [N] the token before the anchor."""
    return torch.cat([before_anchor[:, None], block[:, :-1]], dim=1)


def teacher_forced(
    refiner: XPressRefiner,
    base_logits: torch.Tensor,
    cache: torch.Tensor,
    labels: torch.Tensor,
    before_anchor: torch.Tensor,
) -> torch.Tensor:
    """The refined logits [N, Bs, V] given the true previous tokens (labels [N, Bs], the anchor at
    index 0): the training loss's teacher-forced pass."""
    return base_logits + refiner.block_bias(previous_tokens(labels, before_anchor), cache)


def jacobi_passes(
    refiner: XPressRefiner,
    base_logits: torch.Tensor,
    cache: torch.Tensor,
    anchor: torch.Tensor,
    before_anchor: torch.Tensor,
    passes: int,
) -> Iterator[torch.Tensor]:
    """The refined logits [N, Bs, V] of each of `passes` Jacobi passes, one at a time (the loss
    keeps no more than it needs of each).

    Pass 0 conditions on the drafter's own argmax; pass j on pass j-1's argmax, with index 0 held
    at the anchor (it is known, not predicted). The argmax carries no gradient between passes, as
    in the reference's consistency rounds and its serving loop.
    """
    guess = base_logits.detach().argmax(dim=-1)
    for _ in range(passes):
        guess[:, 0] = anchor
        refined = base_logits + refiner.block_bias(previous_tokens(guess, before_anchor), cache)
        yield refined
        guess = refined.detach().argmax(dim=-1)


def jacobi_rounds(
    refiner: XPressRefiner,
    base_logits: torch.Tensor,
    cache: torch.Tensor,
    anchor: torch.Tensor,
    before_anchor: torch.Tensor,
    passes: int,
) -> list[torch.Tensor]:
    """Every pass of `jacobi_passes`, as a list."""
    return list(jacobi_passes(refiner, base_logits, cache, anchor, before_anchor, passes))


def refined_logits(
    refiner: XPressRefiner,
    base_logits: torch.Tensor,
    hidden: torch.Tensor,
    anchor: torch.Tensor,
    before_anchor: torch.Tensor,
    passes: int,
) -> torch.Tensor:
    """The logits [N, Bs, V] the drafter proposes from after `passes` Jacobi passes (0: the base)."""
    rounds = jacobi_rounds(refiner, base_logits, refiner.hidden_cache(hidden), anchor, before_anchor, passes)
    return rounds[-1] if rounds else base_logits
