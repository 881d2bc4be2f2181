"""Preflight checks, before any worker starts: `python -m dflash_mp.launch doctor [overrides]`.

Every check ends in one line: what was found, or why it fails and how to fix it. The launcher
runs them before it starts torchrun (`launch run|start`, `python -m dflash_mp.train`), so a bad
config, a missing file or a busy port costs seconds, not a job allocation.
"""

from __future__ import annotations

import importlib
import os
from pathlib import Path

from omegaconf import DictConfig

from dflash_mp.config.schema import (
    ConfigError,
    RootConfig,
    TargetConfigError,
    checked_target_config,
    to_dataclass,
)
from dflash_mp.config.validation import processes_per_job, validate
from dflash_mp.launch.host_checks import (
    Check,
    check_disk,
    check_port,
    check_reaper,
    check_run_dir,
)

REQUIRED_MODULES = ("torch", "transformers", "safetensors", "hydra", "omegaconf")
WEIGHT_PATTERNS = ("*.safetensors", "*.bin")
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
UNKNOWN_WORLD = (
    "topology.layout=colocated with topology.drafters=null starts one rank per visible GPU, but no GPU "
    "is in use (train.device=cpu, or none visible): set topology.drafters=N, the number of processes"
)


def preflight(
    dict_cfg: DictConfig,
    run_dir: Path,
    nnodes: int = 1,
    nproc_per_node: int | None = None,
    port: int | None = None,
) -> list[Check]:
    """All checks for one job; `nproc_per_node` defaults to the whole topology on this machine."""
    checks = [check_imports()]
    cfg: RootConfig | None = None
    try:
        cfg = to_dataclass(dict_cfg)
    except Exception as e:  # a value Hydra could not resolve or type
        checks.append(Check("config", False, f"{type(e).__name__}: {e}"))
    if cfg is not None:
        per_node = nproc_per_node or processes_per_job(cfg, visible_gpus() if checks[0].ok else 0)
        if per_node is None and cfg.topology.layout == "colocated":  # split: validate names the field
            checks.append(Check("config", False, UNKNOWN_WORLD))
        checks += check_config(cfg, world_size=nnodes * per_node if per_node else None)
        k = cfg.topology.target_parallel
        if nnodes > 1 and per_node and isinstance(k, int) and k > 1 and per_node % k:
            checks.append(
                Check(
                    "topology",
                    True,
                    f"warning: {per_node} processes per node is not a multiple of topology.target_parallel={k}: "
                    "some target replica spans two nodes and runs its all-reduces over the network; "
                    f"use a multiple of {k} per node",
                )
            )
        if checks[0].ok and per_node:  # the next two need torch
            import torch

            uses_gpu = cfg.train.device != "cpu" and torch.cuda.is_available()
            checks += [check_devices(cfg.train.device, per_node, cfg.preset), check_backends(uses_gpu)]
            checks.append(check_attention(cfg.train.attention, cfg.train.dtype, uses_gpu))
        checks.append(check_target(cfg.model.target_path))
        if not checks[-1].ok:  # a missing target is named once, by the target check
            missing = f"model.target_path={str(cfg.model.target_path)!r}: no config.json there"
            checks = [c for c in checks if not (c.name == "config" and c.message.startswith(missing))]
        # A config.json the config check refuses (it names the file) tells nothing of the kernels.
        if checks[0].ok and checks[-1].ok and _usable_target_config(cfg.model.target_path):
            import torch

            from dflash_mp.config.precision import resolve_cuda_graphs

            on_gpu = cfg.train.device != "cpu" and torch.cuda.is_available()
            checks.append(
                check_target_kernels(
                    cfg.model.target_path,
                    on_gpu,
                    cfg.model.trust_remote_code,
                    cuda_graphs=resolve_cuda_graphs(cfg, torch.device("cuda"), tensor_parallel=False),
                    packed_rows=bool(cfg.data.packing),
                )
            )
        if all(c.ok for c in checks if c.name in ("imports", "config", "target")):
            checks += memory_checks(cfg, nnodes * per_node if per_node else None)
        checks.append(check_run_dir(run_dir, cfg.train.resume, cfg.train.overwrite))
        if checks[-1].ok and cfg.train.resume:
            checks.append(check_resume(cfg, run_dir, nnodes * per_node if per_node else None))
        # A sample of the data through the real tokenizer and template, once they can be read.
        if all(c.ok for c in checks if c.name in ("imports", "config", "target")):
            checks += reading_checks(cfg)
    checks += [check_disk(run_dir), check_reaper()]
    if port is not None:
        checks.append(check_port(port))
    return checks


