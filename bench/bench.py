"""GPU-performance benchmark of dflash_mp (issue 6): 1 target rank + 1 drafter rank, or 1 rank for both.

    torchrun --nproc-per-node 2 bench/bench.py --shape qwen3-8b --out bench.json    # 2 GPUs
    torchrun --nproc-per-node 2 bench/bench.py --shape tiny --device cpu            # CPU, gloo
    torchrun --standalone --nproc-per-node 1 bench/bench.py --shape qwen3-8b --out bench.json  # 1 GPU
    torchrun --standalone --nproc-per-node 1 bench/bench.py --shape tiny --device cpu          # CPU, 1 rank

Measures in one run, each after warm-up: the bf16 matmul peak of each GPU (the MFU denominator),
the target alone (rank 0), the drafter alone (rank 1, one resident micro-batch), the transport alone
(dflash_mp.transport next to raw send/recv), the real pipeline (run_target / run_drafter with a
synthetic reader, an in-memory random target and drafter), and the colocated baseline (target +
drafter in every process, DDP over both). Models are random, built directly on the device.

Every section runs under try/except and a watchdog: an error is recorded in the JSON, a rank
blocked on a failed or hung peer gives up after a timeout, and the JSON is rewritten after every
section, so a failure never costs the sections already measured. Rank 0 writes --out and prints
the table; the exit status is 0 when every section that ran succeeded.

Single-rank mode (WORLD_SIZE 1, e.g. when only one GPU is available): the one process plays both
roles in the sections that do not communicate (matmul_peak, setup, drafter_only, target_only; the
drafter trains without DDP). pipeline, transport and colocated need two ranks and are recorded as
skipped; the summary's 8-GPU projection still follows from the two standalone rates. Each
section's peak memory then includes the other role's resident objects (the target's weights
during drafter_only, the drafter's during target_only).
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import gc  # noqa: E402
import itertools  # noqa: E402
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

from dflash_mp.distributed import init_job  # noqa: E402
from dflash_mp.roles import features_of, hidden_states_for_drafter, run_drafter, run_target  # noqa: E402
from dflash_mp.topology import Topology  # noqa: E402
from dflash_mp.trainer import DrafterTrainer, resolve_precision  # noqa: E402
from dflash_mp.transport import Receiver, Sender, pack_tokens  # noqa: E402

SCHEMA = "dflash_mp.bench/1"
SECTIONS = ("matmul_peak", "setup", "drafter_only", "target_only", "pipeline", "transport", "colocated")
# Sections whose ranks talk to each other (besides the exchange after every section): after a
# failure in one of them, point-to-point operations may be left unmatched, so later ones are skipped.
COMMUNICATING = {"pipeline", "transport", "colocated"}
ROLES = ("target", "drafter")  # rank r of a 2-rank run plays ROLES[r]; a 1-rank run plays both
SINGLE_RANK_SKIP = "needs 2 ranks (1 target + 1 drafter); this run has 1"
TIMEOUT_S = {
    "matmul_peak": 90,
    "setup": 240,
    "drafter_only": 420,  # the cold torch.compile of the drafter (flex_attention fwd + bwd)
    "target_only": 180,
    "pipeline": 300,
    "transport": 120,
    "colocated": 420,
}
DEFAULTS = {  # per shape kind: warm-up and measured iterations
    "gpu": dict(
        warmup=3, iters=20, colocated_iters=10, pipeline_steps=30, transport_iters=50, matmul_iters=50
    ),
    "tiny": dict(warmup=2, iters=8, colocated_iters=4, pipeline_steps=8, transport_iters=8, matmul_iters=5),
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawTextHelpFormatter
    )
    p.add_argument("--shape", choices=sorted(bl.SHAPES), default="qwen3-8b")
    p.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto")
    p.add_argument("--out", default="", help="JSON output (default: bench-<shape>.json)")
    p.add_argument("--micro-batch", type=int, default=1, help="sequences per micro-batch")
    p.add_argument("--grad-accum", type=int, default=1, help="micro-batches per optimizer step")
    p.add_argument("--warmup", type=int, help="warm-up iterations/steps of every section (>= 1)")
    p.add_argument("--iters", type=int, help="measured iterations: target only, drafter only")
    p.add_argument("--colocated-iters", type=int, help="measured steps of the colocated baseline")
    p.add_argument("--pipeline-steps", type=int, help="measured optimizer steps of the pipeline")
    p.add_argument("--transport-iters", type=int, help="measured messages of the transport section")
    p.add_argument("--matmul-iters", type=int, help="measured matmuls of the peak")
    p.add_argument("--matmul-n", type=int, help="matmul side (default: 8192 on GPU shapes)")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma list of {', '.join(SECTIONS)}")
    p.add_argument(
        "--timeout-scale", type=float, default=1.0, help="multiplies every section's watchdog timeout"
    )
    p.add_argument(
        "--time-budget", type=float, default=420.0, help="start no section after this many s (0: none)"
    )
    p.add_argument(
        "--peer-grace", type=float, default=30.0, help="s to wait on a peer that reported a failure"
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--block-size", type=int, help="draft block size (default: the shape's, 16 on GPU shapes)")
    p.add_argument(
        "--override", action="append", default=[], help="Hydra override for the config (repeatable)"
    )
    p.add_argument(
        "--fault",
        default="",
        help="testing aid: SECTION:RANK:raise|hang[:CALL] fails that rank there (pipeline: at its CALL-th micro-batch)",
    )
    args = p.parse_args(argv)
    defaults = DEFAULTS["tiny" if args.shape == "tiny" else "gpu"]
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.warmup = max(1, args.warmup)
    for key in ("iters", "colocated_iters", "pipeline_steps", "transport_iters", "matmul_iters"):
        setattr(args, key, max(1, getattr(args, key)))
    args.sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        p.error(f"unknown sections {unknown}; known: {', '.join(SECTIONS)}")
    args.out = args.out or f"bench-{args.shape}.json"
    if args.fault:
        parts = args.fault.split(":")
        if len(parts) not in (3, 4) or parts[0] not in SECTIONS or parts[2] not in ("raise", "hang"):
            p.error("--fault is SECTION:RANK:raise|hang[:CALL]")
        args.fault = (parts[0], int(parts[1]), parts[2], int(parts[3]) if len(parts) == 4 else 0)
    return args


class TimedExtractor:
    """The target's extractor, with a device-timeline mark before and after every forward."""

    def __init__(self, extractor, device: torch.device, on_call=None) -> None:
        self.extractor = extractor
        self.hidden_size, self.layer_ids = extractor.hidden_size, extractor.layer_ids
        self.marks = bl.Marks(device)
        self.calls: list[tuple[int, int]] = []
        self.on_call = on_call

    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.on_call is not None:
            self.on_call(len(self.calls) + 1)
        start = self.marks.mark()
        out = self.extractor(input_ids)
        self.calls.append((start, self.marks.mark()))
        return out


