"""The drafter's optimisation: micro-steps, gradient accumulation, optimizer steps.

One class serves both the drafter ranks of the multi-process runtime and the
single-process reference trainer, so the two cannot drift apart: the runtime is correct
when its loss column equals the reference's, bit for bit on CPU.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch import nn

from dflash_mp import checkpoint
from dflash_mp.block_diffusion import drafter_loss, per_position_accuracy
from dflash_mp.config import RootConfig, read_target_config, resolved_target_layer_ids
from dflash_mp.mask_token import mask_token_id
from dflash_mp.models.drafter import DFlashDrafter, build_drafter_config
from dflash_mp.models.target import load_embedding_and_head
from dflash_mp.transport import Features


def lr_at(step: int, total_steps: int, peak: float, warmup_ratio: float, min_ratio: float) -> float:
    """Linear warm-up then cosine decay to min_ratio * peak (DFlash recipe: 4% warm-up)."""
    warmup = math.ceil(warmup_ratio * total_steps)
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = (step - warmup) / max(1, total_steps - warmup)
    return peak * (min_ratio + (1 - min_ratio) * 0.5 * (1 + math.cos(math.pi * min(progress, 1.0))))


def resolve_precision(cfg: RootConfig, device: torch.device) -> tuple[torch.dtype, str, bool]:
    """(hidden-state dtype, attention kernel, compile?) with "auto" resolved for `device`."""
    on_gpu = device.type == "cuda"
    dtype = {"auto": torch.bfloat16 if on_gpu else torch.float32, "float32": torch.float32}.get(
        cfg.train.dtype, torch.bfloat16
    )
    attention = cfg.train.attention if cfg.train.attention != "auto" else ("flex" if on_gpu else "sdpa")
    compile_flag = str(cfg.train.compile).lower()
    return dtype, attention, (on_gpu if compile_flag == "auto" else compile_flag == "true")


def build_drafter(cfg: RootConfig) -> DFlashDrafter:
    """A freshly initialised drafter (identical on every rank: seeded by train.seed)."""
    target = read_target_config(cfg.model.target_path)
    layer_ids = resolved_target_layer_ids(cfg, int(target["num_hidden_layers"]))
    config = build_drafter_config(
        target,
        draft_layers=cfg.model.draft_layers,
        target_layer_ids=layer_ids,
        block_size=cfg.model.block_size,
        mask_token_id=mask_token_id(cfg.model),
    )
    return DFlashDrafter(config, seed=cfg.train.seed)


@dataclass
class StepTotals:
    """What a drafter rank accumulates over one optimizer step's micro-batches."""

    micro_batches: int = 0
    sequences: int = 0
    bytes_received: int = 0
    bad_records: int = 0
    correct: torch.Tensor | None = None
    count: torch.Tensor | None = None
    losses: list = field(default_factory=list)
    # Token counts stay tensors: reading them per micro-batch would synchronise the GPU.
    token_counts: list = field(default_factory=list)


