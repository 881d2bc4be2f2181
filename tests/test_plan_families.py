"""The plan per target family: the target stage from the families measurement (measured or
extrapolated by active parameters), presets as targets, targets too big for one GPU, and the
docs table that cannot go stale."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import transformers

from dflash_mp.plan import PlanError
from dflash_mp.plan.cli import main, make_plan, parser
from dflash_mp.plan.costs import shape_from_hf_config, target_flops, target_layers_run, target_params
from dflash_mp.plan.families_table import FAMILY_PRESETS, table
from dflash_mp.plan.measured import read_families
from tests.conftest import REPO

RESULTS = REPO / "bench" / "results"
BENCH = str(RESULTS / "h200x2-qwen3-8b.json")
FAMILIES = str(RESULTS / "h200x1-target-families.json")
ENTRIES = json.loads(Path(FAMILIES).read_text())["shapes"]


def plan_of(*argv: str):
    return make_plan(parser().parse_args(["--gpus", "8", "--bench", BENCH, "--families", FAMILIES, *argv]))


def target_dir(tmp_path: Path, config: dict, name: str = "target") -> Path:
    directory = tmp_path / name
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps(config))
    return directory


def entry_config(entry: str) -> dict:
    return {"model_type": ENTRIES[entry]["model_type"], **ENTRIES[entry]["config"]}


def test_a_preset_of_a_measured_shape_takes_the_entry_time_and_memory(capsys) -> None:
    plan = plan_of("--target", "qwen3.5-9b")
    stage = ENTRIES["qwen3.5-9b"]["variants"]["target_stage"]
    rate, memory = plan.stage.target_rate[1], plan.stage.target_gb
    assert rate.source == "measured" and rate.value == pytest.approx(1e3 / stage["ms"])
    assert memory[1].source == "measured" and memory[1].value == pytest.approx(stage["peak_allocated_gb"])
    # A TP=2 rank holds the embedding whole and half the layers' bf16 weights.
    layers_gb = 2 * ENTRIES["qwen3.5-9b"]["params_layers_run"] / 1e9
    assert memory[1].value - memory[2].value == pytest.approx(layers_gb / 2)
    assert plan.target_mfu == pytest.approx(stage["mfu"])
    # The preset's drafter: 5 layers, block 16 (conf/model/qwen3.5-9b.yaml).
    assert (plan.workload.draft_layers, plan.workload.block_size) == (5, 16)
    assert main(["--gpus", "8", "--bench", BENCH, "--families", FAMILIES, "--target", "qwen3.5-9b"]) == 0
    text = capsys.readouterr().out
    assert "target stage: measured, " in text
    assert "h200x1-target-families.json entry 'qwen3.5-9b': 71.6 ms per 3072-token sequence" in text
    assert "MFU 0.70" in text and "linear_attention fla" in text


def test_a_config_json_of_a_measured_shape_matches_its_entry_multimodal_layout_too(tmp_path: Path) -> None:
    """Qwen3-Coder-30B-A3B has Qwen3-30B-A3B's shape; Qwen3.5-35B-A3B's hub config nests its text config."""
    coder = target_dir(tmp_path, {**entry_config("qwen3-30b-a3b"), "tie_word_embeddings": False}, "coder")
    plan = plan_of("--target", str(coder))
    assert plan.family.exact and plan.family.record.entry == "qwen3-30b-a3b"
    assert plan.stage.target_rate[1].source == "measured"
    # Every expert counted for memory, top 8 of 128 for FLOPs, as the benchmark counted them.
    layers_run = ENTRIES["qwen3-30b-a3b"]["layers_run"]
    assert plan.shape.layer_params_all * layers_run == ENTRIES["qwen3-30b-a3b"]["params_layers_run"]
    assert plan.shape.layer_params_active * layers_run == ENTRIES["qwen3-30b-a3b"]["active_params_layers_run"]
    wrapped = {"model_type": "qwen3_5_moe", "text_config": entry_config("qwen3.5-35b-a3b")}
    plan = plan_of("--target", str(target_dir(tmp_path, wrapped, "vl") / "config.json"))
    assert plan.family.exact and plan.family.record.entry == "qwen3.5-35b-a3b"


def test_a_family_member_no_entry_ran_is_extrapolated_by_active_parameters(capsys) -> None:
    """gpt-oss-120b from gpt-oss-20b: too big for one GPU, so tensor-parallel replicas only."""
    plan = plan_of("--target", "gpt-oss-120b")
    record = plan.family.record
    assert not plan.family.exact and record.entry == "gpt-oss-20b"
    ratio = target_flops(plan.family.record_shape, record.layers_run, record.seq_len) / target_flops(
        plan.shape, target_layers_run(plan.shape, plan.workload), plan.workload.seq_len
    )
    assert 0.5 < ratio < 0.75  # about 4.3B active parameters run against 2.8B
    rate = plan.stage.target_rate[1]
    assert rate.source == "scaled" and rate.value == pytest.approx(1e3 / record.target_ms * ratio)
    assert plan.stage.target_gb[1].value > 200  # 117B parameters in bf16
    assert plan.candidates and all(c.target_parallel >= 2 for c in plan.candidates)
    assert any(reason.startswith("TP=1: target rank") for reason in plan.left_out)
    assert main(["--gpus", "8", "--bench", BENCH, "--families", FAMILIES, "--target", "gpt-oss-120b"]) == 0
    text = capsys.readouterr().out
    assert "target stage: extrapolated from" in text and "entry 'gpt-oss-20b'" in text
    assert "the target does not fit one GPU" in text and "only tensor-parallel replicas" in text


def test_a_qwen3_5_moe_of_about_120b_needs_tensor_parallel_replicas(tmp_path: Path) -> None:
    config = {
        **entry_config("qwen3.5-35b-a3b"),
        "num_hidden_layers": 48,
        "hidden_size": 3072,
        "moe_intermediate_size": 1024,
        "shared_expert_intermediate_size": 1024,
        "num_attention_heads": 32,
    }
    plan = plan_of("--target", str(target_dir(tmp_path, config)))
    assert plan.family.record.entry == "qwen3.5-35b-a3b" and not plan.family.exact
    assert plan.stage.target_rate[1].value < 1e3 / plan.family.record.target_ms  # more active parameters
    assert 100e9 < target_params(plan.shape) < 130e9
    assert plan.candidates and all(c.target_parallel >= 2 for c in plan.candidates)


def test_without_an_entry_of_its_family_the_stage_benchmark_is_scaled(tmp_path: Path) -> None:
    families = plan_of("--target", "qwen3-8b")
    assert families.family is None and families.stage.target_rate[1].source == "measured"
    assert families.target_mfu == pytest.approx(0.797, abs=1e-3)  # the benchmark's target MFU
    llama = {**entry_config("qwen3.5-9b"), "model_type": "llama"}
    for key in [k for k in llama if k.startswith("linear_")]:
        del llama[key]
    plan = plan_of("--target", str(target_dir(tmp_path, llama)))
    assert plan.family is None and plan.stage.target_rate[1].source == "scaled"


def test_a_tensor_parallel_width_the_target_plan_cannot_split_is_left_out(monkeypatch) -> None:
    plan = {**transformers.Qwen3MoeConfig.base_model_tp_plan, "layers.*.mlp.experts": "no_such_style"}
    monkeypatch.setattr(transformers.Qwen3MoeConfig, "base_model_tp_plan", plan)
    result = plan_of("--target", "qwen3-coder-30b-a3b")
    assert all(c.target_parallel == 1 for c in result.candidates)
    assert any(
        reason.startswith("TP=2: topology.target_parallel=2: ") and "'no_such_style'" in reason
        for reason in result.left_out
    )


def test_a_target_that_is_not_one_says_what_it_can_be(tmp_path: Path, capsys) -> None:
    with pytest.raises(
        PlanError, match="--target no-such: not a directory .* a preset .*qwen3.5-9b.* gpt-oss-20b"
    ):
        plan_of("--target", "no-such")
    # qwen3.5-4b: no entry ran its shape and its model.target_path is not here.
    with pytest.raises(PlanError, match="--target qwen3.5-4b: .*no config.json.*give the target's directory"):
        plan_of("--target", "qwen3.5-4b")
    assert (
        main(["--gpus", "8", "--bench", BENCH, "--families", str(tmp_path / "none.json"), "--target", "x"])
        == 2
    )
    assert "none.json: no such file" in capsys.readouterr().err
    (tmp_path / "bench.json").write_text(Path(BENCH).read_text())
    with pytest.raises(PlanError, match="not a bench/target_families.py result"):
        read_families(tmp_path / "bench.json")


def test_a_preset_whose_target_path_is_there_plans_that_config(tmp_path: Path, monkeypatch) -> None:
    wider = {**entry_config("qwen3.5-9b"), "intermediate_size": 2 * 12288}
    monkeypatch.setenv("QWEN3_5_9B_PATH", str(target_dir(tmp_path, wider)))
    plan = plan_of("--target", "qwen3.5-9b")
    assert plan.target_source == str(tmp_path / "target" / "config.json")
    assert not plan.family.exact and plan.stage.target_rate[1].source == "scaled"
    assert plan.shape == shape_from_hf_config(wider, "target")


def test_the_docs_table_is_what_plan_prints(capsys) -> None:
    """docs/TARGETS.md holds the generated table, and each row's numbers are `plan --json`'s."""
    generated = table(8, BENCH, FAMILIES)
    doc = (REPO / "docs" / "TARGETS.md").read_text()
    assert generated in doc, "regenerate it: python -m dflash_mp.plan.families_table (docs/TARGETS.md)"
    rows = generated.splitlines()[2:]
    assert len(rows) == len(FAMILY_PRESETS)
    for line, (_, presets) in zip(rows, FAMILY_PRESETS, strict=True):
        cells = [cell.strip() for cell in line.strip("|").split("|")]
        argv = ["--gpus", "8", "--bench", BENCH, "--families", FAMILIES, "--target", presets[0], "--json"]
        assert main(argv) == 0
        result = json.loads(capsys.readouterr().out)
        best, stage = result["best"], result["target_stage"]
        assert cells[5] == f"`{best['overrides']}`"
        assert float(cells[6]) == pytest.approx(best["samples_per_s"], abs=0.005)
        ms, mfu = re.match(r"([\d.]+) \(([\d.]+)", cells[3]).groups()
        assert float(ms) == pytest.approx(stage["ms"], abs=0.05)
        assert float(mfu) == pytest.approx(stage["mfu"], abs=0.005)


def test_a_measurement_of_several_sequences_per_call_is_read_per_sequence() -> None:
    """bench's --batch 4 times four sequences per call: the plan's costs are per sequence."""
    one = read_families(RESULTS / "h200x1-target-families-qwen3-30b-a3b-b1b.json")["qwen3-30b-a3b"]
    four = read_families(RESULTS / "h200x1-target-families-qwen3-30b-a3b-b4a.json")["qwen3-30b-a3b"]
    assert four.target_ms == pytest.approx(176.8 / 4, abs=0.05)
    assert four.flops_per_forward == pytest.approx(one.flops_per_forward)