class RecordingTrainer:
    """DrafterTrainer as run_drafter sees it, plus a device-timeline mark where each step's data
    is in (after the receive's stream wait) and where its optimizer step ends. In between the
    drafter is busy; outside it waits for data."""

    def __init__(self, trainer: DrafterTrainer, device: torch.device, on_call=None) -> None:
        self.trainer = trainer
        self.marks = bl.Marks(device)
        self.steps: list[tuple[int, int]] = []
        self._start: int | None = None
        self.on_call = on_call
        self.micro_steps = 0

    @property
    def step(self) -> int:
        return self.trainer.step

    def micro_step(self, batch, last_of_step: bool) -> None:
        self.micro_steps += 1
        if self.on_call is not None:
            self.on_call(self.micro_steps)
        if self._start is None:
            self._start = self.marks.mark()
        self.trainer.micro_step(batch, last_of_step=last_of_step)

    def optimizer_step(self, extra: dict | None = None) -> dict:
        record = self.trainer.optimizer_step(extra)
        self.steps.append((self._start, self.marks.mark()))
        self._start = None
        return record


def roles_by_rank(world: int) -> dict[str, str]:
    """The header's setup.roles: rank -> role(s), '+'-joined where one rank plays both."""
    if world == 1:
        return {"0": "+".join(ROLES)}
    return {str(r): role for r, role in enumerate(ROLES)}


def rank_of(setup: dict, role: str) -> str:
    """The rank (as a JSON key) that ran `role`, from setup.roles (2-rank layout if absent)."""
    roles = setup.get("roles") or roles_by_rank(2)
    return next(rank for rank, played in roles.items() if role in played.split("+"))


