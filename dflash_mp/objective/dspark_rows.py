"""DSpark's vocabulary-sized loss terms with their gradient taken during the forward (`dspark_row_loss`).

For rows [M] of hidden states, the loss part ce_alpha * CE + kl_alpha * KL + tv_alpha * TV of a
micro-batch (dspark_loss.py's module docstring; tests/dspark_autograd_reference.py gives the same
value through autograd, the reference the tests compare with) runs a chunk of whole blocks at a
time, once:

    z = scale_logits(hidden @ head.T) + markov @ w2.T,  q = softmax(z),
    p = softmax(scale_logits(teacher @ head.T))                      (no gradient)
    CE = -log q[label],  KL = sum p (log p - log q),  TV = 1 - sum min(p, q),

each row's weight c_t = alpha_t * w_t / denominator (the decay w and sum(w), or D-PACE weights
from the term's own values over the chunk's blocks and the scored count, `term_row_weights`), and

    dLoss/dz = c_ce (q - onehot(label)) + c_kl (q - p) + c_tv q (Q_S - m),

m_v = 1 where q_v < p_v, 1/2 at a tie, else 0 (torch.minimum's backward splits a tie in halves),
Q_S = sum_v q_v m_v. (Autograd's KL term is q sum(p) - p: the same to fp32 rounding. Ties of q and
p are those of this code's own rounding: where both underflow to 0 the entry's factor q_v is 0;
elsewhere TV's derivative jumps at q_v = p_v in any implementation, so an entry equal to rounding
in one and not the other gives either side's one-sided derivative, an event of probability ~0.)
Through scale_logits' derivative (multiplier, soft-capping's 1 - tanh^2) it
gives the hidden states' gradient (dz_x @ head; the head is frozen), and the Markov features'
(dz @ w2) and w2's (dz.T @ markov, summed over chunks): held until the backward, which scales them
by the upstream gradient. The logits are neither stored nor recomputed: three head-sized matmuls
per chunk (draft, teacher, hidden gradient) and three of rank r (bias, the two gradients), against
five and four with activation checkpointing. Under torch.no_grad the gradient work is skipped.

On CUDA with Triton the vocabulary work runs in fused_dspark.py's three passes over the matmuls'
outputs as they are (bf16 in training; computed in fp32), the gradients written over them. If a
kernel raises (they compile at their first call), a warning names the error and the torch path
below takes that chunk and every later one. The process's first fused chunk also runs the torch
path, keeps its numbers, and turns the fused path off the same way if the two disagree.

Memory, fused (CUDA): a chunk holds no [rows, V] tensor besides the matmuls' outputs, in their
dtype: the draft's logits (overwritten with the hidden states' dz), the teacher's, and the Markov
bias (overwritten with the dz the Markov gradients read): 3 bf16 [rows, V] in training, the size of
1.5 fp32 ones (2 without the Markov head or without a teacher, 1 without both), soft-capped or not.
Torch path: at most 3 fp32 [rows, V] tensors alive (z, reused for log q and the gradient; q; the
teacher's p), 4 with soft-capping (its derivative), 2 without a teacher (3 with soft-capping); the
[rows, V] transients in the matmuls' dtype (an output before its fp32 copy, the gradient cast for a
matmul) come while fewer are alive and never lift the peak above that (on CPU at V = 151936: 3.09
and 4.09 chunk sizes above the inputs, against 7.3 and 8.3 with checkpointing). The scaling runs in
fp32 on the matmul's output (the DFlash CE's order; the autograd reference scales in the matmul's dtype). q and
p are both exp(x - lse(x)) in either path, so equal rows of draft and teacher give equal q and p bit
for bit: ties everywhere, as torch.minimum's in the reference.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from dflash_mp.kernels.fused_dspark import dspark_grad_in_place, dspark_terms
from dflash_mp.kernels.row_statistics import ChunkLogits, vocabulary_kernels_run_on
from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks
from dflash_mp.objective.autocast_operands import add_product_, in_autocast_dtype
from dflash_mp.objective.fused_check import disagreement, turn_off
from dflash_mp.objective.position_weights import dpace_weights

_log = logging.getLogger(__name__)
_fused_error: str | None = None  # the fused kernels' first error: the torch path from then on
_fused_checked = False  # whether the process's first fused chunk was compared with the torch path
_NAME = "DSpark's fused loss kernels"


@dataclass(frozen=True)
class RowLossOptions:
    """How `dspark_row_loss` weighs and scales its terms."""

    alphas: tuple[float, float, float]  # ce, kl, tv
    block_size: int
    dpace_alpha: float | None = None
    multiplier: float = 1.0
    softcap: float | None = None
    chunk_rows: int | None = None  # train.vocabulary_chunk_rows (None: the default), rounded to whole blocks


def chunk_rows_of(vocab: int, block_size: int, chunk_rows: int | None = None) -> int:
    """Rows of one chunk: `vocabulary_chunk_blocks` whole blocks (of `chunk_rows` when given)."""
    return vocabulary_chunk_blocks(vocab, block_size, chunk_rows) * block_size


def loss_denominator(weights: Tensor, dpace_alpha: float | None) -> Tensor:
    """The terms' denominator from the decay weights [M]: sum(w), or (D-PACE) the scored count."""
    return weights.sum() if dpace_alpha is None else (weights > 0).sum().float()


