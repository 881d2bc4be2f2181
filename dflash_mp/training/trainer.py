"""The drafter's optimisation: micro-steps, gradient accumulation, optimizer steps.

One class serves both the drafter ranks of the multi-process runtime and the
single-process reference trainer, so the two cannot drift apart: the runtime is correct
when its loss column equals the reference's, bit for bit on CPU. What a step adds up and reads
back in one copy is step_totals.py; the drafter and the lr schedule a config asks for, recipe.py.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn

from dflash_mp.config.precision import resolve_precision
from dflash_mp.config.schema import RootConfig
from dflash_mp.config.target_checks import target_tensors_cache
from dflash_mp.kernels.flash_attention import check_flash_supported
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.target_structure import load_embedding_and_head
from dflash_mp.objective.block_diffusion import drafter_loss, loss_blocks
from dflash_mp.objective.draft_blocks import DraftBlocks
from dflash_mp.objective.dspark_loss import dspark_metrics, loss_weights
from dflash_mp.objective.fused_check import slow_paths
from dflash_mp.objective.lm_head_loss import per_position_accuracy
from dflash_mp.objective.position_weights import dpace_alpha_of
from dflash_mp.objective.selector_loss import selector_metrics
from dflash_mp.objective.xpress_loss import xpress_metrics, xpress_weights
from dflash_mp.run import checkpoint
from dflash_mp.training.features import Features
from dflash_mp.training.muon import build_optimizer
from dflash_mp.training.recipe import build_drafter, lr_at
from dflash_mp.training.step_totals import LOSS_SUM, MICRO_BATCHES, SCORED, HostTotals, ReadBack, StepTotals
from dflash_mp.training.streaming_adamw import triton
from dflash_mp.training.working_weights import WorkingWeights


class NonFiniteStep(FloatingPointError):
    """A non-finite step that ends the job; `record` is its metrics record (skipped, skip_reason
    "nonfinite", stopped_the_job), for metrics.jsonl before the job stops."""

    def __init__(self, message: str, record: dict) -> None:
        super().__init__(message)
        self.record = record


@dataclass
class PreparedBatch:
    """A micro-batch whose blocks (anchors, block tokens, labels, mask) are already queued on the
    device: `DrafterTrainer.prepare`, so that `micro_step` starts with the drafter's forward."""

    batch: Features  # as received: its counters go into the step's totals
    inputs: Features  # what the drafter trains on: the batch, or a placeholder for an empty one
    blocks: DraftBlocks


