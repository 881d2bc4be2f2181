"""The two modules DFlash 2 adds to the DFlash drafter: a grouped dynamic convolution and a selector.

Both follow the reference `dflash` 0.1.0 package (`dflash.model.GroupedDynamicCausalConv`,
`CandidateSelector`): same parameter names and shapes, so an export loads there, and the same
numerics. What differs is the training layout: here many blocks sit back to back in one sequence,
so the convolution takes each token's position inside its block and zeroes every tap that would
reach into the previous block (at inference a forward sees one block, and the tap before the
anchor reads zeros).

Convolution (D channels, groups of G, kernel size K, side 0 before the sublayer, side 1 after):

    Conv_s(y)[t, c] = sum_{o < K, o <= pos_in_block(t)} (base_kernel[s, o, c] + delta[t, s, o, c // G]) * y[t - o, c]

with delta = kernel_projection(x) from the sublayer's normed input x; each sublayer becomes
`h + Conv_1(Sublayer(Conv_0(x)))`. Initialised as the identity (base tap 0 = 1, everything else
and the projection 0), so a fresh DFlash 2 drafter computes what its DFlash weights compute.

Selector (rank r, top-K candidates C_t with unary scores U_t = the target head's logits):

    s_t(a, b) = U_t(b) + <A[a] * W_h h_t, B[b]>    for predecessor token a, candidate b in C_t

walked from the anchor: greedy b_t = argmax, sampled b_t ~ softmax(s_t / T) over the K candidates.
The successor codebook B starts at zero, so the selector starts as a no-op (the unary argmax).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from dflash_mp.kernels.grouped_conv import GroupedConvolution, convolve_with_tensor_ops


def grouped_dynamic_convolve(
    values: Tensor, dynamic: Tensor, base: Tensor, group_size: int, position_in_block: Tensor | None
) -> Tensor:
    """One side of the convolution: values [B, L, D], dynamic [B, L, K, D/G], base [K, D].

    `position_in_block` [L] (each row's index inside its block) zeroes taps t - o that fall before
    the block start; None treats the whole sequence as one block. On CUDA the backward is
    hand-written (`grouped_conv.GroupedConvolution`: one pass for both kernel gradients); the
    CPU keeps autograd's, the reference the parity tests compare against.
    """
    if not values.is_cuda:
        return convolve_with_tensor_ops(values, dynamic, base, group_size, position_in_block)
    if position_in_block is None:
        position_in_block = torch.arange(values.shape[1], device=values.device)
    return GroupedConvolution.apply(values, dynamic, base, position_in_block, group_size)


class GroupedDynamicConv(nn.Module):
    """Depthwise convolution over block positions with a per-token, per-group kernel correction."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        if hidden_size % group_size:
            raise ValueError(f"conv_group_size {group_size} must divide hidden_size {hidden_size}")
        self.kernel_size = kernel_size
        self.group_size = group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    @torch.no_grad()
    def reset_to_identity(self) -> None:
        """Base tap 0 = 1, other taps and the projection 0: both sides pass their input through."""
        self.base_kernel.zero_()
        self.base_kernel[:, 0] = 1.0
        self.kernel_projection.weight.zero_()

    def prepare(self, normed: Tensor, position_in_block: Tensor | None) -> tuple[Tensor, Tensor]:
        """(side 0 applied to the sublayer input, side 1's dynamic kernel), both from `normed`."""
        dynamic = self.kernel_projection(normed).view(*normed.shape[:-1], 2, self.kernel_size, self.groups)
        before = grouped_dynamic_convolve(
            normed, dynamic[..., 0, :, :], self.base_kernel[0], self.group_size, position_in_block
        )
        return before, dynamic[..., 1, :, :]

    def finish(self, sublayer_output: Tensor, dynamic: Tensor, position_in_block: Tensor | None) -> Tensor:
        """Side 1 applied to the sublayer's output."""
        return grouped_dynamic_convolve(
            sublayer_output, dynamic, self.base_kernel[1], self.group_size, position_in_block
        )


class CandidateSelector(nn.Module):
    """Low-rank pairwise scores between a predecessor token and each of the top-K unary candidates.

    The codebooks are bare parameters (no `.weight`), which is how DFlash 2 checkpoints store them.
    """

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        if not 1 <= top_k <= vocab_size:
            raise ValueError(f"selector_top_k {top_k} must be in [1, vocab_size={vocab_size}]")
        self.top_k = top_k
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator) -> None:
        """Predecessor codebook and projection ~ N(0, std); successor codebook 0 (a no-op at start)."""
        for param in (self.predecessor_codebook, self.hidden_projection.weight):
            param.copy_(torch.empty(param.shape, dtype=torch.float32).normal_(0.0, std, generator=generator))
        self.successor_codebook.zero_()

    def pair_scores(self, projected: Tensor, predecessors: Tensor, candidates: Tensor) -> Tensor:
        """<A[a] * W_h h, B[b]>: projected [..., r] (W_h h), predecessors [...], candidates [..., K]."""
        query = F.embedding(predecessors, self.predecessor_codebook) * projected
        keys = F.embedding(candidates, self.successor_codebook)
        return torch.einsum("...r,...kr->...k", query, keys)

    @torch.no_grad()
    def walk(
        self,
        hidden: Tensor,
        logits: Tensor,
        anchor_ids: Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor, Tensor | None]:
        """The served path through a block: hidden [B, T, H], logits [B, T, V] of block positions 1..T.

        Returns (tokens [B, T], candidates [B, T, K], q [B, T, K] or None): from the anchor, each
        position picks among its top-K unary candidates given the previous pick; greedy at
        temperature 0, else sampled from q = softmax(scores / T) over the candidates.
        """
        # As the reference scores: in the logits' dtype and in topk's unsorted order, so that bf16
        # decoding makes the same picks, exact ties included (argmax takes the first).
        unary, candidates = logits.topk(self.top_k, dim=-1, sorted=False)
        tokens, q = self.walk_candidates(
            self.hidden_projection(hidden), unary, candidates, anchor_ids, temperature, generator
        )
        return tokens, candidates, q

    @torch.no_grad()
    def walk_candidates(
        self,
        projected: Tensor,
        unary: Tensor,
        candidates: Tensor,
        anchor_ids: Tensor,
        temperature: float = 0.0,
        generator: torch.Generator | None = None,
    ) -> tuple[Tensor, Tensor | None]:
        """`walk` from projected hidden states [B, T, r] and the unary top-K (values, ids) [B, T, K]."""
        predecessor = anchor_ids
        tokens, q_rows = [], []
        for position in range(projected.shape[1]):
            scores = unary[:, position] + self.pair_scores(
                projected[:, position], predecessor, candidates[:, position]
            )
            if temperature > 0:
                q = torch.softmax(scores.float() / temperature, dim=-1)
                index = torch.multinomial(q, 1, generator=generator)[:, 0]
                q_rows.append(q)
            else:
                index = scores.argmax(-1)
            predecessor = candidates[:, position].gather(-1, index[:, None])[:, 0]
            tokens.append(predecessor)
        return torch.stack(tokens, dim=1), torch.stack(q_rows, dim=1) if q_rows else None