def term_row_weights(
    terms: Tensor, weights: Tensor, dpace_alpha: float | None, block_size: int | None
) -> Tensor:
    """Weights [M, 3] of the row terms [M, 3] (whole blocks of `block_size` rows) from the decay
    weights [M]: the decay, or each term's D-PACE weights from its own values (no gradient)."""
    if dpace_alpha is None:
        return weights[:, None].expand_as(terms)
    if block_size is None:
        raise ValueError("D-PACE weights need the block size")
    scored = (weights > 0).view(-1, block_size)
    per_term = [
        dpace_weights(term.view_as(scored), scored, dpace_alpha).flatten() for term in terms.unbind(-1)
    ]
    return torch.stack(per_term, dim=-1)


def _logits(rows: Tensor, head: Tensor, multiplier: float, softcap: float | None, slope: bool):
    """(fp32 scale_logits(rows @ head.T) [m, V] in a fresh tensor, its derivative w.r.t. the raw
    logits (`slope` and soft-capping; else None: the multiplier alone), the matmul's dtype)."""
    raw = F.linear(rows, head.to(rows.dtype))
    dtype = raw.dtype
    x = raw.float()  # raw itself when fp32
    del raw
    if multiplier != 1.0:
        x.mul_(multiplier)
    derivative = None
    if softcap is not None and softcap > 0:
        x.div_(softcap).tanh_()
        if slope:
            derivative = torch.mul(x, x).neg_().add_(1.0)
            if multiplier != 1.0:
                derivative.mul_(multiplier)
        x.mul_(softcap)
    return x, derivative, dtype


def _softmax_(x: Tensor) -> Tensor:
    """softmax(x) in x as `_terms` takes q, exp((x - max) - log sum exp(x - max)): equal rows give
    equal q and p bit for bit (module docstring)."""
    x.sub_(x.amax(-1, keepdim=True))
    return x.sub_(torch.exp(x).sum(-1, keepdim=True).log_()).exp_()


def _terms(z: Tensor, p: Tensor | None, labels: Tensor) -> tuple[Tensor, Tensor]:
    """(CE, KL, TV [m, 3], q [m, V]) from the draft logits z [m, V], which end as scratch, and the
    teacher's p (None: KL = TV = 0)."""
    z.sub_(z.amax(-1, keepdim=True))
    q = torch.exp(z)
    total = q.sum(-1, keepdim=True)
    z.sub_(total.log())  # log q, as log_softmax
    ce = z.gather(-1, labels[:, None])[:, 0].neg()
    if p is None:
        zero = torch.zeros_like(ce)
        return torch.stack([ce, zero, zero], dim=-1), q.div_(total)
    kl = torch.xlogy(p, p, out=q).addcmul_(p, z, value=-1.0).sum(-1)  # F.kl_div's elements
    torch.exp(z, out=q)
    tv = 1.0 - torch.minimum(q, p, out=z).sum(-1)
    return torch.stack([ce, kl, tv], dim=-1), q


