"""A target replica over two ranks (tensor parallel, gloo on CPU) computes what one rank does."""

from __future__ import annotations

import os
import socket
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from transformers import Qwen3Config

from dflash_mp.embedded import target_dir
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.models.tensor_parallel import layer_plan
from dflash_mp.target_parallel import replica_mesh

LAYER_IDS = [1, 3]
SOURCES = ("embedded", "random")


def _random_config() -> Qwen3Config:
    return Qwen3Config(
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=5,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=8,
        vocab_size=100,
    )


def _input_ids() -> torch.Tensor:
    # Ids below both vocabularies (the embedded target's 159, the random one's 100).
    return torch.randint(3, 100, (2, 11), generator=torch.Generator().manual_seed(0))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _extractor(source: str, mesh=None) -> TargetFeatureExtractor:
    if source == "embedded":  # loaded from disk: 4 attention heads, 2 KV heads
        return TargetFeatureExtractor(target_dir(), LAYER_IDS, torch.float32, "cpu", mesh=mesh)
    return TargetFeatureExtractor.build_random(
        _random_config(), LAYER_IDS, torch.float32, "cpu", seed=3, mesh=mesh
    )


def _worker(rank: int, world_size: int, port: int, out: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        mesh = replica_mesh(dist.new_group(ranks=list(range(world_size))), torch.device("cpu"))
        result = {}
        for source in SOURCES:
            extractor = _extractor(source, mesh)
            q_proj = extractor.decoder.layers[0].self_attn.q_proj.weight
            result[f"{source}_q_rows"] = q_proj.to_local().shape[0]
            result[source] = extractor(_input_ids())
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def replica_results(tmp_path_factory) -> list[dict]:
    """Both sources through one 2-process replica (one spawn: it is the slow part)."""
    out = tmp_path_factory.mktemp("replica")
    try:
        mp.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2, start_method="spawn")
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("*.err")))
        raise AssertionError(f"a replica rank failed:\n{errors}") from e
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.mark.parametrize("source", SOURCES)
def test_a_two_rank_replica_gives_the_hidden_states_of_one_rank(replica_results, source):
    single = _extractor(source)
    full_rows = single.decoder.layers[0].self_attn.q_proj.weight.shape[0]
    expected = single(_input_ids())
    for result in replica_results:
        assert result[f"{source}_q_rows"] == full_rows // 2  # each rank holds half the heads
        torch.testing.assert_close(result[source], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(replica_results[0][source], replica_results[1][source])  # replicated


def test_the_plan_comes_from_the_model_config():
    plan = layer_plan(_random_config())
    assert {name: type(style).__name__ for name, style in plan.items()} == {
        "self_attn.q_proj": "ColwiseParallel",
        "self_attn.k_proj": "ColwiseParallel",
        "self_attn.v_proj": "ColwiseParallel",
        "self_attn.o_proj": "RowwiseParallel",
        "mlp.gate_proj": "ColwiseParallel",
        "mlp.up_proj": "ColwiseParallel",
        "mlp.down_proj": "RowwiseParallel",
    }


def test_a_plan_style_without_a_mapping_is_refused():
    config = _random_config()
    config.base_model_tp_plan = {"layers.*.self_attn.qkv_proj": "packed_colwise"}
    with pytest.raises(ValueError, match="packed_colwise.*topology.target_parallel=1"):
        layer_plan(config)