class DrafterTrainer:
    def __init__(
        self,
        cfg: RootConfig,
        device: torch.device,
        total_steps: int,
        group=None,
        drafter: DFlashDrafter | None = None,
        embed_and_head: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> None:
        """`drafter` and `embed_and_head` default to what cfg.model describes (benchmarks pass their own)."""
        self.cfg = cfg
        self.device = device
        self.total_steps = total_steps
        self.group = group  # drafter-only process group (None: single process)
        self.hidden_dtype, self.attention, compile_drafter = resolve_precision(cfg, device)
        self.drafter = (drafter if drafter is not None else build_drafter(cfg)).to(device)
        if embed_and_head is None:
            embed_and_head = load_embedding_and_head(
                cfg.model.target_path, dtype=self.hidden_dtype, device=device
            )
        embed, head = embed_and_head
        self.embed_weight, self.head_weight = embed.requires_grad_(False), head.requires_grad_(False)
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
        o = cfg.optim
        self.optimizer = torch.optim.AdamW(
            self.drafter.parameters(),
            lr=o.lr,
            betas=tuple(o.betas),
            weight_decay=o.weight_decay,
            fused=device.type == "cuda",
        )
        self.autocast = (
            torch.autocast("cuda", dtype=torch.bfloat16)
            if device.type == "cuda" and self.hidden_dtype == torch.bfloat16
            else nullcontext()
        )
        self.step = 0
        self.totals = StepTotals()
        self._step_start = time.perf_counter()

    # ------------------------------------------------------------------ training

    def micro_step(self, batch: Features, last_of_step: bool) -> None:
        """Forward + backward of one micro-batch; gradients accumulate until the step."""
        accumulation = self.cfg.train.grad_accum
        sync = last_of_step or not isinstance(self.model, nn.parallel.DistributedDataParallel)
        with nullcontext() if sync else self.model.no_sync(), self.autocast:
            if batch.num_sequences == 0:
                # Every record of this micro-batch was skipped as bad: a zero loss that still
                # touches every parameter, so DDP's all-reduce sees the same buckets on all ranks.
                loss = sum(p.reshape(-1)[0] * 0.0 for p in self.drafter.parameters())
                stats = None
            else:
                loss, stats = drafter_loss(
                    self.model,
                    self.embed_weight,
                    self.head_weight,
                    batch,
                    seed=self.cfg.train.seed,
                    num_anchors=self.cfg.data.num_anchors,
                    gamma=self.cfg.train.gamma,
                    attention=self.attention,
                )
            (loss / accumulation).backward()
        t = self.totals
        t.losses.append(loss.detach().float())
        t.micro_batches += 1
        t.sequences += batch.num_sequences
        if batch.num_sequences:
            t.token_counts.append(batch.lengths.sum())
        t.bytes_received += batch.nbytes
        t.bad_records += batch.bad_records
        if stats is not None:
            t.correct = stats["correct"] if t.correct is None else t.correct + stats["correct"]
            t.count = stats["count"] if t.count is None else t.count + stats["count"]

    def optimizer_step(self, extra: dict | None = None) -> dict:
        """Clip, check finiteness, step AdamW at the scheduled lr; returns the metrics record."""
        cfg, t = self.cfg, self.totals
        block = cfg.model.block_size
        correct = t.correct if t.correct is not None else torch.zeros(block, device=self.device)
        count = t.count if t.count is not None else torch.zeros(block, device=self.device)
        # One all-reduce for every per-step number, so the metrics cost one collective.
        local_loss = torch.stack(t.losses).sum()
        local_tokens = torch.stack(t.token_counts).sum() if t.token_counts else torch.zeros(())
        packed = torch.cat(
            [
                local_loss.reshape(1).to(self.device, torch.float64),
                local_tokens.reshape(1).to(self.device, torch.float64),
                torch.tensor(
                    [t.micro_batches, t.sequences, t.bytes_received, t.bad_records],
                    dtype=torch.float64,
                    device=self.device,
                ),
                correct.to(self.device, torch.float64),
                count.to(self.device, torch.float64),
            ]
        )
        if self.group is not None and dist.get_world_size(self.group) > 1:
            dist.all_reduce(packed, group=self.group)
        loss_sum, tokens, micro_batches, sequences, nbytes, bad = packed[:6].tolist()
        correct, count = packed[6 : 6 + block], packed[6 + block :]

        max_norm = cfg.optim.grad_clip if cfg.optim.grad_clip > 0 else float("inf")
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.drafter.parameters(), max_norm))
        loss = loss_sum / max(micro_batches, 1)
        lr = lr_at(self.step, self.total_steps, cfg.optim.lr, cfg.optim.warmup_ratio, cfg.optim.min_lr_ratio)
        finite = math.isfinite(loss) and math.isfinite(grad_norm)
        if not finite and cfg.train.on_nonfinite == "stop":
            raise FloatingPointError(
                f"non-finite loss ({loss}) or gradient norm ({grad_norm}) at step {self.step + 1}; "
                "set train.on_nonfinite=skip to skip such steps, or lower optim.lr"
            )
        if finite:
            for group in self.optimizer.param_groups:
                group["lr"] = lr
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.step += 1

        now = time.perf_counter()
        elapsed, self._step_start = now - self._step_start, now
        record = {
            "step": self.step,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "samples_per_s": sequences / elapsed,
            "tokens_per_s": tokens / elapsed,
            "acc": per_position_accuracy(correct, count),
            "bytes_received": int(nbytes),
            "bad_records": int(bad),
            "skipped": not finite,
            "step_time_s": elapsed,
        }
        record.update(extra or {})
        self.totals = StepTotals()
        return record

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
