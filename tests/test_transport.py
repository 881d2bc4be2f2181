"""Transport over real gloo point-to-point between two processes."""

from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_mp.transport import Receiver, Sender, pack_tokens, unpack_tokens

SHAPES = [(2, 7), (1, 13), (3, 5), (0, 0), (2, 9)]  # (sequences, length); (0, 0): all records were bad
FEATURES = 12


def _micro_batch(m: int, batch: int, seq: int):
    g = torch.Generator().manual_seed(m)
    ids = torch.randint(0, 100, (batch, seq), generator=g)
    mask = torch.randint(0, 2, (batch, seq), generator=g)
    lengths = torch.full((batch,), seq)
    sample_ids = torch.arange(batch) + 10 * m
    hidden = torch.randn(batch, seq, FEATURES, generator=g).to(torch.bfloat16)
    return ids, mask, lengths, sample_ids, hidden


def _worker(rank: int, init_file: str, results, backend: str) -> None:
    device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
    if backend == "nccl":
        torch.cuda.set_device(device)
    kwargs = {"device_id": device} if backend == "nccl" else {}
    dist.init_process_group(backend, init_method=f"file://{init_file}", rank=rank, world_size=2, **kwargs)
    meta = dist.new_group(backend="gloo")  # headers always travel on the CPU
    if rank == 0:
        sender = Sender(meta, None, device, max_inflight=1)
        for m, (batch, seq) in enumerate(SHAPES):
            ids, mask, lengths, sample_ids, hidden = _micro_batch(m, batch, seq)
            sender.send_header(
                1, m, epoch=3, batch=batch, seq=seq, feat=FEATURES, dtype=hidden.dtype, bad=m % 2, too_long=m
            )
            sender.send_tensors(1, pack_tokens(ids, mask, lengths, sample_ids), hidden.to(device))
        sender.send_end_of_data(1, len(SHAPES))
        sender.close()
    else:
        receiver = Receiver(meta, None, device, range(len(SHAPES) + 1), source_of=lambda m: 0)
        for m, (batch, seq) in enumerate(SHAPES):
            got = receiver.next()
            assert got.hidden_states.device == device
            got.input_ids, got.loss_mask, got.lengths, got.sample_ids, got.hidden_states = (
                t.cpu()
                for t in (got.input_ids, got.loss_mask, got.lengths, got.sample_ids, got.hidden_states)
            )
            ids, mask, lengths, sample_ids, hidden = _micro_batch(m, batch, seq)
            assert got.index == m and got.epoch == 3 and not got.end_of_data and got.bad_records == m % 2
            assert got.too_long_records == m
            assert torch.equal(got.input_ids, ids) and torch.equal(got.loss_mask, mask)
            assert torch.equal(got.lengths, lengths) and torch.equal(got.sample_ids, sample_ids)
            assert got.hidden_states.dtype == torch.bfloat16 and torch.equal(got.hidden_states, hidden)
            receiver.prefetch()
        assert receiver.next().end_of_data
        results.put(receiver.bytes_received)
    dist.barrier()
    dist.destroy_process_group()


def _exchange(tmp_path, backend: str) -> None:
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    mp.start_processes(
        _worker, args=(str(tmp_path / "init"), results, backend), nprocs=2, start_method="spawn"
    )
    expected = sum(b * (2 * s + 2) * 8 + b * s * FEATURES * 2 for b, s in SHAPES)
    assert results.get(timeout=5) == expected


def test_micro_batches_of_varying_shapes_arrive_intact(tmp_path):
    _exchange(tmp_path, "gloo")


@pytest.mark.gpu
def test_the_same_transport_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _exchange(tmp_path, "nccl")


def test_token_packing_round_trip():
    ids, mask, lengths, sample_ids, _ = _micro_batch(1, 3, 6)
    back = unpack_tokens(pack_tokens(ids, mask, lengths, sample_ids), 6)
    for a, b in zip(back, (ids, mask, lengths, sample_ids), strict=True):
        assert torch.equal(a, b)
