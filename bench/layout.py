"""Which rank plays which role: `--targets T --drafters D --target-parallel k` over WORLD_SIZE ranks.

Ranks [0, T) are target ranks, in replicas of k consecutive ranks (one tensor-parallel forward
each, its first rank the leader); ranks [T, T+D) are drafter ranks (DDP among themselves when
D > 1), as dflash_mp.runtime.topology.Topology lays out a training job. D = 0 is a target-only run (e.g.
one TP=2 replica on 2 GPUs: the target sections and colocated). A 1-rank run plays both roles in
its one process (no pipeline, no transport).
"""

from __future__ import annotations

from dataclasses import dataclass

ROLES = ("target", "drafter")


class LayoutError(ValueError):
    """A layout that does not fit the launched ranks; the message names the flags to change."""


@dataclass(frozen=True)
class Layout:
    targets: int
    drafters: int
    target_parallel: int = 1
    # One process plays both roles (WORLD_SIZE 1).
    single: bool = False

    @property
    def world(self) -> int:
        return 1 if self.single else self.targets + self.drafters

    @property
    def replicas(self) -> int:
        return self.targets // self.target_parallel

    @property
    def first_drafter(self) -> int:
        return 0 if self.single else self.targets

    @property
    def name(self) -> str:
        """ "1t1d", "2t2d (TP=2)", or "1 rank" for the single-process run."""
        if self.single:
            return "1 rank"
        tp = f" (TP={self.target_parallel})" if self.target_parallel > 1 else ""
        return f"{self.targets}t{self.drafters}d{tp}"

    def roles_of(self, rank: int) -> set[str]:
        if self.single:
            return set(ROLES)
        return {"target"} if rank < self.targets else {"drafter"}

    def replica_of(self, rank: int) -> int:
        return 0 if self.single else rank // self.target_parallel

    def replica_ranks(self, replica: int) -> list[int]:
        first = replica * self.target_parallel
        return list(range(first, first + self.target_parallel))

    def is_leader(self, rank: int) -> bool:
        """The first rank of a target replica (the one that sends; the single rank too)."""
        return self.single or (rank < self.targets and rank % self.target_parallel == 0)

    def roles_by_rank(self) -> dict[str, str]:
        """The header's setup.roles: rank -> role(s), '+'-joined where one rank plays both."""
        return {
            str(r): "+".join(role for role in ROLES if role in self.roles_of(r)) for r in range(self.world)
        }

    def describe(self) -> dict:
        return {
            "name": self.name,
            "targets": self.targets,
            "drafters": self.drafters,
            "target_parallel": self.target_parallel,
            "replicas": [self.replica_ranks(r) for r in range(self.replicas)] if not self.single else [[0]],
            "drafter_ranks": [self.first_drafter + d for d in range(self.drafters)]
            if not self.single
            else [0],
            "single_process": self.single,
        }


def resolve_layout(world: int, targets: int | None, drafters: int | None, target_parallel: int) -> Layout:
    """The layout of `world` ranks from the flags (None: not given); LayoutError if they do not fit.

    Defaults: 1 rank plays both roles; otherwise one target replica of `target_parallel` ranks
    (1 + 1 on 2 ranks) and the remaining ranks drafters (none when the replica takes them all).
    """
    if target_parallel < 1:
        raise LayoutError(f"--target-parallel {target_parallel}: must be >= 1 (1: one rank per target)")
    if world == 1:
        if (targets, drafters) not in ((None, None), (1, 1)) or target_parallel != 1:
            raise LayoutError(
                f"WORLD_SIZE=1 runs both roles in one process; --targets {targets} --drafters {drafters} "
                f"--target-parallel {target_parallel} needs more ranks: launch torchrun with "
                "--nproc-per-node equal to targets + drafters"
            )
        return Layout(1, 1, 1, single=True)
    if targets is None:
        targets = world - drafters if drafters is not None else target_parallel
    if drafters is None:
        drafters = world - targets
    problems = []
    if targets < 1 or drafters < 0:
        problems.append(
            f"--targets {targets} --drafters {drafters}: a layout needs at least one target rank "
            "(and no negative counts)"
        )
    if targets + drafters != world:
        problems.append(
            f"--targets {targets} + --drafters {drafters} = {targets + drafters} ranks, but "
            f"WORLD_SIZE={world}: launch torchrun with --nproc-per-node {targets + drafters} "
            f"(make bench BENCH_RANKS={targets + drafters}) or change the counts"
        )
    if targets >= 1 and targets % target_parallel:
        problems.append(
            f"--targets {targets} is not a multiple of --target-parallel {target_parallel} "
            f"(each target replica takes {target_parallel} ranks)"
        )
    if problems:
        raise LayoutError("; ".join(problems))
    return Layout(targets, drafters, target_parallel)


def roles_by_rank(world: int) -> dict[str, str]:
    """setup.roles of the default layout on `world` ranks (1: both roles; 2: target, drafter)."""
    return resolve_layout(world, None, None, 1).roles_by_rank()


def rank_of(setup: dict, role: str) -> str:
    """The first rank (as a JSON key) that ran `role`, from setup.roles (2-rank layout if absent);
    None when no rank did (a target-only run has no drafter)."""
    roles = setup.get("roles") or roles_by_rank(2)
    return next((rank for rank, played in roles.items() if role in played.split("+")), None)


def layout_of(setup: dict) -> dict:
    """setup.layout, or what a JSON written before it had (1 + 1, or 1 rank for both roles)."""
    if setup.get("layout"):
        return setup["layout"]
    world = setup.get("world_size", 2)
    return resolve_layout(world, None, None, 1).describe()