def _logit_grad_(z: Tensor, q: Tensor, p: Tensor | None, labels: Tensor, c: Tensor, kl: bool) -> Tensor:
    """dLoss/dz into z (scratch) from q, p and the row weights c [m, 3] (module docstring); `kl`:
    whether the KL's weight is non-zero."""
    c_ce, c_kl, c_tv = (column[:, None] for column in c.unbind(-1))
    if p is None:
        torch.mul(q, c_ce, out=z)
    else:
        torch.sub(p, q, out=z).heaviside_(z.new_full((), 0.5))  # m
        accepted = z.mul_(q).sum(-1, keepdim=True)  # Q_S
        z.mul_(c_tv.neg()).addcmul_(q, c_ce + c_kl + c_tv * accepted)
        if kl:
            z.addcmul_(p, c_kl, value=-1.0)
    return z.scatter_add_(-1, labels[:, None], c_ce.neg())


@dataclass
class _Grads:
    """The gradients the forward takes (None: not wanted) and what reads them."""

    hidden: Tensor | None
    markov: Tensor | None
    w2: Tensor | None


def _chunk(
    inputs: tuple, head: Tensor, w2: Tensor | None, scale: Tensor, opts: RowLossOptions, grads: _Grads | None
) -> tuple[Tensor, Tensor, Tensor]:
    """One chunk of rows `part`: (terms [m, 3], correct [m], sum of w * terms [3]); its gradients
    into `grads`. `scale` [3]: alpha_t / denominator. Fused on CUDA, else (or once that failed) torch."""
    if _fused_error is None and vocabulary_kernels_run_on(inputs[0].device):
        if not _fused_checked:
            return _checked_fused_chunk(inputs, head, w2, scale, opts, grads)
        done = _fused_chunk(inputs, head, w2, scale, opts, grads)
        if done is not None:
            return done
    return _torch_chunk(inputs, head, w2, scale, opts, grads)


def _checked_fused_chunk(
    inputs: tuple, head: Tensor, w2: Tensor | None, scale: Tensor, opts: RowLossOptions, grads: _Grads | None
) -> tuple[Tensor, Tensor, Tensor]:
    """The process's first fused chunk beside the torch path's, whose numbers the chunk keeps: the
    kernels are tested under Triton's interpreter, and compiled ones that disagree (beyond the
    bf16 rounding of the gradient) turn the fused path off with a warning."""
    global _fused_checked, _fused_error
    _fused_checked = True
    scratch = None
    if grads is not None:
        scratch = _Grads(
            *(None if g is None else torch.zeros_like(g) for g in (grads.hidden, grads.markov, grads.w2))
        )
    fused = _fused_chunk(inputs, head, w2, scale, opts, scratch)
    result = _torch_chunk(inputs, head, w2, scale, opts, grads)  # the first chunk: grads.w2 is its own
    if fused is None:  # the kernels raised: _guarded turned them off
        return result
    part = inputs[-1]
    pairs = [(fused[0], result[0]), (fused[2], result[2])]  # the terms and their weighted sums
    if grads is not None:
        for mine, theirs in ((scratch.hidden, grads.hidden), (scratch.markov, grads.markov)):
            if theirs is not None:
                pairs.append((mine[part], theirs[part]))
        if grads.w2 is not None:
            pairs.append((scratch.w2, grads.w2))
    problem = disagreement(pairs)
    if problem is not None:
        _fused_error = problem
        turn_off(_NAME, problem, _log)
    return result


