"""bench/bench.py's runner: runs each section on every rank under a watchdog, writes each rank's
partial JSON, exchanges and merges the ranks' records after every section, and writes the JSON and
the table (rank 0). bench.py imports it once the flags and the layout are known to fit.
"""

from __future__ import annotations

import argparse
import os
import platform
import sys
import threading
import time
import traceback

import torch
import torch.distributed as dist
from benchlib.compile_watch import install_recompile_log
from benchlib.jsonio import deep_merge, gather_json, read_json, write_json
from benchlib.shapes import predicted_memory
from benchlib.state import BenchState
from benchlib.timing import memory_report, memory_reset
from benchlib.watchdog import Watchdog
from layout import ROLES, Layout
from sections import (
    NAMES,
    colocated,
    drafter,
    matmul_peak,
    pipeline,
    profile,
    setup,
    target,
    tp_check,
    transport,
)
from summary import summarize
from table import print_table

from dflash_mp.models.drafter import DFlashDrafter

SCHEMA = "dflash_mp.bench/1"
# Sections whose ranks talk to each other (besides the exchange after every section): after a
# failure in one of them, point-to-point operations may be left unmatched, so later ones are skipped.
COMMUNICATING = {"pipeline", "transport", "colocated"}
# With tensor-parallel targets / several drafters these talk too (the replica's all-reduces, DDP).
COMMUNICATING_TP = {"target_only", "target_parallel_check"}
COMMUNICATING_DDP = {"drafter_only", "profile"}
# Sections that need a peer: a 1-rank run records them as skipped.
TWO_RANKS_ONLY = {"pipeline", "transport"}
SINGLE_RANK_SKIP = "needs 2 ranks (1 target + 1 drafter); this run has 1"
# Sections that need a drafter rank: a target-only layout (--drafters 0) records them as skipped.
DRAFTER_SECTIONS = {"drafter_only", "profile", "pipeline", "transport"}
# name -> its module, in running order (sections.NAMES).
SECTIONS = {
    "matmul_peak": matmul_peak,
    "setup": setup,
    "drafter_only": drafter,
    "target_only": target,
    "target_parallel_check": tp_check,
    "profile": profile,
    "pipeline": pipeline,
    "transport": transport,
    "colocated": colocated,
}
assert tuple(SECTIONS) == NAMES, "sections.NAMES and SECTIONS list the same sections in one order"


