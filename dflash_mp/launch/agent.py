"""The launcher's torchrun agent: torchrun's own agent (options, rendezvous, signals, error files),
forking the ranks of a CPU job from itself once it has imported what every rank imports.

A rank started as a fresh interpreter spends its first seconds importing torch, torch._dynamo,
transformers' modeling stack and Hydra (about 5 CPU-seconds on a 2-core machine, on every rank of
every job) before any work. On a machine without a visible GPU the agent imports them once and
torchrun starts the ranks with its `fork` start method, so each rank begins with them loaded. Each
rank is still its own process with its own session, torchrun's environment, signals and error file;
what differs from a fresh interpreter is put back in `_rank_main` (signal handlers, exit handlers,
thread count).

With a GPU visible, or DFLASH_MP_RANK_START=fresh, the agent is exactly torchrun (`python -m
torch.distributed.run`): fresh interpreters. A forked process cannot use CUDA once its parent has
initialised it, and torch's agent may: on an H200, forked ranks failed with "Cannot re-initialize
CUDA in forked subprocess" although CUDA was not initialised when the agent chose to fork.
Plain `torchrun -m dflash_mp.train` always starts fresh interpreters.

The launcher starts the agent the same way. On such a machine it forks a standby copy of itself
(`AgentZygote`) right after importing torch and transformers for its preflight and before running
anything else (a process that has run tensor ops or tokenized holds thread pools a fork would
break); the standby imports what the ranks need while the preflight runs, and becomes the agent
when the supervisor hands it the command (or exits when the preflight refuses the job). Elsewhere
the agent is `python -m dflash_mp.launch.agent`. The forked agent is put back to what that
interpreter would be (`_run_forked`): the job's environment, job.log as stdout and stderr, no
descriptor but the run directory's lock, default signal handlers, no logging handlers, no Hydra
state, no exit handlers. Its processes carry the job's id in `os.environ` (what they start inherits
it) but not in /proc/PID/environ, which keeps the launcher's: `processes.job_processes` finds them
by the lock they hold.

Usage (the supervisor builds it): python -m dflash_mp.launch.agent <torchrun options> -m dflash_mp.train <overrides>
"""

from __future__ import annotations

import atexit
import io
import json
import logging
import os
import signal
import subprocess
import sys
import traceback
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from dflash_mp.launch import rank as rank_program
from dflash_mp.run import startup
from dflash_mp.run.processes import die_with_parent

RANK_START_ENV = "DFLASH_MP_RANK_START"
TRAIN_MODULE = "dflash_mp.train"
# Handlers the agent installs for itself (torchrun's shutdown on a signal); a rank starts with
# Python's defaults and installs its own (dflash_mp.runtime.watchdog).
_RESET_SIGNALS = (
    signal.SIGTERM,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGCHLD,
)


def _default_signals() -> None:
    """Python's own handlers, as a fresh interpreter starts with them."""
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)


def _preimport() -> None:
    """What every rank imports before its first step (the targets' modeling stack, the drafters'
    optimizer, which imports torch._dynamo); a module imported here costs a rank nothing."""
    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import dflash_mp.runtime.job  # noqa: F401


def start_method() -> str:
    """`fork` on a machine without a visible GPU, else `fresh` (also when asked for)."""
    import torch

    if os.environ.get(RANK_START_ENV, "fork") == "fresh" or torch.cuda.is_available():
        return "fresh"
    return "fork"


def _rank_main(*overrides: str) -> None:
    """One rank, as `python -m dflash_mp.train <overrides>` would run it under torchrun."""
    import torch

    os.setsid()  # torchrun gives every rank its own session
    _default_signals()
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # read once at torch's import in a fresh interpreter
        torch.set_num_threads(int(threads))
    atexit._clear()  # the agent's exit handlers are not this rank's
    sys.argv = [sys.argv[0], *overrides]
    try:
        rank_program.main()  # Hydra reads the overrides from sys.argv
    except KeyboardInterrupt:
        # A fresh interpreter ends on an uncaught Ctrl-C by SIGINT; multiprocessing would exit 0.
        atexit._run_exitfuncs()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        atexit._run_exitfuncs()  # a forked child ends with os._exit, which skips them


