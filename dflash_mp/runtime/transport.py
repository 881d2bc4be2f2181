"""Point-to-point transport of micro-batches from target ranks to drafter ranks.

A micro-batch travels as a fixed-size int64 header followed by two tensors:
  tokens  int64 [B, 2*S + 2]  = input_ids | loss_mask | length | sample_id, per row
  hidden  dtype [B, S, K*H]   = the target's concatenated hidden states
Headers go over a gloo group on the CPU even when the data goes over NCCL, so a drafter
can read a header (shapes) without synchronising its GPU. Nothing is ever unpickled: the
header is integers, the rest raw tensors whose shapes the header gives.

Ordering rule: a sender issues, per micro-batch and in increasing index order, the header
then the tensors; only the tensor sends count against `max_inflight` (headers are a few bytes).
A receiver keeps the header receives of its next HEADER_LOOKAHEAD micro-batches posted, in
increasing index order, and posts the tensor receives of micro-batch i+1 as soon as its header
is in: before it hands out micro-batch i when the header is already there (the transfer then
overlaps the compute of i), else at the next `prefetch()` or `next()`, never blocking the
compute of i on a late header. Every micro-batch gets fresh buffers, so a receive never writes
into one the caller still reads. Same code on gloo (CPU) and NCCL (GPU).
"""

from __future__ import annotations

import contextlib
import queue
import threading
import time
from collections import deque
from concurrent.futures import Future
from concurrent.futures import wait as wait_futures
from dataclasses import dataclass

import torch
import torch.distributed as dist

from dflash_mp.runtime.clock import RoleClock
from dflash_mp.training.features import Features

HEADER_LEN = 16
_MAGIC = 0xDF1A54
_VERSION = 1
FLAG_END_OF_DATA = 1
FLAG_PACKED = 2  # the rows pack several documents: their document ids follow the tokens
# Header receives a drafter keeps posted beyond the micro-batch whose tensors it receives next:
# two, so the header of i+2 has the whole compute of i to arrive before i+1 is handed out.
HEADER_LOOKAHEAD = 2

_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Header slots.
_H_MAGIC, _H_VERSION, _H_FLAGS, _H_INDEX, _H_EPOCH, _H_BATCH, _H_SEQ, _H_FEAT, _H_DTYPE = range(9)
_H_BAD_RECORDS, _H_SENDER_BUSY_US, _H_SENDER_WAIT_US, _H_TOO_LONG = 9, 10, 11, 12


def pack_tokens(input_ids, loss_mask, lengths, sample_ids, document_ids=None) -> torch.Tensor:
    """The small integer tensors as one int64 message: [B, 2S+2], [B, 3S+2] with document ids."""
    parts = [input_ids.long(), loss_mask.long(), lengths.long()[:, None], sample_ids.long()[:, None]]
    if document_ids is not None:
        parts.append(document_ids.long())
    return torch.cat(parts, dim=1).contiguous()


def token_columns(seq_len: int, packed: bool) -> int:
    return (3 if packed else 2) * seq_len + 2


def unpack_tokens(tokens: torch.Tensor, seq_len: int):
    s = seq_len  # (input_ids, loss_mask, lengths, sample_ids) of `pack_tokens`' message
    return tokens[:, :s], tokens[:, s : 2 * s], tokens[:, 2 * s], tokens[:, 2 * s + 1]


def unpack_document_ids(tokens: torch.Tensor, seq_len: int) -> torch.Tensor | None:
    """The packed rows' document ids of `pack_tokens`' message; None for unpacked rows."""
    return tokens[:, 2 * seq_len + 2 :] if tokens.shape[1] > 2 * seq_len + 2 else None


@dataclass
class _Send:
    """One message in flight: a header (`data` False) or a micro-batch's tensors."""

    data: bool
    works: list
    tensors: tuple  # referenced until the send completed: see Sender.send_tensors
    done: torch.cuda.Event | None = None  # CUDA: recorded once the send completed


