"""Block speculative decoding with a DFlash (or DFlash 2) drafter and the full target, batch 1.

One decoding round, after the target has accepted everything up to position p:
the drafter gets the block `[token at p, MASK x (B-1)]` at positions p..p+B-1 and the target's
features of all positions < p, and proposes B-1 tokens; the target scores the whole block in one
forward over its KV cache; the longest prefix of proposals the target agrees with is accepted,
plus one token of the target's own (the bonus). Greedy verification compares with the target's
argmax, so the output is exactly the target's greedy decoding; with temperature > 0, rejection
sampling keeps the output distributed as the target's (both distributions cut by the same
top-k/top-p, as the reference's `dflash_generate` does). The accounting (acceptance length = tokens
produced per verify forward, bonus included, cut at the length limit and at a stop token) is the
reference `dflash.model.dflash_generate`'s, so tau here is the number the DFlash paper reports.

A DFlash 2 drafter proposes through its candidate selector, as the reference's `propose` does:
from the anchor, each block position picks among the target head's top-K logits given the
previous pick (argmax, or a sample from q = softmax(scores / T) over the K candidates); rejection
sampling then reads q as a distribution over the vocabulary, zero outside the candidates.

A DSpark drafter proposes through its Markov head, one position after the other over the block it
drafted in parallel (`dspark_decoding.py`); with sample_from_anchor every row proposes (B per block).
"""

from __future__ import annotations

import functools
import inspect
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from dflash_mp.evaluation.dspark_decoding import drafts_per_block, dspark_propose

if TYPE_CHECKING:  # annotations only: the preflight imports this without the models
    from dflash_mp.models.drafter import DFlashDrafter


@dataclass
class Generation:
    """One prompt's decoding."""

    new_tokens: list[int]
    seconds: float
    target_forwards: int  # the prefill included
    acceptance_lengths: list[int] = field(default_factory=list)  # tokens produced per verify forward
    drafted: list[int] = field(default_factory=list)  # [B-1]: rounds that proposed block index k+1
    accepted: list[int] = field(default_factory=list)  # [B-1]: rounds that accepted block index k+1


# ----------------------------------------------------------------------------------------
# decoding


def _synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _new_cache(target: nn.Module) -> Any:
    from transformers import DynamicCache

    cache = DynamicCache(config=target.config)
    # Sliding-window layers drop old entries unless told that the cache will be rolled back.
    cache.activate_past_recording()
    return cache


@functools.cache
def _cache_keyword(model_type: type) -> str:
    # transformers 5 renamed past_key_values to cache; the old name is gone from 5.40 on.
    return "cache" if "cache" in inspect.signature(model_type.forward).parameters else "past_key_values"


def _crop(cache: Any, length: int) -> None:
    cache.crop(length - cache.get_seq_length())  # crop() takes minus the number of tokens to drop


def sampling_probs(
    logits: torch.Tensor, temperature: float, top_k: int = 0, top_p: float = 1.0
) -> torch.Tensor:
    """The distribution a sampler draws from: softmax(logits / T) over the `top_k` likeliest tokens
    (0: all), then cut to the smallest set of them holding `top_p` of the probability, renormalized.
    Top-k before top-p, as transformers, vLLM and the reference `dflash` order them; the target's
    and the drafter's distributions go through the same cut, so rejection sampling stays exact."""
    scores = logits.float() / temperature
    top_k_ids = None
    if 0 < top_k < scores.shape[-1]:
        scores, top_k_ids = scores.topk(top_k, dim=-1)
    probs = torch.softmax(scores, dim=-1)
    if top_p < 1.0:
        descending, order = probs.sort(dim=-1, descending=True)
        # A token stays while the likelier ones hold less than top_p: the one that crosses it stays.
        descending = descending.masked_fill(descending.cumsum(-1) - descending >= top_p, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, descending)
        probs = probs / probs.sum(-1, keepdim=True)
    if top_k_ids is None:
        return probs
    return torch.zeros_like(logits, dtype=probs.dtype).scatter(-1, top_k_ids, probs)


