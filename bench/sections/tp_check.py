"""target_parallel_check: a tensor-parallel replica against one GPU running the same weights.

Every replica (--target-parallel k > 1) runs a forward of one micro-batch together and times
`--iters` more; its leader then builds the whole target from the same seed (the weights do not
depend on the mesh), runs the same micro-batch and times it alone. Recorded: the largest absolute
difference of the hidden states, relative to the largest reference value (per read layer and
overall), whether that is within the hidden dtype's tolerance, and TP=k vs TP=1 samples/s.
The runner skips the section when the whole target does not fit one GPU beside the leader's share.
"""

from __future__ import annotations

import gc
import time

import torch
from benchlib.state import BenchState
from benchlib.synthetic import random_target
from benchlib.timing import sync

from dflash_mp.runtime.roles import hidden_states_for_drafter

TIMEOUT_S = 420  # the whole target's build and (on GPU) its compile on the leader
# Largest |TP - TP=1| / max|TP=1| counted as equal: the split only reorders sums (the row-wise
# projections' partial products are added by the all-reduce), so fp32 agrees to rounding, bf16
# to its 8-bit mantissa accumulated over the layers.
RELATIVE_TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 2e-2, torch.float16: 5e-3}


def _timed(bench: BenchState, extractor, batch) -> tuple[torch.Tensor, float]:
    """(hidden states of `batch`, samples/s over --iters forwards after --warmup)."""
    hidden = None
    for _ in range(bench.args.warmup):
        hidden = hidden_states_for_drafter(extractor, batch, bench.dtype, bench.device)
    sync(bench.device)
    start = time.perf_counter()
    for _ in range(bench.args.iters):
        hidden_states_for_drafter(extractor, batch, bench.dtype, bench.device)
    sync(bench.device)
    return hidden, bench.args.iters * bench.B / (time.perf_counter() - start)


def compare(tp: torch.Tensor, reference: torch.Tensor, layers: int) -> dict:
    """Differences of `tp` from `reference` ([B, S, layers * H]), overall and per read layer."""
    tp, reference = tp.float(), reference.float()
    diff = (tp - reference).abs()

    def stats(d: torch.Tensor, ref: torch.Tensor) -> dict:
        scale = ref.abs().max().item()
        return {
            "max_abs_diff": d.max().item(),
            "mean_abs_diff": d.mean().item(),
            "reference_max_abs": scale,
            "max_rel_diff": d.max().item() / scale if scale > 0 else None,
        }

    result = stats(diff, reference)
    result["per_layer"] = [
        stats(d, r) for d, r in zip(diff.chunk(layers, dim=-1), reference.chunk(layers, dim=-1), strict=True)
    ]
    return result


def run(bench: BenchState) -> dict:
    if "target" not in bench.roles:
        return {}
    batch = bench.reader.read(0)
    k, rank = bench.target_parallel, bench.rank
    tp_hidden, tp_rate = _timed(bench, bench.extractor, batch)
    if not bench.layout.is_leader(rank):
        return {"per_rank": {str(rank): {"tp_samples_per_s": tp_rate}}}
    start = time.perf_counter()
    reference = random_target(
        bench.shape,
        bench.dtype,
        bench.device,
        seed=bench.args.seed,
        compile_layers=bench.compiled,
        packed_rows=bench.args.data == "chat-packed",
        layer_ids=bench.feature_layer_ids,
    )
    build_s = time.perf_counter() - start
    ref_hidden, tp1_rate = _timed(bench, reference, batch)
    del reference
    gc.collect()
    if bench.device.type == "cuda":
        torch.cuda.empty_cache()
    tolerance = RELATIVE_TOLERANCE.get(bench.dtype, 2e-2)
    diff = compare(tp_hidden, ref_hidden, len(bench.feature_layer_ids))
    replica = bench.layout.replica_of(rank)
    measured = {
        **diff,
        "dtype": str(bench.dtype).replace("torch.", ""),
        "relative_tolerance": tolerance,
        "within_tolerance": diff["max_rel_diff"] is not None and diff["max_rel_diff"] <= tolerance,
        "target_parallel": k,
        "ranks": bench.layout.replica_ranks(replica),
        "tp_samples_per_s": tp_rate,
        "tp1_samples_per_s": tp1_rate,
        "tp_speedup": tp_rate / tp1_rate,
        # Speed-up over the k GPUs the replica takes: 1.0 is linear scaling.
        "tp_scaling_efficiency": tp_rate / tp1_rate / k,
        "tp1_build_s": build_s,
        "definition": "max_rel_diff = max |TP - TP=1| / max |TP=1| over the hidden states of one micro-batch",
    }
    result: dict = {
        "per_rank": {str(rank): {"tp_samples_per_s": tp_rate}},
        "per_replica": {str(replica): measured},
    }
    if rank == 0:
        result.update(measured)
    return result
