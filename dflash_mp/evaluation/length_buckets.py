"""tau by prompt length: the evaluated prompts grouped by their length in tokens (the context the
drafter starts from), so that a drop past the training length (`data.max_length`) shows.

The edges are the largest prompt length of each bucket: edges 256, 512 give the buckets <= 256,
257-512 and > 512. By default they are the powers of two from 256 below the run's data.max_length,
then data.max_length itself, so that the last bucket holds the prompts longer than any training
sequence; a drafter without its run's config gets powers of two up to its longest prompt.
`--length-buckets` chooses the edges (data.max_length, when known, is added to them). Each bucket
is summarized by the same function as all the prompts together, restricted to its prompts.
"""

from __future__ import annotations

import argparse
import bisect
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

FIRST_EDGE = 256


def parse_edges(text: str) -> tuple[int, ...]:
    """`--length-buckets 512,1024,4096`: increasing positive token counts (argparse `type`; a bad
    value is refused with argparse's usage error, exit code 2)."""
    parts = [part.strip() for part in text.split(",")]
    try:
        edges = tuple(int(part) for part in parts)
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give comma-separated prompt lengths in tokens, e.g. 512,1024,4096"
        ) from None
    if any(edge < 1 for edge in edges):
        raise argparse.ArgumentTypeError(f"{text!r}: every edge must be a token count >= 1")
    if any(a >= b for a, b in zip(edges, edges[1:], strict=False)):
        raise argparse.ArgumentTypeError(f"{text!r}: the edges must increase, e.g. 512,1024,4096")
    return edges


@dataclass(frozen=True)
class LengthBuckets:
    """How prompts are bucketed: the training max_length (None: unknown) and the edges chosen
    with --length-buckets (None: the default)."""

    max_length: int | None = None
    chosen: tuple[int, ...] | None = None

    def edges(self, longest: int) -> list[int]:
        """The edges for prompts of up to `longest` tokens."""
        if self.chosen is not None:
            edges = set(self.chosen)
        elif self.max_length is not None:
            edges = {FIRST_EDGE << k for k in range(32) if FIRST_EDGE << k < self.max_length}
        else:
            edges = {FIRST_EDGE}
            while max(edges) < longest:
                edges.add(2 * max(edges))
        if self.max_length is not None:
            edges.add(self.max_length)
        return sorted(edges)

    def summarize(
        self, lengths: Sequence[int], runs: Sequence[Any], stats: Callable[[Sequence[Any]], dict[str, Any]]
    ) -> dict[str, Any]:
        """The JSON keys of the buckets of prompts of `lengths` tokens decoded as `runs`; `stats`
        gives a bucket's tau and tokens_per_target_forward from its runs, as for all of them."""
        edges = self.edges(max(lengths, default=0))
        members: dict[int, list[Any]] = {}
        for length, run in zip(lengths, runs, strict=True):
            members.setdefault(bucket_index(length, edges), []).append(run)
        buckets = []
        for index in sorted(members):
            low = edges[index - 1] + 1 if index > 0 else 1
            high = edges[index] if index < len(edges) else None
            beyond = self.max_length is not None and low > self.max_length
            summary = stats(members[index])
            buckets.append(
                {
                    "label": bucket_label(low, high),
                    "min_prompt_tokens": low,
                    "max_prompt_tokens": high,
                    "beyond_max_length": beyond,
                    "num_prompts": len(members[index]),
                    "tau": summary["tau"],
                    "tokens_per_target_forward": summary["tokens_per_target_forward"],
                }
            )
        return {
            "training_max_length": self.max_length,
            "length_bucket_edges": edges,
            "length_buckets": buckets,
        }


def bucket_index(length: int, edges: Sequence[int]) -> int:
    """0 for length <= edges[0], i for edges[i-1] < length <= edges[i], len(edges) above the last."""
    return bisect.bisect_left(edges, length)


def bucket_label(low: int, high: int | None) -> str:
    """`<= 256`, `257-512`, `> 3072` (the open bucket above the last edge)."""
    if high is None:
        return f"> {low - 1}"
    return f"<= {high}" if low == 1 else f"{low}-{high}"


def training_length_note(result: dict[str, Any]) -> str:
    """`data.max_length 3072` (or unknown), for the headings of the bucket tables."""
    max_length = result.get("training_max_length")
    return f"data.max_length {'unknown' if max_length is None else max_length}"


BUCKET_HEADER = f"{'prompt tokens':<16}{'prompts':>8}{'tau':>8}{'tok/fwd':>9}"


def bucket_columns(bucket: dict[str, Any]) -> str:
    """A bucket's label, prompts, tau and tokens per target forward under `BUCKET_HEADER`, and
    `> max_length` when its prompts are all longer than the training max_length."""
    return (
        f"{bucket['label']:<16}{bucket['num_prompts']:>8}{bucket['tau']:>8.2f}"
        f"{bucket['tokens_per_target_forward']:>9.2f}"
        + ("   > max_length" if bucket["beyond_max_length"] else "")
    )


def format_buckets(result: dict[str, Any]) -> list[str]:
    """The held-out table's lines for tau by prompt length: a heading, one line per non-empty bucket."""
    if "length_buckets" not in result:
        return []
    lines = [f"  tau by prompt length ({training_length_note(result)})", f"  {BUCKET_HEADER}"]
    return lines + [f"  {bucket_columns(bucket)}" for bucket in result["length_buckets"]]
