"""How a role spends its time: busy on its own work vs. waiting on the other role.

Busy time is measured around the role's own work; everything else is waiting. On GPU the
CPU runs ahead of the kernels, so host timers would count a kernel's run time as waiting
in whatever call later synchronises; CUDA events recorded in stream order measure the
work where it actually runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import torch


class RoleClock:
    def __init__(self, device: torch.device) -> None:
        self.start = time.perf_counter()
        self.on_gpu = device.type == "cuda"
        self._busy_s = 0.0
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._open: torch.cuda.Event | float | None = None  # the start of the busy span now open

    @contextmanager
    def busy(self) -> Iterator[None]:
        if not self.on_gpu:
            self._open = time.perf_counter()
            yield
            self._busy_s += time.perf_counter() - self._open
            self._open = None
            return
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record()
        yield
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._open, end))
        self._open = None

    @contextmanager
    def paused(self) -> Iterator[None]:
        """Inside `busy()`: what runs in here is waiting, not work (e.g. receiving the next
        micro-batch while this role's update runs). Outside `busy()` it changes nothing."""
        if self._open is None:
            yield
            return
        if not self.on_gpu:
            self._busy_s += time.perf_counter() - self._open
            yield
            self._open = time.perf_counter()
            return
        end = torch.cuda.Event(enable_timing=True)
        end.record()
        self._pending.append((self._open, end))
        yield
        self._open = torch.cuda.Event(enable_timing=True)
        self._open.record()

    @property
    def busy_s(self) -> float:
        # Only spans the GPU has finished are counted; query() never blocks.
        while self._pending and self._pending[0][1].query():
            begin, end = self._pending.pop(0)
            self._busy_s += begin.elapsed_time(end) / 1e3
        return self._busy_s

    @property
    def wait_s(self) -> float:
        return max(0.0, time.perf_counter() - self.start - self.busy_s)
