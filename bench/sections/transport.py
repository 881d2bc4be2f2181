"""The transport alone: dflash_mp.runtime.transport's Sender/Receiver next to raw send/recv of the same size,
between rank 0 (the first target leader) and the first drafter; any other rank idles."""

from __future__ import annotations

import itertools
import time

import torch
import torch.distributed as dist
from benchlib.state import BenchState
from benchlib.timing import GB, GIB, sync

from dflash_mp.runtime.transport import Receiver, Sender, pack_tokens

TIMEOUT_S = 120


def run(bench: BenchState) -> dict:
    args = bench.args
    sender_rank, receiver_rank = 0, bench.first_drafter
    if bench.rank not in (sender_rank, receiver_rank):
        return {}
    shape = (bench.B, bench.S, bench.feature_size)
    batch = bench.reader.read(0)
    tokens = pack_tokens(batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids)
    hidden_bytes = bench.B * bench.S * bench.feature_size * bench.dtype.itemsize
    message_bytes = tokens.numel() * tokens.element_size() + hidden_bytes
    hidden = torch.randn(shape, dtype=bench.dtype, device=bench.device)
    result: dict = {
        "message_shape": list(shape),
        "message_bytes": message_bytes,
        "messages": args.transport_iters,
        "ranks": [sender_rank, receiver_rank],
    }
    if bench.rank == sender_rank:
        result["sender_msgs_per_s"] = args.transport_iters / _send(bench, receiver_rank, tokens, hidden)
    else:
        seconds = _receive(bench, sender_rank, batch.input_ids)
        result.update(
            msgs_per_s=args.transport_iters / seconds,
            gb_per_s=args.transport_iters * message_bytes / seconds / GB,
            gib_per_s=args.transport_iters * message_bytes / seconds / GIB,
            ms_per_msg=seconds / args.transport_iters * 1e3,
        )
    # Raw point-to-point at the hidden-state size, on the same (default) group.
    seconds = _raw_send_recv(bench, sender_rank, receiver_rank, hidden)
    if bench.rank == receiver_rank:
        result.update(
            raw_msgs_per_s=args.transport_iters / seconds,
            raw_gb_per_s=args.transport_iters * hidden_bytes / seconds / GB,
            raw_gib_per_s=args.transport_iters * hidden_bytes / seconds / GIB,
            raw_message_bytes=hidden_bytes,
        )
    return result


def _send(bench: BenchState, receiver_rank: int, tokens: torch.Tensor, hidden: torch.Tensor) -> float:
    """Seconds for the timed messages through the Sender, the end-of-data flag included."""
    total, warmup = bench.args.warmup + bench.args.transport_iters, bench.args.warmup
    sender = Sender(bench.job.meta_group, None, bench.device, bench.cfg.topology.max_inflight_sends)
    t0 = 0.0
    for m in range(total):
        if m == warmup:
            sender.close()
            sync(bench.device)
            t0 = time.perf_counter()
        sender.send_header(receiver_rank, m, 0, bench.B, bench.S, bench.feature_size, bench.dtype, 0)
        sender.send_tensors(receiver_rank, tokens, hidden)
    sender.send_end_of_data(receiver_rank, total)
    sender.close()
    sync(bench.device)
    return time.perf_counter() - t0


def _receive(bench: BenchState, sender_rank: int, sent_ids: torch.Tensor) -> float:
    """Seconds for the timed messages through the Receiver, each checked for its index, the last
    for its tokens, and the end-of-data flag after them."""
    total, warmup = bench.args.warmup + bench.args.transport_iters, bench.args.warmup
    receiver = Receiver(
        bench.job.meta_group,
        None,
        bench.device,
        itertools.chain(range(total), [total]),
        lambda m: sender_rank,
    )
    t0 = 0.0
    for m in range(total):
        if m == warmup:
            sync(bench.device)
            t0 = time.perf_counter()
        features = receiver.next()
        receiver.prefetch()
        if features.end_of_data or features.index != m:
            raise RuntimeError(
                f"transport: got micro-batch {features.index} (end {features.end_of_data}), expected {m}"
            )
    sync(bench.device)
    seconds = time.perf_counter() - t0
    if not receiver.next().end_of_data:
        raise RuntimeError("transport: no end-of-data flag after the last message")
    if not torch.equal(features.input_ids.cpu(), sent_ids):
        raise RuntimeError("transport: received tokens differ from the sent ones")
    return seconds


def _raw_send_recv(bench: BenchState, sender_rank: int, receiver_rank: int, hidden: torch.Tensor) -> float:
    """Seconds for the timed dist.send/recv of a hidden-state-sized tensor."""
    total, warmup = bench.args.warmup + bench.args.transport_iters, bench.args.warmup
    buffer = hidden if bench.rank == sender_rank else torch.empty_like(hidden)
    t0 = 0.0
    for i in range(total):
        if i == warmup:
            sync(bench.device)
            t0 = time.perf_counter()
        if bench.rank == sender_rank:
            dist.send(buffer, dst=receiver_rank)
        else:
            dist.recv(buffer, src=sender_rank)
    sync(bench.device)
    return time.perf_counter() - t0
