"""Transport over real gloo point-to-point between two processes, and its ordering and
backpressure rules over an in-process stand-in for torch.distributed's point-to-point calls."""

from __future__ import annotations

import contextlib
import os
import threading
import time
import weakref
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.runtime import roles, transport
from dflash_mp.runtime.topology import Topology
from dflash_mp.runtime.transport import Receiver, Sender, pack_tokens, unpack_tokens
from tests import spawn_pool

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
    """Gloo: two processes forked from tests/spawn_pool.py's forkserver; NCCL: spawned ones."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    init = str(tmp_path / "init")
    if backend == "gloo":
        results = spawn_pool.context().Queue()
        spawn_pool.start_processes(_worker, args=(init, results, backend), nprocs=2)
    else:
        results = mp.get_context("spawn").Queue()
        mp.start_processes(_worker, args=(init, results, backend), nprocs=2, start_method="spawn")
    expected = sum(b * (2 * s + 2) * 8 + b * s * FEATURES * 2 for b, s in SHAPES)
    assert results.get(timeout=5) == expected


def test_micro_batches_of_varying_shapes_arrive_intact(tmp_path):
    _exchange(tmp_path, "gloo")


@pytest.mark.gpu
def test_the_same_transport_over_nccl(tmp_path):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    _exchange(tmp_path, "nccl")


class _SlowTeardown:
    """Freed with this module's globals in the interpreter's teardown, which it stretches as a loaded
    machine does: what the target does next (a header, its exit) lands in it."""

    def __del__(self) -> None:
        time.sleep(1.5)


_slow_teardown = None


def _leaving_worker(rank: int, init_file: str, target: str, exited: str) -> None:
    """Rank 0 serves micro-batches; rank 1 takes three, then leaves as a stopped drafter rank does."""
    global _slow_teardown
    import atexit

    from dflash_mp.launch import rank as rank_program
    from dflash_mp.runtime import distributed

    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2)
    meta = dist.new_group(backend="gloo")
    if rank == 0:
        sender = Sender(meta, None, torch.device("cpu"), max_inflight=1)
        ids, mask, lengths, sample_ids, hidden = _micro_batch(0, 2, 7)
        with contextlib.suppress(RuntimeError):  # the drafter left
            for m in range(1000):
                if target == "hung" and m == 4:  # until the drafter has exited, then this process ends
                    while not os.path.exists(exited):
                        time.sleep(0.05)
                    time.sleep(0.3)
                    return
                time.sleep(0.2)  # the forward: the drafter waits on every header
                sender.send_header(1, m, epoch=0, batch=2, seq=7, feat=FEATURES, dtype=hidden.dtype, bad=0)
                sender.send_tensors(1, pack_tokens(ids, mask, lengths, sample_ids), hidden)
        return
    receiver = Receiver(meta, None, torch.device("cpu"), range(1000), source_of=lambda m: 0)
    for _ in range(3):  # then a stop, with receives posted for headers the target has not sent yet
        receiver.next()
    _slow_teardown = _SlowTeardown()
    atexit.register(lambda: open(exited, "w").close())
    distributed.LEAVE_TIMEOUT_S = 1.0
    rank_program._exit_early(0)


@pytest.mark.parametrize("target", ["serving", "hung"])
def test_a_drafter_that_leaves_mid_stream_ends_without_aborting(tmp_path, target):
    """A drafter leaves (a stop request) with header receives posted; the target's next header, or
    its exit, comes while the drafter's interpreter tears down. No abort from the thread that waits
    on them: the drafter sees them through, or, its target hung, exits after its exit handlers
    without the interpreter's teardown."""
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    exited = tmp_path / "exited"
    # Raises ProcessExitedException ("terminated with signal SIGABRT") on an abort.
    mp.start_processes(
        _leaving_worker, args=(str(tmp_path / "init"), target, str(exited)), nprocs=2, start_method="spawn"
    )
    assert exited.exists()  # the drafter ran its exit handlers (its heartbeat's "exited" mark)


def test_token_packing_round_trip():
    ids, mask, lengths, sample_ids, _ = _micro_batch(1, 3, 6)
    back = unpack_tokens(pack_tokens(ids, mask, lengths, sample_ids), 6)
    for a, b in zip(back, (ids, mask, lengths, sample_ids), strict=True):
        assert torch.equal(a, b)


# ----------------------------------------------------------------------------- in-process stand-in

META = "meta"  # the header group; the data group is None (the default group), as in roles.py


