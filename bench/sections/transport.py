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
    total, warmup = args.warmup + args.transport_iters, args.warmup
    shape = (bench.B, bench.S, bench.feature_size)
    batch = bench.reader.read(0)
    tokens = pack_tokens(batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids)
    message_bytes = (
        tokens.numel() * tokens.element_size() + bench.B * bench.S * bench.feature_size * bench.dtype.itemsize
    )
    hidden_bytes = bench.B * bench.S * bench.feature_size * bench.dtype.itemsize
    hidden = torch.randn(shape, dtype=bench.dtype, device=bench.device)
    result: dict = {
        "message_shape": list(shape),
        "message_bytes": message_bytes,
        "messages": args.transport_iters,
        "ranks": [sender_rank, receiver_rank],
    }
    t0 = t1 = 0.0
    if bench.rank == sender_rank:
        sender = Sender(bench.job.meta_group, None, bench.device, bench.cfg.topology.max_inflight_sends)
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
        t1 = time.perf_counter()
        result["sender_msgs_per_s"] = args.transport_iters / (t1 - t0)
    else:
        receiver = Receiver(
            bench.job.meta_group,
            None,
            bench.device,
            itertools.chain(range(total), [total]),
            lambda m: sender_rank,
        )
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
        t1 = time.perf_counter()
        if not receiver.next().end_of_data:
            raise RuntimeError("transport: no end-of-data flag after the last message")
        if not torch.equal(features.input_ids.cpu(), batch.input_ids):
            raise RuntimeError("transport: received tokens differ from the sent ones")
        seconds = t1 - t0
        result.update(
            msgs_per_s=args.transport_iters / seconds,
            gb_per_s=args.transport_iters * message_bytes / seconds / GB,
            gib_per_s=args.transport_iters * message_bytes / seconds / GIB,
            ms_per_msg=seconds / args.transport_iters * 1e3,
        )
    # Raw point-to-point at the hidden-state size, on the same (default) group.
    buffer = (
        hidden if bench.rank == sender_rank else torch.empty(shape, dtype=bench.dtype, device=bench.device)
    )
    for i in range(total):
        if i == warmup:
            sync(bench.device)
            t0 = time.perf_counter()
        if bench.rank == sender_rank:
            dist.send(buffer, dst=receiver_rank)
        else:
            dist.recv(buffer, src=sender_rank)
    sync(bench.device)
    seconds = time.perf_counter() - t0
    if bench.rank == receiver_rank:
        result.update(
            raw_msgs_per_s=args.transport_iters / seconds,
            raw_gb_per_s=args.transport_iters * hidden_bytes / seconds / GB,
            raw_gib_per_s=args.transport_iters * hidden_bytes / seconds / GIB,
            raw_message_bytes=hidden_bytes,
        )
    return result
