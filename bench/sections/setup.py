"""Builds the resident objects: the target (target role; a rank's tensor-parallel share with
--target-parallel > 1), the drafter trainer (DDP over the drafter ranks when there are several)
and one received-form micro-batch (drafter role), and counts their useful FLOPs.
"""

from __future__ import annotations

import time

import torch
from benchlib.flops import drafter_flops_per_micro_batch, target_flops_per_seq
from benchlib.state import BenchState
from benchlib.synthetic import count_params, random_target, received_form, seeded
from benchlib.timing import sync

TIMEOUT_S = 240


# The sections that run the target setup builds (colocated builds its own when setup did not).
TARGET_SECTIONS = ("target_only", "target_parallel_check", "pipeline", "colocated")


def run(bench: BenchState) -> dict:
    result = {}
    # A run of drafter sections alone leaves the target out: a head whose step needs most of a
    # GPU (XPress at the Qwen3-8B shape) is then measured as a drafter rank holds it.
    if "target" in bench.roles and any(name in bench.args.sections for name in TARGET_SECTIONS):
        result["target"] = _setup_target(bench)
    if "drafter" in bench.roles:
        result["drafter"] = _setup_drafter(bench)
    return result


def _setup_target(bench: BenchState) -> dict:
    start = time.perf_counter()
    # With --target-parallel k, each rank builds its share of the replica's target (layer by layer).
    bench.extractor = random_target(
        bench.shape,
        bench.dtype,
        bench.device,
        seed=bench.args.seed,
        compile_layers=bench.compiled,
        mesh=bench.mesh,
        packed_rows=bench.args.data == "chat-packed",
        layer_ids=bench.feature_layer_ids,
    )
    sync(bench.device)
    flops = target_flops_per_seq(bench.extractor, bench.shape)
    return {
        "build_s": time.perf_counter() - start,
        "params_used": flops["params_used"],
        "layers_run": flops["layers_run"],
        "flops_per_seq": flops["per_seq"],
        "flops_breakdown": {k: flops[k] for k in ("linear", "attention")},
        "flops_counting": flops["counting"],
        "target_parallel": bench.target_parallel,
        "kernels": getattr(bench.extractor, "kernels", None),
        "per_rank": {str(bench.rank): {"target_build_s": time.perf_counter() - start}},
    }


def _setup_drafter(bench: BenchState) -> dict:
    start = time.perf_counter()
    # The drafter group: None on 1 rank (the trainer then runs without DDP).
    bench.trainer = bench.new_trainer(group=bench.job.drafter_group)
    batch = bench.reader.read(0)
    with seeded(bench.device, bench.args.seed + 2):
        width = batch.input_ids.shape[1]  # S, or a chat-data row's own width (--data chat*)
        hidden = torch.randn(bench.B, width, bench.feature_size, dtype=bench.dtype, device=bench.device)
    bench.features = received_form(batch, hidden, bench.device)
    flops = drafter_flops_per_micro_batch(bench.shape, bench.cfg, batch)
    sync(bench.device)
    return {
        "build_s": time.perf_counter() - start,
        "params": count_params(bench.trainer.drafter),
        "flops_per_micro_batch": flops["train"],
        "flops_per_micro_batch_previous_counting": flops["train_previous_counting"],
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
