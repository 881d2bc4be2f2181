"""The benchmark's layouts (--targets / --drafters / --target-parallel) and its llama3-70b shape.

In process: the layout rules, the shapes' weight arithmetic, the one-GPU fit rule. Under torchrun
(gloo, tiny shape, 3 ranks): a tensor-parallel target replica feeding one drafter, and one target
feeding two drafters that train under DDP.
"""

from __future__ import annotations

import sys
from dataclasses import replace
from types import SimpleNamespace

import pytest
import torch
from transformers import LlamaConfig

from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.tensor_parallel import layer_plan
from dflash_mp.plan.measured import read_bench
from tests.conftest import REPO
from tests.test_bench import _positive, run_bench

sys.path.insert(0, str(REPO / "bench"))
from benchlib.shapes import SHAPES  # noqa: E402
from benchlib.state import BenchState  # noqa: E402
from benchlib.synthetic import random_target  # noqa: E402
from layout import Layout, LayoutError, resolve_layout  # noqa: E402
from summary import projection_of_8  # noqa: E402

H200_BYTES = 141 * 10**9


def test_default_layouts_are_the_old_ones_and_flags_fill_in_the_rest() -> None:
    assert resolve_layout(1, None, None, 1) == Layout(1, 1, 1, single=True)
    assert resolve_layout(1, None, None, 1).roles_by_rank() == {"0": "target+drafter"}
    assert resolve_layout(2, None, None, 1).roles_by_rank() == {"0": "target", "1": "drafter"}
    assert resolve_layout(3, None, None, 1) == Layout(1, 2, 1)  # 1t2d
    assert resolve_layout(4, None, None, 2) == Layout(2, 2, 2)  # one TP=2 replica, 2 drafters
    assert resolve_layout(4, None, 3, 1) == Layout(1, 3, 1)
    assert resolve_layout(4, 2, None, 1) == Layout(2, 2, 1)
    layout = resolve_layout(4, 2, 2, 2)
    assert layout.name == "2t2d (TP=2)" and layout.replicas == 1 and layout.first_drafter == 2
    assert layout.describe()["replicas"] == [[0, 1]] and layout.describe()["drafter_ranks"] == [2, 3]
    assert [layout.is_leader(r) for r in range(4)] == [True, False, False, False]
    # A replica that takes every rank: a target-only run (target sections and colocated).
    assert resolve_layout(2, None, None, 2) == Layout(2, 0, 2)


@pytest.mark.parametrize(
    ("world", "targets", "drafters", "k", "message"),
    [
        (4, 2, 1, 1, "WORLD_SIZE=4"),  # 3 ranks asked for, 4 launched
        (3, 1, 2, 2, "not a multiple of --target-parallel 2"),
        (2, 0, 2, 1, "at least one target rank"),
        (3, 4, -1, 1, "no negative counts"),
        (1, 2, 1, 1, "WORLD_SIZE=1"),
        (2, None, None, 0, "must be >= 1"),
    ],
)
def test_layouts_that_do_not_fit_the_ranks_are_refused_naming_the_flags(
    world: int, targets: int | None, drafters: int | None, k: int, message: str
) -> None:
    with pytest.raises(LayoutError, match=message):
        resolve_layout(world, targets, drafters, k)


def test_llama3_70b_shape_is_llama_3_70b_and_its_drafter_follows_its_hidden_size() -> None:
    shape = SHAPES["llama3-70b"]
    config = shape.target_config()
    assert isinstance(config, LlamaConfig)  # Llama's base_model_tp_plan splits it
    assert (config.num_hidden_layers, config.hidden_size, config.intermediate_size) == (80, 8192, 28672)
    assert (config.num_attention_heads, config.num_key_value_heads, config.head_dim) == (64, 8, 128)
    assert config.vocab_size == 128256 and config.rope_parameters["rope_theta"] == 500000.0
    assert set(layer_plan(config)) >= {"self_attn.q_proj", "self_attn.o_proj", "mlp.down_proj"}
    assert (shape.seq_len, shape.num_anchors, shape.block_size, shape.draft_layers) == (3072, 512, 16, 5)
    drafter = build_drafter_config(
        config, shape.draft_layers, shape.layer_ids, shape.block_size, shape.target.vocab - 1
    )
    assert (drafter.hidden_size, drafter.intermediate_size, drafter.num_hidden_layers) == (8192, 28672, 5)
    assert drafter.rope_parameters["rope_theta"] == 500000.0
    # ~140 GB in bf16 (the layers run: up to layer 77), half of the layers per rank at TP=2.
    whole, shard = shape.target_weight_bytes(2), shape.target_weight_bytes(2, 2)
    assert 130e9 < whole < 141e9 and 65e9 < shard < 72e9


