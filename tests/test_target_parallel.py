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

from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.target_checks import target_parallel_head_problems
from dflash_mp.config.validation import validate
from dflash_mp.embedded import target_dir
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.models.tensor_parallel import layer_plan
from dflash_mp.runtime.target_parallel import replica_mesh
from tests import spawn_pool
from tests.conftest import read_metrics, run_train

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
            # A shard that is a view of the full weight would keep the whole weight alive.
            result[f"{source}_oversized"] = [
                name
                for name, p in extractor.named_parameters()
                if hasattr(p, "to_local")
                and p.to_local().untyped_storage().nbytes() > p.to_local().numel() * p.element_size()
            ]
            result[source] = extractor(_input_ids())
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def replica_results(tmp_path_factory) -> list[dict]:
    """Both sources through one 2-process replica (forked from tests/spawn_pool.py's forkserver)."""
    out = tmp_path_factory.mktemp("replica")
    try:
        spawn_pool.start_processes(_worker, args=(2, _free_port(), str(out)), nprocs=2)
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
        assert result[f"{source}_oversized"] == []
        torch.testing.assert_close(result[source], expected, atol=1e-5, rtol=1e-5)
    assert torch.equal(replica_results[0][source], replica_results[1][source])  # replicated


def _gpu_worker(rank: int, port: int, out: str) -> None:
    """One rank of a 2-GPU replica: the TP=1 and TP=2 builds of one random target, eager and compiled."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=2, device_id=device)
        mesh = replica_mesh(dist.new_group(ranks=[0, 1]), device)
        config = Qwen3Config(
            hidden_size=512,
            intermediate_size=1536,
            num_hidden_layers=6,
            num_attention_heads=8,
            num_key_value_heads=4,
            head_dim=64,
            vocab_size=1000,
        )
        ids = torch.randint(0, 1000, (2, 256), generator=torch.Generator().manual_seed(0)).to(device)
        result = {}
        for dtype in (torch.float32, torch.bfloat16):
            name = str(dtype).split(".")[-1]
            before = torch.cuda.memory_allocated(device)
            single = TargetFeatureExtractor.build_random(config, [1, 4], dtype, device, seed=5)
            result[f"{name}_single"] = single(ids).cpu()
            single_bytes = torch.cuda.memory_allocated(device) - before
            del single
            torch.cuda.empty_cache()
            before = torch.cuda.memory_allocated(device)
            sharded = TargetFeatureExtractor.build_random(config, [1, 4], dtype, device, seed=5, mesh=mesh)
            result[f"{name}_memory_ratio"] = (torch.cuda.memory_allocated(device) - before) / single_bytes
            result[f"{name}_sharded"] = sharded(ids).cpu()
            sharded.compile_layers()
            result[f"{name}_compiled"] = sharded(ids).cpu()
            del sharded
            torch.cuda.empty_cache()
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.gpu
def test_a_two_gpu_replica_over_nccl_gives_the_hidden_states_of_one_gpu(tmp_path):
    """NCCL, random target built on the GPUs, eager and torch.compiled; each GPU holds about half."""
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    try:
        mp.start_processes(_gpu_worker, args=(_free_port(), str(tmp_path)), nprocs=2, start_method="spawn")
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(tmp_path.glob("*.err")))
        raise AssertionError(f"a replica rank failed:\n{errors}") from e
    for rank in range(2):
        result = torch.load(tmp_path / f"rank{rank}.pt", weights_only=True)
        # Relative error over the whole tensor: bf16 rounds each element too coarsely for elementwise checks.
        for name, tolerance in (("float32", 1e-5), ("bfloat16", 2e-2)):
            expected = result[f"{name}_single"].float()
            for variant in ("sharded", "compiled"):
                error = (result[f"{name}_{variant}"].float() - expected).norm() / expected.norm()
                assert error < tolerance, (name, variant, error.item())
            # Layers halved, embedding and norms whole (the embedding is small at this shape).
            assert result[f"{name}_memory_ratio"] < 0.7, result[f"{name}_memory_ratio"]


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


def _cfg(*overrides: str):
    return to_dataclass(compose_config(list(overrides)))


def test_a_two_rank_replica_is_a_valid_config():
    validate(_cfg("topology.targets=2", "topology.target_parallel=2", "topology.drafters=1"), world_size=3)


def test_targets_must_be_a_multiple_of_target_parallel():
    cfg = _cfg("topology.targets=3", "topology.target_parallel=2", "topology.drafters=1")
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=4)
    message = str(info.value)
    assert "topology.targets=3 is not a multiple of topology.target_parallel=2" in message
    assert "set topology.targets to 2" in message


def test_target_parallel_must_divide_the_heads():
    # The embedded target has 4 attention heads and 2 KV heads: 4 ranks cannot split the KV heads.
    cfg = _cfg("topology.targets=4", "topology.target_parallel=4", "topology.drafters=1")
    with pytest.raises(ConfigError, match=r"target_parallel=4: .*num_key_value_heads=2 .*use one of \[2\]"):
        validate(cfg, world_size=5)


def test_head_problems_name_the_splits_that_fit():
    assert target_parallel_head_problems(2, {"num_attention_heads": 6, "num_key_value_heads": 2}) == []
    (problem,) = target_parallel_head_problems(4, {"num_attention_heads": 12, "num_key_value_heads": 6})
    assert "use one of [2, 3, 6]" in problem
    (problem,) = target_parallel_head_problems(2, {"num_attention_heads": 5})  # no KV count: MHA
    assert "num_key_value_heads=5" in problem and "use one of [5]" in problem
    (problem,) = target_parallel_head_problems(2, {"num_attention_heads": 8, "num_key_value_heads": 1})
    assert "use topology.target_parallel=1" in problem
    (problem,) = target_parallel_head_problems(
        2, {"num_attention_heads": 8, "num_key_value_heads": 2, "intermediate_size": 99}
    )
    assert "intermediate_size=99" in problem


def test_target_parallel_below_one_is_refused():
    with pytest.raises(ConfigError, match=r"topology.target_parallel=0: must be >= 1"):
        validate(_cfg("topology.target_parallel=0"), world_size=3)


def _replica_and_single_target_runs(tmp_path, *overrides: str) -> tuple[Path, Path]:
    """The same 6-step job with one 2-rank target replica and with one 1-rank target."""
    common = (
        "train.max_steps=6",
        "train.micro_batch_size=2",
        "train.grad_accum=2",
        "train.export=false",
        "eval.every=0",
        *overrides,
        "logger.progress_every=100",
        "topology.drafters=1",
    )
    run_train(tmp_path / "tp2", *common, "topology.targets=2", "topology.target_parallel=2")
    run_train(tmp_path / "tp1", *common, "topology.targets=1")
    return tmp_path / "tp2", tmp_path / "tp1"


@pytest.mark.slow
def test_a_two_rank_replica_job_trains_like_a_one_rank_target(tmp_path):
    """targets=2 target_parallel=2 (one replica) + 1 drafter against 1 target + 1 drafter."""
    tp2, tp1 = _replica_and_single_target_runs(tmp_path)
    sharded = [r["loss"] for r in read_metrics(tp2)]
    single = [r["loss"] for r in read_metrics(tp1)]
    assert len(sharded) == 6
    assert sharded == pytest.approx(single, rel=1e-5, abs=1e-5)
    job_log = (tp2 / "logs" / "job.log").read_text()
    assert "1 replica(s) of 2 ranks" in job_log
    # Only the leader sends: the drafter received what the single target sent, byte for byte.
    assert [r["bytes_received"] for r in read_metrics(tp2)] == [
        r["bytes_received"] for r in read_metrics(tp1)
    ]


@pytest.mark.gpu
@pytest.mark.slow
def test_a_two_gpu_replica_job_trains_like_a_one_gpu_target(tmp_path):
    """On 3 GPUs: the replica's all-reduces (its NCCL group) beside the leader's sends (the default
    group) must neither hang nor change the training, up to float rounding."""
    if torch.cuda.device_count() < 3:
        pytest.skip("needs 3 GPUs")
    tp2, tp1 = _replica_and_single_target_runs(tmp_path, "train.device=cuda", "train.dtype=float32")
    sharded = [r["loss"] for r in read_metrics(tp2)]
    single = [r["loss"] for r in read_metrics(tp1)]
    assert len(sharded) == 6
    assert sharded == pytest.approx(single, rel=1e-3)


def test_doctor_warns_when_a_replica_would_span_two_nodes(tmp_path):
    from dflash_mp.launch import doctor

    job = ["topology.targets=2", "topology.target_parallel=2", "topology.drafters=4", "train.device=cpu"]
    checks = doctor.preflight(compose_config(job), tmp_path / "run", nnodes=2, nproc_per_node=3)
    assert not doctor.failed(checks)
    warnings = [c.message for c in checks if c.name == "topology"]
    assert len(warnings) == 1 and "not a multiple of topology.target_parallel=2" in warnings[0]
    job[2] = "topology.drafters=2"  # 2 nodes x 2 processes: each replica on one node
    checks = doctor.preflight(compose_config(job), tmp_path / "run", nnodes=2, nproc_per_node=2)
    assert not doctor.failed(checks) and not [c for c in checks if c.name == "topology"]
