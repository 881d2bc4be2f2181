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

Usage (the supervisor builds it): python -m dflash_mp.launch.agent <torchrun options> -m dflash_mp.train <overrides>
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import uuid

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


def _preimport() -> None:
    """What every rank imports before its first step (the targets' modeling stack, the drafters'
    optimizer, which imports torch._dynamo); a module imported here costs a rank nothing."""
    import torch._dynamo  # noqa: F401
    import torch.optim  # noqa: F401
    import transformers.modeling_utils  # noqa: F401

    import dflash_mp.runtime.job  # noqa: F401
    import dflash_mp.train  # noqa: F401


def start_method() -> str:
    """`fork` on a machine without a visible GPU, else `fresh` (also when asked for)."""
    import torch

    if os.environ.get(RANK_START_ENV, "fork") == "fresh" or torch.cuda.is_available():
        return "fresh"
    return "fork"


def _rank_main(*overrides: str) -> None:
    """One rank, as `python -m dflash_mp.train <overrides>` would run it under torchrun."""
    import torch

    from dflash_mp import train

    os.setsid()  # torchrun gives every rank its own session
    for sig in _RESET_SIGNALS:
        signal.signal(sig, signal.SIG_DFL)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    threads = os.environ.get("OMP_NUM_THREADS")
    if threads and threads.isdigit():  # read once at torch's import in a fresh interpreter
        torch.set_num_threads(int(threads))
    atexit._clear()  # the agent's exit handlers are not this rank's
    sys.argv = [sys.argv[0], *overrides]
    try:
        train.main()  # Hydra reads the overrides from sys.argv
    except KeyboardInterrupt:
        # A fresh interpreter ends on an uncaught Ctrl-C by SIGINT; multiprocessing would exit 0.
        atexit._run_exitfuncs()
        signal.signal(signal.SIGINT, signal.SIG_DFL)
        os.kill(os.getpid(), signal.SIGINT)
    finally:
        atexit._run_exitfuncs()  # a forked child ends with os._exit, which skips them


def main(argv: list[str] | None = None) -> None:
    from torch.distributed import run as torchrun
    from torch.distributed.launcher.api import elastic_launch

    args = torchrun.parse_args(argv)
    if not (args.module and args.training_script == TRAIN_MODULE and args.standalone):
        sys.exit(f"dflash_mp.launch.agent runs `--standalone ... -m {TRAIN_MODULE}` jobs only")
    if start_method() == "fresh":
        print(
            f"dflash_mp agent: starting {args.nproc_per_node} rank(s) as fresh interpreters", file=sys.stderr
        )
        torchrun.run(args)
        return
    # What torchrun's --standalone means: a c10d rendezvous on a free local port.
    args.rdzv_backend, args.rdzv_endpoint, args.rdzv_id = "c10d", "localhost:0", str(uuid.uuid4())
    _preimport()
    config, _, _ = torchrun.config_from_args(args)
    config.start_method = "fork"
    print(f"dflash_mp agent: starting {args.nproc_per_node} rank(s) forked from this agent", file=sys.stderr)
    elastic_launch(config=config, entrypoint=_rank_main)(*args.training_script_args)


if __name__ == "__main__":
    from torch.distributed.elastic.multiprocessing.errors import record

    record(main)()