def _guarded(call, *args):
    """`call(*args)`, or None once it raised: then a warning names the error, and the fused path
    is off for the rest of the process (the kernels compile at their first call on the device)."""
    global _fused_error
    try:
        return call(*args)
    except torch.OutOfMemoryError:  # not the kernels' fault: the torch path needs more
        raise
    except Exception as error:  # the torch path gives the same numbers, slower
        _fused_error = f"{type(error).__name__}: {error}"
        turn_off(_NAME, _fused_error, _log)
        return None


def _fused_chunk(
    inputs: tuple, head: Tensor, w2: Tensor | None, scale: Tensor, opts: RowLossOptions, grads: _Grads | None
) -> tuple[Tensor, Tensor, Tensor] | None:
    """`_chunk` through fused_dspark.py on the matmuls' outputs, the gradients written over them;
    None where a kernel failed, before any gradient was stored."""
    hidden, markov, teacher, labels, weights, part = inputs
    teacher_raw = None if teacher is None else F.linear(teacher, head.to(teacher.dtype))
    raw = F.linear(hidden, head.to(hidden.dtype))
    bias = None if markov is None else F.linear(markov, w2.to(markov.dtype))
    logits = ChunkLogits(raw, bias, teacher_raw, labels, opts.multiplier, opts.softcap)
    done = _guarded(dspark_terms, logits)
    if done is None:
        return None
    terms, correct, stats = done
    row_weights = term_row_weights(terms, weights, opts.dpace_alpha, opts.block_size)
    sums = (row_weights * terms).sum(0)
    if grads is None:
        return terms, correct, sums
    markov_grads = grads.markov is not None or grads.w2 is not None
    wanted = (logits, stats, row_weights * scale, grads.hidden is not None, markov_grads)
    done = _guarded(dspark_grad_in_place, *wanted)
    if done is None:
        return None
    del teacher_raw, logits, wanted
    hidden_dz, dz = done  # raw and bias, overwritten
    if dz is not None and grads.markov is not None:
        grads.markov[part] = dz @ w2.to(dz.dtype)
    if dz is not None and grads.w2 is not None:
        add_product_(grads.w2, dz.T, markov.to(dz.dtype))
    if hidden_dz is not None:
        grads.hidden[part] = hidden_dz @ head.to(hidden_dz.dtype)
    return terms, correct, sums


def _torch_chunk(
    inputs: tuple, head: Tensor, w2: Tensor | None, scale: Tensor, opts: RowLossOptions, grads: _Grads | None
) -> tuple[Tensor, Tensor, Tensor]:
    """`_chunk` in torch: fp32 copies of the logits, eager passes over them (module docstring)."""
    hidden, markov, teacher, labels, weights, part = inputs
    p = None
    if teacher is not None:
        p = _softmax_(_logits(teacher, head, opts.multiplier, opts.softcap, False)[0])
    z, slope, dtype = _logits(hidden, head, opts.multiplier, opts.softcap, grads is not None)
    if markov is not None:
        bias = F.linear(markov, w2.to(markov.dtype))
        bias_dtype = bias.dtype
        z.add_(bias)
        del bias
    correct = z.argmax(-1) == labels
    terms, q = _terms(z, p, labels)
    row_weights = term_row_weights(terms, weights, opts.dpace_alpha, opts.block_size)
    sums = (row_weights * terms).sum(0)
    if grads is None:
        return terms, correct, sums
    dz = _logit_grad_(z, q, p, labels, row_weights * scale, opts.alphas[1] != 0.0)
    del q, p
    if markov is not None and (grads.markov is not None or grads.w2 is not None):
        low = dz.to(bias_dtype)
        if grads.markov is not None:
            grads.markov[part] = low @ w2.to(bias_dtype)
        if grads.w2 is not None:
            add_product_(grads.w2, low.T, markov.to(bias_dtype))
        del low
    if grads.hidden is not None:
        if slope is not None:
            dz.mul_(slope)
        elif opts.multiplier != 1.0:
            dz.mul_(opts.multiplier)
        grads.hidden[part] = dz.to(dtype) @ head.to(dtype)
    return terms, correct, sums


