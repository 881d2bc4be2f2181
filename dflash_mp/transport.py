"""Point-to-point transport of micro-batches from target ranks to drafter ranks.

A micro-batch travels as a fixed-size int64 header followed by two tensors:
  tokens  int64 [B, 2*S + 2]  = input_ids | loss_mask | length | sample_id, per row
  hidden  dtype [B, S, K*H]   = the target's concatenated hidden states
Headers go over a gloo group on the CPU even when the data goes over NCCL, so a drafter
can read a header (shapes) without synchronising its GPU. Nothing is ever unpickled: the
header is integers, the rest raw tensors whose shapes the header gives.

Ordering rule: a sender issues, per micro-batch, header then tensors; a receiver posts the
header of the next micro-batch it needs before it computes on the current one, then the
tensor receives once the header is in. Same code on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_mp.clock import RoleClock

HEADER_LEN = 16
_MAGIC = 0xDF1A54
_VERSION = 1
FLAG_END_OF_DATA = 1

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Header slots.
_H_MAGIC, _H_VERSION, _H_FLAGS, _H_INDEX, _H_EPOCH, _H_BATCH, _H_SEQ, _H_FEAT, _H_DTYPE = range(9)
_H_BAD_RECORDS, _H_SENDER_BUSY_US, _H_SENDER_WAIT_US, _H_TOO_LONG = 9, 10, 11, 12


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


def pack_tokens(input_ids, loss_mask, lengths, sample_ids) -> torch.Tensor:
    """The four small integer tensors as one contiguous int64 [B, 2S+2] tensor (one message)."""
    return torch.cat(
        [input_ids.long(), loss_mask.long(), lengths.long()[:, None], sample_ids.long()[:, None]], dim=1
    ).contiguous()


def unpack_tokens(tokens: torch.Tensor, seq_len: int):
    s = seq_len
    return tokens[:, :s], tokens[:, s : 2 * s], tokens[:, 2 * s], tokens[:, 2 * s + 1]


class Sender:
    """Target side: sends micro-batches, at most `max_inflight` data sends outstanding."""

    def __init__(self, meta_group, data_group, device: torch.device, max_inflight: int) -> None:
        self.meta_group = meta_group
        self.data_group = data_group
        self.device = device
        self.max_inflight = max_inflight
        self.inflight: deque = deque()
        self.clock = RoleClock(device)  # the caller times its work with `with sender.clock.busy():`
        self.bytes_sent = 0

    def _header(
        self,
        flags: int,
        index: int,
        epoch: int,
        batch: int,
        seq: int,
        feat: int,
        dtype,
        bad: int,
        too_long: int = 0,
    ):
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[_H_MAGIC], header[_H_VERSION], header[_H_FLAGS] = _MAGIC, _VERSION, flags
        header[_H_INDEX], header[_H_EPOCH] = index, epoch
        header[_H_BATCH], header[_H_SEQ], header[_H_FEAT] = batch, seq, feat
        header[_H_DTYPE] = _DTYPES.index(dtype)
        header[_H_BAD_RECORDS], header[_H_TOO_LONG] = bad, too_long
        header[_H_SENDER_BUSY_US] = int(self.clock.busy_s * 1e6)
        header[_H_SENDER_WAIT_US] = int(self.clock.wait_s * 1e6)
        return header

    def send_header(
        self,
        dst: int,
        index: int,
        epoch: int,
        batch: int,
        seq: int,
        feat: int,
        dtype,
        bad: int,
        too_long: int = 0,
    ):
        """Announce micro-batch `index` (shapes) before its hidden states exist."""
        header = self._header(0, index, epoch, batch, seq, feat, dtype, bad, too_long)
        self.inflight.append((dist.isend(header, dst=dst, group=self.meta_group), header, None))

    def send_tensors(self, dst: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        tokens = tokens.to(self.device, non_blocking=True).contiguous()
        hidden = hidden.contiguous()
        works = [dist.isend(t, dst=dst, group=self.data_group) for t in (tokens, hidden) if t.numel() > 0]
        done = None
        if self.device.type == "cuda":
            for work in works:
                work.wait()  # makes the current stream wait for the send, without blocking the CPU
            done = torch.cuda.Event()
            done.record()
        self.bytes_sent += tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size()
        self.inflight.append((works, (tokens, hidden), done))
        self._drain(self.max_inflight)

    def send_end_of_data(self, dst: int, index: int) -> None:
        header = self._header(FLAG_END_OF_DATA, index, 0, 0, 0, 0, torch.float32, 0)
        self.inflight.append((dist.isend(header, dst=dst, group=self.meta_group), header, None))

    def _drain(self, keep: int) -> None:
        while len(self.inflight) > keep:
            works, _, done = self.inflight.popleft()
            for work in works if isinstance(works, list) else [works]:
                work.wait()
            if done is not None:
                done.synchronize()

    def close(self) -> None:
        self._drain(0)


class _PendingHeader:
    def __init__(self, index: int, src: int, meta_group) -> None:
        self.index, self.src = index, src
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.work = dist.irecv(self.header, src=src, group=meta_group)


class _PendingTensors:
    def __init__(self, features: Features, works: list) -> None:
        self.features, self.works = features, works


class Receiver:
    """Drafter side: receives the micro-batches it consumes, in increasing index order.

    `indices` yields this drafter's micro-batch indices; `source_of(m)` gives the target
    rank that produces m. The receive of micro-batch i+1 is posted before micro-batch i
    is returned to the caller (double buffering).
    """

    def __init__(self, meta_group, data_group, device: torch.device, indices, source_of) -> None:
        self.meta_group, self.data_group, self.device = meta_group, data_group, device
        self.indices = iter(indices)
        self.source_of = source_of
        self.clock = RoleClock(device)  # the caller times its work with `with receiver.clock.busy():`
        self.bytes_received = 0
        self._next_header = self._post_header()
        self._next_tensors: _PendingTensors | None = None

    def _post_header(self) -> _PendingHeader | None:
        index = next(self.indices, None)
        return None if index is None else _PendingHeader(index, self.source_of(index), self.meta_group)

    def _wait(self, works) -> None:
        for work in works:
            work.wait()

    def _post_tensors(self, pending: _PendingHeader) -> _PendingTensors:
        self._wait([pending.work])
        h = pending.header.tolist()
        if h[_H_MAGIC] != _MAGIC or h[_H_VERSION] != _VERSION:
            raise RuntimeError(
                f"transport: bad header from rank {pending.src} for micro-batch {pending.index} "
                f"(magic {h[_H_MAGIC]:#x}, version {h[_H_VERSION]}): ranks run different code versions?"
            )
        if h[_H_INDEX] != pending.index:
            raise RuntimeError(
                f"transport: expected micro-batch {pending.index} from rank {pending.src}, "
                f"got {h[_H_INDEX]}: routing mismatch between target and drafter ranks"
            )
        batch, seq, feat = h[_H_BATCH], h[_H_SEQ], h[_H_FEAT]
        tokens = torch.empty(batch, 2 * seq + 2, dtype=torch.int64, device=self.device)
        hidden = torch.empty(batch, seq, feat, dtype=_DTYPES[h[_H_DTYPE]], device=self.device)
        end = bool(h[_H_FLAGS] & FLAG_END_OF_DATA)
        works = []
        if not end:
            works = [
                dist.irecv(t, src=pending.src, group=self.data_group)
                for t in (tokens, hidden)
                if t.numel() > 0
            ]
        input_ids, loss_mask, lengths, sample_ids = unpack_tokens(tokens, seq)
        features = Features(
            index=pending.index,
            epoch=h[_H_EPOCH],
            input_ids=input_ids,
            loss_mask=loss_mask,
            lengths=lengths,
            sample_ids=sample_ids,
            hidden_states=hidden,
            end_of_data=end,
            bad_records=h[_H_BAD_RECORDS],
            too_long_records=h[_H_TOO_LONG],
            sender_busy_s=h[_H_SENDER_BUSY_US] / 1e6,
            sender_wait_s=h[_H_SENDER_WAIT_US] / 1e6,
            nbytes=tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size(),
        )
        return _PendingTensors(features, works)

    def next(self) -> Features:
        """The next micro-batch for this drafter (end_of_data=True once the stream ends)."""
        self.prefetch()
        if self._next_tensors is None:
            raise RuntimeError("transport: receive past the end of this drafter's micro-batches")
        current, self._next_tensors = self._next_tensors, None
        self._wait(current.works)
        self.bytes_received += current.features.nbytes
        if not current.features.end_of_data:
            # The next header receive is posted before the caller computes on this one.
            self._next_header = self._post_header()
        return current.features

    def prefetch(self) -> None:
        """Once the next header is in, post the tensor receives for it.

        Call after launching the compute of the current micro-batch: on GPU the CPU runs
        ahead of the kernels, so NCCL fills the next buffers while the current step runs.
        """
        if self._next_tensors is None and self._next_header is not None:
            self._next_tensors = self._post_tensors(self._next_header)
            self._next_header = None
