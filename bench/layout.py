"""Which rank plays which role: rank r of a 2-rank run plays ROLES[r]; a 1-rank run plays both."""

from __future__ import annotations

ROLES = ("target", "drafter")


def roles_by_rank(world: int) -> dict[str, str]:
    """The header's setup.roles: rank -> role(s), '+'-joined where one rank plays both."""
    if world == 1:
        return {"0": "+".join(ROLES)}
    return {str(r): role for r, role in enumerate(ROLES)}


def rank_of(setup: dict, role: str) -> str:
    """The rank (as a JSON key) that ran `role`, from setup.roles (2-rank layout if absent)."""
    roles = setup.get("roles") or roles_by_rank(2)
    return next(rank for rank, played in roles.items() if role in played.split("+"))