def main(argv: list[str] | None = None) -> None:
    startup.pause()
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not (args.module and args.training_script == TRAIN_MODULE and args.standalone):
        sys.exit(f"dflash_mp.launch.agent runs `--standalone ... -m {TRAIN_MODULE}` jobs only")
    if start_method() == "fresh":
        print(
            f"dflash_mp agent: starting {args.nproc_per_node} rank(s) as fresh interpreters", file=sys.stderr
        )
        startup.resume()
        _ending_on_a_signal_in_one_line(lambda: torchrun.run(args))
        return
    # What torchrun's --standalone means: a c10d rendezvous on a free local port.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    _preimport()
    startup.resume()  # before the fork: each rank starts with the stack frozen and shared
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    print(f"dflash_mp agent: starting {args.nproc_per_node} rank(s) forked from this agent", file=sys.stderr)
    _ending_on_a_signal_in_one_line(
        lambda: elastic_launch(config=config, entrypoint=_rank_main)(*args.training_script_args)
    )


def _ending_on_a_signal_in_one_line(run_agent: Callable[[], object]) -> None:
    """Run torchrun's agent. A stop signal (the launcher's, or the parent-death signal when it was
    killed) makes the agent pass it on to the ranks and then raise SignalException: that ends the
    agent with one line in job.log instead of torchrun's stack (about 50 lines), exit 1 as before."""
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    logging.getLogger("torch.distributed.elastic.multiprocessing.api").addFilter(_without_rank_stack)
    try:
        run_agent()
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"dflash_mp agent: stopped by {name}, which it passed on to the ranks", file=sys.stderr)
        sys.exit(1)
    except ChildFailedError as e:
        # torchrun's summary repeats the failed rank's traceback, which the launcher writes once,
        # last, as the job's root cause (launch/outcome.py).
        # "exitcode: N (pid: P)" as in torchrun's summary: the launcher reads a signal's death there.
        failed = "; ".join(
            f"rank {rank} exitcode: {failure.exitcode} (pid: {failure.pid})"
            for rank, failure in sorted(e.failures.items())
        )
        print(f"dflash_mp agent: {failed}; the root cause follows below", file=sys.stderr)
        sys.exit(1)


def _without_rank_stack(record: logging.LogRecord) -> bool:
    """torchrun's "failed (exitcode ...)" line without the agent's own stack (ProcessExitedException):
    the rank's traceback is its error file's, written once as the root cause."""
    if str(record.msg).startswith("failed (exitcode"):
        record.exc_info, record.exc_text = None, None
    return True


class ForkedAgent:
    """An agent forked from the launcher, as much of `subprocess.Popen` as the supervisor uses."""

    def __init__(self, pid: int) -> None:
        self.pid, self.returncode = pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)  # -N: killed by signal N, as Popen
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, sig)


class AgentZygote:
    """A copy of the launcher forked before its preflight, waiting to become the job's agent."""

    def __init__(self, pid: int, command_fd: int) -> None:
        self.pid, self.command_fd = pid, command_fd  # None once handed over or discarded

    @classmethod
    def fork(cls, lock_fd: int, log_path: Path) -> AgentZygote | None:
        """Import torch and transformers and fork the standby agent, where forking is the way to
        start one (see the module docstring); None elsewhere."""
        import threading

        try:
            import torch  # noqa: F401  (what the preflight imports anyway)
            import transformers  # noqa: F401

            # What the preflight and every rank both import (configs, data, the target stage):
            # imported once here rather than in the launcher and again in the standby (0.5 CPU-s).
            import dflash_mp.data  # noqa: F401
            import dflash_mp.evaluation.acceptance  # noqa: F401
            import dflash_mp.models.drafter_config  # noqa: F401
            import dflash_mp.models.target  # noqa: F401
        except Exception:  # a broken install: the preflight's import check names it
            return None
        if threading.active_count() != 1 or start_method() != "fork":
            return None
        read_fd, write_fd = os.pipe()
        sys.stdout.flush()
        sys.stderr.flush()
        die_with_launcher = die_with_parent(signal.SIGTERM)
        pid = os.fork()
        if pid == 0:
            os.close(write_fd)
            die_with_launcher()
            _zygote_main(read_fd, lock_fd, log_path)
        os.close(read_fd)
        return cls(pid, write_fd)

    def start(self, command: list[str], env: dict[str, str]) -> ForkedAgent:
        """Hand over `command` (python -m dflash_mp.launch.agent ARGS): the standby becomes the agent."""
        payload = json.dumps({"argv": command[3:], "env": env}).encode()
        fd, self.command_fd = self.command_fd, None
        with os.fdopen(fd, "wb") as pipe:
            pipe.write(payload)
        return ForkedAgent(self.pid)

    def discard(self) -> None:
        """The job does not start (preflight refused, an error): the standby exits unused."""
        fd, self.command_fd = self.command_fd, None
        if fd is not None:
            os.close(fd)
            os.kill(self.pid, signal.SIGKILL)  # it holds nothing of its own: no need to wait for its imports
            os.waitpid(self.pid, 0)


