"""bench/target_families.py on CPU: every variant runs, keeps HF's features, and reports its MFU inputs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

from dflash_mp.models.moe_experts import EXPERTS_IMPLEMENTATION
from tests.conftest import REPO


def test_target_families_runs_on_cpu(tmp_path: Path) -> None:
    sys.path.insert(0, str(REPO / "bench"))
    import target_families

    out = tmp_path / "families.json"
    argv = ["--shapes", "tiny-qwen3.5-moe,tiny-gpt-oss", "--device", "cpu", "--out", str(out)]
    assert target_families.main([*argv, "--iters", "1", "--warmup", "0", "--batch", "2"]) == 0
    report = json.loads(out.read_text())
    for name in ("tiny-qwen3.5-moe", "tiny-gpt-oss"):
        shape = report["shapes"][name]
        assert shape["status"] == "ok", shape
        # Two sequences per forward: twice the matmul FLOPs of the active parameters.
        assert shape["batch"] == 2
        assert (
            shape["matmul_flops_per_forward"] == 2 * shape["active_params_layers_run"] * shape["seq_len"] * 2
        )
        assert set(shape["variants"]) == {"hf", "kernels", "target_stage"}
        # Routed experts count top-k of the experts: 2 of 4 here.
        assert shape["params_layers_run"] > shape["active_params_layers_run"] > shape["params_layers_run"] / 2
        for variant in ("kernels", "target_stage"):
            assert shape["variants"][variant]["max_abs_diff_vs_hf"] < 1e-4
        for variant in shape["variants"].values():  # CPU: the host runs the forward, so issuing is all of it
            assert 0 < variant["host_ms"] <= variant["ms"] * 1.5
        assert shape["kernels"]["experts"] == EXPERTS_IMPLEMENTATION
    assert report["shapes"]["tiny-gpt-oss"]["kernels"]["attention"].startswith("flex_attention with sinks")
    # Layers 0..2 run, all gated deltanet: their fla kernels stay eager.
    assert report["shapes"]["tiny-qwen3.5-moe"]["compiled"] == {"mlp and norms": 3}
