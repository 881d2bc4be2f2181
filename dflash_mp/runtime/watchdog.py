"""Liveness of a running rank: heartbeat, hang watchdog, stop requests, fault injection.

- **Heartbeat.** The training loops call `beat(phase, step)`: two attribute stores, no I/O.
  A daemon thread (it never runs model code) writes the heartbeat to
  RUN_DIR/heartbeats/rank{r}.json every second and ends the process with EXIT_HUNG when the
  rank has made no progress for `watchdog.timeout_s`. The launcher reads the same files, so
  a rank whose threads cannot run at all (SIGSTOP, a C call holding the GIL) is caught too.
  It goes on writing after the rank's final state, until the process exits through Python
  (`exited`): a rank that finished and was then killed by a signal is told from one that ended.
- **Blame.** A rank that may be waiting on a peer (receive, send, a collective) looks at the
  peers' heartbeats before reporting itself: a peer that is frozen, or stuck in its own work
  (forward, eval, checkpoint ...), is the one reported, with its phase and step.
- **Stop requests.** SIGTERM, SIGUSR1 and SIGUSR2 (what torchrun forwards and SLURM or submitit
  send before a preemption or the time limit) only set a flag. Drafter ranks agree on it at the next
  optimizer-step boundary, the first drafter checkpoints and writes RUN_DIR/PREEMPTED, and
  they exit with EXIT_PREEMPTED; target ranks keep serving micro-batches until then.
- **Fault injection (a test hook).** DFLASH_MP_FAULT="rank=R,step=S,kind=raise|exit|hang|stall"
  (optionally ",phase=P", and ",seconds=N" for stall) makes rank R raise, exit abruptly, hang, or
  stall (sleep N seconds, 60 by default, or until a stop request) at its first heartbeat of
  optimizer step >= S. Several faults are separated by ";" (each fires once, in the order given).
  Read once, in `start`.

Free of torch imports: the launcher reads heartbeats without loading torch.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import signal
import socket
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

from dflash_mp.run.logs import append_job_log, get_logger

# A rank that made no progress for watchdog.timeout_s (in-process watchdog or launcher).
EXIT_HUNG = 3
# The first drafter wrote a checkpoint after a stop signal: requeue with train.resume=true
# (75 is EX_TEMPFAIL in sysexits.h: "try again later").
EXIT_PREEMPTED = 75
# kind=exit of DFLASH_MP_FAULT: a rank that vanishes without a Python traceback.
FAULT_EXIT_CODE = 13

FAULT_ENV = "DFLASH_MP_FAULT"
STOP_SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2)
WRITE_INTERVAL_S = 1.0
# Phases that wait on another rank. A rank waiting on a stuck peer is reported this much later
# than the peer itself, so the job log names the rank that is stuck, not the ones waiting for it.
WAITING_PHASES = frozenset({"send", "receive"})
PEER_GRACE_S = 10.0
# Phases in which a rank waits on nobody: a rank stuck there is the one to blame.
OWN_WORK_PHASES = frozenset({"tokenize", "forward", "eval", "checkpoint", "export"})
PR_SET_PDEATHSIG = 1


def heartbeat_dir(run_dir: str | Path) -> Path:
    return Path(run_dir) / "heartbeats"


def preempted_marker(run_dir: str | Path) -> Path:
    return Path(run_dir) / "PREEMPTED"


class Preempted(Exception):
    """Raised at an optimizer-step boundary once the drafters agreed to stop."""

    def __init__(self, step: int) -> None:
        super().__init__(f"stopped on request after step {step}")
        self.step = step


class Fault:
    """The parsed DFLASH_MP_FAULT of this rank."""

    KINDS = ("raise", "exit", "hang", "stall")

    def __init__(self, spec: str) -> None:
        try:
            fields = dict(item.split("=", 1) for item in spec.split(",") if item)
            self.rank, self.step, self.kind = int(fields["rank"]), int(fields["step"]), fields["kind"]
        except (KeyError, ValueError) as e:
            raise ValueError(
                f"{FAULT_ENV}={spec!r}: expected rank=R,step=S,kind=raise|exit|hang|stall"
            ) from e
        self.spec, self.phase = spec, fields.get("phase")
        self.seconds = float(fields.get("seconds", 60))
        if self.kind not in self.KINDS:
            raise ValueError(f"{FAULT_ENV}={spec!r}: kind must be one of {', '.join(self.KINDS)}")

    def due(self, phase: str, step: int) -> bool:
        return step >= self.step and (self.phase is None or phase == self.phase)

    def fire(self, phase: str, step: int) -> None:
        where = f"at step {step} in phase {phase!r} ({FAULT_ENV}={self.spec})"
        get_logger().error("injected fault: %s %s", self.kind, where)
        if self.kind == "exit":
            os._exit(FAULT_EXIT_CODE)
        if self.kind == "hang":
            while True:  # no more beats: the watchdog thread must notice
                time.sleep(3600)
        if self.kind == "stall":  # a slow phase that a stop request still ends
            deadline = time.monotonic() + self.seconds
            while time.monotonic() < deadline and not stop_requested():
                time.sleep(0.1)
            return
        raise RuntimeError(f"injected fault {where}")


class Heartbeat:
    """What this rank is doing, kept in memory and written out by a daemon thread."""

    def __init__(self, run_dir: Path, rank: int, role: str, timeout_s: float) -> None:
        self.run_dir, self.rank, self.role, self.timeout_s = run_dir, rank, role, timeout_s
        self.path = heartbeat_dir(run_dir) / f"rank{rank}.json"
        self.state, self.phase, self.step = "running", "startup", 0
        self.error: str | None = None
        self.blame: dict[str, Any] | None = None  # the peer a waiting rank reported as stuck
        self.exited = False  # set when the process exits through Python
        self.progress_at, self._progress_mono = time.time(), time.monotonic()
        self._main_thread = threading.main_thread().ident
        self._stop = threading.Event()
        self._lock = threading.Lock()  # the thread never overwrites a final state with "running"
        self._thread = threading.Thread(target=self._loop, name="dflash-watchdog", daemon=True)

    def beat(self, phase: str, step: int) -> None:
        self.phase, self.step = phase, step
        self.progress_at, self._progress_mono = time.time(), time.monotonic()

    def as_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "role": self.role,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "state": self.state,
            "phase": self.phase,
            "step": self.step,
            "progress_at": self.progress_at,
            "written_at": time.time(),
            "timeout_s": self.timeout_s,
            "stop_requested": _stop_signal,
            "error": self.error,
            "blame": self.blame,
            "exited": self.exited,
        }

    def write(self) -> None:
        tmp = self.path.with_suffix(f".tmp{os.getpid()}")
        tmp.write_text(json.dumps(self.as_dict()))
        os.replace(tmp, self.path)  # readers never see half a file

    def _try_write(self) -> None:
        try:
            self.write()
        except OSError as e:  # a full disk must not take the rank or its watchdog down
            get_logger().warning("heartbeat: cannot write %s: %s", self.path, e)

    def start(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.write()
        self._thread.start()

    def finish(self, state: str, error: str | None = None) -> None:
        """The final state; the thread goes on writing (the rank lives) but no longer watches."""
        with self._lock:
            self.state, self.error = state, error
            self._try_write()

    def mark_exited(self) -> None:
        """At interpreter exit: the process ends by itself, not by a signal."""
        with self._lock:
            self._stop.set()
            self.exited = True
            self._try_write()

    def _loop(self) -> None:
        while not self._stop.wait(WRITE_INTERVAL_S):
            with self._lock:
                if self._stop.is_set():
                    return
                self._try_write()
                if self.state != "running" or self.timeout_s <= 0:
                    continue
                idle = time.monotonic() - self._progress_mono
                limit = self.timeout_s + (PEER_GRACE_S if self.phase in WAITING_PHASES else 0.0)
                if idle <= limit:
                    continue
                culprit = self._stuck_peer()
                # A stuck peer whose watchdog runs reports itself, with its stack: give it the grace.
                if culprit is None or culprit["frozen"] or idle > limit + PEER_GRACE_S:
                    self._report_hang(idle, culprit)

    def _stuck_peer(self) -> dict[str, Any] | None:
        """The peer this rank is presumably waiting for: one whose heartbeat stopped (frozen), else,
        when this rank may be waiting, one stuck about as long in a phase that waits on nobody."""
        now, idle = time.time(), time.monotonic() - self._progress_mono
        peers = [
            beat
            for rank, beat in read_heartbeats(self.run_dir).items()
            if rank != self.rank and beat["state"] == "running"
        ]
        frozen = [beat for beat in peers if now - beat["written_at"] > self.timeout_s]
        stuck = [
            beat
            for beat in peers
            if beat["phase"] in OWN_WORK_PHASES and now - beat["progress_at"] > idle - PEER_GRACE_S
        ]
        if frozen:
            found = min(frozen, key=lambda beat: beat["written_at"])
            why = f"its heartbeat stopped {now - found['written_at']:.0f}s ago: the process is stopped or frozen"
        elif stuck and self.phase not in OWN_WORK_PHASES:
            found = min(stuck, key=lambda beat: beat["progress_at"])
            why = f"it has made no progress for {now - found['progress_at']:.0f}s"
        else:
            return None
        return {key: found[key] for key in ("rank", "role", "phase", "step")} | {
            "why": why,
            "frozen": bool(frozen),
        }

    def _report_hang(self, idle: float, culprit: dict[str, Any] | None) -> None:
        try:
            frame = sys._current_frames().get(self._main_thread)
            stack = "".join(traceback.format_stack(frame)[-6:]) if frame is not None else "(unknown)\n"
            self.state = "hung"
            if culprit is None:
                self.error = (
                    f"no progress for {idle:.0f}s in phase {self.phase!r} at step {self.step} "
                    f"(watchdog.timeout_s={self.timeout_s:g})"
                )
            else:
                self.blame = culprit
                self.error = (
                    f"waited {idle:.0f}s in phase {self.phase!r} at step {self.step} for rank "
                    f"{culprit['rank']} ({culprit['role']}), in phase {culprit['phase']!r} at step "
                    f"{culprit['step']}: {culprit['why']} (watchdog.timeout_s={self.timeout_s:g})"
                )
            message = (
                f"watchdog: rank {self.rank} ({self.role}) {self.error}; ending the job. If this phase "
                "is legitimately slow (loading a large target, the first torch.compile), raise "
                f"watchdog.timeout_s. Main thread at:\n{stack.rstrip()}"
            )
            get_logger().error(message)
            append_job_log(self.run_dir, message)
            self.write()
        finally:
            os._exit(EXIT_HUNG)  # whatever failed while reporting, the hung rank goes


_current: Heartbeat | None = None
_faults: list[Fault] = []  # this rank's, not yet fired; the first one fires first
_stop_signal: str | None = None


def start(run_dir: str | Path, rank: int, role: str, timeout_s: float) -> Heartbeat:
    """Start this rank's heartbeat thread, take STOP_SIGNALS as stop requests, arm the fault hook."""
    global _current, _faults
    specs = [spec.strip() for spec in os.environ.get(FAULT_ENV, "").split(";") if spec.strip()]
    _faults = [fault for fault in map(Fault, specs) if fault.rank == rank]
    for sig in STOP_SIGNALS:
        signal.signal(sig, _request_stop)
    _current = Heartbeat(Path(run_dir), rank, role, timeout_s)
    _current.start()
    atexit.register(_current.mark_exited)
    return _current


