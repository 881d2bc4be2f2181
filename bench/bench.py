"""GPU-performance benchmark of dflash_mp: T target ranks (in tensor-parallel replicas of
k) + D drafter ranks, by default 1 + 1 on 2 ranks, or 1 rank for both roles.

    torchrun --nproc-per-node 2 bench/bench.py --shape qwen3-8b --out bench.json    # 2 GPUs
    torchrun --nproc-per-node 2 bench/bench.py --shape tiny --device cpu            # CPU, gloo
    torchrun --standalone --nproc-per-node 1 bench/bench.py --shape qwen3-8b --out bench.json  # 1 GPU
    torchrun --standalone --nproc-per-node 1 bench/bench.py --shape tiny --device cpu          # CPU, 1 rank
    torchrun --standalone --nproc-per-node 4 bench/bench.py --shape llama3-70b \
        --targets 2 --target-parallel 2 --drafters 2                    # one TP=2 replica, 2 drafters

Layouts (`--targets T --drafters D --target-parallel k`, T + D = WORLD_SIZE, k divides T; the
layout of dflash_mp.runtime.topology.Topology): target_only runs on every target rank (a replica's ranks
run each forward together; reported per replica, rank 0's replica at the top), drafter_only on
every drafter rank (DDP over the drafters when D > 1; the first drafter's at the top), transport
between rank 0 and the first drafter, pipeline over the whole layout (run_target / run_drafter),
colocated over every rank (both roles in each, DDP over all). With k > 1, target_parallel_check
compares the replica's hidden states and throughput with a one-GPU forward of the same weights.
--drafters 0 is a target-only run (`--target-parallel 2` on 2 ranks: one TP=2 replica, its check,
and colocated x2). Sections that need a whole target on one GPU (target_parallel_check, colocated)
are skipped when its weights do not fit; a target shard that fits no GPU is refused at start.

Measures in one run, each after warm-up: the bf16 matmul peak of each GPU (the MFU denominator),
the target alone (rank 0), the drafter alone (rank 1, one resident micro-batch), the transport alone
(dflash_mp.runtime.transport next to raw send/recv), the real pipeline (run_target / run_drafter with a
synthetic reader, an in-memory random target and drafter), and the colocated baseline (target +
drafter in every process, DDP over both). Models are random, built directly on the device.
On demand (`--sections setup,profile`): a torch.profiler breakdown of a drafter step by phase.

This file is the runner (per-rank partial JSON, the watchdog, the exchange after every section);
what the sections share (the rank's layout, job, config, resident models, fault injection) is
bench/benchlib/state.py, the flags are bench/options.py, the layouts bench/layout.py, each section
is a module of bench/sections/, the headline numbers bench/summary.py and their table bench/table.py,
the other helpers bench/benchlib/. Imports run one way: bench.py -> sections -> benchlib.

Every section runs under try/except and a watchdog: an error is recorded in the JSON, a rank
blocked on a failed or hung peer gives up after a timeout, and the JSON is rewritten after every
section, so a failure never costs the sections already measured. Rank 0 writes --out and prints
the table; the exit status is 0 when every section that ran succeeded. A timed section whose
measured steps skipped their update as non-finite more than rarely (random weights may give one)
fails: such steps run no AdamW and would read as fast ones (benchlib.count_nonfinite).

Single-rank mode (WORLD_SIZE 1, e.g. when only one GPU is available): the one process plays both
roles (matmul_peak, setup, drafter_only, target_only, profile; the drafter trains without DDP),
and colocated runs target forward + drafter step back to back in that process without DDP: the
colocated rate of one GPU, reported next to the two stage rates and the best split they imply.
pipeline and transport need two ranks and are recorded as skipped; the summary's 8-GPU projection
still follows from the two standalone rates. Each section's peak memory then includes the other
role's resident objects (the target's weights during drafter_only, the drafter's during
target_only); colocated first drops the drafter_only objects, so its peak is one GPU's pair.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import os  # noqa: E402
import platform  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import traceback  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

import benchlib as bl  # noqa: E402
import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from benchlib.state import BenchState  # noqa: E402
from layout import ROLES, Layout  # noqa: E402
from options import default_out, layout_from_env, parse_args  # noqa: E402
from sections import SECTIONS  # noqa: E402
from summary import summarize  # noqa: E402
from table import print_table  # noqa: E402

from dflash_mp.models.drafter import DFlashDrafter  # noqa: E402

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


class Bench(BenchState):
    """The runner: runs each section on every rank under a watchdog, exchanges and merges the
    ranks' records after it, and writes the JSON."""

    def __init__(self, args: argparse.Namespace, layout: Layout) -> None:
        # A previous run's partial files would read as a failed peer: each rank removes its own
        # before the rendezvous, so both are gone once init_job returns.
        self.partial_paths = [f"{args.out}.rank{r}.partial.json" for r in range(layout.world)]
        own = self.partial_paths[int(os.environ["RANK"])]
        if os.path.exists(own):
            os.remove(own)
        super().__init__(args, layout, PROCESS_START)
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
        bl.install_recompile_log()
        self.watchdog = bl.Watchdog(self._peer_state, self._abort, grace_s=args.peer_grace)

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
        bl.write_json(self.partial_paths[self.rank], self.partial)

    def _peers(self) -> list[dict]:
        return [
            state
            for rank, path in enumerate(self.partial_paths)
            if rank != self.rank and (state := bl.read_json(path)) is not None
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
            bl.deep_merge(section, r.get("result") or {})
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
        self.merged["total_s"] = time.perf_counter() - PROCESS_START
        bl.write_json(self.args.out, self.merged)

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
        bl.memory_reset(self.device)
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
            "process_elapsed_s": time.perf_counter() - PROCESS_START,
            "memory": bl.memory_report(self.device),
            "result": result,
        }
        self.partial["sections"][name] = record
        self._write_partial()
        self.log(f"{name}: {'ok' if error is None else 'FAILED: ' + error} in {record['elapsed_s']:.1f}s")
        # The other rank may still be in its part of this section (e.g. compiling): wait as long.
        self.watchdog.arm(f"exchange:{name}", timeout + 60)
        try:
            records = bl.gather_json(record, self.job.meta_group)
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


def main(argv=None) -> int:
    args = parse_args(argv, __doc__)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if on_cpu and args.shape != "tiny":
        raise SystemExit(f"bench.py: --shape {args.shape} needs GPUs; on CPU use --shape tiny --device cpu")
    if args.compute_every_row:  # before Bench builds a drafter
        DFlashDrafter.skips_repeated_rows = False
    layout = layout_from_env(args)
    args.out = args.out or default_out(args.shape, layout)
    bench = Bench(args, layout)
    roles = "+".join(role for role in ROLES if role in bench.roles)
    bench.log(
        f"{bench.device} rank {bench.rank} ({roles}) of layout {bench.layout.name}, shape {args.shape}, "
        f"startup {bench.startup_s:.1f}s"
    )
    for name in SECTIONS:
        bench.run_section(name)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
