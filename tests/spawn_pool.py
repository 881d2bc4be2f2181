"""Child processes for the tests that need several (gloo process groups), without a fresh interpreter each.

`start_method="spawn"` gives every child a new interpreter that imports torch, transformers' modeling
stack and torch._dynamo again: ~5 CPU-s a child before it does anything. Here the children are forked
from multiprocessing's forkserver, a single-threaded process started once per test process that
imported those modules already (`PRELOAD`), so a child pays for its own work only. The test process
itself is never forked (it has run torch ops and holds threads). A child starts with the test
process's environment as it is at the call, as a spawned one would (the forkserver's is the one it
started with).

Children end with `os._exit` after `fn` returns (no interpreter teardown, no atexit handlers): a test
of what a process does while it exits must spawn its own.
"""

from __future__ import annotations

import multiprocessing
import os
from typing import Any

import torch.multiprocessing as mp

# What the children import anyway: the forkserver pays for it once. (Not the test modules: the
# forkserver is shared by every test of the process, and a child imports its own module on unpickling.)
PRELOAD = [
    "torch",
    "torch.distributed",
    "torch._dynamo",
    "transformers",
    "transformers.modeling_utils",
    "dflash_mp.config.schema",
    "dflash_mp.models.target",
    "dflash_mp.models.tensor_parallel",
    "dflash_mp.runtime.target_parallel",
    "dflash_mp.runtime.transport",
    "dflash_mp.training.trainer",
]


def context() -> Any:
    """The forkserver context (its Queue reaches the children), with `PRELOAD` set."""
    forkserver = multiprocessing.get_context("forkserver")
    forkserver.set_forkserver_preload(PRELOAD)  # read when the forkserver starts (the first child)
    return forkserver


def _child(index: int, fn, environ: dict[str, str], *args) -> None:
    os.environ.clear()
    os.environ.update(environ)
    fn(index, *args)


def start_processes(fn, args: tuple = (), nprocs: int = 1) -> None:
    """torch.multiprocessing.start_processes(fn, args, nprocs) with children forked from the
    forkserver; raises as it does when a child fails (ProcessRaisedException, ProcessExitedException)."""
    context()
    mp.start_processes(_child, args=(fn, dict(os.environ), *args), nprocs=nprocs, start_method="forkserver")


def manager() -> Any:
    """A started multiprocessing Manager (its shared dicts reach the children), itself a fork of the
    forkserver rather than of the test process."""
    return context().Manager()


def in_gloo_group(rank: int, world_size: int, port: int, checks, *args) -> None:
    """`checks(rank, *args)` in a gloo group of `world_size` children on 127.0.0.1:`port`, what
    it made freed while the group and the peers live: a DDP reducer freed after
    destroy_process_group can hang in the gloo group's destructor (its thread join) once a peer
    has exited. So the checks run in their own frame (on failure, their traceback's frames are
    cleared), then a barrier, then the group goes."""
    import traceback

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world_size)
    try:
        checks(rank, *args)
        dist.barrier()
    except BaseException as error:
        traceback.clear_frames(error.__traceback__)
        raise
    finally:
        dist.destroy_process_group()