@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_target_weight_bytes_is_what_the_built_target_holds(family: str) -> None:
    shape = replace(SHAPES["tiny"], target=replace(SHAPES["tiny"].target, model_type=family))
    extractor = random_target(shape, torch.float32, torch.device("cpu"), seed=0, compile_layers=False)
    held = sum(t.numel() * t.element_size() for t in extractor.parameters())
    assert shape.target_weight_bytes(4) == held


def _bench_like(shape: str, target_parallel: int) -> SimpleNamespace:
    return SimpleNamespace(
        shape=SHAPES[shape],
        dtype=torch.bfloat16,
        gpu_memory_bytes=H200_BYTES,
        target_parallel=target_parallel,
        args=SimpleNamespace(shape=shape),
    )


def test_a_target_that_fits_no_gpu_is_refused_or_its_one_gpu_sections_skipped() -> None:
    seventy = _bench_like("llama3-70b", 1)
    with pytest.raises(SystemExit, match="raise --target-parallel"):
        BenchState._check_target_fits(seventy)
    BenchState._check_target_fits(_bench_like("llama3-70b", 2))  # a 69 GB shard fits
    assert "target does not fit one GPU" in BenchState.one_gpu_target_problem(seventy)
    assert BenchState.one_gpu_target_problem(_bench_like("qwen3-8b", 2)) is None


def test_projection_counts_target_gpus_in_whole_replicas() -> None:
    one = projection_of_8(10.0, 5.0)
    assert [s["targets"] for s in one["splits"]] == list(range(1, 8))
    two = projection_of_8(20.0, 5.0, target_parallel=2)
    assert [s["targets"] for s in two["splits"]] == [2, 4, 6]
    # 2 target GPUs = one replica at 20/s; 6 drafters at 5/s: 20.
    assert two["splits"][0]["samples_per_s"] == 20.0 and two["best_split"] == "2t6d"


