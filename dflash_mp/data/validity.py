"""The preflight's full pass: every record decoded and checked for an accepted format, no tokenizer.

Tokenizing is what makes reading data slow, and a sample of it says how records render; but a
malformed line is found only by reading it, so the preflight reads them all (up to FULL_PASS_LIMIT
records): UTF-8, JSON and the record format, exactly as training checks them before tokenizing
(dflash_mp.data.records). A JSONL file is read front to back in one go, not record by record.
"""

from __future__ import annotations

import math
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import Any

from dflash_mp.data.errors import BadRecord
from dflash_mp.data.order import JsonlIndex
from dflash_mp.data.records import RecordError, decode_line, parse_json, to_record

# Records the full pass reads at most (200k chat records of 2.3 KB, 454 MiB, take 2.2 s on one
# core); beyond it the report says how many were left to the sample.
FULL_PASS_LIMIT = 2_000_000
EXAMPLES_PER_REASON = 3


def check_record(raw: bytes, path: str, line: int) -> BadRecord | None:
    """Why a record cannot be used before it is tokenized (None: it may be)."""
    try:
        to_record(parse_json(decode_line(raw)))
    except RecordError as e:
        return BadRecord(path, line, str(e), e.kind)
    except Exception as e:  # what parse_record calls a record it cannot render
        return BadRecord(path, line, f"{type(e).__name__}: {e}", "cannot render")
    return None


@dataclass
class FullPass:
    """Bad records among the first `checked` of `total` records (all of them unless bounded)."""

    total: int
    checked: int = 0
    bad: Counter = field(default_factory=Counter)  # kind -> count
    examples: dict[str, list[str]] = field(default_factory=dict)  # kind -> "file:line: reason", ...
    bad_ids: set[int] = field(default_factory=set)
    seconds: float = 0.0
    source: str = "decoded and checked for a record format"

    def add_bad(self, record_id: int, bad: BadRecord) -> None:
        self.bad[bad.kind] += 1
        self.bad_ids.add(record_id)
        examples = self.examples.setdefault(bad.kind, [])
        if len(examples) < EXAMPLES_PER_REASON:
            examples.append(str(bad) if not examples else f"{bad.path}:{bad.line}")

    @property
    def bad_count(self) -> int:
        return sum(self.bad.values())

    @property
    def complete(self) -> bool:
        return self.checked == self.total

    @property
    def bad_fraction(self) -> float:
        return self.bad_count / max(self.checked, 1)

    def summary(self) -> list[str]:
        what = f"all {self.total}" if self.complete else f"the first {self.checked} of {self.total}"
        bounded = (
            ""
            if self.complete
            else f" (the full pass stops at {FULL_PASS_LIMIT} records; the rest are judged by the sample)"
        )
        lines = [
            f"full pass: {what} records {self.source} in {self.seconds:.1f} s: "
            f"{self.bad_count} bad ({self.bad_fraction:.1%}){bounded}"
        ]
        for kind, count in self.bad.most_common():
            first, *others = self.examples.get(kind) or ["(see the job's log)"]
            also = f" (also {', '.join(others)})" if others else ""
            lines.append(f"bad: {count} ({kind}), e.g. {first}{also}")
        return lines


def full_pass(index: Any, limit: int = FULL_PASS_LIMIT) -> FullPass:
    """Every record (the first `limit`) of `index` checked by check_record."""
    started = time.monotonic()
    result = FullPass(total=len(index), checked=min(len(index), limit))
    records = _jsonl_records(index) if isinstance(index, JsonlIndex) else _indexed_records(index)
    for record_id, (path, line, raw) in enumerate(records):
        if record_id >= result.checked:
            break
        bad = check_record(raw, path, line)
        if bad is not None:
            result.add_bad(record_id, bad)
    result.seconds = time.monotonic() - started
    return result


def _indexed_records(index: Any) -> Any:
    for i in range(len(index)):
        yield index.read_bytes(i)


def _jsonl_records(index: JsonlIndex) -> Any:
    """The records of a JsonlIndex in order, read sequentially (its rule for blank lines)."""
    for path in index.paths:
        with open(path, "rb") as f:
            for line_number, line in enumerate(f, start=1):
                if line.removeprefix(b"\xef\xbb\xbf").strip():
                    yield path, line_number, line


def upper_bound(bad: int, n: int, z: float = 1.96) -> float:
    """The Wilson score interval's upper end for a fraction bad/n (95% by default)."""
    if n == 0:
        return 1.0
    p = bad / n
    centre = p + z * z / (2 * n)
    spread = z * math.sqrt(p * (1 - p) / n + z * z / (4 * n * n))
    return min(1.0, (centre + spread) / (1 + z * z / n))
