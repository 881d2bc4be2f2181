"""A mixture-of-experts target as a two-rank replica (gloo on CPU) computes what one rank does.

The tiny stock targets of tests/target_families.py (Qwen3-MoE, gpt-oss, Qwen3.5-MoE, DeepSeek-V3,
GLM-4-MoE), loaded from disk with the config's own plans, on HF's default kernels (a CPU target
rank's) and on `use_fast_kernels` (grouped-GEMM experts, gpt-oss sinks on flex: a GPU target
rank's, here on their CPU paths). gpt-oss also runs the attention plan older transformers versions gave it (heads
and sinks split), built in memory. One spawn of two processes holds every case: it is the slow part.
"""

from __future__ import annotations

import os
import traceback
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import transformers

from dflash_mp.config.schema import ConfigError
from dflash_mp.config.validation import validate
from dflash_mp.models.moe_experts import EXPERTS_IMPLEMENTATION
from dflash_mp.models.parallel_styles import ExpertsParallel, PerHeadParameters
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.models.tensor_parallel import layer_plan, plan_problems
from dflash_mp.runtime.target_parallel import replica_mesh
from tests import spawn_pool
from tests.target_families import ensure_family_target, family_config
from tests.test_target_families import TOKENS, custom_recipe
from tests.test_target_parallel import _free_port

FAMILIES = ("qwen3_moe", "gpt_oss", "qwen3_5_moe", "deepseek_v3", "glm4_moe")
LAYER_IDS = [1, 3]  # a linear-attention layer of Qwen3.5-MoE, and the last (after the final norm)
# gpt-oss's plan in transformers 4.55-5.x before its attention left the plan: heads and sinks split.
GPT_OSS_ATTENTION_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.self_attn.sinks": "local_rowwise",
    "layers.*.mlp.experts": "gather",
    "layers.*.mlp.router": "ep_router",
    "layers.*.mlp.experts.gate_up_proj": "grouped_gemm",
    "layers.*.mlp.experts.gate_up_proj_bias": "grouped_gemm",
    "layers.*.mlp.experts.down_proj": "grouped_gemm",
    "layers.*.mlp.experts.down_proj_bias": "grouped_gemm",
}
CASES = (*FAMILIES, "gpt_oss_attention_plan")
COMPILED = "qwen3_moe"  # gpt-oss's sink attention runs outside compiled graphs on CPU


def _targets(out: Path) -> dict[str, str]:
    """The stock family directories; gpt-oss's copied with random biases (its init zeroes them, and
    the experts' down bias must be added once, not once per rank)."""
    targets = {name: str(ensure_family_target(name)) for name in FAMILIES}
    model = transformers.GptOssForCausalLM.from_pretrained(targets["gpt_oss"], dtype=torch.float32)
    torch.manual_seed(0)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bias"):
                param.normal_(0.0, 0.1)
    model.save_pretrained(out / "gpt_oss")
    return {**targets, "gpt_oss": str(out / "gpt_oss")}


def _extractor(case: str, targets: dict[str, str], mesh=None) -> TargetFeatureExtractor:
    if case == "gpt_oss_attention_plan":
        config = family_config("gpt_oss")
        config.base_model_tp_plan = GPT_OSS_ATTENTION_PLAN
        return TargetFeatureExtractor.build_random(config, LAYER_IDS, torch.float32, "cpu", seed=5, mesh=mesh)
    return TargetFeatureExtractor(targets[case], LAYER_IDS, torch.float32, "cpu", mesh=mesh)


def _run(case: str, targets: dict[str, str], mesh=None, compiled: bool = False) -> dict:
    """Features on HF's kernels, then on the fast ones (and, `compiled`, with the layers compiled
    as a GPU target rank compiles them, on aot_eager: no C++ build); the shapes a rank holds of the
    last layer (full attention in every family)."""
    extractor = _extractor(case, targets, mesh)
    layer = extractor.decoder.layers[LAYER_IDS[-1]]
    weights = {
        "gate_up_proj": layer.mlp.experts.gate_up_proj,
        "down_proj": layer.mlp.experts.down_proj,
        # The query projection that carries the heads: q_proj, or MLA's q_b_proj after its low rank.
        "attention": (getattr(layer.self_attn, "q_b_proj", None) or layer.self_attn.q_proj).weight,
        "sinks": getattr(layer.self_attn, "sinks", torch.empty(0)),
    }
    result = {f"{name}_shape": list(_local(w).shape) for name, w in weights.items()}
    # A shard that is a view of the full weight would keep the whole weight alive.
    result["oversized"] = [
        name
        for name, p in extractor.named_parameters()
        if _local(p).untyped_storage().nbytes() > _local(p).numel() * p.element_size()
    ]
    result["hf"] = extractor(TOKENS)
    result["experts"] = extractor.use_fast_kernels()["experts"]
    result["fast"] = extractor(TOKENS)
    if compiled:  # one graph per layer: the experts' all-reduce traces without a break
        extractor.compile_layers(backend="aot_eager", fullgraph=True)
        result["compiled"] = extractor(TOKENS)
    return result


