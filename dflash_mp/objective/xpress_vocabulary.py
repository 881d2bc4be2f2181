"""The vocabulary work of XPress's CE passes over one chunk (objective/xpress_rows.py `_chunk`):
each pass's statistics (CE, argmax) and, once every pass's row weights are known, the gradients:
each biased pass's dz over its bias, and their sum through scale_logits' derivative for the raw
logits. `TorchVocabulary` in torch ops on fp32 copies (every device), `FusedVocabulary` through the
Triton kernels on the matmuls' outputs (CUDA: row_statistics.py's statistics, the teacher-forced
pass's with the base anchor's from one read, and fused_xpress.py's one gradient pass)."""

from __future__ import annotations

from typing import Protocol

import torch
from torch import Tensor

from dflash_mp.kernels.fused_xpress import xpress_gradients_in_place
from dflash_mp.kernels.row_statistics import ChunkLogits, ce_with_base, row_statistics
from dflash_mp.models.drafter import scale_logits


class ScaleOptions(Protocol):
    """What the vocabulary work reads of `XPressRowOptions`: the logit scaling."""

    multiplier: float
    softcap: float | None


class TorchVocabulary:
    """The passes' vocabulary work in torch ops on fp32 [n, V] copies."""

    def __init__(self, raw: Tensor, labels: Tensor, opts: ScaleOptions) -> None:
        self.base = scale_logits(raw.float(), opts.multiplier, opts.softcap)  # z_0, read by every pass
        self.raw, self.labels, self.opts = raw, labels[:, None], opts

    @staticmethod
    def slots(passes: int, biased: int) -> int:
        """The [slots, n, V] buffer's passes: every pass's dz, summed for the raw logits' gradient."""
        return passes

    def statistics(self, bias: Tensor | None) -> tuple[Tensor, Tensor, tuple]:
        """(CE [n], argmax [n], what `gradient` reads) of z_0 + bias."""
        z = self.base if bias is None else self.base + bias.float()
        lse = torch.logsumexp(z, dim=-1, keepdim=True)
        return (lse - z.gather(-1, self.labels))[:, 0], z.argmax(-1), (z, lse)

    def statistics_with_base(self, bias: Tensor) -> tuple[tuple, tuple]:
        """`statistics` of z_0 + bias and of z_0 alone (the base anchor)."""
        return self.statistics(bias), self.statistics(None)

    def pass_gradient(self, index: int, state: tuple, c: Tensor, dz: Tensor) -> None:
        """dLoss/dz of biased pass `index` for row weights c [n] over its bias in dz (the pass's z
        ends as scratch)."""
        self._gradient(state[0], state[1], c, dz[index])

    def base_gradient(self, state: tuple, c: Tensor, dz: Tensor) -> None:
        """dLoss/dz of the base anchor (z_0 alone) into dz's last slot."""
        self._gradient(state[0].clone(), state[1], c, dz[-1])

    def _gradient(self, z: Tensor, lse: Tensor, c: Tensor, into: Tensor) -> None:
        into.copy_(z.sub_(lse).exp_().mul_(c[:, None]).scatter_add_(-1, self.labels, -c[:, None]))

    def raw_gradient(self, dz: Tensor) -> Tensor:
        """The raw logits' gradient in their dtype from every pass's dz [P, n, V]."""
        return summed_raw_gradient(dz, self.raw, self.opts)


class FusedVocabulary:
    """The same through fused_dspark.py's CE-only passes on the matmuls' outputs (CUDA)."""

    def __init__(self, raw: Tensor, labels: Tensor, opts: ScaleOptions) -> None:
        self.raw, self.labels, self.opts = raw, labels, opts
        self.log_normalisers: list[Tensor] = []  # each pass's, in the order the kernel reads
        self.weights: list[Tensor] = []

    @staticmethod
    def slots(passes: int, biased: int) -> int:
        """The biased passes alone: the base anchor's dz is only summed, inside the kernel."""
        return biased

    def _logits(self, bias: Tensor | None) -> ChunkLogits:
        return ChunkLogits(self.raw, bias, None, self.labels, self.opts.multiplier, self.opts.softcap)

    def statistics(self, bias: Tensor | None) -> tuple[Tensor, Tensor, object]:
        terms, _, stats, _ = row_statistics(self._logits(bias))
        return terms[:, 0], stats.argmax, stats

    def statistics_with_base(self, bias: Tensor) -> tuple[tuple, tuple]:
        """Both from one read of the raw logits and the bias."""
        biased, base = ce_with_base(self._logits(bias))
        return (biased.ce, biased.stats.argmax, biased.stats), (base.ce, base.stats.argmax, base.stats)

    def pass_gradient(self, index: int, state, c: Tensor, dz: Tensor) -> None:
        """Kept for `raw_gradient`, which writes every biased pass's dz over its bias at once."""
        assert index == len(self.weights)
        self.log_normalisers.append(state.draft_lse)
        self.weights.append(c)

    def base_gradient(self, state, c: Tensor, dz: Tensor) -> None:
        self.pass_gradient(dz.shape[0], state, c, dz)

    def raw_gradient(self, dz: Tensor) -> Tensor:
        """fused_xpress.py's one pass: each dz over its bias, their sum's gradient over raw."""
        lse, weights = torch.stack(self.log_normalisers), torch.stack(self.weights)
        opts = self.opts
        return xpress_gradients_in_place(
            self.raw, dz, self.labels, lse, weights, opts.multiplier, opts.softcap
        )


def summed_raw_gradient(dz: Tensor, raw: Tensor, opts: ScaleOptions) -> Tensor:
    """The raw logits' gradient in their dtype: the passes' dz [P, n, V] summed in fp32, times
    scale_logits' derivative (the multiplier, soft-capping's 1 - tanh^2)."""
    capped = opts.softcap is not None and opts.softcap > 0
    if not capped and opts.multiplier == 1.0 and dz.dtype == raw.dtype:
        return dz.sum(0)  # reduced in fp32 for bf16 too
    total = dz.sum(0, dtype=torch.float32)
    if capped:
        tanh = torch.tanh(raw.float() * opts.multiplier / opts.softcap)
        total.mul_(tanh.mul_(tanh).neg_().add_(1.0))
    if opts.multiplier != 1.0:
        total.mul_(opts.multiplier)
    return total.to(raw.dtype)