def die_with_agent() -> None:
    """Linux: SIGKILL this rank when its parent, the torchrun agent, dies. torchrun gives every
    rank its own session, so nothing else ends a rank whose agent was killed: it would run on
    as an orphan, still writing into the run directory."""
    with contextlib.suppress(OSError, AttributeError):  # not Linux
        ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)


def beat(phase: str, step: int) -> None:
    """Record progress: this rank is now in `phase` of optimizer step `step` (0-based)."""
    if _current is None:  # not under the runtime (reference trainer, tests)
        return
    _current.beat(phase, step)
    if _faults and _faults[0].due(phase, step):
        _faults.pop(0).fire(phase, step)  # fires once


def finish(state: str, error: str | None = None) -> None:
    """Final heartbeat: "done", "failed", "stopped" or "preempted"; the watchdog stops watching."""
    if _current is not None:
        _current.finish(state, error)


def stop_requested() -> bool:
    return _stop_signal is not None


def _request_stop(signum: int, frame: object) -> None:
    global _stop_signal
    if _stop_signal is None:
        _stop_signal = signal.Signals(signum).name
        get_logger().warning("received %s: stopping at the next optimizer-step boundary", _stop_signal)


def mark_preempted(run_dir: str | Path, step: int) -> None:
    """Tell the launcher (and a requeue script) that the job stopped with a checkpoint at `step`."""
    preempted_marker(run_dir).write_text(json.dumps({"step": step, "signal": _stop_signal}))


def read_heartbeats(run_dir: str | Path) -> dict[int, dict[str, Any]]:
    """The ranks' latest heartbeats by rank (files being replaced right now are skipped)."""
    beats = {}
    for path in heartbeat_dir(run_dir).glob("rank*.json"):
        try:
            data = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        beats[int(data["rank"])] = data
    return beats