def _local(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.to_local() if hasattr(tensor, "to_local") else tensor


def _worker(rank: int, world_size: int, port: int, targets: dict[str, str], out: str) -> None:
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        torch.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world_size)
        mesh = replica_mesh(dist.new_group(ranks=list(range(world_size))), torch.device("cpu"))
        torch.save(
            {case: _run(case, targets, mesh, compiled=case == COMPILED) for case in CASES},
            Path(out) / f"rank{rank}.pt",
        )
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.fixture(scope="module")
def targets(tmp_path_factory) -> dict[str, str]:
    return _targets(tmp_path_factory.mktemp("moe-targets"))


def _spawn_replica(worker, targets: dict[str, str], out: Path, forked: bool = True) -> list[dict]:
    """Two processes of `worker` (forked from tests/spawn_pool.py's forkserver, or spawned);
    each rank's results, or the ranks' tracebacks."""
    args = (2, _free_port(), targets, str(out))
    try:
        if forked:
            spawn_pool.start_processes(worker, args=args, nprocs=2)
        else:
            mp.start_processes(worker, args=args, nprocs=2, start_method="spawn")
    except Exception as e:
        errors = "\n".join(p.read_text() for p in sorted(out.glob("*.err")))
        raise AssertionError(f"a replica rank failed:\n{errors}") from e
    return [torch.load(out / f"rank{r}.pt", weights_only=True) for r in range(2)]


@pytest.fixture(scope="module")
def replica_results(tmp_path_factory, targets) -> list[dict]:
    return _spawn_replica(_worker, targets, tmp_path_factory.mktemp("moe-replica"))


def _plan(case: str) -> dict:
    config = family_config(case.removesuffix("_attention_plan")).get_text_config()
    if case == "gpt_oss_attention_plan":
        config.base_model_tp_plan = GPT_OSS_ATTENTION_PLAN
    return layer_plan(config)


def _numel(shape: list[int]) -> int:
    return torch.Size(shape).numel()


@pytest.mark.parametrize("case", CASES)
def test_a_two_rank_moe_replica_gives_the_hidden_states_of_one_rank(replica_results, targets, case):
    single = _run(case, targets)
    assert single["experts"] == EXPERTS_IMPLEMENTATION
    splits_heads = bool({"self_attn.q_proj", "self_attn.q_b_proj"} & set(_plan(case)))
    for rank_results in replica_results:
        result = rank_results[case]
        assert result["oversized"] == []
        for kernels in ("hf", "fast"):
            torch.testing.assert_close(result[kernels], single[kernels], atol=1e-5, rtol=1e-5)
        if case == COMPILED:
            torch.testing.assert_close(result["compiled"], single["fast"], atol=1e-5, rtol=1e-5)
        # Every expert is on every rank, with half its intermediate width.
        for weight in ("gate_up_proj", "down_proj"):
            local, full = result[f"{weight}_shape"], single[f"{weight}_shape"]
            assert local[0] == full[0] and 2 * _numel(local) == _numel(full), (weight, local, full)
        # Heads (and gpt-oss's sinks with them) are split where the plan splits q/k/v.
        for weight in ("attention", "sinks"):
            local, full = result[f"{weight}_shape"], single[f"{weight}_shape"]
            assert _numel(local) * (2 if splits_heads else 1) == _numel(full), (weight, local, full)
    assert torch.equal(replica_results[0][case]["fast"], replica_results[1][case]["fast"])  # replicated