def reading_checks(cfg: RootConfig) -> list[Check]:
    """The checks that read the data and the held-out prompts through the target's tokenizer
    (validate reads neither). Under plain torchrun rank 0 runs them before any heavy work."""
    from dflash_mp.data.preflight import check_data_sample
    from dflash_mp.evaluation.evaluator import eval_context_problem

    checks = [Check("data", *check_data_sample(cfg))]
    if cfg.eval.every:
        try:
            problem = eval_context_problem(cfg)
        except Exception as e:  # prompts or tokenizer that do not load: the message names them
            problem = f"cannot read the held-out prompts: {type(e).__name__}: {e}"
        checks.append(
            Check("eval", problem is None, problem or "the held-out prompts fit the target's context")
        )
    return checks


def memory_checks(cfg: RootConfig, world_size: int | None = None) -> list[Check]:
    """The predicted peak memory per GPU against the GPU's (dflash_mp.plan.memory_check): a config
    that cannot fit fails, naming the fixes; none when the GPU's memory is unknown (a CPU job, no
    GPU here and no DFLASH_MP_GPU_MEMORY_GIB). Under plain torchrun rank 0 runs it too."""
    from dflash_mp.plan.memory_check import gpu_memory_gib, memory_verdict

    try:
        total = gpu_memory_gib(cfg)
    except ValueError as e:  # DFLASH_MP_GPU_MEMORY_GIB that is not a positive number
        return [Check("memory", False, str(e))]
    if total is None:
        return []
    try:
        verdict = memory_verdict(cfg, total=total, world_size=world_size)
    except Exception as e:  # a config.json the shapes cannot read: loading the target says more
        return [Check("memory", True, f"warning: no prediction ({type(e).__name__}: {e})")]
    return [] if verdict is None else [Check("memory", *verdict)]


def failed(checks: list[Check]) -> list[Check]:
    return [c for c in checks if not c.ok]


def format_checks(checks: list[Check]) -> str:
    return "\n".join(f"{'ok' if c.ok else 'FAIL':4}  {c.name:8}  {c.message}" for c in checks)


def count_line(checks: list[Check]) -> str:
    """doctor's last line: how many checks ran, passed and failed (warnings pass)."""
    bad = len(failed(checks))
    warned = sum(1 for c in checks if c.ok and c.message.startswith("warning:"))
    also = f" ({warned} with a warning)" if warned else ""
    return f"{len(checks)} checks: {len(checks) - bad} ok{also}, {bad} failed"


def check_imports() -> Check:
    found, missing = [], []
    for name in REQUIRED_MODULES:
        try:
            module = importlib.import_module(name)
        except Exception as e:  # ImportError, or a broken install raising anything at import time
            missing.append(f"{name} ({type(e).__name__}: {e})")
            continue
        found.append(f"{name} {getattr(module, '__version__', '?')}")
    if missing:
        return Check(
            "imports",
            False,
            f"cannot import {'; '.join(missing)}: run `make setup` (or `pip install -e .`) in this environment",
        )
    return Check("imports", True, ", ".join(found))


def check_config(cfg: RootConfig, world_size: int | None) -> list[Check]:
    """validation.validate, one check per problem (it reports all of them at once)."""
    try:
        validate(cfg, world_size=world_size)
    except ConfigError as e:
        problems = [line[4:] for line in str(e).splitlines() if line.startswith("  - ")]
        return [Check("config", False, problem) for problem in problems]
    return [Check("config", True, f"valid for a world of {world_size} process(es)")]


def visible_gpus() -> int:
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


# Presets made to run on CPU; every other one is a real target's recipe, made for GPUs.
CPU_PRESETS = ("embedded", "smoke")


def check_devices(requested: str, nproc_per_node: int, preset: str = "embedded") -> Check:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if requested == "auto" and gpus == 0 and preset and preset not in CPU_PRESETS:
        return Check(
            "devices",
            True,
            f"warning: no GPU is visible, so experiment={preset} (a GPU recipe) would run on CPU, "
            f"{nproc_per_node} process(es) on gloo: check the driver and CUDA_VISIBLE_DEVICES, or set "
            "train.device=cpu to mean it",
        )
    if requested == "cpu" or (requested == "auto" and gpus == 0):
        return Check("devices", True, f"CPU, {nproc_per_node} process(es) on gloo")
    if gpus == 0:
        return Check(
            "devices",
            False,
            "train.device=cuda but no CUDA device is visible: use train.device=cpu, or check the "
            "driver and CUDA_VISIBLE_DEVICES",
        )
    if nproc_per_node > gpus:
        return Check(
            "devices",
            False,
            f"{nproc_per_node} process(es) per node need as many GPUs but {gpus} are visible: make "
            f"topology.targets + topology.drafters = {gpus} x nodes, or expose more GPUs",
        )
    return Check("devices", True, f"{gpus} GPU(s) ({torch.cuda.get_device_name(0)}), {nproc_per_node} used")


