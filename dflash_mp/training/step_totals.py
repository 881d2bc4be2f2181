"""What a drafter rank adds up over one optimizer step, carried as one float64 vector on the device.

Everything the host decides on after a step (loss, token counts, micro-batches without loss tokens,
stop votes, accuracy per block position, the DFlash 2 selector's totals, the gradient norm and
whether the update applied) travels in one vector: one all-reduce over the drafters, one copy to
the host (docs/DESIGN.md §2, one host synchronisation per optimizer step). This module owns the
vector's layout: `StepTotals.pack` writes it, `HostTotals.unpack` reads it back.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch

from dflash_mp.objective.selector_loss import add_selector_stats, pack_selector_totals
from dflash_mp.objective.xpress_loss import XPRESS_TERMS
from dflash_mp.training.features import Features

# Slots of the packed vector: the counters, then correct [Bs], count [Bs], the selector totals
# (DFlash 2), then the gradient norm and whether the update applied (`optimizer_step` adds those).
LOSS_SUM, SCORED, MICRO_BATCHES = 0, 2, 3  # the token count is 1
COUNTERS = 9  # ... then sequences, bytes, bad records, too-long records, stop votes


@dataclass
class StepTotals:
    """What a drafter rank accumulates over one optimizer step's micro-batches."""

    micro_batches: int = 0
    sequences: int = 0
    bytes_received: int = 0
    bad_records: int = 0
    too_long_records: int = 0
    correct: torch.Tensor | None = None
    count: torch.Tensor | None = None
    losses: list = field(default_factory=list)
    scored: list = field(default_factory=list)  # per micro-batch: bool tensor, had loss tokens
    # Token counts stay tensors: reading them per micro-batch would synchronise the GPU.
    token_counts: list = field(default_factory=list)
    selector: dict = field(default_factory=dict)  # DFlash 2 selector stats (selector_loss.py)
    xpress: list = field(default_factory=list)  # XPress loss terms per micro-batch (xpress_loss.py)
    dspark: list = field(default_factory=list)  # DSpark sums per micro-batch (dspark_loss.py)

    def add(self, batch: Features, loss: torch.Tensor, stats: dict) -> None:
        """One micro-batch's loss and stats (`drafter_loss`), without reading anything back."""
        self.losses.append(loss.detach().float())
        # Stays a tensor (no host sync): whether this micro-batch had any loss token.
        self.scored.append(stats["weight_sum"].detach() > 0)
        self.micro_batches += 1
        self.sequences += batch.num_sequences
        if batch.num_sequences > 0:
            self.token_counts.append(batch.lengths.sum())
        self.bytes_received += batch.nbytes
        self.bad_records += batch.bad_records
        self.too_long_records += batch.too_long_records
        self.correct = stats["correct"] if self.correct is None else self.correct + stats["correct"]
        self.count = stats["count"] if self.count is None else self.count + stats["count"]
        add_selector_stats(self.selector, stats.get("selector"))
        if "xpress" in stats:
            self.xpress.append(stats["xpress"])
        if "dspark" in stats:
            self.dspark.append(stats["dspark"].detach())

    def pack(
        self, block: int, device: torch.device, stop_requested: bool, dflash2: bool, xpress: bool = False
    ) -> torch.Tensor:
        """Every per-step number in one float64 vector on `device`: the COUNTERS scalars, then
        correct [block], count [block], the DFlash 2 selector totals, the XPress terms."""
        correct = self.correct if self.correct is not None else torch.zeros(block, device=device)
        count = self.count if self.count is not None else torch.zeros(block, device=device)
        no_tokens = torch.zeros((), dtype=torch.long, device=device)
        local_tokens = torch.stack(self.token_counts).sum() if self.token_counts else no_tokens
        local_scored = torch.stack(self.scored).sum() if self.scored else no_tokens
        host_counters = torch.tensor(
            [
                self.micro_batches,
                self.sequences,
                self.bytes_received,
                self.bad_records,
                self.too_long_records,
                float(stop_requested),
            ],
            dtype=torch.float64,
        )
        if device.type == "cuda":
            # A pageable host-to-device copy synchronises; from pinned memory it is queued like a kernel.
            host_counters = host_counters.pin_memory()
        return torch.cat(
            [
                torch.stack(self.losses).sum().reshape(1).to(device, torch.float64),
                local_tokens.reshape(1).to(device, torch.float64),
                local_scored.reshape(1).to(device, torch.float64),
                host_counters.to(device, non_blocking=True),
                correct.to(device, torch.float64),
                count.to(device, torch.float64),
                pack_selector_totals(self.selector, block, device, dflash2),
                # DSpark's sums share the selector's slot (a drafter has one or the other, or neither).
                torch.stack(self.dspark).sum(0).to(device, torch.float64)
                if self.dspark
                else torch.zeros(0, dtype=torch.float64, device=device),
                _xpress_totals(self.xpress, device, xpress),
            ]
        )


