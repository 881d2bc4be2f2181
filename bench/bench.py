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

This file reads the flags and refuses a layout that does not fit the ranks before torch and the
models are imported; the runner (per-rank partial JSON, the watchdog, the exchange after every
section) is bench/runner.py; what the sections share (the rank's layout, job, config, resident
models, fault injection) is bench/benchlib/state.py, the flags are bench/options.py, the layouts
bench/layout.py, each section is a module of bench/sections/, the headline numbers
bench/summary.py and their table bench/table.py, the other helpers bench/benchlib/. Imports run one
way: bench.py -> runner -> sections -> benchlib.

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
Setup builds the target only when a section that runs it is selected, so drafter sections alone
(`--sections setup,drafter_only`) measure what a drafter rank holds.
"""

from __future__ import annotations

import time

PROCESS_START = time.perf_counter()

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # the repository, when not installed

from options import default_out, layout_from_env, parse_args  # noqa: E402

from dflash_mp.run import startup  # noqa: E402

if __name__ == "__main__":
    startup.pause()  # resumed once the benchmark's stack is imported


def main(argv=None) -> int:
    args = parse_args(argv, __doc__)
    if args.shape != "tiny":  # only a GPU shape can be refused here: torch is imported for it alone
        import torch

        on_cpu = args.device == "cpu" or (args.device == "auto" and not torch.cuda.is_available())
        if on_cpu:
            raise SystemExit(
                f"bench.py: --shape {args.shape} needs GPUs; on CPU use --shape tiny --device cpu"
            )
    layout = layout_from_env(args)
    args.out = args.out or default_out(args.shape, layout)
    # torch, transformers and the models: only once the run is known to fit the ranks.
    from runner import run

    startup.resume()
    return run(args, layout, PROCESS_START)


if __name__ == "__main__":
    sys.exit(main())