def check_backends(uses_gpu: bool) -> Check:
    import torch.distributed as dist

    if not dist.is_available():
        return Check("backends", False, "this torch has no torch.distributed: install a standard torch build")
    if not dist.is_gloo_available():
        return Check(
            "backends",
            False,
            "gloo is missing (headers always travel on gloo): install a torch build with gloo",
        )
    if uses_gpu and not dist.is_nccl_available():
        return Check("backends", False, "NCCL is missing: install a CUDA build of torch")
    return Check("backends", True, "gloo + nccl" if uses_gpu else "gloo")


def check_attention(requested: str, dtype: str, uses_gpu: bool) -> Check:
    """The attention kernel train.attention comes to on this machine; an explicit flash must run here."""
    from dflash_mp.kernels.flash_attention import flash_unusable_reason

    if not uses_gpu:
        if requested == "flash":
            return Check("attention", False, "train.attention=flash needs a CUDA GPU: use sdpa on CPU")
        return Check("attention", True, "sdpa (CPU)" if requested == "auto" else requested)
    if requested not in ("auto", "flash"):
        return Check("attention", True, requested)
    import torch

    reason = flash_unusable_reason(torch.device("cuda", 0))
    if dtype == "float32":
        reason = "it runs in bf16, not train.dtype=float32"
    if requested == "flash":
        if reason is not None:
            return Check("attention", False, f"train.attention=flash: {reason}")
        return Check("attention", True, "flash (FlashAttention 4)")
    return Check(
        "attention", True, "flash (FlashAttention 4)" if reason is None else f"flex (not flash: {reason})"
    )


def check_target(target_path: str) -> Check:
    path = Path(target_path)
    if not path.is_dir():
        return Check(
            "target",
            False,
            f"model.target_path={target_path!r} is not a directory: point it at a local HF model",
        )
    weights = [w for pattern in WEIGHT_PATTERNS for w in path.glob(pattern)]
    if not weights:
        return Check(
            "target",
            False,
            f"no *.safetensors or *.bin weights in {path}: download the whole model "
            "(e.g. `huggingface-cli download NAME --local-dir DIR`)",
        )
    unreadable = [str(p) for p in [path / "config.json", *weights] if not os.access(p, os.R_OK)]
    if unreadable:
        return Check("target", False, f"not readable: {', '.join(unreadable)}: fix the permissions")
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return Check(
            "target",
            False,
            f"no tokenizer in {path} ({', '.join(TOKENIZER_FILES)}): copy the model's tokenizer files",
        )
    size = sum(w.stat().st_size for w in weights) / 2**30
    return Check("target", True, f"{path}: {len(weights)} weight file(s), {size:.2f} GiB")


def _usable_target_config(target_path: str) -> bool:
    try:
        checked_target_config(target_path)
    except TargetConfigError:
        return False
    return True


def check_target_kernels(
    target_path: str,
    on_gpu: bool,
    trust_remote_code: bool = False,
    cuda_graphs: bool = True,
    packed_rows: bool = False,
) -> Check:
    """The kernels the target forward will run (attention, linear attention, state-space mixers,
    experts), whether it replays CUDA graphs, and what a missing optional package costs; a missing
    one is a warning, not a failure. `packed_rows`: data.packing."""
    from dflash_mp.models.target import load_target_config
    from dflash_mp.models.target_kernels import describe_kernels, format_kernels

    try:
        config = load_target_config(target_path, trust_remote_code=trust_remote_code).get_text_config()
    except Exception as e:  # an unknown model type: the load itself will say more
        return Check("kernels", True, f"warning: cannot read the target's config ({type(e).__name__}: {e})")
    kernels = describe_kernels(config, on_gpu, packed_rows)
    if on_gpu:  # a tensor-parallel target runs eagerly whatever this says (its rank logs so)
        kernels["CUDA graphs"] = "one per input shape" if cuda_graphs else "no"
    slow = any("torch fallback" in kernels.get(kind, "") for kind in ("linear_attention", "state_space"))
    return Check("kernels", True, ("warning: " if slow else "") + format_kernels(kernels))


def check_resume(cfg: RootConfig, run_dir: Path, world_size: int | None) -> Check:
    """A resume the first drafter would refuse (nothing left to train, the data order moved),
    refused before any worker starts."""
    from dflash_mp.runtime.resume import resume_problem

    problem = resume_problem(cfg, Path(run_dir), world_size)
    return Check("resume", problem is None, problem or "the checkpoints' settings allow this resume")