class _DSparkRowLoss(torch.autograd.Function):
    """The weighted CE + KL + TV of rows [M] (module docstring), its gradient taken in the forward."""

    @staticmethod
    def forward(ctx, hidden, markov, w2, teacher, labels, head, weights, opts, grad_enabled):
        rows, device = hidden.shape[0], hidden.device
        want = [grad_enabled and needed for needed in ctx.needs_input_grad[:3]]
        grads = None
        if any(want):
            hidden_grad = torch.empty_like(hidden) if want[0] else None
            markov_grad = torch.empty_like(markov) if want[1] else None
            w2_grad = torch.zeros_like(w2, dtype=torch.float32) if want[2] else None
            grads = _Grads(hidden_grad, markov_grad, w2_grad)
        denominator = loss_denominator(weights, opts.dpace_alpha).clamp_min(torch.finfo(torch.float32).tiny)
        alphas = opts.alphas
        scale = torch.stack([alpha / denominator for alpha in alphas])  # on the device: no copy to it
        terms = torch.empty(rows, 3, dtype=torch.float32, device=device)
        correct = torch.empty(rows, dtype=torch.bool, device=device)
        sums = torch.zeros(3, dtype=torch.float32, device=device)
        size = chunk_rows_of(head.shape[0], opts.block_size, opts.chunk_rows)
        ctx.w2_dtype = None if w2 is None else w2.dtype
        hidden_in, markov_in, teacher_in, head, w2 = in_autocast_dtype(hidden, markov, teacher, head, w2)
        for start in range(0, rows, size):
            part = slice(start, start + size)
            chunked = (hidden_in, markov_in, teacher_in, labels, weights)
            inputs = tuple(None if x is None else x[part] for x in chunked)
            terms[part], correct[part], chunk_sums = _chunk((*inputs, part), head, w2, scale, opts, grads)
            sums += chunk_sums
        values = sums / denominator
        loss = alphas[0] * values[0] + alphas[1] * values[1] + alphas[2] * values[2]
        saved = (None, None, None) if grads is None else (grads.hidden, grads.markov, grads.w2)
        ctx.save_for_backward(*saved)
        ctx.mark_non_differentiable(values, terms, correct)
        return loss, values, terms, correct

    @staticmethod
    def backward(ctx, loss_grad: Tensor, *_non_differentiable):
        hidden_grad, markov_grad, w2_grad = ctx.saved_tensors
        if hidden_grad is not None:
            hidden_grad = hidden_grad * loss_grad.to(hidden_grad.dtype)
        if markov_grad is not None:
            markov_grad = markov_grad * loss_grad.to(markov_grad.dtype)
        if w2_grad is not None:
            w2_grad = (w2_grad * loss_grad).to(ctx.w2_dtype)
        return hidden_grad, markov_grad, w2_grad, None, None, None, None, None, None


def dspark_row_loss(
    hidden: Tensor,
    markov: Tensor | None,
    teacher: Tensor | None,
    labels: Tensor,
    head: Tensor,
    markov_w2: Tensor | None,
    weights: Tensor,
    options: RowLossOptions,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """(ce_alpha * CE + kl_alpha * KL + tv_alpha * TV, those three terms before their alphas [3],
    the row terms [M, 3] and argmax == label [M], all three detached) of hidden rows [M, H], Markov
    features [M, r] (or None), the teacher's rows [M, H] (or None: CE only), labels [M], the frozen
    head [V, H], w2 [V, r] and decay weights [M] of whole blocks: the autograd reference's
    value and gradients without the logits kept or recomputed (module docstring)."""
    if torch.is_grad_enabled() and head.requires_grad:
        raise ValueError("dspark_row_loss takes no gradient for the head: it must be frozen")
    if hidden.shape[0] % options.block_size:
        raise ValueError(f"{hidden.shape[0]} rows are not whole blocks of {options.block_size}")
    return _DSparkRowLoss.apply(
        hidden, markov, markov_w2, teacher, labels, head, weights, options, torch.is_grad_enabled()
    )
