"""The layout plan (`python -m dflash_mp.plan`): candidates, their rates and memory, bad input."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_mp.plan import PlanError
from dflash_mp.plan.cli import main, make_plan, parser
from dflash_mp.plan.costs import (
    ModelShape,
    Workload,
    drafter_flops_per_sample,
    drafter_trainable_params,
    layer_params,
    shape_from_hf_config,
    target_flops_per_sample,
    target_layers_run,
    target_weight_bytes,
)
from dflash_mp.plan.measured import gpu_memory_gb, read_bench
from tests.conftest import REPO

RESULTS = REPO / "bench" / "results"
QWEN3_8B = {"hidden": 4096, "layers": 36, "heads": 32, "kv_heads": 8, "head_dim": 128, "intermediate": 12288}
LLAMA_70B = {
    "hidden_size": 8192,
    "num_hidden_layers": 80,
    "num_attention_heads": 64,
    "num_key_value_heads": 8,
    "intermediate_size": 28672,
    "vocab_size": 128256,
}


def bench_json(tmp_path: Path, sections: dict, **setup) -> Path:
    """A benchmark result with the Qwen3-8B shape and only the given sections."""
    data = {
        "schema": "dflash_mp.bench/1",
        "shape": {
            "name": "qwen3-8b",
            **QWEN3_8B,
            "vocab": 151936,
            "draft_layers": 5,
            "seq_len": 3072,
            "num_anchors": 512,
            "block_size": 16,
        },
        "setup": {
            "device": "cuda",
            "device_name": "NVIDIA H200",
            "world_size": 2,
            "roles": {"0": "target", "1": "drafter"},
            "micro_batch": 1,
            **setup,
        },
        "sections": sections,
    }
    path = tmp_path / "bench.json"
    path.write_text(json.dumps(data))
    return path


def stages(target: float | None = 13.83, drafter: float | None = 6.66) -> dict:
    sections = {}
    if target is not None:
        sections["target_only"] = {"status": "ok", "samples_per_s": target}
    if drafter is not None:
        sections["drafter_only"] = {"status": "ok", "samples_per_s": drafter}
    return sections


def plan_of(*argv: str):
    return make_plan(parser().parse_args(list(argv)))


def hf_target(tmp_path: Path, config: dict, name: str = "target") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def test_eight_gpus_at_the_measured_rates_put_3t5d_first_among_splits(tmp_path: Path) -> None:
    plan = plan_of("--gpus", "8", "--bench", str(bench_json(tmp_path, stages())))
    splits = {c.layout: c.samples_per_s for c in plan.candidates if c.target_parallel == 1 and c.targets}
    assert max(splits, key=splits.get) == "3t5d"
    # min(T x 13.83, D x 6.66) with no pipeline measurement: efficiency 1.0, assumed.
    assert splits["3t5d"] == pytest.approx(5 * 6.66)
    assert splits["2t6d"] == pytest.approx(2 * 13.83)
    assert splits["4t4d"] == pytest.approx(4 * 6.66)
    assert len(splits) == 7
    assert plan.stage.efficiency.source == "assumed"
    # No colocated measurement: 1 / (t_target + t_drafter) per GPU.
    colocated = next(c for c in plan.candidates if c.layout == "colocated")
    assert colocated.samples_per_s == pytest.approx(8 / (1 / 13.83 + 1 / 6.66))
    assert plan.stage.colocated_rate.source == "estimated"
    rates = [c.samples_per_s for c in plan.candidates]
    assert rates == sorted(rates, reverse=True)


def test_measured_colocated_rate_and_pipeline_efficiency_are_used(tmp_path: Path) -> None:
    sections = stages()
    sections["pipeline"] = {"status": "ok", "samples_per_s": 6.66 * 0.9}
    sections["colocated"] = {
        "status": "ok",
        "per_rank": {"0": {"samples_per_s": 4.2}, "1": {"samples_per_s": 4.3}},
    }
    plan = plan_of("--gpus", "8", "--bench", str(bench_json(tmp_path, sections)))
    by_layout = {c.layout: c for c in plan.candidates}
    assert plan.stage.colocated_rate.source == "measured"
    assert by_layout["colocated"].samples_per_s == pytest.approx(8 * 4.25)
    assert plan.stage.efficiency.value == pytest.approx(0.9)
    assert by_layout["3t5d"].samples_per_s == pytest.approx(5 * 6.66 * 0.9)
    assert by_layout["3t5d"].overrides == "topology.targets=3 topology.drafters=5"
    assert by_layout["colocated"].overrides == "topology=colocated"


def test_tensor_parallel_rates_are_assumed_from_the_flag(tmp_path: Path) -> None:
    plan = plan_of("--gpus", "8", "--bench", str(bench_json(tmp_path, stages())), "--tp-efficiency", "0.8")
    assert plan.stage.target_rate[1].source == "measured"
    assert plan.stage.target_rate[2].source == "assumed"
    assert plan.stage.target_rate[4].value == pytest.approx(4 * 0.8 * 13.83)
    tp2 = next(c for c in plan.candidates if c.layout.startswith("6t2d TP=2"))
    assert tp2.overrides == "topology.targets=6 topology.drafters=2 topology.target_parallel=2"
    assert tp2.samples_per_s == pytest.approx(min(3 * 2 * 0.8 * 13.83, 2 * 6.66))
    # A rate measured on a TP=2 replica anchors the others.
    measured_tp2 = bench_json(tmp_path, stages(target=20.0), target_parallel=2)
    plan = plan_of("--gpus", "8", "--bench", str(measured_tp2), "--tp-efficiency", "0.8")
    assert plan.stage.target_rate[2].value == pytest.approx(20.0)
    assert plan.stage.target_rate[2].source == "measured"
    assert plan.stage.target_rate[1].value == pytest.approx(20.0 / 1.6)
    assert plan.stage.target_rate[4].value == pytest.approx(40.0)


def test_a_70b_target_fits_only_as_tensor_parallel_replicas(tmp_path: Path) -> None:
    target = hf_target(tmp_path, LLAMA_70B)
    plan = plan_of("--gpus", "8", "--bench", str(bench_json(tmp_path, stages())), "--target", str(target))
    assert plan.candidates, "TP=2 and TP=4 replicas fit"
    assert all(c.target_parallel >= 2 for c in plan.candidates)
    assert {c.target_parallel for c in plan.candidates} == {2, 4}
    assert all(c.gpu_gb <= 141 * 0.9 for c in plan.candidates)
    reasons = "\n".join(plan.left_out)
    assert "TP=1: target rank" in reasons and "> 126.9 GB usable" in reasons
    assert "colocated: target + drafter" in reasons
    # The 8B benchmark's rates are carried to the 70B shape by FLOPs: about 10x slower targets.
    assert plan.stage.target_rate[1].source == "scaled"
    assert 1.0 < plan.stage.target_rate[1].value < 1.6
    assert plan.stage.target_gb[1].value > 127


def test_tensor_parallel_widths_that_do_not_divide_the_heads_are_left_out(tmp_path: Path) -> None:
    config = {**LLAMA_70B, "num_attention_heads": 12, "num_key_value_heads": 4, "hidden_size": 1536}
    target = hf_target(tmp_path, {**config, "intermediate_size": 4096, "num_hidden_layers": 16})
    plan = plan_of("--gpus", "8", "--bench", str(bench_json(tmp_path, stages())), "--target", str(target))
    assert 8 not in plan.stage.target_rate and 4 in plan.stage.target_rate
    assert "TP=8: 12 attention / 4 KV heads do not divide by 8" in plan.left_out


def test_one_gpu_offers_colocated_only(tmp_path: Path) -> None:
    plan = plan_of("--gpus", "1", "--bench", str(bench_json(tmp_path, stages())))
    assert [c.layout for c in plan.candidates] == ["colocated"]
    assert plan.left_out == ["splits: need 2 GPUs or more (a target and a drafter), have 1"]


def test_a_70b_target_on_two_gpus_has_no_layout_and_says_why(tmp_path: Path, capsys) -> None:
    target = hf_target(tmp_path, LLAMA_70B)
    bench = str(bench_json(tmp_path, stages()))
    assert main(["--gpus", "2", "--bench", bench, "--target", str(target)]) == 0
    text = capsys.readouterr().out
    assert "TP=2: needs 2 target + 1 drafter GPUs, have 2" in text
    assert "TP=4" not in text  # the plan names the next width only
    assert "no layout fits" in text


def test_the_cli_plans_from_the_recorded_two_gpu_benchmark(capsys: pytest.CaptureFixture) -> None:
    bench = str(RESULTS / "h200x2-qwen3-8b.json")
    assert main(["--gpus", "8", "--bench", bench]) == 0
    text = capsys.readouterr().out
    assert "best: " in text and "torchrun --nproc-per-node 8 -m dflash_mp.train" in text
    assert "topology.targets=3 topology.drafters=5" in text

    assert main(["--gpus", "8", "--bench", bench, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    rates = [c["samples_per_s"] for c in result["candidates"]]
    assert rates == sorted(rates, reverse=True) and result["best"]["samples_per_s"] == rates[0]
    by_layout = {c["layout"]: c for c in result["candidates"]}
    # BENCHMARKS.md: 3t5d = min(3 x 13.83, 5 x 6.66) x pipeline efficiency 0.997; colocated 4.21 per GPU.
    assert by_layout["3t5d"]["samples_per_s"] == pytest.approx(5 * 6.6592 * 0.997, rel=1e-3)
    assert by_layout["colocated"]["samples_per_s"] == pytest.approx(8 * 8.4276 / 2, rel=1e-3)
    inputs = result["inputs"]
    assert inputs["target_gb"]["1"]["value"] == pytest.approx(14.879, abs=1e-3)
    assert inputs["drafter_gb"]["source"] == "measured"
    assert inputs["colocated_gb"]["value"] == pytest.approx(46.0, abs=0.01)


def test_a_one_rank_benchmark_subtracts_the_target_weights_from_the_drafter_peak() -> None:
    record = read_bench(RESULTS / "h200x1-qwen3-8b.json")
    drafter_only_peak = 40.339215872  # one process: drafter step + the resident target
    expected = drafter_only_peak - target_weight_bytes(record.shape, record.workload) / 1e9
    assert record.drafter_peak_gb == pytest.approx(expected)
    assert 25 < record.drafter_peak_gb < 27  # the two-rank run measured 26.0 on its own GPU
    assert record.target_peak_gb is None


def test_costs_count_as_the_benchmark_counts() -> None:
    setup = json.loads((RESULTS / "h200x2-qwen3-8b.json").read_text())["sections"]["setup"]
    record = read_bench(RESULTS / "h200x2-qwen3-8b.json")
    s, w = record.shape, record.workload
    assert target_layers_run(s, w) == setup["target"]["layers_run"]
    assert target_layers_run(s, w) * layer_params(s) == setup["target"]["params_used"]
    assert target_flops_per_sample(s, w) == pytest.approx(setup["target"]["flops_per_seq"], rel=1e-9)
    assert drafter_trainable_params(s, w) == setup["drafter"]["params"]
    # The benchmark counts the anchors it drew; the plan assumes them three quarters in. Counted
    # now as the benchmark counts (the stored result predates the counting of 2026-12-02).
    assert drafter_flops_per_sample(s, w) == pytest.approx(_bench_drafter_flops("qwen3-8b"), rel=0.01)


def _bench_drafter_flops(shape_name: str) -> float:
    sys.path.insert(0, str(REPO / "bench"))
    try:
        from benchlib.flops import drafter_flops_per_micro_batch
        from benchlib.shapes import SHAPES, bench_config
        from benchlib.synthetic import SyntheticReader
    finally:
        sys.path.remove(str(REPO / "bench"))
    import torch

    shape = SHAPES[shape_name]
    cfg = bench_config(shape, torch.device("cpu"), 1, 1, [])
    return drafter_flops_per_micro_batch(shape, cfg, SyntheticReader(shape, 1, 0).read(0))["train"]


@pytest.mark.parametrize(
    ("name", "memory"),
    [
        ("NVIDIA H200", 141.0),
        ("NVIDIA A100-SXM4-80GB", 80.0),
        ("NVIDIA H100 80GB HBM3", 80.0),
        ("NVIDIA GH200 480GB", None),
        ("cpu", None),
    ],
)
def test_gpu_memory_by_device_name(name: str, memory: float | None) -> None:
    assert gpu_memory_gb(name) == memory


def test_bad_input_is_refused_naming_the_input_and_the_fix(
    tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    assert main(["--gpus", "8", "--bench", str(tmp_path / "missing.json")]) == 2
    assert "missing.json: no such file" in capsys.readouterr().err

    only_drafter = bench_json(tmp_path, stages(target=None))
    with pytest.raises(PlanError, match="no target_only rate.*--sections setup,target_only,drafter_only"):
        plan_of("--gpus", "8", "--bench", str(only_drafter))
    # ... unless the missing rate is given.
    plan = plan_of("--gpus", "8", "--bench", str(only_drafter), "--target-ms", "72.3")
    assert plan.stage.target_rate[1].source == "given"

    (tmp_path / "garbage.json").write_text("{not json")
    with pytest.raises(PlanError, match="not JSON"):
        plan_of("--gpus", "8", "--bench", str(tmp_path / "garbage.json"))

    on_cpu = bench_json(tmp_path, stages(), device="cpu", device_name="cpu")
    with pytest.raises(PlanError, match="--gpu-memory-gb is needed"):
        plan_of("--gpus", "8", "--bench", str(on_cpu))

    with pytest.raises(PlanError, match="--gpus 0: must be at least 1"):
        plan_of("--gpus", "0", "--bench", str(only_drafter))


def test_without_bench_the_bundled_benchmark_is_used_and_named(tmp_path, capsys, monkeypatch) -> None:
    """`--gpus 8 --target qwen3.5-9b` alone: the bundled benchmark (the Makefile's BENCH), named;
    the suggested command launches the target's preset, or `custom` with its directory."""
    from dflash_mp.plan import cli

    assert main(["--gpus", "8", "--target", "qwen3.5-9b"]) == 0
    text = capsys.readouterr().out
    assert f"rates from {RESULTS / 'h200x2-qwen3-8b.json'} (the bundled benchmark, --bench's default" in text
    assert "torchrun --nproc-per-node 8 -m dflash_mp.train experiment=qwen3.5-9b topology=" in text
    assert main(["--gpus", "8", "--json"]) == 0  # the benchmark's own shape: its preset
    result = json.loads(capsys.readouterr().out)
    assert result["bench_is_default"] and result["experiment"] == "experiment=qwen3-8b"
    assert "-m dflash_mp.train experiment=qwen3-8b topology=" in result["best"]["command"]
    target = hf_target(tmp_path, LLAMA_70B)
    assert main(["--gpus", "8", "--target", str(target / "config.json"), "--json"]) == 0
    assert (
        json.loads(capsys.readouterr().out)["experiment"] == f"experiment=custom model.target_path={target}"
    )
    monkeypatch.setattr(cli, "DEFAULT_BENCH", tmp_path / "not-in-this-checkout.json")
    with pytest.raises(
        PlanError, match="--bench FILE is needed .*not-in-this-checkout.json is not in this checkout"
    ):
        plan_of("--gpus", "8")


def test_a_mixture_of_experts_config_without_its_model_type_is_refused_clearly() -> None:
    """Its parameters are counted on transformers' model of that type (tests/test_plan_families.py)."""
    with pytest.raises(PlanError, match="--target qwen3-moe: config.json has no model_type"):
        shape_from_hf_config(
            {**LLAMA_70B, "num_experts": 128, "moe_intermediate_size": 768}, name="qwen3-moe"
        )
    shape = shape_from_hf_config({**LLAMA_70B, "num_experts": 0}, name="dense")
    assert shape == ModelShape(8192, 80, 64, 8, 128, 28672, 128256)
    assert Workload(3072, 512, 16, 5).micro_batch == 1


def test_a_target_of_the_benchmark_shape_uses_the_measurements(tmp_path: Path) -> None:
    qwen3_8b = {
        "hidden_size": 4096,
        "num_hidden_layers": 36,
        "num_attention_heads": 32,
        "num_key_value_heads": 8,
        "head_dim": 128,
        "intermediate_size": 12288,
        "vocab_size": 151936,
        "tie_word_embeddings": False,
    }
    target = hf_target(tmp_path, qwen3_8b)
    plan = plan_of(
        "--gpus",
        "8",
        "--bench",
        str(RESULTS / "h200x2-qwen3-8b.json"),
        "--target",
        str(target / "config.json"),
    )
    assert plan.stage.target_rate[1].source == plan.stage.drafter_rate.source == "measured"
    assert plan.stage.colocated_gb.source == "measured"
    wider = hf_target(tmp_path, {**qwen3_8b, "intermediate_size": 2 * 12288}, name="wider")
    plan = plan_of("--gpus", "8", "--bench", str(RESULTS / "h200x2-qwen3-8b.json"), "--target", str(wider))
    assert plan.stage.target_rate[1].source == "scaled"
    assert plan.stage.target_rate[1].value < 13.83 / 1.5


def test_python_dash_m_runs_the_plan_and_exits_2_on_bad_input(tmp_path: Path) -> None:
    command = [sys.executable, "-m", "dflash_mp.plan", "--gpus", "8", "--bench"]
    done = subprocess.run([*command, str(RESULTS / "h200x2-qwen3-8b.json")], capture_output=True, text=True)
    assert done.returncode == 0 and "best: " in done.stdout
    done = subprocess.run([*command, str(tmp_path / "none.json")], capture_output=True, text=True)
    assert done.returncode == 2 and "none.json: no such file" in done.stderr and not done.stdout