@dataclass
class HostTotals:
    """The step's vector, all-reduced over the drafters and read back, by name."""

    loss_sum: float
    tokens: float
    scored: float  # micro-batches that had loss tokens
    micro_batches: float
    sequences: float
    nbytes: float
    bad_records: float
    too_long_records: float
    stop_votes: float
    correct: torch.Tensor  # [block]
    count: torch.Tensor  # [block]
    selector: torch.Tensor  # the DFlash 2 selector totals (empty for DFlash)
    grad_norm: float
    applied: bool
    xpress: torch.Tensor | None = None  # the XPress terms' sums (XPRESS_TERMS)

    @classmethod
    def unpack(cls, host: torch.Tensor, block: int, xpress: bool = False) -> HostTotals:
        """`host` is `StepTotals.pack` followed by the gradient norm and the applied flag."""
        counters = host[:COUNTERS].tolist()
        tail = len(XPRESS_TERMS) if xpress else 0
        return cls(
            *counters,
            correct=host[COUNTERS : COUNTERS + block],
            count=host[COUNTERS + block : COUNTERS + 2 * block],
            selector=host[COUNTERS + 2 * block : host.shape[0] - 2 - tail],
            grad_norm=float(host[-2]),
            applied=bool(host[-1]),
            xpress=host[host.shape[0] - 2 - tail : -2],
        )


def _xpress_totals(terms: list, device: torch.device, enabled: bool) -> torch.Tensor:
    """The XPress terms summed over the micro-batches (zeros for none; empty unless `enabled`)."""
    if not enabled:
        return torch.zeros(0, dtype=torch.float64, device=device)
    if not terms:
        return torch.zeros(len(XPRESS_TERMS), dtype=torch.float64, device=device)
    return torch.stack(terms).sum(0).to(device, torch.float64)


class ReadBack:
    """Copies of device values to the host that do not wait for work queued after them."""

    def __init__(self) -> None:
        self._stream: torch.cuda.Stream | None = None

    def start(self, values: torch.Tensor) -> Callable[[], torch.Tensor]:
        """Queue `values`' copy to the host; the returned function waits for it.

        On CUDA the copy runs on a side stream after what the current stream has queued so far, so
        waiting for it does not wait for work queued later (AdamW's update).
        """
        if values.device.type != "cuda":
            return lambda: values
        if self._stream is None:
            self._stream = torch.cuda.Stream(values.device)
        stream = self._stream
        stream.wait_stream(torch.cuda.current_stream(values.device))
        host = torch.empty(values.shape, dtype=values.dtype, pin_memory=True)
        with torch.cuda.stream(stream):
            host.copy_(values, non_blocking=True)
        values.record_stream(stream)  # its memory is not reused before the copy ran

        def wait() -> torch.Tensor:
            stream.synchronize()
            return host

        return wait
