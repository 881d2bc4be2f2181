"""What the benchmark's sections share: one rank's layout, job, config and device, the models and
data kept from one section to the next, the results of the sections already run, and helpers.

bench/bench.py's runner is a BenchState that also runs the sections; each section module
(bench/sections/) takes the state, so the sections import nothing from the runner.
"""

from __future__ import annotations

import argparse
import dataclasses
import time
from typing import TYPE_CHECKING

import torch

from dflash_mp.config.dspark_checks import feature_layer_ids
from dflash_mp.config.precision import resolve_precision
from dflash_mp.runtime.distributed import init_job
from dflash_mp.runtime.target_parallel import replica_mesh
from dflash_mp.runtime.topology import Topology
from dflash_mp.training.trainer import DrafterTrainer

from .shapes import SHAPES, bench_config
from .synthetic import SyntheticReader, random_drafter, random_embed_and_head
from .timing import GB

if TYPE_CHECKING:
    from layout import Layout  # bench/layout.py: imports nothing

# Of a GPU's memory, what the weights of one model may take before it counts as not fitting.
FITS_FRACTION = 0.9


class BenchState:
    def __init__(self, args: argparse.Namespace, layout: Layout, process_start: float) -> None:
        self.args = args
        self.shape = SHAPES[args.shape]
        if args.block_size:
            self.shape = dataclasses.replace(self.shape, block_size=args.block_size)
        self.shape = self.shape.with_row(args.seq_len, args.num_anchors)
        self.layout = layout
        # One rank for both roles keeps the 1 + 1 topology (its trainer runs without DDP).
        self.topology = Topology(
            targets=layout.targets,
            drafters=layout.drafters,
            grad_accum=args.grad_accum,
            target_parallel=layout.target_parallel,
        )
        self.world = layout.world
        self.single = layout.single
        self.target_parallel = layout.target_parallel
        # One rank plays both roles: no drafter group, so its trainer runs without DDP.
        self.job = init_job(self.topology, args.device, drafter_group=not self.single)
        self.rank, self.device = self.job.rank, self.job.device
        # The roles this process plays: one per rank, both on 1 rank.
        self.roles = layout.roles_of(self.rank)
        # This target rank's replica as a DeviceMesh (tensor-parallel targets only).
        self.mesh = replica_mesh(self.job.replica_group, self.device) if "target" in self.roles else None
        self.process_start = process_start
        self.startup_s = time.perf_counter() - process_start
        self.cfg = bench_config(
            self.shape,
            self.device,
            args.micro_batch,
            args.grad_accum,
            args.override,
            targets=layout.targets,
            drafters=layout.drafters,
            target_parallel=layout.target_parallel,
        )
        self.dtype, self.attention, self.compiled = resolve_precision(self.cfg, self.device)
        self.gpu_memory_bytes = (
            torch.cuda.get_device_properties(self.device).total_memory if self.device.type == "cuda" else None
        )
        self._check_target_fits()
        self.B, self.A, self.S = args.micro_batch, args.grad_accum, self.shape.seq_len
        # The target layers sent to the drafter: its inputs, and the teacher's last layer where a
        # DSpark loss term reads it (as the runtime's target ranks send).
        self.feature_layer_ids = feature_layer_ids(
            self.shape.layer_ids, self.shape.target.layers, self.cfg.model
        )
        self.feature_size = self.shape.target.hidden * len(self.feature_layer_ids)
        self.first_drafter = layout.first_drafter
        self.reader = self._reader(args)
        # This rank's record of every section run so far (later sections read earlier results).
        self.partial: dict = {"rank": self.rank, "sections": {}, "failed": None}
        # Objects that live from one section to the next.
        self.extractor = None
        self.trainer: DrafterTrainer | None = None
        self.features = None
        self.peak_flops: float | None = None
        self.sustained_flops: float | None = None  # matmuls' rate at the power limit (matmul_peak)

    def _reader(self, args):
        if args.data == "fixed":
            return SyntheticReader(self.shape, self.B, seed=args.seed)
        from benchlib.chat_data import ChatShapedReader

        pad_to = self.cfg.data.pad_to_multiple
        packed = args.data == "chat-packed"
        return ChatShapedReader(
            self.shape.target.vocab, self.shape.seq_len, self.B, packed, pad_to, seed=args.seed
        )

    def _check_target_fits(self) -> None:
        """A target shard larger than a GPU fails here, naming the fix, before any model is built."""
        needed = self.shape.target_weight_bytes(self.dtype.itemsize, self.target_parallel)
        if self.gpu_memory_bytes and needed > FITS_FRACTION * self.gpu_memory_bytes:
            fitting = self.shape.target_weight_bytes(self.dtype.itemsize, 2 * self.target_parallel)
            raise SystemExit(
                f"bench.py: --shape {self.args.shape}: one target rank would hold {needed / GB:.0f} GB "
                f"of weights at --target-parallel {self.target_parallel}, more than "
                f"{FITS_FRACTION:.0%} of a GPU ({self.gpu_memory_bytes / GB:.0f} GB): raise "
                f"--target-parallel (at {2 * self.target_parallel}: {fitting / GB:.0f} GB per rank) "
                "and --targets with it"
            )

    def one_gpu_target_problem(self, beside: int = 0) -> str | None:
        """Why a whole (TP=1) target does not fit one GPU next to `beside` bytes; None if it does."""
        whole = self.shape.target_weight_bytes(self.dtype.itemsize)
        if self.gpu_memory_bytes and whole + beside > FITS_FRACTION * self.gpu_memory_bytes:
            extra = f" next to {beside / GB:.0f} GB already resident" if beside else ""
            return (
                f"target does not fit one GPU: its weights take {whole / GB:.0f} GB{extra}, "
                f"the GPU has {self.gpu_memory_bytes / GB:.0f} GB"
            )
        return None

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
        print(f"[bench r{self.rank} {time.perf_counter() - self.process_start:7.1f}s] {message}", flush=True)

    def new_trainer(self, group) -> DrafterTrainer:
        """A DrafterTrainer on a random drafter, embedding and head; `group` None: no DDP."""
        drafter = random_drafter(self.shape, self.device, seed=self.args.seed, model_cfg=self.cfg.model)
        embed_and_head = random_embed_and_head(self.shape, self.dtype, self.device, seed=self.args.seed)
        return DrafterTrainer(
            self.cfg,
            self.device,
            self.cfg.train.max_steps,
            group=group,
            drafter=drafter,
            embed_and_head=embed_and_head,
        )

    def mfu(self, flops_per_s: float, gpus: int = 1) -> float | None:
        """Useful FLOP/s over the peak of `gpus` GPUs like this rank's (a replica: target_parallel)."""
        return flops_per_s / (gpus * self.peak_flops) if self.peak_flops else None

    def mfu_at_sustained(self, flops_per_s: float) -> float | None:
        """Useful FLOP/s over the matmul rate one GPU holds at its power limit (context for `mfu`)."""
        return flops_per_s / self.sustained_flops if self.sustained_flops else None