@pytest.mark.slow
def test_tensor_parallel_target_replica_feeds_a_drafter(tmp_path) -> None:
    # Short sections (the assertions are about the layout, not the rates): a TP=2 forward on CPU
    # goes through DTensor and is slow.
    proc, result = run_bench(
        tmp_path,
        *("--targets", "2", "--target-parallel", "2", "--drafters", "1"),
        *("--warmup", "1", "--iters", "2", "--pipeline-steps", "2"),
        *("--colocated-iters", "2", "--transport-iters", "2"),
        nproc=3,
        timeout=150,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    setup, sections = result["setup"], result["sections"]
    assert setup["roles"] == {"0": "target", "1": "target", "2": "drafter"}
    assert setup["target_parallel"] == 2 and setup["layout"]["replicas"] == [[0, 1]]
    ran = (
        "setup",
        "target_only",
        "target_parallel_check",
        "drafter_only",
        "pipeline",
        "transport",
        "colocated",
    )
    assert {name: sections[name]["status"] for name in ran} == dict.fromkeys(ran, "ok")

    check = sections["target_parallel_check"]
    # fp32: the split only reorders sums.
    assert check["within_tolerance"] is True and check["max_rel_diff"] < 1e-4, check
    assert _positive(check["reference_max_abs"]) and len(check["per_layer"]) == len(SHAPES["tiny"].layer_ids)
    assert _positive(check["tp_samples_per_s"]) and _positive(check["tp1_samples_per_s"])
    assert check["ranks"] == [0, 1] and set(check["per_rank"]) >= {"0", "1"}

    target = sections["target_only"]
    assert target["target_parallel"] == 2 and target["per_replica"]["0"]["ranks"] == [0, 1]
    assert all(_positive(target["per_rank"][r]["samples_per_s"]) for r in ("0", "1"))
    pipeline = sections["pipeline"]
    assert _positive(pipeline["samples_per_s"]) and _positive(pipeline["efficiency"])
    assert set(pipeline["per_rank"]) == {"0", "1", "2"}
    assert sections["transport"]["ranks"] == [0, 2] and _positive(sections["transport"]["gb_per_s"])
    assert set(sections["colocated"]["per_rank"]) == {"0", "1", "2"}

    summary = result["summary"]
    assert summary["layout"] == "2t1d (TP=2)"
    assert summary["target_parallel_check"]["within_tolerance"] is True
    assert set(summary["peak_memory_gb_per_gpu"]) == {"0", "1", "2"}
    assert summary["recompiles_after_warmup_pipeline_per_rank"] == {"0": 0, "1": 0, "2": 0}
    # The plan reads the replica's rate as that of a TP=2 target.
    record = read_bench(tmp_path / "bench.json")
    assert record.target_parallel == 2 and record.target_rate == target["samples_per_s"]
    assert "pipeline 2t+1d TP=2" in proc.stdout and "TP=2 vs TP=1" in proc.stdout


@pytest.mark.slow
def test_one_target_feeds_two_drafters_training_under_ddp(tmp_path) -> None:
    proc, result = run_bench(
        tmp_path,
        "--drafters",
        "2",
        "--sections",
        "setup,drafter_only,target_only,pipeline",
        "--warmup",
        "1",
        "--iters",
        "2",
        "--pipeline-steps",
        "2",
        nproc=3,
        timeout=150,
    )
    assert proc.returncode == 0, f"{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    sections = result["sections"]
    assert result["setup"]["roles"] == {"0": "target", "1": "drafter", "2": "drafter"}
    assert sections["target_parallel_check"]["status"] == "skipped"
    for name in ("transport", "colocated"):  # --sections leaves them out
        assert sections[name] == {"status": "skipped", "reason": "not selected (--sections)"}, name
    drafter = sections["drafter_only"]
    assert drafter["status"] == "ok" and drafter["ddp"] is True and drafter["drafters"] == 2
    assert all(_positive(drafter["per_rank"][r]["samples_per_s"]) for r in ("1", "2"))
    pipeline = sections["pipeline"]
    assert pipeline["status"] == "ok" and pipeline["drafters"] == 2
    # Both drafters step together on their own samples: the layout's rate is twice each one's.
    assert pipeline["samples_per_s"] == pytest.approx(2 * pipeline["samples_per_s_per_drafter"])
    assert all(_positive(pipeline["per_rank"][r]["samples_per_s"]) for r in ("1", "2"))
    summary = result["summary"]["pipeline"]
    assert summary["drafters_samples_per_s"] == pytest.approx(
        sum(drafter["per_rank"][r]["samples_per_s"] for r in ("1", "2"))
    )
    assert summary["efficiency"] == pytest.approx(
        pipeline["samples_per_s"] / min(summary["targets_samples_per_s"], summary["drafters_samples_per_s"])
    )
    # The plan takes the efficiency against both drafters, not against one of them.
    assert read_bench(tmp_path / "bench.json").pipeline_efficiency == pytest.approx(summary["efficiency"])


@pytest.mark.slow
def test_a_layout_that_does_not_match_the_ranks_fails_before_any_work(tmp_path) -> None:
    proc, result = run_bench(tmp_path, "--targets", "1", "--target-parallel", "2", nproc=2, timeout=60)
    assert proc.returncode != 0 and result is None
    assert "--targets 1 is not a multiple of --target-parallel 2" in proc.stderr + proc.stdout


@pytest.mark.slow
def test_a_drafter_failing_among_several_neither_hangs_the_others_nor_loses_the_json(tmp_path) -> None:
    # Rank 2 fails at its third pipeline micro-batch: rank 1 waits in the drafters' all-reduce and
    # rank 0 on its sends; the watchdog of each sees a peer that failed and ends them.
    proc, result = run_bench(
        tmp_path,
        "--drafters",
        "2",
        "--sections",
        "setup,drafter_only,target_only,pipeline",
        "--fault",
        "pipeline:2:raise:3",
        "--peer-grace",
        "2",
        "--warmup",
        "1",
        "--iters",
        "2",
        nproc=3,
        timeout=120,
    )
    assert proc.returncode != 0
    assert result is not None, f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
    sections = result["sections"]
    assert sections["drafter_only"]["status"] == "ok"
    assert sections["pipeline"]["status"] == "error"
    assert "injected fault" in sections["pipeline"]["errors"]["2"]
