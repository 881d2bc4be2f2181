"""The benchmark's watchdog: no rank blocks forever on a failed or hung peer."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable


class Watchdog:
    """Bounds every blocking phase: past its deadline, or when the other rank reported a failure
    in the same phase (or its exit) and this rank is still inside the phase `grace_s` later,
    `on_abort(phase, reason)` runs (it writes what is known and exits the process). A rank blocked
    in a receive from a peer that failed can therefore never hang the job."""

    def __init__(
        self, peer_state: Callable[[], dict | None], on_abort: Callable[[str, str], None], grace_s: float
    ):
        self.peer_state, self.on_abort, self.grace_s = peer_state, on_abort, grace_s
        self.lock = threading.Lock()
        self.phase: str | None = None
        self.deadline = 0.0
        self.timeout = 0.0
        self.peer_failed_seen: float | None = None
        threading.Thread(target=self._loop, name="bench-watchdog", daemon=True).start()

    def arm(self, phase: str, timeout_s: float) -> None:
        with self.lock:
            self.phase, self.timeout = phase, timeout_s
            self.deadline = time.monotonic() + timeout_s
            self.peer_failed_seen = None

    def disarm(self) -> None:
        with self.lock:
            self.phase = None

    def _loop(self) -> None:
        while True:
            time.sleep(0.5)
            with self.lock:
                phase, deadline, timeout = self.phase, self.deadline, self.timeout
            if phase is None:
                continue
            reason = None
            if time.monotonic() > deadline:
                reason = f"timed out after {timeout:.0f}s (raise --timeout-scale if this is just slow)"
            else:
                peer = self.peer_state() or {}
                failed = peer.get("failed") or {}
                if peer.get("exited") or failed.get("phase") == phase:
                    if self.peer_failed_seen is None:
                        self.peer_failed_seen = time.monotonic()
                    elif time.monotonic() - self.peer_failed_seen > self.grace_s:
                        what = "exited" if peer.get("exited") else "failed in this section"
                        reason = (
                            f"the other rank {what} ({str(failed.get('error', '?'))[:300]}) and this "
                            f"rank was still blocked {self.grace_s:.0f}s later"
                        )
            if reason is not None:
                with self.lock:
                    if self.phase != phase:
                        continue
                self.on_abort(phase, reason)
                return
