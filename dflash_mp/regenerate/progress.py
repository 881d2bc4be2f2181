"""Progress of a rank's records as log lines: how many are written, the rate, and when it ends."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

log = logging.getLogger("dflash_mp.regenerate")
EVERY_S = 30.0  # between two lines; the first batch's line and the last always come


def duration(seconds: float) -> str:
    """1h02m, 3m05s, 12s."""
    seconds = int(round(seconds))
    hours, rest = divmod(seconds, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m"
    return f"{minutes}m{secs:02d}s" if minutes else f"{secs}s"


class Progress:
    """'rank R: N of M records written, X records/s, ETA ...' at most every `every_s` seconds, after
    the first records (the first estimate) and once all are done."""

    def __init__(
        self, total: int, rank: int, every_s: float = EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.total, self.rank, self.every_s, self.clock = total, rank, every_s, clock
        self.started = self.clock()
        self.done, self.failed = 0, 0
        self.reported_at: float | None = None

    def advance(self, written: int, failed: int = 0) -> None:
        self.done += written + failed
        self.failed += failed
        now = self.clock()
        finished = self.done >= self.total
        if finished or self.reported_at is None or now - self.reported_at >= self.every_s:
            self.reported_at = now
            log.info("%s", self.line(now))

    def line(self, now: float) -> str:
        elapsed = max(now - self.started, 1e-9)
        rate = self.done / elapsed
        failed = f", {self.failed} failed" if self.failed else ""
        head = f"rank {self.rank}: {self.done - self.failed} of {self.total} records written{failed}"
        if self.done >= self.total:
            return f"{head}; done in {duration(elapsed)} ({rate:.2f} records/s)"
        eta = duration((self.total - self.done) / rate) if rate > 0 else "unknown"
        return f"{head}, {rate:.2f} records/s, ETA {eta}"
