"""Routing is a pure function of the micro-batch index, and the protocol cannot deadlock."""

import itertools

import pytest

from dflash_mp.runtime.roles import drafter_indices
from dflash_mp.runtime.topology import Role, Topology


@pytest.mark.parametrize("targets,drafters,accum", [(1, 1, 1), (2, 1, 4), (5, 3, 2), (3, 5, 1), (2, 2, 3)])
def test_every_micro_batch_has_one_producer_and_one_consumer(targets, drafters, accum):
    topo = Topology(targets, drafters, accum)
    steps = 4
    total = steps * topo.micro_batches_per_step
    produced = sorted(
        itertools.chain.from_iterable(topo.micro_batches_of_target(t, 0, total) for t in range(targets))
    )
    assert produced == list(range(total))
    consumed = sorted(
        m for d in range(drafters) for s in range(steps) for m in topo.micro_batches_of_drafter(d, s)
    )
    assert consumed == list(range(total))
    for m in range(total):
        assert m in topo.micro_batches_of_target(topo.target_rank(m), 0, total)
        assert topo.role_of(topo.target_rank(m)) is Role.TARGET
        assert topo.role_of(topo.drafter_rank(m)) is Role.DRAFTER


def test_a_step_holds_the_same_micro_batches_whatever_the_split():
    """1 drafter x accum 4 and 2 drafters x accum 2 train on the same micro-batches per step."""
    one = Topology(1, 1, 4)
    two = Topology(3, 2, 2)
    for step in range(5):
        a = set(one.micro_batches_of_drafter(0, step))
        b = set(two.micro_batches_of_drafter(0, step)) | set(two.micro_batches_of_drafter(1, step))
        assert a == b


def test_resume_starts_targets_where_the_checkpoint_left():
    topo = Topology(2, 1, 3)
    start, stop = 2 * topo.micro_batches_per_step, 5 * topo.micro_batches_per_step
    got = sorted(
        itertools.chain(
            topo.micro_batches_of_target(0, start, stop), topo.micro_batches_of_target(1, start, stop)
        )
    )
    assert got == list(range(start, stop))


def _simulate(topo: Topology, steps: int, max_inflight: int) -> bool:
    """Discrete simulation of the protocol: True when every rank finishes.

    Targets post sends in index order and block once more than `max_inflight` are
    unreceived; drafters receive in index order and meet in an all-reduce after each step.
    """
    total = steps * topo.micro_batches_per_step
    end = topo.end_of_data_indices(total)
    leaders = [t for t in range(topo.targets) if topo.is_replica_leader(t)]  # the senders
    producer_queue = {
        t: list(topo.micro_batches_of_target(t, 0, total))
        + sorted(m for m in end.values() if topo.target_rank(m) == t)
        for t in leaders
    }
    consumer_queue = {d: list(drafter_indices(topo, d, 0, steps)) for d in range(topo.drafters)}
    posted: set[int] = set()
    unreceived = {t: [] for t in leaders}
    received_in_step = dict.fromkeys(range(topo.drafters), 0)
    at_barrier: set[int] = set()
    progress = True
    while progress:
        progress = False
        for t, queue in producer_queue.items():
            unreceived[t] = [m for m in unreceived[t] if m in posted]
            if queue and len(unreceived[t]) <= max_inflight:
                m = queue.pop(0)
                posted.add(m)
                unreceived[t].append(m)
                progress = True
        for d, queue in consumer_queue.items():
            if d in at_barrier or not queue or queue[0] not in posted:
                continue
            posted.discard(queue.pop(0))
            progress = True
            if len(queue) > 0:  # the last index is the end-of-data flag: no step follows it
                received_in_step[d] += 1
                if received_in_step[d] == topo.grad_accum:
                    at_barrier.add(d)
        if len(at_barrier) == topo.drafters:
            at_barrier.clear()
            received_in_step = dict.fromkeys(range(topo.drafters), 0)
            progress = True
    return all(not q for q in producer_queue.values()) and all(not q for q in consumer_queue.values())


@pytest.mark.parametrize("targets", [1, 2, 3, 5])
@pytest.mark.parametrize("drafters", [1, 2, 3])
@pytest.mark.parametrize("accum", [1, 2, 3])
@pytest.mark.parametrize("max_inflight", [1, 2])
def test_protocol_never_deadlocks(targets, drafters, accum, max_inflight):
    assert _simulate(Topology(targets, drafters, accum), steps=3, max_inflight=max_inflight)


@pytest.mark.parametrize("targets,parallel", [(2, 2), (4, 2), (6, 3), (4, 4)])
@pytest.mark.parametrize("drafters,accum", [(1, 2), (3, 1)])
def test_replicas_route_like_single_rank_targets(targets, parallel, drafters, accum):
    """R replicas of k ranks produce what R one-rank targets would, each sent by its leader."""
    topo = Topology(targets, drafters, accum, target_parallel=parallel)
    plain = Topology(targets // parallel, drafters, accum)
    assert topo.replicas == targets // parallel
    total = 4 * topo.micro_batches_per_step
    for m in range(total):
        leader = topo.target_rank(m)
        assert topo.is_replica_leader(leader)
        assert leader == plain.target_rank(m) * parallel
        assert topo.drafter_rank(m) == plain.drafter_rank(m) + targets - plain.targets
    for rank in range(targets):
        replica = topo.replica_of(rank)
        assert rank in topo.replica_ranks(replica)
        # Every rank of a replica computes the same micro-batches as the replica's leader.
        assert topo.micro_batches_of_target(rank, 3, total) == plain.micro_batches_of_target(
            replica, 3, total
        )
    assert [r for r in range(topo.world_size) if topo.is_replica_leader(r)] == list(
        range(0, targets, parallel)
    )
    assert topo.replica_ranks(topo.replicas - 1)[-1] == targets - 1


def test_a_split_that_does_not_divide_the_targets_is_refused():
    with pytest.raises(
        ValueError, match="topology.targets=3 is not a multiple of topology.target_parallel=2"
    ):
        Topology(3, 1, 1, target_parallel=2)


@pytest.mark.parametrize("targets,parallel", [(2, 2), (6, 2), (6, 3)])
@pytest.mark.parametrize("drafters", [1, 2])
def test_replicas_never_deadlock(targets, parallel, drafters):
    """The simulation runs the leaders (the only senders): replicas compute in lockstep with them."""
    topo = Topology(targets, drafters, 2, target_parallel=parallel)
    assert _simulate(topo, steps=3, max_inflight=1)