class Loopback:
    """torch.distributed's isend/irecv between one sender and one receiver in this process: the
    k-th receive posted on a group gets a copy of the k-th tensor sent on it. A send completes at
    once; a receive's wait() blocks until its send exists. `events` logs what happens, in order."""

    def __init__(self) -> None:
        self.sent: dict = defaultdict(list)
        self.receives: dict = defaultdict(int)
        self.ready = threading.Condition()
        self.events: list[tuple] = []
        self.header_waits: list[threading.Event] = []  # set once the header receive was waited

    def isend(self, tensor, dst, group):
        with self.ready:
            self.sent[group].append(tensor.clone())
            self.ready.notify_all()
        kind = "header" if group == META else "data"
        number = len(self.sent[group]) - 1
        # Two data messages (tokens, hidden) per micro-batch.
        micro_batch = number if kind == "header" else number // 2
        return SimpleNamespace(wait=lambda: self.events.append(("wait", kind, micro_batch)))

    def irecv(self, tensor, src, group):
        number = self.receives[group]
        self.receives[group] += 1
        self.events.append(("post", "header" if group == META else "data", number))
        waited = threading.Event()
        if group == META:
            self.header_waits.append(waited)

        def wait():
            with self.ready:
                if not self.ready.wait_for(lambda: len(self.sent[group]) > number, timeout=10):
                    raise TimeoutError(f"nothing sent for receive {number} on group {group}")
                tensor.copy_(self.sent[group][number])
            waited.set()

        return SimpleNamespace(wait=wait)

    def headers_waited(self) -> None:
        """Until every header receive posted so far has been waited on (by the receiver's thread;
        at most a few seconds, so that a receiver that waits on them itself fails the test below
        on its order, not here)."""
        for waited in list(self.header_waits):
            waited.wait(timeout=2)
        time.sleep(0.05)  # the thread hands the result over right after wait() returns


@pytest.fixture
def loopback(monkeypatch) -> Loopback:
    fake = Loopback()
    monkeypatch.setattr(transport, "dist", SimpleNamespace(isend=fake.isend, irecv=fake.irecv))
    return fake


def _send(sender: Sender, m: int, dst: int = 1) -> None:
    batch, seq = 2, 5
    ids, mask, lengths, sample_ids, hidden = _micro_batch(m, batch, seq)
    sender.send_header(dst, m, 0, batch, seq, FEATURES, hidden.dtype, 0)
    sender.send_tensors(dst, pack_tokens(ids, mask, lengths, sample_ids), hidden)


def _waits(fake: Loopback) -> list[tuple]:
    return [event[1:] for event in fake.events if event[0] == "wait"]


def test_only_tensor_sends_count_against_max_inflight(loopback):
    sender = Sender(META, None, torch.device("cpu"), max_inflight=2)
    for m in range(3):
        sender.send_header(1, m, 0, 1, 1, FEATURES, torch.bfloat16, 0)
    assert _waits(loopback) == [] and sender.data_sends_in_flight == 0  # headers never make it wait
    loopback.sent.clear()
    sender = Sender(META, None, torch.device("cpu"), max_inflight=2)
    _send(sender, 0)
    _send(sender, 1)
    assert _waits(loopback) == [] and sender.data_sends_in_flight == 2
    _send(sender, 2)  # a third outstanding: the oldest (and its header, long received) is waited
    assert _waits(loopback) == [("header", 0), ("data", 0), ("data", 0)]
    assert sender.data_sends_in_flight == 2
    sender.close()
    assert sender.data_sends_in_flight == 0 and len(_waits(loopback)) == 9


def test_max_inflight_1_keeps_one_tensor_send_outstanding(loopback):
    sender = Sender(META, None, torch.device("cpu"), max_inflight=1)
    _send(sender, 0)
    assert _waits(loopback) == [] and sender.data_sends_in_flight == 1
    _send(sender, 1)
    assert _waits(loopback) == [("header", 0), ("data", 0), ("data", 0)]
    assert sender.data_sends_in_flight == 1


class RecordingTrainer:
    """What run_drafter drives, logging each micro-step into the loopback's event log."""

    def __init__(self, fake: Loopback, during_micro_step=None) -> None:
        self.fake, self.during_micro_step = fake, during_micro_step
        self.step = 0
        self.stop_agreed = False
        self.computed: list[int] = []

    def micro_step(self, batch, last_of_step: bool) -> None:
        self.fake.events.append(("compute", batch.index))
        self.computed.append(batch.index)
        ids, mask, lengths, sample_ids, hidden = _micro_batch(batch.index, 2, 5)
        assert torch.equal(batch.input_ids, ids) and torch.equal(batch.hidden_states, hidden)
        if self.during_micro_step is not None:
            self.during_micro_step(batch.index)

    def prepare(self, batch):
        self.fake.events.append(("prepare", batch.index))
        return batch

    def optimizer_step(self, while_waiting=None) -> dict:
        self.fake.events.append(("update queued", self.step))
        if while_waiting is not None:  # as DrafterTrainer: once the update is queued
            while_waiting()
        self.step += 1
        self.fake.events.append(("read back", self.step))
        return {"step": self.step}