def start(
    command: list[str], env: dict[str, str], log_path: Path, lock_fd: int, zygote: AgentZygote | None
) -> subprocess.Popen | ForkedAgent:
    """Start the agent `command` (python -m dflash_mp.launch.agent ...) with `env`, job.log as its
    output and the run directory's lock: `zygote` becomes it, else a new interpreter. Either gets
    SIGTERM when this process dies."""
    if zygote is not None:  # it writes to job.log already
        return zygote.start(command, env)
    log_fd = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    try:
        return subprocess.Popen(
            command,
            stdin=subprocess.DEVNULL,
            stdout=log_fd,
            stderr=subprocess.STDOUT,
            env=env,
            pass_fds=(lock_fd,),  # the agent shares the lock: it holds it while the ranks end
            # A killed supervisor (kill -9, OOM) stops the agent like `stop` does: the ranks checkpoint
            # and end within torchrun's grace, and each rank dies with its agent. Nothing runs on.
            preexec_fn=die_with_parent(signal.SIGTERM),
        )
    finally:
        os.close(log_fd)


def _zygote_main(command_fd: int, lock_fd: int, log_path: Path) -> NoReturn:
    """The standby: imports, then waits for the command (EOF: not needed). It writes to job.log,
    not the launcher's terminal, and leaves a Ctrl-C to the launcher, which then discards it."""
    try:
        signal.signal(signal.SIGINT, signal.SIG_IGN)
        null = os.open(os.devnull, os.O_RDONLY)
        log = os.open(log_path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        for fd, target in ((null, 0), (log, 1), (log, 2)):
            os.dup2(fd, target)
        _preimport()
        with os.fdopen(command_fd, "rb") as pipe:
            payload = pipe.read()
    except BaseException:
        traceback.print_exc()
        os._exit(1)
    if not payload:
        os._exit(0)
    command = json.loads(payload)
    _run_forked(command["argv"], command["env"], lock_fd)


def _run_forked(argv: list[str], env: dict[str, str], lock_fd: int) -> NoReturn:
    """The forked agent: made what `python -m dflash_mp.launch.agent ARGV` would start as (its
    output already goes to job.log), then run."""
    code, interrupted = 1, False
    try:
        os.closerange(3, lock_fd)  # the launcher's other files are not the job's
        os.closerange(lock_fd + 1, os.sysconf("SC_OPEN_MAX"))
        os.environ.clear()
        os.environ.update(env)
        # PYTHONUNBUFFERED=1, as the job's environment asks: every line reaches job.log at once.
        sys.stdin = sys.__stdin__ = io.TextIOWrapper(io.FileIO(0, "r", closefd=False))
        for fd, name in ((1, "stdout"), (2, "stderr")):
            stream = io.TextIOWrapper(
                io.FileIO(fd, "w", closefd=False), write_through=True, errors="backslashreplace"
            )
            setattr(sys, name, stream)
            setattr(sys, f"__{name}__", stream)
        _default_signals()
        logging.root.handlers.clear()  # Hydra's job logging of the launcher
        logging.root.setLevel(logging.WARNING)
        if "hydra" in sys.modules:  # each rank's Hydra starts anew
            from hydra.core.global_hydra import GlobalHydra

            GlobalHydra.instance().clear()
        atexit._clear()  # the launcher's exit handlers are not the agent's
        sys.argv = [__file__, *argv]
        from torch.distributed.elastic.multiprocessing.errors import record

        record(main)(argv)
        code = 0
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            code = e.code or 0
        else:
            print(e.code, file=sys.stderr)
    except KeyboardInterrupt:
        interrupted = True
    except BaseException:
        traceback.print_exc()
    finally:
        atexit._run_exitfuncs()
        for stream in (sys.stdout, sys.stderr):
            stream.flush()
        if interrupted:  # an interpreter ends on an uncaught Ctrl-C by SIGINT
            signal.signal(signal.SIGINT, signal.SIG_DFL)
            os.kill(os.getpid(), signal.SIGINT)
        os._exit(code)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
