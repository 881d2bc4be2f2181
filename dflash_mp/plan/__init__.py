"""Which layout to train with: `python -m dflash_mp.plan --gpus N --bench bench.json [--target T]`.

T: the target's HF directory, a preset (`qwen3.5-9b`, `gpt-oss-120b`, ...) or an entry of the
target-families measurement (`--families`, bench/target_families.py; the recorded one by default).
From the benchmark's measured stage rates (bench/bench.py writes them) and the target's shape,
the plan lists every layout of N GPUs that fits in memory: colocated (each GPU runs the target
forward and the drafter step), each split of T target ranks and D drafter ranks, and the splits
whose target replicas span k GPUs by tensor parallelism (`topology.target_parallel=k`). Each gets
its expected samples/s, its memory per GPU and the overrides that launch it; the best is named.

The rates combine as BENCHMARKS.md describes:
    split      = min(R x target_rate(k), D x drafter_rate) x pipeline efficiency   (R = T / k replicas)
    colocated  = N x colocated rate per GPU   (measured, else 1 / (target time + drafter time))
The target stage comes from the families measurement where an entry ran the target's shape, or is
extrapolated from its family's entry by active parameters; else from the benchmark (targets.py).
Every number says where it came from: measured (a JSON, same shape), scaled (a measured time or
memory carried to another target shape by the ratio of FLOPs or bytes), assumed (a flag's factor,
e.g. tensor-parallel efficiency), given (a flag) or estimated (shapes only).

Rooms: costs.py (parameters, FLOPs and bytes of a shape), measured.py (reading the benchmark and
families JSON), targets.py (what --target names, which entry measured it), layouts.py (rates and
memory per layout, the candidates), cli.py (arguments and output), families_table.py (the table
of docs/TARGETS.md); memory.py (a rank's peak GPU memory, term by term), memory_check.py (the
preflight's memory line) and memory_cli.py (`python -m dflash_mp.plan memory`).
"""


class PlanError(ValueError):
    """Input the plan cannot use; the message names the input and the fix."""
