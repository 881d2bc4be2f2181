"""Roles, routing and process groups.

Routing is a pure function of the global micro-batch index m and the topology, so every
rank knows who produces and who consumes each micro-batch without talking, and everyone
walks m in increasing order (no deadlock: a rank only ever waits on a smaller m, or on the
same step's all-reduce whose inputs all have smaller m than anything it holds back).

Optimizer step s consumes micro-batches [s*A*D, (s+1)*A*D): drafter d takes the A
consecutive ones starting at s*A*D + d*A. The target that produces m is m mod T. Neither
choice changes which samples form a step, so the training math is the same for any T.

The colocated layout (topology.layout=colocated) is the topology with T = 0: every rank is a
drafter that reads and runs the target for its own micro-batches, with the same routing of
micro-batches to drafters, so it trains as the split with as many drafter ranks.

With `target_parallel=k`, the T target ranks form T/k replicas of k ranks each (replica r:
ranks [r*k, (r+1)*k)), which run one tensor-parallel forward together. Routing counts
replicas: replica m mod (T/k) produces m, and its first rank (the leader) sends it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

from dflash_mp.config.validation import target_parallel_problems


class Role(str, Enum):
    TARGET = "target"
    DRAFTER = "drafter"
    COLOCATED = "colocated"  # target forward and drafter step in the same process


@dataclass(frozen=True)
class Topology:
    targets: int
    drafters: int
    grad_accum: int
    # Target ranks per target replica (one tensor-parallel group); divides `targets`.
    target_parallel: int = 1

    def __post_init__(self) -> None:
        problems = target_parallel_problems(self.targets, self.target_parallel)
        if problems:
            raise ValueError("; ".join(problems))

    @property
    def world_size(self) -> int:
        return self.targets + self.drafters

    @property
    def micro_batches_per_step(self) -> int:
        return self.drafters * self.grad_accum

    @property
    def colocated(self) -> bool:
        """No target ranks: every rank runs the target for the micro-batches it trains on."""
        return self.targets == 0

    def role_of(self, rank: int) -> Role:
        if self.colocated:
            return Role.COLOCATED
        return Role.TARGET if rank < self.targets else Role.DRAFTER

    @property
    def replicas(self) -> int:
        """Target replicas: groups of `target_parallel` ranks that each hold the whole target."""
        return self.targets // self.target_parallel

    def replica_of(self, rank: int) -> int:
        """The replica a target rank belongs to."""
        return rank // self.target_parallel

    def replica_ranks(self, replica: int) -> list[int]:
        """Global ranks of `replica`, its leader first."""
        first = replica * self.target_parallel
        return list(range(first, first + self.target_parallel))

    def is_replica_leader(self, rank: int) -> bool:
        """True for the target rank that sends its replica's micro-batches."""
        return rank < self.targets and rank % self.target_parallel == 0

    def target_rank(self, m: int) -> int:
        """Global rank of the target that sends micro-batch m: the leader of replica m mod replicas."""
        return (m % self.replicas) * self.target_parallel

    def drafter_index(self, m: int) -> int:
        """Index (0..D-1) among drafters of the one that consumes micro-batch m."""
        return (m % self.micro_batches_per_step) // self.grad_accum

    def drafter_rank(self, m: int) -> int:
        return self.targets + self.drafter_index(m)

    def micro_batches_of_drafter(self, drafter_index: int, step: int) -> range:
        """The micro-batch indices drafter `drafter_index` consumes in optimizer step `step`."""
        start = step * self.micro_batches_per_step + drafter_index * self.grad_accum
        return range(start, start + self.grad_accum)

    def micro_batches_of_target(self, target_rank: int, start: int, stop: int) -> range:
        """The indices in [start, stop) that target `target_rank` computes (with the rest of its
        replica), in increasing order."""
        replica = self.replica_of(target_rank)
        first = start + (replica - start) % self.replicas
        return range(first, stop, self.replicas)

    def end_of_data_indices(self, total: int) -> dict[int, int]:
        """For each drafter index, the index m >= total whose header tells it the data ended.

        `total` is a multiple of micro_batches_per_step (whole steps), so drafter d's next
        index would be total + d*A; the target that would produce it sends the flag.
        """
        return {d: total + d * self.grad_accum for d in range(self.drafters)}