class Bench(BenchState):
    """The runner: runs each section on every rank under a watchdog, exchanges and merges the
    ranks' records after it, and writes the JSON."""

    def __init__(self, args: argparse.Namespace, layout: Layout, process_start: float) -> None:
        # A previous run's partial files would read as a failed peer: each rank removes its own
        # before the rendezvous, so both are gone once init_job returns.
        self.partial_paths = [f"{args.out}.rank{r}.partial.json" for r in range(layout.world)]
        own = self.partial_paths[int(os.environ["RANK"])]
        if os.path.exists(own):
            os.remove(own)
        super().__init__(args, layout, process_start)
        communicating = set(COMMUNICATING)
        if self.target_parallel > 1:
            communicating |= COMMUNICATING_TP
        if layout.drafters > 1:
            communicating |= COMMUNICATING_DDP
        self.communicating = communicating
        self.merged: dict = self._header()
        self.process_elapsed = 0.0
        self.comm_failed = False
        self._aborting = threading.Lock()
        install_recompile_log()
        self.watchdog = Watchdog(self._peer_state, self._abort, grace_s=args.peer_grace)

    # ------------------------------------------------------------------ plumbing

    def _header(self) -> dict:
        cuda = self.device.type == "cuda"
        return {
            "schema": SCHEMA,
            "shape": self.shape.describe(),
            "setup": {
                "argv": sys.argv,
                "args": {k: v for k, v in vars(self.args).items()},
                "device": self.device.type,
                "device_name": torch.cuda.get_device_name(self.device) if cuda else "cpu",
                "world_size": self.world,
                "roles": self.layout.roles_by_rank(),
                "layout": self.layout.describe(),
                # dflash_mp.plan reads it: target_only's rate is that of one replica of this many GPUs.
                "target_parallel": self.target_parallel,
                "micro_batch": self.B,
                "grad_accum": self.A,
                "hidden_dtype": str(self.dtype).replace("torch.", ""),
                "attention": self.attention,
                "compile": self.compiled,
                "activation_checkpointing": self.cfg.train.activation_checkpointing,
                # dflash_mp.plan.memory's peaks for this shape and layout, beside the measured ones.
                "memory_prediction": predicted_memory(
                    self.shape, self.cfg, max(1, self.layout.drafters), self.world
                ),
                "torch": torch.__version__,
                "cuda": torch.version.cuda,
                "nccl": _nccl_version() if cuda else None,
                "transformers": __import__("transformers").__version__,
                "python": platform.python_version(),
                "env": {
                    k: os.environ[k] for k in sorted(os.environ) if k.startswith(("NCCL_", "TORCH_", "OMP_"))
                },
                "startup_s": self.startup_s,
            },
            "sections": {},
        }

    def _write_partial(self) -> None:
        write_json(self.partial_paths[self.rank], self.partial)

    def _peers(self) -> list[dict]:
        return [
            state
            for rank, path in enumerate(self.partial_paths)
            if rank != self.rank and (state := read_json(path)) is not None
        ]

    def _peer_state(self) -> dict | None:
        """The other ranks' state as the watchdog reads one peer: exited if any exited; failed in
        the phase being watched if any did (else the first failure seen)."""
        if self.single:  # no peer: the watchdog only enforces deadlines
            return None
        peers = self._peers()
        exited = [p for p in peers if p.get("exited")]
        failures = [p["failed"] for p in peers if p.get("failed")]
        phase = self.watchdog.phase if hasattr(self, "watchdog") else None
        failed = next((f for f in failures if f.get("phase") == phase), failures[0] if failures else None)
        if exited and failed is None:
            failed = exited[0].get("failed")
        return {"exited": bool(exited), "failed": failed}

    def _merge(self, name: str, records: list[dict]) -> dict:
        """One section from the ranks' records (identical on every rank)."""
        errors = {str(r["rank"]): r["error"] for r in records if r.get("error")}
        section: dict = {
            "status": "error" if errors else "ok",
            "elapsed_s": max(r.get("elapsed_s", 0.0) for r in records),
            "per_rank": {
                str(r["rank"]): {"memory": r.get("memory"), "elapsed_s": r.get("elapsed_s")} for r in records
            },
        }
        if errors:
            section["errors"] = errors
        for r in records:
            deep_merge(section, r.get("result") or {})
        return section

    def _abort(self, phase: str, reason: str) -> None:
        """Watchdog (or failed exchange): record, write what is known, exit without waiting on anyone."""
        if not self._aborting.acquire(blocking=False):
            time.sleep(10**6)  # the other thread is aborting; it ends the process
        name = phase.split(":")[-1]
        try:
            self.log(f"ABORT in {phase}: {reason}")
            mine = self.partial["sections"].setdefault(
                name, {"rank": self.rank, "error": None, "elapsed_s": 0.0, "result": {}}
            )
            mine["error"] = (
                (mine.get("error") or "") + (" | " if mine.get("error") else "") + f"{phase}: {reason}"
            )
            self.partial["failed"] = self.partial.get("failed") or {"phase": name, "error": reason}
            self.partial["exited"] = True
            self._write_partial()
            if self.rank == 0:
                states = [self.partial, *self._peers()]
                for section_name in SECTIONS:
                    if section_name in self.merged["sections"]:
                        continue
                    records = [
                        rec for state in states if (rec := state.get("sections", {}).get(section_name))
                    ]
                    if records:
                        self.merged["sections"][section_name] = self._merge(section_name, records)
                self.merged["aborted"] = {"phase": phase, "rank": self.rank, "reason": reason}
                self._finalize_json()
                print_table(self.merged)
        finally:
            sys.stdout.flush()
            sys.stderr.flush()
            # Rank 0 fails the job; the drafter rank exits quietly so torchrun does not kill rank 0
            # before it has written the JSON.
            os._exit(1 if self.rank == 0 else 0)

    def _finalize_json(self) -> None:
        self.merged["summary"] = summarize(self.merged)
        self.merged["total_s"] = time.perf_counter() - self.process_start
        write_json(self.args.out, self.merged)

    def _skip_reason(self, name: str) -> str | None:
        sections = self.merged["sections"]

        def ok(section: str) -> bool:
            return sections.get(section, {}).get("status") == "ok"

        if name not in self.args.sections:
            return "not selected (--sections)"
        if self.single and name in TWO_RANKS_ONLY:
            return SINGLE_RANK_SKIP
        if self.layout.drafters == 0 and name in DRAFTER_SECTIONS:
            return "no drafter rank in this layout (--drafters 0)"
        if name == "target_parallel_check":
            if self.target_parallel == 1:
                return "no tensor-parallel target (--target-parallel 1)"
            # The leader holds its shard and builds the whole target beside it.
            shard = self.shape.target_weight_bytes(self.dtype.itemsize, self.target_parallel)
            problem = self.one_gpu_target_problem(beside=shard)
            if problem:
                return problem
        if name == "colocated" and (problem := self.one_gpu_target_problem()):
            return problem
        budget = self.args.time_budget
        if budget > 0 and self.process_elapsed > budget:
            return f"time budget: {self.process_elapsed:.0f}s elapsed > --time-budget {budget:.0f}s"
        if name in self.communicating and self.comm_failed:
            return "an earlier communicating section failed (unmatched point-to-point operations)"
        needs = {
            "drafter_only": ["setup"],
            "target_only": ["setup"],
            "profile": ["setup"],
            "target_parallel_check": ["setup"],
            "pipeline": ["setup", "drafter_only", "target_only"],
        }.get(name, [])
        missing = [n for n in needs if not ok(n)]
        if missing:
            return f"needs {', '.join(missing)} (failed or skipped)"
        return None

    def run_section(self, name: str) -> None:
        skip = self._skip_reason(name)
        if skip is not None:
            self.log(f"{name}: skipped ({skip})")
            self.merged["sections"][name] = {"status": "skipped", "reason": skip}
            if self.rank == 0:
                self._finalize_json()
            return
        self.log(f"{name}: start")
        memory_reset(self.device)
        timeout = SECTIONS[name].TIMEOUT_S * self.args.timeout_scale
        self.watchdog.arm(name, timeout)
        start = time.perf_counter()
        error, result = None, {}
        try:
            self.fault_at(name)(0)
            result = SECTIONS[name].run(self) or {}
        except Exception as e:
            error = f"{type(e).__name__}: {e}"
            traceback.print_exc()
            self.partial["failed"] = {"phase": name, "error": error}
        finally:
            self.watchdog.disarm()
        if error is not None and self.device.type == "cuda":
            torch.cuda.empty_cache()
        record = {
            "rank": self.rank,
            "error": error,
            "elapsed_s": time.perf_counter() - start,
            "process_elapsed_s": time.perf_counter() - self.process_start,
            "memory": memory_report(self.device),
            "result": result,
        }
        self.partial["sections"][name] = record
        self._write_partial()
        self.log(f"{name}: {'ok' if error is None else 'FAILED: ' + error} in {record['elapsed_s']:.1f}s")
        # The other rank may still be in its part of this section (e.g. compiling): wait as long.
        self.watchdog.arm(f"exchange:{name}", timeout + 60)
        try:
            records = gather_json(record, self.job.meta_group)
        except Exception as e:
            self._abort(f"exchange:{name}", f"exchange with the other rank failed: {type(e).__name__}: {e}")
        self.watchdog.disarm()
        section = self._merge(name, records)
        self.merged["sections"][name] = section
        self.process_elapsed = max(r["process_elapsed_s"] for r in records)
        if name in self.communicating and section["status"] != "ok":
            self.comm_failed = True
        if self.rank == 0:
            self._finalize_json()

    def finish(self) -> int:
        failed = [n for n, s in self.merged["sections"].items() if s.get("status") == "error"]
        if self.rank == 0:
            self._finalize_json()
            print_table(self.merged)
            self.log(f"wrote {self.args.out}")
        self.watchdog.arm("shutdown", 120)
        dist.barrier(group=self.job.meta_group)
        self.trainer = self.extractor = self.features = None
        dist.destroy_process_group()
        self.watchdog.disarm()
        for path in self.partial_paths[self.rank : self.rank + 1]:
            if os.path.exists(path):
                os.remove(path)
        return 1 if failed and self.rank == 0 else 0


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        return None


def run(args: argparse.Namespace, layout: Layout, process_start: float) -> int:
    """Every section in order on this rank; the exit status (rank 0: 1 when a section failed)."""
    if args.compute_every_row:  # before Bench builds a drafter
        DFlashDrafter.skips_repeated_rows = False
    bench = Bench(args, layout, process_start)
    roles = "+".join(role for role in ROLES if role in bench.roles)
    bench.log(
        f"{bench.device} rank {bench.rank} ({roles}) of layout {bench.layout.name}, shape {args.shape}, "
        f"startup {bench.startup_s:.1f}s"
    )
    for name in SECTIONS:
        bench.run_section(name)
    return bench.finish()
