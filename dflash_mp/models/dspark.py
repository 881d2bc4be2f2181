"""DSpark's two heads on the DFlash backbone (`model.arch=dspark`, docs/drafter.md: DSpark).

- `MarkovHead`: a low-rank logit bias B_k = W2 f_k added to the backbone's logits at block position
  k, where f_k (rank r) is built from the previous block token x_{k-1} (W1[x_{k-1}], an embedding
  of its own over the target vocabulary): "vanilla" uses it as it is, "gated" scales it by
  sigmoid(gate_proj([h_k; W1[x_{k-1}]])), "rnn" carries a gated state across the block and emits
  tanh of an output projection. Drafting therefore runs left to right over the block (each
  position conditions on the token drawn before it); training teacher-forces the true tokens.
- `ConfidenceHead`: one linear map of [h_k; W1[x_{k-1}]] (or h_k alone) to a logit of the
  probability that position k's draft is accepted.

Parameter names and the math follow speculators' `speculators.models.dspark` (`markov_head.*`,
`confidence_head.proj.*`), the layout vLLM loads; tests/test_dspark_parity.py holds them equal.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from dflash_mp.models.dspark_fields import MARKOV_HEAD_TYPES


class MarkovHead(nn.Module):
    """The low-rank transition bias (module docstring); vocabulary V, rank r, hidden size H."""

    def __init__(self, vocab_size: int, markov_rank: int, hidden_size: int, head_type: str) -> None:
        super().__init__()
        if head_type not in MARKOV_HEAD_TYPES:
            raise ValueError(f"markov_head_type={head_type!r}: must be one of {MARKOV_HEAD_TYPES}")
        self.head_type = head_type
        self.markov_rank = markov_rank
        self.markov_w1 = nn.Embedding(vocab_size, markov_rank)
        self.markov_w2 = nn.Linear(markov_rank, vocab_size, bias=False)
        if head_type == "gated":
            self.gate_proj = nn.Linear(hidden_size + markov_rank, markov_rank)
        elif head_type == "rnn":  # [gate; candidate; output] from [state; W1[x]; h]
            self.joint_proj = nn.Linear(2 * markov_rank + hidden_size, 3 * markov_rank)

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator) -> None:
        """normal(0, std) weights and zero biases (ModelOpt's DeepSpec init), drawn in a fixed order."""
        for module in (
            self.markov_w1,
            self.markov_w2,
            getattr(self, "gate_proj", None),
            getattr(self, "joint_proj", None),
        ):
            if module is None:
                continue
            weight = torch.empty(module.weight.shape, dtype=torch.float32)
            module.weight.copy_(weight.normal_(0.0, std, generator=generator))
            if getattr(module, "bias", None) is not None:
                module.bias.zero_()

    def embed(self, token_ids: Tensor) -> Tensor:
        """W1[x]: [..., r] for token ids [...]."""
        return self.markov_w1(token_ids.long())

    def features(self, prev_emb: Tensor, hidden: Tensor) -> Tensor:
        """f [N, Bs, r] (what W2 maps to the bias) of a block's previous-token embeddings
        prev_emb [N, Bs, r] and backbone hidden states hidden [N, Bs, H] (teacher forcing)."""
        prev_emb = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return prev_emb
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb
        state = prev_emb.new_zeros(prev_emb.shape[0], self.markov_rank)
        outputs = []
        for k in range(prev_emb.shape[1]):
            output, state = self.step(prev_emb[:, k], hidden[:, k], state)
            outputs.append(output)
        return torch.stack(outputs, dim=1)

    def step(self, prev_emb: Tensor, hidden: Tensor, state: Tensor | None) -> tuple[Tensor, Tensor | None]:
        """One position: (f [N, r], the rnn state after it) from W1[x_{k-1}] [N, r] and h_k [N, H];
        `state` None starts a block (zeros). Memoryless heads return `state` as it came."""
        prev_emb = prev_emb.to(self.markov_w2.weight.dtype)
        if self.head_type == "vanilla":
            return prev_emb, state
        hidden = hidden.to(prev_emb.dtype)
        if self.head_type == "gated":
            return torch.sigmoid(self.gate_proj(torch.cat([hidden, prev_emb], dim=-1))) * prev_emb, state
        if state is None:
            state = prev_emb.new_zeros(prev_emb.shape[0], self.markov_rank)
        gate, candidate, output = self.joint_proj(torch.cat([state, prev_emb, hidden], dim=-1)).chunk(
            3, dim=-1
        )
        gate = torch.sigmoid(gate)
        state = gate * state + (1.0 - gate) * torch.tanh(candidate)
        return torch.tanh(output), state

    def bias(self, features: Tensor) -> Tensor:
        """B = W2 f: [..., V]."""
        return self.markov_w2(features)


class ConfidenceHead(nn.Module):
    """Acceptance-probability logit of each block position from [h_k; W1[x_{k-1}]] (or h_k)."""

    def __init__(self, input_dim: int) -> None:
        super().__init__()
        self.proj = nn.Linear(input_dim, 1)

    @torch.no_grad()
    def init_weights(self, std: float, generator: torch.Generator) -> None:
        weight = torch.empty(self.proj.weight.shape, dtype=torch.float32)
        self.proj.weight.copy_(weight.normal_(0.0, std, generator=generator))
        self.proj.bias.zero_()

    def forward(self, hidden: Tensor, prev_emb: Tensor | None) -> Tensor:
        """[...] logits of hidden [..., H] and, with the Markov input, prev_emb [..., r]."""
        features = hidden if prev_emb is None else torch.cat([hidden, prev_emb.to(hidden.dtype)], dim=-1)
        return self.proj(features).squeeze(-1)


def build_heads(
    fields: dict[str, Any], vocab_size: int, hidden_size: int
) -> tuple[MarkovHead | None, ConfidenceHead | None]:
    """The heads a drafter with DSpark `fields` carries (either may be absent)."""
    rank = int(fields["markov_rank"])
    markov = MarkovHead(vocab_size, rank, hidden_size, str(fields["markov_head_type"])) if rank > 0 else None
    confidence = None
    if fields["enable_confidence_head"]:
        with_markov = bool(fields["confidence_head_with_markov"])
        confidence = ConfidenceHead(hidden_size + (rank if with_markov else 0))
    return markov, confidence


def previous_tokens(labels: Tensor, anchor_tokens: Tensor, sample_from_anchor: bool) -> Tensor:
    """The teacher-forced previous token of each block position, [..., Bs], from the labels
    [..., Bs] and the anchors' tokens [...]: with `sample_from_anchor` position k predicts
    x[a+k+1] and conditions on x[a+k] (the anchor for k = 0); without, it predicts x[a+k] and
    conditions on x[a+k-1] (position 0, the anchor itself, is not scored and sees the anchor)."""
    first = anchor_tokens[..., None] if sample_from_anchor else labels[..., :1]
    return torch.cat([first, labels[..., :-1]], dim=-1)