def _pick(
    logits: torch.Tensor,
    temperature: float,
    generator: torch.Generator | None,
    top_k: int = 0,
    top_p: float = 1.0,
) -> torch.Tensor:
    """Next tokens [N] from logits [N, V]: argmax, or a sample at `temperature` (top-k, top-p)."""
    if temperature <= 0:
        return logits.argmax(-1)
    return torch.multinomial(sampling_probs(logits, temperature, top_k, top_p), 1, generator=generator)[:, 0]


def _rejection_sample(
    draft_tokens: torch.Tensor,
    draft_probs: torch.Tensor,
    target_probs: torch.Tensor,
    generator: torch.Generator | None,
) -> tuple[int, int]:
    """(accepted proposals, next token) of speculative sampling (Leviathan et al. 2023, Alg. 1).

    Proposal k is kept with probability min(1, p_k / q_k); at the first rejection the next token is
    drawn from normalize(max(0, p - q)), and after all B-1 acceptances from the target's last row,
    which makes every emitted token distributed exactly as the target's own sample.
    """
    rows = torch.arange(draft_tokens.numel(), device=draft_tokens.device)
    p = target_probs[rows, draft_tokens]
    q = draft_probs[rows, draft_tokens]
    uniform = torch.rand(q.shape, generator=generator, device=q.device)
    accepted = int((uniform * q < p).int().cumprod(0).sum())
    if accepted == draft_tokens.numel():
        residual = target_probs[accepted]
    else:
        residual = (target_probs[accepted] - draft_probs[accepted]).clamp_min(0)
        if residual.sum() <= 0:  # p == q: the rejection had probability 0; fall back to p
            residual = target_probs[accepted]
    return accepted, int(torch.multinomial(residual, 1, generator=generator))