def _drafter_job(cfg) -> SimpleNamespace:
    topology = Topology(targets=1, drafters=1, grad_accum=cfg.train.grad_accum)
    return SimpleNamespace(
        topology=topology, meta_group=META, device=torch.device("cpu"), drafter_index=0, drafter_group=None
    )


def test_the_receives_of_the_next_micro_batch_are_posted_before_the_current_one_is_computed(loopback):
    cfg = to_dataclass(compose_config(["train.grad_accum=2"]))
    steps = 3
    sender = Sender(META, None, torch.device("cpu"), max_inflight=100)
    for m in range(steps * 2):  # the target is ahead: everything is sent before the drafter starts
        _send(sender, m)
    sender.send_end_of_data(1, steps * 2)
    # Each "compute" lasts until the headers posted so far are in, as a real step would.
    trainer = RecordingTrainer(loopback, during_micro_step=lambda m: loopback.headers_waited())
    roles.run_drafter(cfg, _drafter_job(cfg), trainer, 0, steps, on_step=lambda record: None)
    assert trainer.computed == list(range(steps * 2))
    events = loopback.events
    # The k-th data receive pair is micro-batch k (one drafter, all indices in order).
    posted = {number // 2: events.index(("post", "data", number)) for number in range(0, 4 * steps, 2)}
    computed = {m: events.index(("compute", m)) for m in range(steps * 2)}
    # The first header can only be in after the first micro-batch was handed out; from then on
    # the transfer of m+1 is posted before m is computed, so it overlaps that compute.
    for m in range(1, steps * 2 - 1):
        assert posted[m + 1] < computed[m], (m, events)
    assert all(posted[m] < computed[m] for m in range(steps * 2))
    # The next step's first micro-batch is handed out and prepared while the update runs.
    for step in range(steps - 1):
        first = events.index(("prepare", 2 * (step + 1)))
        assert events.index(("update queued", step)) < first < events.index(("read back", step + 1))


def test_a_late_header_does_not_hold_up_the_compute_of_the_micro_batch_before_it(loopback):
    cfg = to_dataclass(compose_config(["train.grad_accum=2"]))
    steps, total = 2, 4
    sender = Sender(META, None, torch.device("cpu"), max_inflight=100)
    _send(sender, 0)

    def target_lags_one_behind(m: int) -> None:
        # The target produces m+1 only while the drafter computes m: a receiver that waited for
        # header m+1 before handing out m would never get here (the loopback times out).
        if m + 1 < total:
            _send(sender, m + 1)
        else:
            sender.send_end_of_data(1, total)

    trainer = RecordingTrainer(loopback, during_micro_step=target_lags_one_behind)
    roles.run_drafter(cfg, _drafter_job(cfg), trainer, 0, steps, on_step=lambda record: None)
    assert trainer.computed == list(range(total))


@pytest.mark.gpu
def test_a_cuda_send_leaves_the_compute_stream_free_and_holds_its_tensors_until_it_completed(monkeypatch):
    class Transfer:
        """An NCCL send as the sender sees it: wait() makes the current stream wait for the
        transfer, here a spin of about a second on the GPU."""

        def wait(self) -> None:
            torch.cuda._sleep(1_000_000_000)

    instant = SimpleNamespace(wait=lambda: None)
    sends = lambda tensor, dst, group: instant if group == META else Transfer()  # noqa: E731
    monkeypatch.setattr(transport, "dist", SimpleNamespace(isend=sends))
    device = torch.device("cuda")
    sender = Sender(META, None, device, max_inflight=1)
    tokens = torch.zeros(2, 12, dtype=torch.long)
    hidden = torch.randn(2, 5, FEATURES, device=device)
    first_hidden = weakref.ref(hidden)
    sender.send_header(1, 0, 0, 2, 5, FEATURES, hidden.dtype, 0)
    sender.send_tensors(1, tokens, hidden)
    del hidden
    first_done = sender.inflight[-1].done
    compute = torch.cuda.Event()
    compute.record()  # on the compute stream, after the send was issued
    compute.synchronize()
    assert not first_done.query()  # the transfer still runs: the compute stream did not wait for it
    assert first_hidden() is not None  # so its memory must not go back to the allocator yet
    sender.send_header(1, 1, 0, 2, 5, FEATURES, torch.float32, 0)
    sender.send_tensors(1, tokens, torch.randn(2, 5, FEATURES, device=device))
    # Two outstanding with max_inflight=1: the host waited for the first, then let it go.
    assert first_done.query() and first_hidden() is None and sender.data_sends_in_flight == 1
    sender.close()
    assert sender.data_sends_in_flight == 0