class Sender:
    """Target side: sends micro-batches, at most `max_inflight` tensor sends outstanding.

    Headers do not count: they are small, and the receiver posts their receives ahead. On CUDA
    the compute stream never waits for a send (NCCL's stream already waits for the compute
    stream when the send is issued); a side stream waits for each send and records an event,
    and only the backpressure (more than `max_inflight` tensor sends outstanding) waits on the
    host, for the oldest one.
    """

    def __init__(self, meta_group, data_group, device: torch.device, max_inflight: int) -> None:
        self.meta_group = meta_group
        self.data_group = data_group
        self.device = device
        self.max_inflight = max_inflight
        self.inflight: deque[_Send] = deque()  # headers and tensor sends, in issue order
        self.clock = RoleClock(device)  # the caller times its work with `with sender.clock.busy():`
        self.bytes_sent = 0
        self._completion_stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    @property
    def data_sends_in_flight(self) -> int:
        """Tensor sends not yet known to be complete (what `max_inflight` bounds)."""
        return sum(send.data for send in self.inflight)

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
        packed: bool = False,
        flags: int = 0,
    ):
        """Announce micro-batch `index` (shapes) before its hidden states exist."""
        header = torch.zeros(HEADER_LEN, dtype=torch.int64)
        header[_H_MAGIC], header[_H_VERSION] = _MAGIC, _VERSION
        header[_H_FLAGS] = flags | (FLAG_PACKED if packed else 0)
        header[_H_INDEX], header[_H_EPOCH] = index, epoch
        header[_H_BATCH], header[_H_SEQ], header[_H_FEAT] = batch, seq, feat
        header[_H_DTYPE] = _DTYPES.index(dtype)
        header[_H_BAD_RECORDS], header[_H_TOO_LONG] = bad, too_long
        header[_H_SENDER_BUSY_US] = int(self.clock.busy_s * 1e6)
        header[_H_SENDER_WAIT_US] = int(self.clock.wait_s * 1e6)
        # Not counted against max_inflight; waited when the tensor send after it is drained
        # (by then the receiver has read it, so that wait does not block).
        self.inflight.append(_Send(False, [dist.isend(header, dst=dst, group=self.meta_group)], (header,)))

    def send_tensors(self, dst: int, tokens: torch.Tensor, hidden: torch.Tensor) -> None:
        if self.device.type == "cuda" and tokens.device.type == "cpu":
            # From pinned memory the copy is queued like a kernel; from pageable memory the
            # driver may first wait for the stream (the forward that is still running).
            tokens = tokens.pin_memory()
        tokens = tokens.to(self.device, non_blocking=True).contiguous()
        hidden = hidden.contiguous()
        works = [dist.isend(t, dst=dst, group=self.data_group) for t in (tokens, hidden) if t.numel() > 0]
        done = None
        if self._completion_stream is not None:
            # The side stream, not the compute stream, waits for the send: the target's next
            # forward overlaps the transfer. The tensors stay referenced here until `done`
            # completed. They were allocated on the compute stream; freed earlier, the caching
            # allocator would hand their blocks to the next allocation on that stream at once,
            # while the NCCL stream may still read them. (ProcessGroupNCCL's own stash of them
            # is let go at wait(), which orders only the side stream. record_stream(side) would
            # defer the reuse too; holding the references frees them where the backpressure
            # waits, so memory stays bounded by max_inflight micro-batches.)
            done = torch.cuda.Event()
            with torch.cuda.stream(self._completion_stream):
                for work in works:
                    work.wait()
                done.record(self._completion_stream)
        self.bytes_sent += tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size()
        self.inflight.append(_Send(True, works, (tokens, hidden), done))
        self._drain(self.max_inflight)

    def send_end_of_data(self, dst: int, index: int) -> None:
        self.send_header(dst, index, 0, 0, 0, 0, torch.float32, 0, flags=FLAG_END_OF_DATA)

    def _drain(self, keep: int) -> None:
        """Wait, oldest first, until at most `keep` tensor sends are outstanding."""
        while self.inflight and (keep == 0 or self.data_sends_in_flight > keep):
            send = self.inflight.popleft()
            if send.done is not None:
                send.done.synchronize()  # host wait: the backpressure that bounds memory
            else:
                for work in send.works:
                    work.wait()

    def close(self) -> None:
        self._drain(0)