def busy_fraction(marks: bl.Marks, intervals: list[tuple[int, int]]) -> tuple[float, float]:
    """(busy seconds, span seconds) over `intervals` of `marks`."""
    busy = sum(marks.seconds(a, b) for a, b in intervals)
    return busy, marks.seconds(intervals[0][0], intervals[-1][1])


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.shape = bl.SHAPES[args.shape]
        if args.block_size:
            self.shape = dataclasses.replace(self.shape, block_size=args.block_size)
        self.topology = Topology(targets=1, drafters=1, grad_accum=args.grad_accum)
        world = int(os.environ.get("WORLD_SIZE", "0"))
        if world not in (1, 2):
            raise SystemExit(
                f"bench.py runs on 2 ranks (1 target + 1 drafter) or on 1 rank (both roles, no "
                f"pipeline/transport/colocated); WORLD_SIZE={world or 'unset'}: launch it with "
                "torchrun --nproc-per-node 2 (or --standalone --nproc-per-node 1 on a single GPU)"
            )
        self.world = world
        self.single = world == 1
        # A previous run's partial files would read as a failed peer: each rank removes its own
        # before the rendezvous, so both are gone once init_job returns.
        self.partial_paths = [f"{args.out}.rank{r}.partial.json" for r in range(world)]
        own = self.partial_paths[int(os.environ["RANK"])]
        if os.path.exists(own):
            os.remove(own)
        # One rank plays both roles: no drafter group, so its trainer runs without DDP.
        self.job = init_job(self.topology, args.device, drafter_group=not self.single)
        self.rank, self.device = self.job.rank, self.job.device
        # The roles this process plays: one per rank on 2 ranks, both on 1.
        self.roles = set(ROLES) if self.single else {ROLES[self.rank]}
        self.startup_s = time.perf_counter() - PROCESS_START
        self.cfg = bl.bench_config(self.shape, self.device, args.micro_batch, args.grad_accum, args.override)
        self.dtype, self.attention, self.compiled = resolve_precision(self.cfg, self.device)
        self.B, self.A, self.S = args.micro_batch, args.grad_accum, self.shape.seq_len
        self.feature_size = self.shape.hidden * len(self.shape.layer_ids)
        self.reader = bl.SyntheticReader(self.shape, self.B, seed=args.seed)
        self.partial: dict = {"rank": self.rank, "sections": {}, "failed": None}
        self.merged: dict = self._header()
        self.process_elapsed = 0.0
        self.comm_failed = False
        # Objects that live from one section to the next.
        self.extractor = None
        self.trainer: DrafterTrainer | None = None
        self.features = None
        self.peak_flops: float | None = None
        self._aborting = threading.Lock()
        bl.install_recompile_log()
        self.watchdog = bl.Watchdog(self._peer_state, self._abort, grace_s=args.peer_grace)

    # ------------------------------------------------------------------ plumbing

    def fault_at(self, section: str):
        """`--fault`: a callable(call) that raises or hangs at the chosen section, rank and call."""

        def check(call: int) -> None:
            fault = self.args.fault
            if fault and fault[0] == section and fault[1] == self.rank and fault[3] == call:
                self.log(f"injecting fault: {fault}")
                if fault[2] == "raise":
                    raise RuntimeError(f"injected fault {fault}")
                time.sleep(10**6)

        return check

    def log(self, message: str) -> None:
        print(f"[bench r{self.rank} {time.perf_counter() - PROCESS_START:7.1f}s] {message}", flush=True)

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
                "roles": roles_by_rank(self.world),
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

    def _peer_state(self) -> dict | None:
        if self.single:  # no peer: the watchdog only enforces deadlines
            return None
        return bl.read_json(self.partial_paths[1 - self.rank])

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
                peer = self._peer_state() or {}
                for section_name in SECTIONS:
                    if section_name in self.merged["sections"]:
                        continue
                    records = [
                        rec
                        for rec in (
                            self.partial["sections"].get(section_name),
                            peer.get("sections", {}).get(section_name),
                        )
                        if rec
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
        if self.single and name in COMMUNICATING:
            return SINGLE_RANK_SKIP
        budget = self.args.time_budget
        if budget > 0 and self.process_elapsed > budget:
            return f"time budget: {self.process_elapsed:.0f}s elapsed > --time-budget {budget:.0f}s"
        if name in COMMUNICATING and self.comm_failed:
            return "an earlier communicating section failed (unmatched point-to-point operations)"
        needs = {
            "drafter_only": ["setup"],
            "target_only": ["setup"],
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
        timeout = TIMEOUT_S[name] * self.args.timeout_scale
        self.watchdog.arm(name, timeout)
        start = time.perf_counter()
        error, result = None, {}
        try:
            self.fault_at(name)(0)
            result = getattr(self, f"section_{name}")() or {}
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
        if name in COMMUNICATING and section["status"] != "ok":
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

    # ------------------------------------------------------------------ sections

    def section_matmul_peak(self) -> dict:
        n = self.args.matmul_n or self.shape.matmul_n
        result = bl.matmul_peak(self.device, n, warmup=max(3, self.args.warmup), iters=self.args.matmul_iters)
        result["device_name"] = (
            torch.cuda.get_device_name(self.device) if self.device.type == "cuda" else "cpu"
        )
        self.peak_flops = result["tflops"] * 1e12
        return {"per_rank": {str(self.rank): result}}

    def section_setup(self) -> dict:
        result = {}
        if "target" in self.roles:
            result["target"] = self._setup_target()
        if "drafter" in self.roles:
            result["drafter"] = self._setup_drafter()
        return result

    def _setup_target(self) -> dict:
        start = time.perf_counter()
        self.extractor = bl.random_target(
            self.shape, self.dtype, self.device, seed=self.args.seed, compile_layers=self.compiled
        )
        bl.sync(self.device)
        flops = bl.target_flops_per_seq(self.extractor, self.shape)
        return {
            "build_s": time.perf_counter() - start,
            "params_used": flops["params_used"],
            "layers_run": flops["layers_run"],
            "flops_per_seq": flops["per_seq"],
            "flops_breakdown": {k: flops[k] for k in ("linear", "attention")},
            "flops_counting": flops["counting"],
        }

    def _setup_drafter(self) -> dict:
        start = time.perf_counter()
        # The drafter group: None on 1 rank (the trainer then runs without DDP).
        self.trainer = self._new_trainer(group=self.job.drafter_group)
        batch = self.reader.read(0)
        with bl.seeded(self.device, self.args.seed + 2):
            hidden = torch.randn(self.B, self.S, self.feature_size, dtype=self.dtype, device=self.device)
        self.features = bl.received_form(batch, hidden, self.device)
        flops = bl.drafter_flops_per_micro_batch(self.shape, self.cfg, batch)
        bl.sync(self.device)
        return {
            "build_s": time.perf_counter() - start,
            "params": bl.count_params(self.trainer.drafter),
            "flops_per_micro_batch": flops["train"],
            "flops_per_micro_batch_head_as_trainable": flops["train_head_as_trainable"],
            "flops_breakdown_forward": {
                k: flops[k] for k in ("forward", "layers_linear", "layers_attention", "fc", "lm_head")
            },
            "tokens": {
                k: flops[k]
                for k in (
                    "query_tokens",
                    "context_tokens",
                    "valid_anchors",
                    "scored_tokens",
                    "attended_pairs_per_layer",
                    "dense_pairs_per_layer",
                )
            },
            "flops_counting": flops["counting"],
        }

    def _new_trainer(self, group) -> DrafterTrainer:
        drafter = bl.random_drafter(self.shape, self.device, seed=self.args.seed, model_cfg=self.cfg.model)
        embed_and_head = bl.random_embed_and_head(self.shape, self.dtype, self.device, seed=self.args.seed)
        return DrafterTrainer(
            self.cfg,
            self.device,
            self.cfg.train.max_steps,
            group=group,
            drafter=drafter,
            embed_and_head=embed_and_head,
        )

    def _mfu(self, flops_per_s: float) -> float | None:
        return flops_per_s / self.peak_flops if self.peak_flops else None

    def section_drafter_only(self) -> dict:
        if "drafter" not in self.roles:
            return {}
        trainer, batch, args = self.trainer, self.features, self.args
        watch = bl.CompileWatch()
        step_s, skipped, loss = [], 0, None
        start = prev = time.perf_counter()
        first_step_s = t0 = 0.0
        for i in range(args.warmup + args.iters):
            if i == args.warmup:
                bl.sync(self.device)
                watch.start()
                t0 = prev = time.perf_counter()
            for micro in range(self.A):
                trainer.micro_step(batch, last_of_step=micro == self.A - 1)
            record = trainer.optimizer_step()
            now = time.perf_counter()
            if i == 0:
                first_step_s = now - start
                self.log(
                    f"drafter_only: first step (compile included) {first_step_s:.1f}s, loss {record['loss']:.3f}"
                )
            if i >= args.warmup:
                step_s.append(now - prev)
                skipped += bool(record["skipped"])
                loss = record["loss"]
            prev = now
        bl.sync(self.device)
        seconds = time.perf_counter() - t0
        steps = args.iters
        counted = self.partial["sections"]["setup"]["result"]["drafter"]
        flops = counted["flops_per_micro_batch"] * self.A * steps
        flops_head_as_trainable = counted["flops_per_micro_batch_head_as_trainable"] * self.A * steps
        return {
            "samples_per_s": steps * self.A * self.B / seconds,
            "ms_per_step": seconds / steps * 1e3,
            "ms_per_micro_batch": seconds / (steps * self.A) * 1e3,
            "step_time": bl.distribution(step_s),
            "tflops": flops / seconds / 1e12,
            "mfu": self._mfu(flops / seconds),
            "mfu_head_as_trainable": self._mfu(flops_head_as_trainable / seconds),
            "first_step_s": first_step_s,
            "process_start_to_first_step_s": start + first_step_s - PROCESS_START,
            "steps": steps,
            "warmup": args.warmup,
            "skipped_nonfinite_steps": skipped,
            "last_loss": loss,
            "recompiles_after_warmup": watch.result()["recompiles"],
            "recompile_reasons": watch.result()["recompile_reasons"],
            "dynamo_frames_compiled_total": bl.frames_compiled_total(),
            "compile_seconds_so_far": bl.compile_seconds(),
        }

    def section_target_only(self) -> dict:
        if "target" not in self.roles:
            return {}
        args, batch = self.args, self.reader.read(0)
        watch = bl.CompileWatch()
        start, first_forward_s = time.perf_counter(), None
        for i in range(args.warmup):
            hidden_states_for_drafter(self.extractor, batch, self.dtype, self.device)
            if i == 0:
                bl.sync(self.device)
                first_forward_s = time.perf_counter() - start
                self.log(f"target_only: first forward (compile included) {first_forward_s:.1f}s")
        bl.sync(self.device)
        watch.start()
        marks = bl.Marks(self.device)
        t0 = time.perf_counter()
        marks.mark()
        for _ in range(args.iters):
            hidden = hidden_states_for_drafter(self.extractor, batch, self.dtype, self.device)
            marks.mark()
        bl.sync(self.device)
        seconds = time.perf_counter() - t0
        assert hidden.shape == (self.B, self.S, self.feature_size), hidden.shape
        flops = self.partial["sections"]["setup"]["result"]["target"]["flops_per_seq"] * self.B * args.iters
        return {
            "samples_per_s": args.iters * self.B / seconds,
            "ms_per_seq": seconds / (args.iters * self.B) * 1e3,
            "forward_time": bl.distribution(marks.intervals()),
            "tflops": flops / seconds / 1e12,
            "mfu": self._mfu(flops / seconds),
            "iters": args.iters,
            "warmup": args.warmup,
            "first_forward_s": first_forward_s,
            "compile_seconds_so_far": bl.compile_seconds(),
            "recompiles_after_warmup": watch.result()["recompiles"],
        }

    def section_pipeline(self) -> dict:
        args, warmup = self.args, self.args.warmup
        steps = warmup + args.pipeline_steps
        start = time.perf_counter()
        if self.rank == 0:
            extractor = TimedExtractor(self.extractor, self.device, on_call=self.fault_at("pipeline"))
            run_target(self.cfg, self.job, 0, steps, self.reader, extractor, self.dtype)
            bl.sync(self.device)
            busy, span = busy_fraction(extractor.marks, extractor.calls[warmup * self.A :])
            return {
                "target_busy_frac": busy / span,
                "target_wait_frac": 1 - busy / span,
                "target_forward_time": bl.distribution(
                    [extractor.marks.seconds(a, b) for a, b in extractor.calls[warmup * self.A :]]
                ),
                "target_elapsed_s": time.perf_counter() - start,
            }
        trainer = RecordingTrainer(self.trainer, self.device, on_call=self.fault_at("pipeline"))
        records, stamps = [], []
        watch = bl.CompileWatch()

        def on_step(record: dict) -> None:
            records.append(record)
            stamps.append(time.perf_counter())
            if len(records) == 1:
                self.log(f"pipeline: first step after {stamps[0] - start:.1f}s")
            if len(records) == warmup:
                watch.start()

        run_drafter(self.cfg, self.job, trainer, 0, steps, on_step)
        bl.sync(self.device)
        measured = len(stamps) - warmup
        window = stamps[-1] - stamps[warmup - 1]
        samples_per_s = measured * self.A * self.B / window
        busy, span = busy_fraction(trainer.marks, trainer.steps[warmup:])
        last = records[-1]
        return {
            "samples_per_s": samples_per_s,
            "tokens_per_s": samples_per_s * self.S,
            "ms_per_step": window / measured * 1e3,
            "steps": measured,
            "warmup": warmup,
            "step_time": bl.distribution(
                [b - a for a, b in zip(stamps[warmup - 1 :], stamps[warmup:], strict=False)]
            ),
            "time_to_first_step_s": stamps[0] - start,
            "drafter_busy_frac": busy / span,
            "drafter_wait_frac": 1 - busy / span,
            "runtime_reported": {
                k: last.get(k)
                for k in ("drafter_busy_frac", "drafter_wait_frac", "target_busy_frac", "target_wait_frac")
            },
            "recompiles_after_warmup": watch.result()["recompiles"],
            "recompile_reasons": watch.result()["recompile_reasons"],
            "skipped_nonfinite_steps": sum(bool(r["skipped"]) for r in records[warmup:]),
        }

    def section_transport(self) -> dict:
        args = self.args
        total, warmup = args.warmup + args.transport_iters, args.warmup
        shape = (self.B, self.S, self.feature_size)
        batch = self.reader.read(0)
        tokens = pack_tokens(batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids)
        message_bytes = (
            tokens.numel() * tokens.element_size() + self.B * self.S * self.feature_size * self.dtype.itemsize
        )
        hidden_bytes = self.B * self.S * self.feature_size * self.dtype.itemsize
        hidden = torch.randn(shape, dtype=self.dtype, device=self.device)
        result: dict = {
            "message_shape": list(shape),
            "message_bytes": message_bytes,
            "messages": args.transport_iters,
        }
        t0 = t1 = 0.0
        if self.rank == 0:
            sender = Sender(self.job.meta_group, None, self.device, self.cfg.topology.max_inflight_sends)
            for m in range(total):
                if m == warmup:
                    sender.close()
                    bl.sync(self.device)
                    t0 = time.perf_counter()
                sender.send_header(1, m, 0, self.B, self.S, self.feature_size, self.dtype, 0)
                sender.send_tensors(1, tokens, hidden)
            sender.send_end_of_data(1, total)
            sender.close()
            bl.sync(self.device)
            t1 = time.perf_counter()
            result["sender_msgs_per_s"] = args.transport_iters / (t1 - t0)
        else:
            receiver = Receiver(
                self.job.meta_group, None, self.device, itertools.chain(range(total), [total]), lambda m: 0
            )
            for m in range(total):
                if m == warmup:
                    bl.sync(self.device)
                    t0 = time.perf_counter()
                features = receiver.next()
                receiver.prefetch()
                if features.end_of_data or features.index != m:
                    raise RuntimeError(
                        f"transport: got micro-batch {features.index} (end {features.end_of_data}), expected {m}"
                    )
            bl.sync(self.device)
            t1 = time.perf_counter()
            if not receiver.next().end_of_data:
                raise RuntimeError("transport: no end-of-data flag after the last message")
            if not torch.equal(features.input_ids.cpu(), batch.input_ids):
                raise RuntimeError("transport: received tokens differ from the sent ones")
            seconds = t1 - t0
            result.update(
                msgs_per_s=args.transport_iters / seconds,
                gb_per_s=args.transport_iters * message_bytes / seconds / bl.GB,
                gib_per_s=args.transport_iters * message_bytes / seconds / bl.GIB,
                ms_per_msg=seconds / args.transport_iters * 1e3,
            )
        # Raw point-to-point at the hidden-state size, on the same (default) group.
        buffer = hidden if self.rank == 0 else torch.empty(shape, dtype=self.dtype, device=self.device)
        for i in range(total):
            if i == warmup:
                bl.sync(self.device)
                t0 = time.perf_counter()
            if self.rank == 0:
                dist.send(buffer, dst=1)
            else:
                dist.recv(buffer, src=0)
        bl.sync(self.device)
        seconds = time.perf_counter() - t0
        if self.rank == 1:
            result.update(
                raw_msgs_per_s=args.transport_iters / seconds,
                raw_gb_per_s=args.transport_iters * hidden_bytes / seconds / bl.GB,
                raw_gib_per_s=args.transport_iters * hidden_bytes / seconds / bl.GIB,
                raw_message_bytes=hidden_bytes,
            )
        return result

    def section_colocated(self) -> dict:
        args = self.args
        if self.rank == 1:  # the drafter-only objects make room for this rank's own target
            self.trainer = self.features = None
            gc.collect()
            if self.device.type == "cuda":
                torch.cuda.empty_cache()
        start = time.perf_counter()
        if self.extractor is None:
            self.extractor = bl.random_target(
                self.shape, self.dtype, self.device, seed=self.args.seed + 10, compile_layers=self.compiled
            )
        trainer = self._new_trainer(group=dist.group.WORLD)  # DDP over both ranks
        build_s = time.perf_counter() - start
        watch = bl.CompileWatch()
        step_s, first_step_s, t0 = [], 0.0, 0.0
        start = prev = time.perf_counter()
        for i in range(args.warmup + args.colocated_iters):
            if i == args.warmup:
                bl.sync(self.device)
                watch.start()
                t0 = prev = time.perf_counter()
            for micro in range(self.A):
                m = (i * 2 + self.rank) * self.A + micro
                batch = bl.batch_to(self.reader.read(m), self.device)
                hidden = hidden_states_for_drafter(self.extractor, batch, self.dtype, self.device)
                trainer.micro_step(features_of(batch, hidden), last_of_step=micro == self.A - 1)
            trainer.optimizer_step()
            now = time.perf_counter()
            if i == 0:
                first_step_s = now - start
                self.log(f"colocated: first step (compile included) {first_step_s:.1f}s")
            if i >= args.warmup:
                step_s.append(now - prev)
            prev = now
        bl.sync(self.device)
        seconds = time.perf_counter() - t0
        del trainer
        return {
            "per_rank": {
                str(self.rank): {
                    "samples_per_s": args.colocated_iters * self.A * self.B / seconds,
                    "ms_per_step": seconds / args.colocated_iters * 1e3,
                    "step_time": bl.distribution(step_s),
                    "build_s": build_s,
                    "first_step_s": first_step_s,
                    "recompiles_after_warmup": watch.result()["recompiles"],
                    "recompile_reasons": watch.result()["recompile_reasons"],
                }
            },
            "steps": args.colocated_iters,
            "warmup": args.warmup,
        }


# ---------------------------------------------------------------------- summary and table


def _nccl_version() -> str | None:
    try:
        version = torch.cuda.nccl.version()
        return ".".join(map(str, version)) if isinstance(version, tuple) else str(version)
    except Exception:
        return None


def _get(d: dict, *keys):
    for key in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(key)
    return d


def summarize(merged: dict) -> dict:
    """Headline numbers (a pure function of the sections; None where a section did not run)."""
    s = merged["sections"]
    peaks = {
        r: v.get("tflops")
        for r, v in (_get(s, "matmul_peak", "per_rank") or {}).items()
        if isinstance(v, dict)
    }
    target_rate = _get(s, "target_only", "samples_per_s")
    drafter_rate = _get(s, "drafter_only", "samples_per_s")
    pipeline_rate = _get(s, "pipeline", "samples_per_s")
    colocated_ranks = [
        v["samples_per_s"]
        for v in (_get(s, "colocated", "per_rank") or {}).values()
        if "samples_per_s" in (v or {})
    ]
    colocated_rate = sum(colocated_ranks) if len(colocated_ranks) == 2 else None
    if colocated_rate is not None:
        s["colocated"]["samples_per_s_total"] = colocated_rate
        s["colocated"]["tokens_per_s_total"] = colocated_rate * merged["shape"]["seq_len"]
    bottleneck = min(target_rate, drafter_rate) if target_rate and drafter_rate else None
    efficiency = pipeline_rate / bottleneck if pipeline_rate and bottleneck else None
    if efficiency is not None:
        s["pipeline"]["efficiency"] = efficiency
        s["pipeline"]["efficiency_definition"] = (
            "pipeline samples/s / min(target-only, drafter-only samples/s)"
        )
    target_flops = _get(s, "setup", "target", "flops_per_seq")
    drafter_flops_mb = _get(s, "setup", "drafter", "flops_per_micro_batch")
    micro_batch = merged["setup"]["micro_batch"]
    per_sample = (
        target_flops + drafter_flops_mb / micro_batch
        if target_flops is not None and drafter_flops_mb
        else None
    )
    total_peak = sum(peaks.values()) * 1e12 if len(peaks) == 2 and all(peaks.values()) else None

    def system_mfu(rate):
        return rate * per_sample / total_peak if rate and per_sample and total_peak else None

    target_rank, drafter_rank = rank_of(merged["setup"], "target"), rank_of(merged["setup"], "drafter")
    memory = {}
    for label, section, rank in (
        ("target_only", "target_only", target_rank),
        ("target_in_pipeline", "pipeline", target_rank),
        ("drafter_only", "drafter_only", drafter_rank),
        ("drafter_in_pipeline", "pipeline", drafter_rank),
        ("colocated_rank0", "colocated", "0"),
        ("colocated_rank1", "colocated", "1"),
    ):
        report = _get(s, section, "per_rank", rank, "memory") or {}
        memory[label] = report.get("peak_allocated_gb", report.get("host_peak_rss_gb"))
    recompiles = {
        "drafter_only": _get(s, "drafter_only", "recompiles_after_warmup"),
        "target_only": _get(s, "target_only", "recompiles_after_warmup"),
        "pipeline_drafter": _get(s, "pipeline", "recompiles_after_warmup"),
        "colocated_rank0": _get(s, "colocated", "per_rank", "0", "recompiles_after_warmup"),
        "colocated_rank1": _get(s, "colocated", "per_rank", "1", "recompiles_after_warmup"),
    }
    projection = None
    if target_rate and drafter_rate:
        # Idealised (no DDP or transport cost): T targets + D drafters on 8 GPUs, vs 8 colocated GPUs.
        splits = [
            {"targets": t, "drafters": 8 - t, "samples_per_s": min(t * target_rate, (8 - t) * drafter_rate)}
            for t in range(1, 8)
        ]
        best = max(splits, key=lambda x: x["samples_per_s"])
        projection = {
            "note": "standalone rates x GPUs, no communication cost: an upper bound to compare splits",
            "best_split": f"{best['targets']}t{best['drafters']}d",
            "best_samples_per_s": best["samples_per_s"],
            "colocated_8_gpus_samples_per_s": 8 / (1 / target_rate + 1 / drafter_rate),
            "splits": splits,
        }
    summary = {
        "matmul_peak_tflops": peaks,
        "target_only": {
            "samples_per_s": target_rate,
            "ms_per_seq": _get(s, "target_only", "ms_per_seq"),
            "mfu": _get(s, "target_only", "mfu"),
        },
        "drafter_only": {
            "samples_per_s": drafter_rate,
            "ms_per_step": _get(s, "drafter_only", "ms_per_step"),
            "mfu": _get(s, "drafter_only", "mfu"),
            "mfu_head_as_trainable": _get(s, "drafter_only", "mfu_head_as_trainable"),
        },
        "transport": {
            "gb_per_s": _get(s, "transport", "gb_per_s"),
            "msgs_per_s": _get(s, "transport", "msgs_per_s"),
            "raw_gb_per_s": _get(s, "transport", "raw_gb_per_s"),
            "raw_gib_per_s": _get(s, "transport", "raw_gib_per_s"),
        },
        "pipeline": {
            "samples_per_s": pipeline_rate,
            "tokens_per_s": _get(s, "pipeline", "tokens_per_s"),
            "efficiency": efficiency,
            "bottleneck": None
            if not bottleneck
            else ("target" if target_rate <= drafter_rate else "drafter"),
            "system_mfu": system_mfu(pipeline_rate),
            "target_busy_frac": _get(s, "pipeline", "target_busy_frac"),
            "drafter_busy_frac": _get(s, "pipeline", "drafter_busy_frac"),
        },
        "colocated": {
            "samples_per_s": colocated_rate,
            "system_mfu": system_mfu(colocated_rate),
            "pipeline_over_colocated": pipeline_rate / colocated_rate
            if pipeline_rate and colocated_rate
            else None,
        },
        "peak_memory_gb": memory,
        "peak_memory_kind": "torch.cuda.max_memory_allocated"
        if merged["setup"]["device"] == "cuda"
        else "host peak RSS (CPU run)",
        "time_to_first_step_s": {
            "drafter_cold_compile": _get(s, "drafter_only", "first_step_s"),
            "process_start_to_first_drafter_step": _get(s, "drafter_only", "process_start_to_first_step_s"),
            "pipeline": _get(s, "pipeline", "time_to_first_step_s"),
            "colocated_rank0": _get(s, "colocated", "per_rank", "0", "first_step_s"),
        },
        "recompiles_after_warmup": recompiles,
        "useful_flops_per_sample": per_sample,
        "projection_8_gpus": projection,
        "statuses": {name: sec.get("status") for name, sec in s.items()},
    }
    if merged["setup"].get("world_size") == 1:
        summary["peak_memory_note"] = (
            "1 rank plays both roles: each section's peak includes the other role's resident objects"
        )
    return summary


def _fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    if value is None:
        return "-"
    if isinstance(value, float) and spec.endswith("%"):
        return f"{value:{spec}}"
    return f"{value:{spec}}{suffix}"


def print_table(merged: dict) -> None:
    sm = merged.get("summary") or summarize(merged)
    shape, setup = merged["shape"], merged["setup"]
    world = setup.get("world_size", 2)
    peak_ranks = list(sm["matmul_peak_tflops"]) or [str(r) for r in range(world)]
    memory_keys = ("target_in_pipeline", "drafter_in_pipeline", "colocated_rank0", "colocated_rank1")
    memory_label = "target | drafter | coloc r0, r1"
    if world == 1:  # no pipeline: the standalone sections' peaks
        memory_keys, memory_label = ("target_only", "drafter_only"), "target only | drafter only"
    rows = [
        (
            "matmul peak",
            "TFLOP/s " + " | ".join(f"rank{r}" for r in peak_ranks),
            " | ".join(_fmt(v, ".1f") for v in sm["matmul_peak_tflops"].values()) or "-",
        ),
        (
            f"target only (r{rank_of(setup, 'target')})",
            "samples/s | ms/seq | MFU",
            f"{_fmt(sm['target_only']['samples_per_s'])} | {_fmt(sm['target_only']['ms_per_seq'], '.1f')} | "
            f"{_fmt(sm['target_only']['mfu'], '.1%')}",
        ),
        (
            f"drafter only (r{rank_of(setup, 'drafter')})",
            "samples/s | ms/step | MFU (head as trainable)",
            f"{_fmt(sm['drafter_only']['samples_per_s'])} | {_fmt(sm['drafter_only']['ms_per_step'], '.1f')} | "
            f"{_fmt(sm['drafter_only']['mfu'], '.1%')} ({_fmt(sm['drafter_only']['mfu_head_as_trainable'], '.1%')})",
        ),
        (
            "transport",
            "msgs/s | GB/s | raw GB/s",
            f"{_fmt(sm['transport']['msgs_per_s'], '.1f')} | {_fmt(sm['transport']['gb_per_s'], '.1f')} | "
            f"{_fmt(sm['transport']['raw_gb_per_s'], '.1f')}",
        ),
        (
            "pipeline 1t+1d",
            "samples/s | tokens/s | efficiency",
            f"{_fmt(sm['pipeline']['samples_per_s'])} | {_fmt(sm['pipeline']['tokens_per_s'], '.0f')} | "
            f"{_fmt(sm['pipeline']['efficiency'], '.2f')} (bottleneck {sm['pipeline']['bottleneck'] or '-'})",
        ),
        (
            "",
            "busy target | drafter, sys MFU",
            f"{_fmt(sm['pipeline']['target_busy_frac'], '.0%')} | {_fmt(sm['pipeline']['drafter_busy_frac'], '.0%')}, "
            f"{_fmt(sm['pipeline']['system_mfu'], '.1%')}",
        ),
        (
            "colocated DDP x2",
            "samples/s total | pipeline/coloc",
            f"{_fmt(sm['colocated']['samples_per_s'])} | {_fmt(sm['colocated']['pipeline_over_colocated'], '.2f')}",
        ),
        (
            "8-GPU projection",
            "best split: samples/s | coloc x8",
            "-"
            if not sm.get("projection_8_gpus")
            else f"{sm['projection_8_gpus']['best_split']}: {sm['projection_8_gpus']['best_samples_per_s']:.2f} | "
            f"{sm['projection_8_gpus']['colocated_8_gpus_samples_per_s']:.2f} (upper bounds)",
        ),
        (
            "peak memory GB",
            memory_label,
            " | ".join(_fmt(sm["peak_memory_gb"][k], ".1f") for k in memory_keys),
        ),
        (
            "first step s",
            "drafter cold | pipeline | coloc",
            " | ".join(
                _fmt(sm["time_to_first_step_s"][k], ".1f")
                for k in ("drafter_cold_compile", "pipeline", "colocated_rank0")
            ),
        ),
        (
            "recompiles",
            "after warm-up",
            ", ".join(f"{k} {'-' if v is None else v}" for k, v in sm["recompiles_after_warmup"].items()),
        ),
    ]
    title = (
        f"dflash_mp bench: {shape['name']} (target {shape['layers']}L h{shape['hidden']}, runs "
        f"{shape['target_layers_run']}; drafter {shape['draft_layers']}L; S={shape['seq_len']}, "
        f"{shape['num_anchors']} anchors x {shape['block_size']}; B={setup['micro_batch']} A={setup['grad_accum']}) "
        f"on {world}x {setup['device_name']}"
    )
    lines = [title, "-" * min(len(title), 110)]
    width = max(len(b) for _, b, _ in rows)
    lines += [f"{a:<18} {b:<{width}} {c}" for a, b, c in rows]
    for name, section in merged["sections"].items():
        if section.get("status") == "error":
            for rank, error in (section.get("errors") or {}).items():
                lines.append(f"ERROR {name} rank {rank}: {error[:300]}")
        elif section.get("status") == "skipped":
            lines.append(f"skipped {name}: {section.get('reason')}")
    if merged.get("aborted"):
        lines.append(f"ABORTED: {merged['aborted']}")
    print("\n".join(lines), flush=True)


def main(argv=None) -> int:
    args = parse_args(argv)
    on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
    if on_cpu and args.shape != "tiny":
        raise SystemExit(f"bench.py: --shape {args.shape} needs GPUs; on CPU use --shape tiny --device cpu")
    bench = Bench(args)
    roles = "+".join(role for role in ROLES if role in bench.roles)
    bench.log(
        f"{bench.device} rank {bench.rank} ({roles}), shape {args.shape}, startup {bench.startup_s:.1f}s"
    )
    for name in SECTIONS:
        bench.run_section(name)
    return bench.finish()


if __name__ == "__main__":
    sys.exit(main())