class DrafterTrainer:
    def __init__(
        self,
        cfg: RootConfig,
        device: torch.device,
        total_steps: int,
        group=None,
        drafter: DFlashDrafter | None = None,
        embed_and_head: tuple[torch.Tensor, torch.Tensor] | None = None,
        stop_requested: Callable[[], bool] | None = None,
        working_weights: bool | None = None,
    ) -> None:
        """`drafter` and `embed_and_head` default to what cfg.model describes (benchmarks pass their own).
        `stop_requested()` says whether this rank was asked to stop (SIGTERM/SIGUSR1): each optimizer
        step agrees on it over the drafter group (`stop_agreed`) in the all-reduce it makes anyway.
        `working_weights`: bf16 working copies of the matmul weights with fp32 masters
        (`dflash_mp.training.working_weights`); by default where the step runs under bf16 autocast with the
        Triton optimizer pass, i.e. on CUDA."""
        self.cfg = cfg
        self.stop_requested = stop_requested or (lambda: False)
        self.stop_agreed = False
        self.device = device
        self.total_steps = total_steps
        self.group = group  # drafter-only process group (None: single process)
        self.hidden_dtype, self.attention, compile_drafter = resolve_precision(cfg, device)
        if cfg.train.attention == "flash":  # "auto" only chose flash after the same check
            check_flash_supported(device)
        self.drafter = (drafter if drafter is not None else build_drafter(cfg)).to(device)
        # Each draft layer's forward runs again in the backward; compiled layers are recomputed compiled.
        self.drafter.gradient_checkpointing = cfg.train.activation_checkpointing
        if embed_and_head is None:
            embed_and_head = load_embedding_and_head(
                cfg.model.target_path,
                self.hidden_dtype,
                device,
                cfg.model.trust_remote_code,
                names_cache=target_tensors_cache(),
            )
        embed, head = embed_and_head
        self.embed_weight, self.head_weight = embed.requires_grad_(False), head.requires_grad_(False)
        if working_weights is None:
            working_weights = (
                device.type == "cuda" and self.hidden_dtype == torch.bfloat16 and triton is not None
            )
        self.working = WorkingWeights(self.drafter) if working_weights else None
        if compile_drafter:
            self.drafter.compile_layers()
        self.model: nn.Module = self.drafter
        if group is not None and dist.get_world_size(group) > 1:
            self.model = nn.parallel.DistributedDataParallel(
                self.drafter,
                process_group=group,
                device_ids=[device.index] if device.type == "cuda" else None,
                broadcast_buffers=False,
            )
            if self.working is not None:  # gradients reduced in fp32, as with fp32 weights
                self.model.register_comm_hook(group, self.working.fp32_allreduce_hook)
        # StreamingAdamW (optim=adamw), or Muon on the hidden matrices and it on the rest (optim=muon).
        self.optimizer = build_optimizer(cfg.optim, self.drafter, self.working)
        # bf16 working weights only compute under autocast (fp32 norms meet bf16 matmuls there).
        self.autocast = (
            torch.autocast(device.type, dtype=torch.bfloat16)
            if self.working is not None or (device.type == "cuda" and self.hidden_dtype == torch.bfloat16)
            else nullcontext()
        )
        self.step = 0
        self.nonfinite_in_a_row = 0  # skipped non-finite steps since the last applied one
        self.totals = StepTotals()
        self._read_back = ReadBack()
        self._step_start = time.perf_counter()

    # ------------------------------------------------------------------ training

    def prepare(self, batch: Features) -> PreparedBatch:
        """Queue the blocks of `batch` (anchor sampling, labels, mask: ~200 small kernels) now.

        They depend on the data and the seed only, so preparing the next micro-batch while the
        device still runs this step's update (`optimizer_step(while_waiting=...)`) takes the host's
        slowest stretch off the start of the next step: there the device would otherwise wait for
        the host's launches.
        """
        inputs = self._placeholder(batch) if batch.num_sequences == 0 else batch
        blocks = loss_blocks(
            self.model,
            inputs,
            seed=self.cfg.train.seed,
            num_anchors=self.cfg.data.num_anchors,
            gamma=self.cfg.train.gamma,
            attention=self.attention,
            row_tokens=self.cfg.data.max_length,
        )
        return PreparedBatch(batch, inputs, blocks)

    def micro_step(self, batch: Features | PreparedBatch, last_of_step: bool) -> None:
        """Forward + backward of one micro-batch (prepared or not); gradients accumulate until the step.

        A micro-batch whose records were all skipped as bad still runs a forward and backward,
        on a placeholder through the same (DDP) model times zero: every drafter then joins the
        same gradient all-reduces in the same order whatever its data, and the placeholder adds
        exactly zero gradient.
        """
        prepared = batch if isinstance(batch, PreparedBatch) else self.prepare(batch)
        batch = prepared.batch
        accumulation = self.cfg.train.grad_accum
        data_parallel = isinstance(self.model, nn.parallel.DistributedDataParallel)
        sync = last_of_step or not data_parallel
        empty = batch.num_sequences == 0
        with nullcontext() if sync else self.model.no_sync(), self.autocast:
            loss, stats = drafter_loss(
                self.model,
                self.embed_weight,
                self.head_weight,
                prepared.inputs,
                seed=self.cfg.train.seed,
                num_anchors=self.cfg.data.num_anchors,
                gamma=self.cfg.train.gamma,
                attention=self.attention,
                selector_alpha=self.cfg.model.selector_loss_alpha,
                selector_gold=self.cfg.model.selector_gold_outside_top_k,
                blocks=prepared.blocks,
                dpace_alpha=dpace_alpha_of(self.cfg.train),
                xpress=xpress_weights(self.cfg.model),
                dspark=loss_weights(self.cfg.model),
                vocabulary_chunk_rows=self.cfg.train.vocabulary_chunk_rows,
            )
            if empty:
                loss = loss * 0.0
            (loss / accumulation).backward()
        if self.working is not None:
            self.working.after_backward(last_of_step, data_parallel)
        self.totals.add(batch, loss, stats)

    def _placeholder(self, empty: Features) -> Features:
        """One all-padding sequence without loss tokens, shaped like the data (no new dtypes)."""
        width = max(1, self.cfg.data.pad_to_multiple)
        seq_len = width * -(-self.cfg.model.block_size // width)
        zeros = torch.zeros(1, seq_len, dtype=torch.long, device=self.device)
        feature_size = empty.hidden_states.shape[-1]
        return Features(
            index=empty.index,
            epoch=empty.epoch,
            input_ids=zeros,
            loss_mask=zeros,
            lengths=torch.full((1,), seq_len, dtype=torch.long, device=self.device),
            sample_ids=torch.zeros(1, dtype=torch.long, device=self.device),
            hidden_states=torch.zeros(
                1, seq_len, feature_size, dtype=empty.hidden_states.dtype, device=self.device
            ),
        )

    def optimizer_step(
        self, extra: dict | None = None, while_waiting: Callable[[], None] | None = None
    ) -> dict:
        """Clip, check finiteness, step AdamW at the scheduled lr; returns the metrics record.

        The step's loss is the mean over the micro-batches (of all drafters) that had loss
        tokens, and the gradient is rescaled to match it. A step in which no drafter had a loss
        token is skipped by every drafter alike (they all see the same all-reduced count): no
        AdamW update, `skip_reason` "no_loss_tokens", loss null. The step counter, hence the data
        position and the lr schedule, advances either way.

        On GPU the step synchronises with the host once: everything the host decides on (loss,
        counts, gradient norm, finiteness) is computed on the device and read back in one copy,
        and the update, skipped on the device when it does not apply, is queued before that read:
        the device is never left idle while the host decides. `while_waiting()` runs once the update
        is queued and before the read: the caller's host work for the next step (`prepare`), which
        the device then finds queued behind the update instead of waiting for it.
        """
        cfg = self.cfg
        block = cfg.model.block_size
        xpress = self.drafter.arch == "xpress"
        packed = self.totals.pack(
            block, self.device, self.stop_requested(), self.drafter.arch == "dflash2", xpress
        )
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(packed, group=self.group)

        grads = self.optimizer.gradients()
        norm, gradient_scale = self._norm_and_gradient_scale(grads, packed)
        # Whether the update applies is decided on the device too (loss tokens, a finite loss and
        # norm), so AdamW is queued before the host reads anything: the device runs the update
        # while the host reads the step's numbers and prepares the next step.
        applies = (packed[SCORED] > 0) & torch.isfinite(packed[LOSS_SUM]) & torch.isfinite(norm)
        lr = lr_at(self.step, self.total_steps, cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # The step's one host synchronisation; the copy is queued before the update.
        read_back = self._read_back.start(
            torch.cat([packed, norm.reshape(1), applies.reshape(1).to(torch.float64)])
        )
        if grads:
            self.optimizer.step(grad_multiplier=gradient_scale, applies=applies)
        if while_waiting is not None:
            while_waiting()
        host = HostTotals.unpack(read_back(), block, xpress)
        self.stop_agreed = host.stop_votes > 0  # any drafter asked: all stop after this same step
        if not host.applied:
            self.optimizer.uncount_last_step()

        loss, grad_norm, skip_reason = self._judge(host)
        if host.applied != (skip_reason is None):  # the device's rule and the host's must agree
            raise RuntimeError(
                f"step {self.step + 1}: the device {'applied' if host.applied else 'skipped'} "
                f"the update, the host says {skip_reason or 'apply'}"
            )
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        now = time.perf_counter()
        elapsed, self._step_start = now - self._step_start, now
        record = self._record(host, lr, loss, grad_norm, skip_reason, elapsed)
        record.update(extra or {})
        self.totals = StepTotals()
        if skip_reason == "nonfinite":
            self._stop_if_nonfinite_ends_the_job(record)
        return record

    def _norm_and_gradient_scale(
        self, grads: list[torch.Tensor], packed: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(the step's gradient norm, the multiplier AdamW applies to the gradients), on the device."""
        # Micro-batches without loss tokens do not dilute the step (factor 1.0 when all had some),
        # and clipping bounds the norm of the rescaled gradient. Both become one multiplier that
        # stays on the device, so nothing here waits for the host.
        factor = packed[MICRO_BATCHES] / packed[SCORED].clamp_min(1)
        norm = torch.zeros((), dtype=torch.float64, device=self.device)
        if grads:
            # bf16 gradients (working weights) are summed in fp32 and give fp32 norms.
            wide = all(g.dtype == torch.float32 for g in grads)
            norms = torch._foreach_norm(grads) if wide else torch._foreach_norm(grads, 2, dtype=torch.float32)
            norm = factor * torch.linalg.vector_norm(torch.stack(norms).double())
        max_norm = self.cfg.optim.grad_clip if self.cfg.optim.grad_clip > 0 else float("inf")
        return norm, factor * (max_norm / (norm + 1e-6)).clamp(max=1.0)

    def _record(
        self,
        host: HostTotals,
        lr: float,
        loss: float | None,
        grad_norm: float,
        skip_reason: str | None,
        elapsed: float,
    ) -> dict:
        """The metrics record of the step just taken, with the drafter architecture's own terms."""
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": host.sequences / elapsed,
            "tokens_per_s": host.tokens / elapsed,
            "acc": per_position_accuracy(host.correct, host.count),
            "bytes_received": int(host.nbytes),
            "bad_records": int(host.bad_records),
            "too_long_records": int(host.too_long_records),
            "micro_batches_without_loss": int(host.micro_batches - host.scored),
            "skipped": skip_reason is not None,
            "skip_reason": skip_reason,
            "step_time_s": elapsed,
        }
        if self.device.type == "cuda":  # this rank's high-water mark: long rows live or die by it
            record["peak_memory_gib"] = torch.cuda.max_memory_allocated(self.device) / 2**30
        if slow := slow_paths():  # a fused path that turned itself off: the run is slower for it
            record["slow_paths"] = "; ".join(sorted(slow))
        if self.drafter.arch == "dflash2":
            record.update(selector_metrics(host.selector, host.count, host.scored))
        if self.drafter.arch == "xpress":
            record.update(xpress_metrics(host.xpress, host.scored))
        if self.drafter.arch == "dspark":  # its sums travel in the selector's slot (step_totals.py)
            record.update(dspark_metrics(host.selector, host.correct, host.count, host.scored))
        return record

    def _judge(self, host: HostTotals) -> tuple[float | None, float, str | None]:
        """The step's loss, gradient norm and skip reason (None: the update applied)."""
        if host.scored == 0:
            return None, 0.0, "no_loss_tokens"
        loss, grad_norm = host.loss_sum / host.scored, host.grad_norm
        if math.isfinite(loss) and math.isfinite(grad_norm):
            self.nonfinite_in_a_row = 0
            return loss, grad_norm, None
        self.nonfinite_in_a_row += 1
        return loss, grad_norm, "nonfinite"

    def _stop_if_nonfinite_ends_the_job(self, record: dict) -> None:
        """Raise NonFiniteStep (carrying the step's record) with train.on_nonfinite=stop, or with
        skip once so many steps in a row were skipped that the run no longer trains (a broken
        kernel, data or target): skipping them forever would finish the job, and export its
        drafter, as if it had trained."""
        limit, in_a_row = self.cfg.train.max_nonfinite_in_a_row, self.nonfinite_in_a_row
        record = record | {"stopped_the_job": True}
        if self.cfg.train.on_nonfinite == "stop":
            raise NonFiniteStep(
                f"non-finite loss ({record['loss']}) or gradient norm ({record['grad_norm']}) at step "
                f"{self.step}; set train.on_nonfinite=skip to skip such steps, or lower optim.lr",
                record,
            )
        if limit and in_a_row >= limit:
            raise NonFiniteStep(
                f"steps {self.step + 1 - in_a_row} to {self.step}: {in_a_row} steps in a row had a "
                "non-finite loss or gradient norm and were skipped (train.on_nonfinite=skip), so the "
                "drafter is not training. Check the data, the target's hidden states and optim.lr; "
                "train.max_nonfinite_in_a_row sets how many are tolerated (0: no limit).",
                record,
            )

    def full_precision_weights(self) -> AbstractContextManager:
        """Inside, the drafter computes with fp32 weights (its masters where it has working copies):
        for evaluation, which runs without autocast."""
        return nullcontext() if self.working is None else self.working.masters_in_place()

    def restart_step_clock(self) -> None:
        """Start timing the next step now (after work that is not training, e.g. an evaluation)."""
        self._step_start = time.perf_counter()

    # ------------------------------------------------------------------ state

    def training_state(self) -> checkpoint.TrainingState:
        return checkpoint.TrainingState(
            step=self.step,
            model=self.drafter.state_dict(),
            optimizer=self.optimizer.state_dict(),
            rng=checkpoint.rng_state(),
        )

    def load_training_state(self, state: checkpoint.TrainingState) -> None:
        self.drafter.load_state_dict(state.model)
        self.optimizer.load_state_dict(state.optimizer)
        checkpoint.restore_rng(state.rng)
        self.step = state.step