def test_the_experts_split_comes_from_the_config_plans():
    qwen3_moe = _plan("qwen3_moe")
    assert isinstance(qwen3_moe["mlp.experts"], ExpertsParallel)
    assert type(qwen3_moe["self_attn.q_proj"]).__name__ == "ColwiseParallel"
    assert not {"mlp.experts.gate_up_proj", "mlp.experts.down_proj", "mlp.gate"} & set(qwen3_moe)
    # gpt-oss names its experts in the tensor-parallel plan or (recent versions) the expert-parallel one.
    assert isinstance(_plan("gpt_oss")["mlp.experts"], ExpertsParallel)
    older = _plan("gpt_oss_attention_plan")
    assert isinstance(older["self_attn"], PerHeadParameters) and older["self_attn"].names == ("sinks",)
    assert "mlp.router" not in older  # every rank routes every token
    # Qwen3.5's linear attention: column shards gathered back whole.
    in_proj = _plan("qwen3_5_moe")["linear_attn.in_proj_qkv"]
    assert type(in_proj).__name__ == "ColwiseParallel" and in_proj.output_layouts[0].is_replicate()
    # MLA's kv_a projection (transformers >= 5.2x names it "mla_kv_a_proj") stays whole: its output
    # feeds the rope keys of every head, and the style's only work is a backward reduction.
    config = family_config("deepseek_v3").get_text_config()
    config.base_model_tp_plan = {
        **config.base_model_tp_plan,
        "layers.*.self_attn.kv_a_proj_with_mqa": "mla_kv_a_proj",
    }
    mla = layer_plan(config)
    assert "self_attn.kv_a_proj_with_mqa" not in mla and "self_attn.kv_b_proj" in mla


def test_a_moe_plan_that_leaves_the_experts_whole_is_refused():
    config = family_config("qwen3_moe")
    config.base_model_tp_plan = {
        "layers.*.self_attn.q_proj": "colwise",
        "layers.*.self_attn.o_proj": "rowwise",
    }
    config.base_model_ep_plan = None
    with pytest.raises(ValueError, match="neither its base_model_tp_plan nor its base_model_ep_plan names"):
        layer_plan(config)


def test_the_preflight_names_the_plan_entry_it_cannot_apply(monkeypatch):
    target = ensure_family_target("qwen3_moe")
    replica = ("topology.targets=2", "topology.target_parallel=2")
    validate(custom_recipe(target, *replica))
    plan = {**transformers.Qwen3MoeConfig.base_model_tp_plan, "layers.*.mlp.experts": "no_such_style"}
    monkeypatch.setattr(transformers.Qwen3MoeConfig, "base_model_tp_plan", plan)
    message = r"topology.target_parallel=2: .*base_model_tp_plan\['layers.\*.mlp.experts'\] = 'no_such_style'"
    with pytest.raises(ConfigError, match=message):
        validate(custom_recipe(target, *replica))


def test_the_preflight_refuses_experts_that_do_not_divide():
    config = {**family_config("qwen3_moe").to_dict(), "moe_intermediate_size": 6}
    assert plan_problems(config, 2) == []
    (problem,) = plan_problems(config, 4)
    assert "moe_intermediate_size=6 does not divide by it" in problem


def _gpu_worker(rank: int, world_size: int, port: int, targets: dict[str, str], out: str) -> None:
    """One rank of a 2-GPU replica: what a GPU target rank runs (bf16, fast kernels, compiled
    layers), sharded and whole."""
    try:
        os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        device = torch.device("cuda", rank)
        torch.cuda.set_device(device)
        dist.init_process_group("nccl", rank=rank, world_size=world_size, device_id=device)
        mesh = replica_mesh(dist.new_group(ranks=list(range(world_size))), device)
        result = {}
        for case in ("qwen3_moe", "gpt_oss"):
            for name, replica in (("single", None), ("sharded", mesh)):
                extractor = TargetFeatureExtractor(
                    targets[case], LAYER_IDS, torch.bfloat16, device, mesh=replica
                )
                extractor.use_fast_kernels()
                extractor.compile_layers()
                result[f"{case}_{name}"] = extractor(TOKENS.to(device)).float().cpu()
        torch.save(result, Path(out) / f"rank{rank}.pt")
        dist.destroy_process_group()
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise


@pytest.mark.gpu
def test_a_two_gpu_moe_replica_on_the_fast_compiled_path_gives_the_hidden_states_of_one_gpu(
    tmp_path, targets
):
    if torch.cuda.device_count() < 2:
        pytest.skip("needs 2 GPUs")
    for result in _spawn_replica(_gpu_worker, targets, tmp_path, forked=False):
        for case in ("qwen3_moe", "gpt_oss"):
            expected = result[f"{case}_single"]
            # Relative error over the whole tensor: bf16 rounds each element too coarsely.
            error = (result[f"{case}_sharded"] - expected).norm() / expected.norm()
            assert error < 2e-2, (case, error.item())
