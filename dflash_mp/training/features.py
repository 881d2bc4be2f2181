"""One micro-batch as the drafter trains on it: the tokens and the target's hidden states.

Target ranks send it (`dflash_mp.runtime.transport` carries it between processes); the colocated
layout and the single-process reference build it in place from what they read (`features_of`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from dflash_mp.data import MicroBatch


@dataclass
class Features:
    """One micro-batch as the drafter consumes it (or the end-of-data marker)."""

    index: int
    epoch: int
    input_ids: torch.Tensor  # int64 [B, S]
    loss_mask: torch.Tensor  # int64 [B, S], 1 on response tokens
    lengths: torch.Tensor  # int64 [B]
    sample_ids: torch.Tensor  # int64 [B]
    hidden_states: torch.Tensor  # [B, S, K*H]
    # Packed rows: int64 [B, S] record id of the document at each position, -1 on padding
    # (dflash_mp.models.packed_rows); None: one record per row.
    document_ids: torch.Tensor | None = None
    end_of_data: bool = False
    # Sender-side counters carried in the header (for the role-balance metrics).
    bad_records: int = 0
    too_long_records: int = 0  # truncated or skipped, per data.on_too_long
    sender_busy_s: float = 0.0
    sender_wait_s: float = 0.0
    nbytes: int = 0

    @property
    def num_sequences(self) -> int:
        return int(self.input_ids.shape[0])


def features_of(
    batch: MicroBatch, hidden_states: torch.Tensor, bad_records: int = 0, too_long_records: int = 0
) -> Features:
    """A locally read micro-batch in the form the drafter consumes (the reference trainer's path),
    on the hidden states' device, as the transport would deliver it."""
    device = hidden_states.device
    return Features(
        index=batch.index,
        epoch=batch.epoch,
        input_ids=batch.input_ids.to(device),
        loss_mask=batch.loss_mask.long().to(device),
        lengths=batch.lengths.to(device),
        sample_ids=batch.sample_ids.to(device),
        # The extractor runs under inference_mode; autograd may not save such tensors.
        hidden_states=hidden_states.clone(),
        document_ids=None if batch.document_ids is None else batch.document_ids.to(device),
        bad_records=bad_records,
        too_long_records=too_long_records,
        nbytes=0,
    )