class _HeaderArrivals:
    """Waits in a helper thread on posted header receives (settling, on tensor receives too), in
    the order they were posted, so the receiver can ask whether a header is in without blocking:
    gloo's work.is_completed() stays False until someone has called wait(). The interpreter must
    not end while the thread waits in gloo: woken then (a header, the sender gone), the thread
    aborts the process ("terminate called without an active exception"). See Receiver.settle."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._closed = False
        self._thread = threading.Thread(target=self._run, name="transport-headers", daemon=True)
        self._thread.start()

    def watch(self, work) -> Future:
        arrived: Future = Future()
        self._queue.put((work, arrived))
        return arrived

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            self._queue.put(None)

    def join(self, timeout_s: float) -> bool:
        """True once the thread has ended (it waits inside gloo no more)."""
        self._thread.join(max(timeout_s, 0.0))
        return not self._thread.is_alive()

    def _run(self) -> None:
        while (item := self._queue.get()) is not None:
            work, arrived = item
            try:
                work.wait()
            except BaseException as error:  # handed to the receiver, which raises it
                arrived.set_exception(error)
            else:
                arrived.set_result(None)


class _PendingHeader:
    def __init__(self, index: int, src: int, meta_group, arrivals: _HeaderArrivals) -> None:
        self.index, self.src = index, src
        self.header = torch.empty(HEADER_LEN, dtype=torch.int64)
        self.arrived = arrivals.watch(dist.irecv(self.header, src=src, group=meta_group))


class _PendingTensors:
    def __init__(self, features: Features, works: list) -> None:
        self.features, self.works = features, works


_open_receivers: list[Receiver] = []  # those that may have receives posted


def settle_open_receivers(timeout_s: float) -> bool:
    """Receiver.settle for every open receiver, within `timeout_s` in all: True when none is left."""
    deadline = time.monotonic() + timeout_s
    return all([receiver.settle(deadline - time.monotonic()) for receiver in list(_open_receivers)])


class Receiver:
    """Drafter side: receives the micro-batches it consumes, in increasing index order.

    `indices` yields this drafter's micro-batch indices; `source_of(m)` gives the target
    rank that produces m. The tensor receives of micro-batch i+1 are posted before micro-batch
    i is handed out when the header of i+1 is in, else by the first `prefetch()` or `next()`
    that finds it in (double buffering); the header receives run HEADER_LOOKAHEAD ahead.
    """

    def __init__(self, meta_group, data_group, device: torch.device, indices, source_of) -> None:
        self.meta_group, self.data_group, self.device = meta_group, data_group, device
        self.indices = iter(indices)
        self.source_of = source_of
        self.clock = RoleClock(device)  # the caller times its work with `with receiver.clock.busy():`
        self.bytes_received = 0
        self._arrivals = _HeaderArrivals()
        self._headers: deque[_PendingHeader] = deque()  # posted; their tensor receives are not
        self._next_tensors: _PendingTensors | None = None  # posted for the next micro-batch handed out
        self._ended = False  # no more header receives to post (indices exhausted, or end of data read)
        _open_receivers.append(self)
        self._post_headers()

    def _post_headers(self) -> None:
        while not self._ended and len(self._headers) < HEADER_LOOKAHEAD:
            index = next(self.indices, None)
            if index is None:
                self._ended = True
                return
            self._headers.append(
                _PendingHeader(index, self.source_of(index), self.meta_group, self._arrivals)
            )

    def _closed(self) -> None:  # nothing posted any more
        self._ended = True
        self._arrivals.close()
        if self in _open_receivers:
            _open_receivers.remove(self)

    def _wait(self, works) -> None:
        for work in works:
            work.wait()  # NCCL: the current stream waits, not the host; gloo: the host waits

    def _post_tensors(self, pending: _PendingHeader) -> _PendingTensors:
        pending.arrived.result()  # raises what the header receive raised
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
        packed = bool(h[_H_FLAGS] & FLAG_PACKED)
        tokens = torch.empty(batch, token_columns(seq, packed), dtype=torch.int64, device=self.device)
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
            document_ids=unpack_document_ids(tokens, seq),
            end_of_data=end,
            bad_records=h[_H_BAD_RECORDS],
            too_long_records=h[_H_TOO_LONG],
            sender_busy_s=h[_H_SENDER_BUSY_US] / 1e6,
            sender_wait_s=h[_H_SENDER_WAIT_US] / 1e6,
            nbytes=tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size(),
        )
        return _PendingTensors(features, works)

    def _post_next_tensors(self, block: bool) -> None:
        """Post the tensor receives of the next micro-batch once its header is in; with `block`
        False only if it already is (a late header must not hold up the caller's compute)."""
        if self._next_tensors is not None or not self._headers:
            return
        if not block and not self._headers[0].arrived.done():
            return
        self._next_tensors = self._post_tensors(self._headers.popleft())
        if self._next_tensors.features.end_of_data:
            self._ended = True
        else:
            self._post_headers()

    def next(self) -> Features:
        """The next micro-batch for this drafter (end_of_data=True once the stream ends)."""
        self._post_next_tensors(block=True)
        if self._next_tensors is None:
            raise RuntimeError("transport: receive past the end of this drafter's micro-batches")
        current, self._next_tensors = self._next_tensors, None
        self._post_next_tensors(block=False)
        self._wait(current.works)
        self._post_next_tensors(block=False)  # the header may have come in during the wait (gloo)
        self.bytes_received += current.features.nbytes
        if current.features.end_of_data:
            self._closed()
        return current.features

    def prefetch(self) -> None:
        """Post the next micro-batch's tensor receives if its header is in; never blocks.

        Call after launching the compute of the current micro-batch, for the case its header
        was not in when `next()` handed the current one out.
        """
        self._post_next_tensors(block=False)

    def settle(self, timeout_s: float) -> bool:
        """Leaving early (a stop), before the groups go: a gloo receive cannot be cancelled, so see
        each posted one through, its micro-batch received and dropped, or failed as its sender
        left. The senders serve until a send to this rank fails, so the headers still to come
        arrive; their tensors are received, which lets the senders past those sends. True when
        nothing is left posted within `timeout_s`."""
        deadline = time.monotonic() + timeout_s
        left = lambda: max(deadline - time.monotonic(), 0.0)  # noqa: E731
        self._ended = True
        tensors = [self._next_tensors] if self._next_tensors is not None else []
        self._next_tensors = None
        while self._headers and wait_futures([self._headers[0].arrived], timeout=left()).done:
            with contextlib.suppress(Exception):  # the sender left (or sent garbage): nothing comes
                tensors.append(self._post_tensors(self._headers.popleft()))
        for work in (work for pending in tensors for work in pending.works):
            self._arrivals.watch(work)  # the thread waits on them before it ends
        self._arrivals.close()
        settled = not self._headers and self._arrivals.join(left())
        if settled:
            self._closed()
        return settled