def _target_step(
    target: nn.Module,
    token_ids: list[int],
    start: int,
    cache: Any,
    layer_ids: list[int] | None,
    logits_to_keep: int = 0,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Target forward of `token_ids` at positions start.. over the cache: (logits [T, V], features [T, K*H])."""
    device = target.get_input_embeddings().weight.device
    input_ids = torch.tensor([token_ids], device=device)
    positions = torch.arange(start, start + len(token_ids), device=device)[None]
    output = target(
        input_ids=input_ids,
        position_ids=positions,
        **{_cache_keyword(type(target)): cache},
        use_cache=True,
        output_hidden_states=layer_ids is not None,
        logits_to_keep=logits_to_keep,
    )
    if layer_ids is None:
        return output.logits[0], None
    # hidden_states[0] is the embedding output, so target layer i is entry i + 1 (docs/DESIGN.md §3).
    features = torch.cat([output.hidden_states[i + 1] for i in layer_ids], dim=-1)
    return output.logits[0], features[0]


def _window_mask(start: int, context_len: int, size: int, window: int, device: torch.device) -> torch.Tensor:
    """[1, 1, size, context_len + size] bool: |query - key position| < window, the reference's
    non-causal sliding rule; context key j is at position j, block row i at start + i."""
    queries = torch.arange(start, start + size, device=device)[:, None]
    keys = torch.cat([torch.arange(context_len, device=device), queries[:, 0]])[None]
    return ((queries - keys).abs() < window)[None, None]


def _propose(
    drafter: DFlashDrafter,
    target: nn.Module,
    context_features: torch.Tensor,
    first_token: int,
    start: int,
    size: int,
    temperature: float,
    generator: torch.Generator | None,
    top_k: int = 0,
    top_p: float = 1.0,
    before_first: int | None = None,
) -> tuple[list[int], torch.Tensor | None]:
    """The drafter's `size - 1` proposals for block [first_token, MASK...] at positions start..; and
    their sampling distributions [size-1, V] when temperature > 0, cut by top_k/top_p as the target's
    (a DFlash 2 drafter's: its selector's q over its K candidates, zero elsewhere and not cut, as the
    reference's `propose`; rejection sampling is exact for any q the proposals were drawn from).
    An XPress drafter drafts the whole block (its refiner's mixer spans it) and proposes from the
    logits its K Jacobi passes leave (`xpress_logits`; `before_first` is the token before the block)."""
    device = context_features.device
    param = next(drafter.parameters())
    refiner = getattr(drafter, "refiner_head", None)
    proposed, size = size, drafter.block_size if refiner is not None else size
    block_ids = torch.full((1, size), drafter.mask_token_id, device=device)
    block_ids[0, 0] = first_token
    embed_weight = target.get_input_embeddings().weight
    head = target.get_output_embeddings()
    context_len = context_features.shape[0]
    # One block that sees all context before it and itself: everything, except in a sliding layer.
    mask: Any = torch.ones(1, 1, size, context_len + size, dtype=torch.bool, device=device)
    if drafter.sliding_window is not None:
        mask = {
            "full_attention": mask,
            "sliding_attention": _window_mask(start, context_len, size, drafter.sliding_window, device),
        }
    block_embeddings = F.embedding(block_ids, embed_weight) * drafter.input_embedding_scale
    # Eager even when the layers are compiled for training: a new context length every call would
    # otherwise recompile them, and fill the compile cache that training shapes need.
    with torch.compiler.set_stance("force_eager"):
        hidden = drafter(
            context_features[None].to(param.dtype),
            block_embeddings.to(param.dtype),
            torch.arange(context_len, device=device)[None],
            torch.arange(start, start + size, device=device)[None],
            mask,
        )
    if getattr(drafter, "arch", "dflash") == "dspark":  # a Markov chain over the block: dspark_decoding.py
        return dspark_propose(
            drafter, hidden[0], head, first_token, temperature, generator, sampling_probs, top_k, top_p
        )
    # Output at block index k guesses the token at start + k; index 0 is the known token.
    if refiner is not None:
        logits = xpress_logits(drafter, hidden.to(head.weight.dtype), head, first_token, before_first)[
            1:proposed
        ]
    else:
        logits = drafter.logits(hidden[0, 1:].to(head.weight.dtype), head)
    selector = getattr(drafter, "candidate_selector", None)
    if selector is not None:
        anchor = torch.tensor([first_token], device=device)
        tokens, candidates, q = selector.walk(hidden[:, 1:], logits[None], anchor, temperature, generator)
        draft_probs = None
        if q is not None:
            draft_probs = torch.zeros_like(logits, dtype=torch.float32).scatter_add_(-1, candidates[0], q[0])
        return tokens[0].tolist(), draft_probs
    if temperature <= 0:
        return logits.argmax(-1).tolist(), None
    draft_probs = sampling_probs(logits, temperature, top_k, top_p)
    return torch.multinomial(draft_probs, 1, generator=generator)[:, 0].tolist(), draft_probs


@torch.inference_mode()
def speculative_generate(
    drafter: DFlashDrafter,
    target: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Generation:
    """Block speculative decoding of one prompt (batch 1) with the drafter proposing every block;
    with temperature > 0 every token is sampled from the target's distribution cut by top_k/top_p."""
    block_size, layer_ids = drafter.block_size, drafter.target_layer_ids
    device = target.get_input_embeddings().weight.device
    stop = set(stop_token_ids)
    max_length = len(prompt_ids) + max_new_tokens
    drafted, accepted_at = [0] * drafts_per_block(drafter), [0] * drafts_per_block(drafter)
    acceptance_lengths = []
    _synchronize(device)
    began = time.perf_counter()

    sampling = (temperature, generator, top_k, top_p)
    cache = _new_cache(target)
    logits, context_features = _target_step(target, prompt_ids, 0, cache, layer_ids, logits_to_keep=1)
    tokens = list(prompt_ids) + _pick(logits[-1:], *sampling).tolist()
    # tokens[start] is the newest token: produced, but not yet run through the target.
    start = len(prompt_ids)
    stopped = tokens[start] in stop
    while start + 1 < max_length and not stopped:
        size = min(block_size, max_length - start)
        proposals, draft_probs = [], None
        if size > 1:
            proposals, draft_probs = _propose(
                drafter, target, context_features, tokens[start], start, size, *sampling,
                before_first=tokens[start - 1],
            )  # fmt: skip
        block = [tokens[start], *proposals]
        logits, block_features = _target_step(target, block, start, cache, layer_ids)
        accepted, next_token = _verify(logits, proposals, draft_probs, device, *sampling)
        for k in range(len(proposals)):
            drafted[k] += 1
            accepted_at[k] += k < accepted
        new = [*proposals[:accepted], next_token]
        produced, stopped = _tokens_kept(new, max_length - start - 1, stop)
        tokens = tokens[: start + 1] + new[:produced]
        # The target's features of the block are valid up to the last token it agreed with.
        context_features = torch.cat([context_features, block_features[:produced]])
        start += produced
        _crop(cache, start)
        acceptance_lengths.append(produced)
    _synchronize(device)
    return Generation(
        new_tokens=tokens[len(prompt_ids) :],
        seconds=time.perf_counter() - began,
        target_forwards=1 + len(acceptance_lengths),
        acceptance_lengths=acceptance_lengths,
        drafted=drafted,
        accepted=accepted_at,
    )


def _verify(
    logits: torch.Tensor,
    proposals: list[int],
    draft_probs: torch.Tensor | None,
    device: torch.device,
    temperature: float,
    generator: torch.Generator | None,
    top_k: int,
    top_p: float,
) -> tuple[int, int]:
    """(drafts the target accepts, the token it adds after them), from the target's logits over the
    block (`device`: the proposals' tensor's): greedy agreement at temperature 0, else rejection
    sampling against the drafter's probs."""
    if temperature <= 0:
        agrees = torch.tensor(proposals, device=device) == logits[:-1].argmax(-1)
        accepted = int(agrees.int().cumprod(0).sum())
        return accepted, int(logits[accepted].argmax())
    if proposals:
        return _rejection_sample(
            torch.tensor(proposals, device=device),
            draft_probs,
            sampling_probs(logits, temperature, top_k, top_p),
            generator,
        )
    return 0, int(_pick(logits[-1:], temperature, generator, top_k, top_p))


def _tokens_kept(new: list[int], room: int, stop: set[int]) -> tuple[int, bool]:
    """(how many of the `new` tokens are kept, whether a stop token ended the generation): at most
    `room`, and none past the first stop token."""
    produced = min(len(new), room)
    stop_at = next((i for i, token in enumerate(new[:produced]) if token in stop), None)
    if stop_at is not None:
        return stop_at + 1, True
    return produced, False


@torch.inference_mode()
def autoregressive_generate(
    target: nn.Module,
    prompt_ids: list[int],
    max_new_tokens: int,
    stop_token_ids: Sequence[int] = (),
    temperature: float = 0.0,
    generator: torch.Generator | None = None,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> Generation:
    """Plain decoding with the target, one token per forward over a KV cache: the baseline."""
    device = target.get_input_embeddings().weight.device
    stop = set(stop_token_ids)
    _synchronize(device)
    began = time.perf_counter()
    cache = _new_cache(target)
    logits, _ = _target_step(target, prompt_ids, 0, cache, None, logits_to_keep=1)
    new_tokens = _pick(logits[-1:], temperature, generator, top_k, top_p).tolist()
    while len(new_tokens) < max_new_tokens and new_tokens[-1] not in stop:
        logits, _ = _target_step(target, new_tokens[-1:], len(prompt_ids) + len(new_tokens) - 1, cache, None)
        new_tokens += _pick(logits[-1:], temperature, generator, top_k, top_p).tolist()
    _synchronize(device)
    return Generation(
        new_tokens=new_tokens, seconds=time.perf_counter() - began, target_forwards=len(new_tokens)
    )


def xpress_logits(
    drafter: DFlashDrafter, hidden: torch.Tensor, head: nn.Module, first_token: int, before_first: int | None
) -> torch.Tensor:
    """[Bs, V]: an XPress drafter's logits of one block, hidden [1, Bs, H], after its
    `num_jacobi_passes` Jacobi passes, each conditioned on the previous pass's argmax (greedy, as
    the reference's recurrence; models/xpress.py). `before_first` None: the block's own first token
    stands in for the token before it, as vLLM's XPress speculator does."""
    from dflash_mp.models.xpress import refined_logits

    device = hidden.device
    anchor = torch.tensor([first_token], device=device)
    before = anchor if before_first is None else torch.tensor([before_first], device=device)
    base = drafter.logits(hidden, head)
    return refined_logits(drafter.refiner_head, base, hidden, anchor, before, drafter.num_jacobi_passes)[0]
