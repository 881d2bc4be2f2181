"""XPress's loss with its gradient taken during the forward (`xpress_row_loss`), what training runs.

The value is `xpress_terms`' (xpress_loss.py, the autograd reference the tests compare with): per
chunk of whole blocks, the head's logits z_0 = scale(hidden @ head.T) and each pass's
z = z_0 + readout(latent(previous tokens)): the teacher-forced pass, then each Jacobi round on the
previous pass's argmax, then the base anchor (z_0 alone). Each pass's CE with its row weights c
(decay x mask, or D-PACE from that CE, times the term's weight over the scored count) has

    dLoss/dz = c (softmax(z) - onehot(label)),

which goes three ways: into the readout's gradient (dz.T @ latent) and the latent's (dz @ readout),
one matmul each over all of a chunk's passes, and, summed over the passes in fp32, through scale's
derivative into the hidden states' (one head matmul per chunk). Each pass's latent runs without
a graph; after the last chunk every pass's latent is recomputed at once and autograd takes their
gradients back through the refiner's rank-r layers (`XPressRefiner.latent`) to its parameters and
to the hidden cache, whose own backward (down_h, down_g) autograd takes outside. The [rows, V]
tensors are neither kept nor recomputed: against `xpress_terms` under checkpointing, one head
matmul per chunk instead of four, no fp32 log-softmax saved per pass, no second forward.

Vocabulary work: on CUDA with Triton, each pass's statistics (with the argmax) in row_statistics.py's
pass over the matmuls' bf16 outputs (the base anchor's with the teacher-forced pass's, from one read
of the raw logits), then one fused_xpress.py pass for all of a chunk's passes, which writes each
biased pass's dz over its bias and the raw logits' gradient over them; elsewhere, or once the
process's first fused chunk failed its check (fused_check.py), torch ops on fp32 copies. Memory per
chunk: the head's raw logits and each pass's bias, then its dz, in the matmul dtype ([passes, rows,
V]; the fused path keeps no slot for the base anchor, whose dz it only sums); the torch path adds
the fp32 z_0 and one pass's fp32 z (plan/memory.py's `xpress_chunk_bytes`, `xpress_pass_bytes`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_mp.kernels.row_statistics import vocabulary_kernels_run_on
from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks
from dflash_mp.models.xpress import XPressRefiner, previous_tokens
from dflash_mp.objective.autocast_operands import add_product_, in_autocast_dtype
from dflash_mp.objective.fused_check import disagreement, turn_off
from dflash_mp.objective.position_weights import dpace_weights
from dflash_mp.objective.xpress_vocabulary import FusedVocabulary, TorchVocabulary

_log = logging.getLogger(__name__)
_fused_error: str | None = None  # the kernels' first error: the torch path from then on
_fused_tried = False  # whether the process's first fused chunk was checked
_NAME = "XPress's fused loss kernels"
DENOMINATOR_EPS = 1e-8  # the reference's `_hard_label_ce`


@dataclass(frozen=True)
class XPressRowOptions:
    """How `xpress_row_loss` weighs and scales its passes (`XPressWeights` and the logit scaling)."""

    rounds: int  # Jacobi rounds with a consistency weight (0: none)
    consistency_weight: float
    base_anchor_weight: float
    base_anchor_full_weight: bool
    dpace_alpha: float | None
    multiplier: float = 1.0
    softcap: float | None = None
    chunk_rows: int | None = None  # train.vocabulary_chunk_rows (None: the default), rounded to whole blocks

    def pass_weights(self) -> list[tuple[float, bool]]:
        """(the pass's weight in the loss before the denominator, whether it is decayed) per pass:
        the teacher-forced one, each round, the base anchor (when weighted)."""
        passes = [(1.0, True)]
        if self.rounds:
            passes += [(self.consistency_weight / self.rounds, True)] * self.rounds
        if self.base_anchor_weight > 0:
            passes.append((self.base_anchor_weight, not self.base_anchor_full_weight))
        return passes


@dataclass
class _Targets:
    """One chunk's blocks: labels, the token before each anchor, scored positions, decay [n, Bs]."""

    labels: Tensor
    before_anchor: Tensor
    mask: Tensor
    decay: Tensor
    _fixed: dict[bool, Tensor] = field(default_factory=dict)

    def fixed_weights(self, decayed: bool) -> Tensor:
        """The weights without D-PACE: mask x decay, or the mask; made once a chunk, not a pass."""
        if decayed not in self._fixed:
            weight = self.mask.float()
            self._fixed[decayed] = weight * self.decay.float() if decayed else weight
        return self._fixed[decayed]


def _fused_on(device: torch.device) -> bool:
    return _fused_error is None and vocabulary_kernels_run_on(device)


def _row_weights(ce: Tensor, targets: _Targets, decayed: bool, dpace_alpha: float | None) -> Tensor:
    """A pass's weights [n, Bs] of its CE [n, Bs], as `weighted_ce` takes them."""
    if decayed and dpace_alpha is not None:
        return dpace_weights(ce, targets.mask, dpace_alpha)
    return targets.fixed_weights(decayed)


@dataclass
class _Grads:
    """The gradients the forward takes (fp32 sums where chunks add to them), and each pass's
    previous tokens with its latent's gradient, taken back through the refiner once all chunks ran."""

    hidden: Tensor
    cache: Tensor
    readout: Tensor
    latent: list[Tensor]
    pending: list[tuple[Tensor, slice, Tensor]] = field(default_factory=list)

    def take_latent_gradients(self, refiner: XPressRefiner, cache: Tensor, params: list[Tensor]) -> None:
        """One backward through the refiner's rank-r layers for every pass of every chunk: their
        latents recomputed at once from (previous tokens, the chunk's cache rows), so autograd runs
        one small graph, not one per pass, and the embedding's dense [V, r] gradient is made once,
        not summed over every pass. Fills the hidden cache's gradient and adds the parameters'."""
        if not self.pending:
            return
        prevs, parts, latent_grads = zip(*self.pending, strict=True)
        self.pending = []
        block_size = prevs[0].shape[1]
        cache_leaf = cache.detach().requires_grad_()
        with torch.enable_grad():
            blocks = cache_leaf.view(-1, block_size, cache.shape[-1])
            latent = refiner.latent(torch.cat(prevs), torch.cat([blocks[part] for part in parts]))
        grad = torch.cat(latent_grads).view_as(latent).to(latent.dtype)
        found = torch.autograd.grad(latent, [cache_leaf, *params], grad)
        self.cache.copy_(found[0])
        for total, grad in zip(self.latent, found[1:], strict=True):
            total += grad.float()


def _chunk(
    kind, refiner, head, hidden, cache, targets, readout, scales, opts, grads, rows
) -> tuple[Tensor, Tensor]:
    """One chunk's passes through `kind`'s vocabulary work: (mask x weight x CE [P, n, Bs] per
    pass, teacher-forced argmax == label and scored [n, Bs]); their gradients into `grads` (`rows`:
    the chunk's rows of the hidden)."""
    blocks, block_size = targets.labels.shape
    raw = F.linear(hidden, head)  # the fused gradient pass writes over it: made here, per try
    vocab = kind(raw, targets.labels.flatten(), opts)
    passes = opts.pass_weights()
    biased = 1 + opts.rounds  # the passes with a bias: the teacher-forced one and the rounds
    # Each pass's bias, then its dz over it: one sum of the dz and one readout matmul per chunk.
    dz = None
    if grads is not None:
        dz = torch.empty(kind.slots(len(passes), biased), *raw.shape, dtype=readout.dtype, device=raw.device)
    chunk_cache = cache.view(blocks, block_size, -1)
    weighted, prevs, flats = [], [], []
    prev = previous_tokens(targets.labels, targets.before_anchor)  # the teacher-forced pass's
    correct = guess = base_ce = base_state = None
    for index in range(biased):
        if index:  # a Jacobi round on the previous round's argmax (the first: z_0's)
            guess = guess.view(blocks, block_size).clone()
            guess[:, 0] = targets.labels[:, 0]
            prev = previous_tokens(guess, targets.before_anchor)
        with torch.no_grad():  # its gradient: `take_latent_gradients`, once for all passes
            flat = refiner.latent(prev, chunk_cache).flatten(0, 1).to(readout.dtype)
        bias = F.linear(flat, readout) if dz is None else torch.mm(flat, readout.t(), out=dz[index])
        if index == 0:  # with the base anchor's (z_0 alone), whose argmax seeds the first round
            (ce, argmax, state), (base_ce, guess, base_state) = vocab.statistics_with_base(bias)
            correct = (argmax.view(blocks, block_size) == targets.labels) & targets.mask
        else:
            ce, guess, state = vocab.statistics(bias)
        weights = _row_weights(ce.view(blocks, block_size), targets, passes[index][1], opts.dpace_alpha)
        weighted.append(ce.view(blocks, block_size) * weights)
        if dz is not None:
            vocab.pass_gradient(index, state, (weights * scales[index]).flatten(), dz)
            prevs.append(prev)
            flats.append(flat)
        del bias, state
    if opts.base_anchor_weight > 0:
        weights = _row_weights(base_ce.view(blocks, block_size), targets, passes[-1][1], opts.dpace_alpha)
        weighted.append(base_ce.view(blocks, block_size) * weights)
        if dz is not None:
            vocab.base_gradient(base_state, (weights * scales[-1]).flatten(), dz)
    if dz is not None:
        del base_state
        grads.hidden[rows] = vocab.raw_gradient(dz) @ head
        del vocab, raw
        with_bias = dz[:biased].flatten(0, 1)
        flat = torch.cat(flats)
        add_product_(grads.readout, with_bias.T, flat)
        latent_grads = (with_bias @ readout).split(flat.shape[0] // biased)
        part = slice(rows.start // block_size, rows.start // block_size + blocks)
        grads.pending += [(prev, part, grad) for prev, grad in zip(prevs, latent_grads, strict=True)]
    return torch.stack(weighted), correct


def _first_fused_chunk_checked(args: tuple, grads: _Grads | None) -> tuple[Tensor, Tensor]:
    """The process's first fused chunk beside the torch path's, whose numbers the chunk keeps
    (fused_check.py): if a kernel raises (they compile here) or the two disagree, a warning says so
    and the torch path takes every later chunk. The fused try writes into scratch sums."""
    global _fused_error, _fused_tried
    _fused_tried = True
    *inputs, rows = args
    scratch = None
    if grads is not None:
        zeros = torch.zeros_like
        scratch = _Grads(zeros(grads.hidden), grads.cache, zeros(grads.readout), grads.latent)
    try:
        fused = _chunk(FusedVocabulary, *inputs[:-1], scratch, rows)
    except torch.OutOfMemoryError:
        raise
    except Exception as error:  # the torch path gives the same numbers, slower
        fused, problem = None, f"{type(error).__name__}: {error}"
    result = _chunk(TorchVocabulary, *args)
    if fused is not None:
        pairs = [(fused[0], result[0])]
        if grads is not None:
            pairs += [(scratch.hidden[rows], grads.hidden[rows]), (scratch.readout, grads.readout)]
            mine, theirs = scratch.pending, grads.pending[-len(scratch.pending) :]
            pairs += [(a[2], b[2]) for a, b in zip(mine, theirs, strict=True)]  # the latents' gradients
        problem = disagreement(pairs)
    if problem is not None:
        _fused_error = problem
        turn_off(_NAME, problem, _log)
    return result


class _XPressRowLoss(torch.autograd.Function):
    """XPress's loss over the blocks (module docstring), its gradient taken in the forward."""

    @staticmethod
    def forward(ctx, hidden, cache, readout, head, targets, opts, refiner, grad_enabled, *latent_params):
        blocks, block_size = targets.labels.shape
        want = grad_enabled and any(ctx.needs_input_grad[:3] + ctx.needs_input_grad[8:])
        grads = None
        if want:
            fp32 = lambda t: torch.zeros_like(t, dtype=torch.float32)  # noqa: E731
            grads = _Grads(
                torch.empty_like(hidden),
                torch.empty_like(cache),
                fp32(readout),
                [fp32(p) for p in latent_params],
            )
        ctx.dtypes = (readout.dtype, [p.dtype for p in latent_params])
        denominator = targets.mask.float().sum() + DENOMINATOR_EPS
        # Filled on the device: a host scalar's copy there would wait for the GPU (pageable memory).
        scales = torch.stack([denominator.new_full((), w) / denominator for w, _ in opts.pass_weights()])
        hidden_in, head, readout = in_autocast_dtype(hidden, head, readout)
        chunk = vocabulary_chunk_blocks(head.shape[0], block_size, opts.chunk_rows)
        weighted, correct = [], []
        for start in range(0, blocks, chunk):
            part = slice(start, start + chunk)
            rows = slice(start * block_size, (start + chunk) * block_size)
            chunk_targets = _Targets(
                *(t[part] for t in (targets.labels, targets.before_anchor, targets.mask, targets.decay))
            )
            args = (refiner, head, hidden_in[rows], cache[rows], chunk_targets, readout, scales, opts)
            if not _fused_on(hidden.device):
                chunk_weighted, chunk_correct = _chunk(TorchVocabulary, *args, grads, rows)
            elif not _fused_tried:
                chunk_weighted, chunk_correct = _first_fused_chunk_checked((*args, grads, rows), grads)
            else:
                chunk_weighted, chunk_correct = _chunk(FusedVocabulary, *args, grads, rows)
            weighted.append(chunk_weighted)
            correct.append(chunk_correct)
        if grads is not None:
            grads.take_latent_gradients(refiner, cache, list(latent_params))
        # Each pass's sum over the micro-batch at once (as `xpress_terms`), over the scored count.
        values = torch.stack([term.sum() for term in torch.cat(weighted, dim=1)]) / denominator
        loss, _ = combine_passes(values, opts.rounds, opts.consistency_weight, opts.base_anchor_weight)
        saved = [] if grads is None else [grads.hidden, grads.cache, grads.readout, *grads.latent]
        ctx.save_for_backward(*saved)
        correct = torch.cat(correct)
        ctx.mark_non_differentiable(values, correct)
        return loss, values, correct

    @staticmethod
    def backward(ctx, loss_grad, *_non_differentiable):
        if not ctx.saved_tensors:
            return (None,) * (8 + len(ctx.dtypes[1]))
        hidden, cache, readout, *latent = ctx.saved_tensors
        readout_dtype, latent_dtypes = ctx.dtypes
        scaled = [(g * loss_grad).to(dtype) for g, dtype in zip(latent, latent_dtypes, strict=True)]
        return (
            hidden * loss_grad.to(hidden.dtype), cache * loss_grad.to(cache.dtype),
            (readout * loss_grad).to(readout_dtype), None, None, None, None, None, *scaled,
        )  # fmt: skip


def combine_passes(
    values: Tensor, rounds: int, consistency_weight: float, base_anchor_weight: float
) -> tuple[Tensor, dict[str, Tensor]]:
    """(loss, the metrics {name: detached value}) of the passes' values [P]: the teacher-forced
    pass, the mean of the `rounds` Jacobi rounds times their weight, the base anchor times its."""
    loss, terms = values[0], {"tf_loss": values[0].detach()}
    if rounds:
        consistency = values[1 : 1 + rounds].mean()
        loss = loss + consistency_weight * consistency
        terms["consistency_loss"] = consistency.detach()
    if base_anchor_weight > 0:
        loss = loss + base_anchor_weight * values[-1]
        terms["base_anchor_loss"] = values[-1].detach()
    return loss, terms


def xpress_row_loss(
    refiner: XPressRefiner,
    hidden: Tensor,
    head: Tensor,
    targets: tuple[Tensor, Tensor, Tensor, Tensor],
    opts: XPressRowOptions,
) -> tuple[Tensor, Tensor, Tensor]:
    """(loss, each pass's value [P], teacher-forced argmax == label on scored positions [N, Bs]) of
    the drafter's hidden states [N, Bs, H] through the frozen head [V, H], for targets (labels
    [N, Bs] with the anchor at index 0, the token before each anchor [N], scored positions and
    decay [N, Bs]): `xpress_terms`' values with the gradient taken in the forward."""
    if torch.is_grad_enabled() and head.requires_grad:
        raise ValueError("xpress_row_loss takes no gradient for the head: it must be frozen")
    cache = refiner.hidden_cache(hidden).flatten(0, 1)
    blocks = _Targets(*targets)
    params = refiner.latent_parameters()
    flat = hidden.flatten(0, 1)
    return _XPressRowLoss.apply(
        flat, cache, refiner.readout.weight, head, blocks, opts, refiner, torch.is_grad_enabled(), *params
    )
