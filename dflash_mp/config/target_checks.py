"""The config against the target's config.json: its layers, heads, context, vocabulary and the
drafter config they give (part of `dflash_mp.config.validation.validate`)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from omegaconf import DictConfig

from dflash_mp.config.mask_token import mask_token_problems
from dflash_mp.config.schema import (
    RootConfig,
    TargetConfigError,
    checked_target_config,
    resolved_target_layer_ids,
)
from dflash_mp.embedded import cache_dir


def target_problems(cfg: DictConfig | RootConfig) -> list[str]:
    """The config against the target's config.json: its layers, heads, context and vocabulary.
    An unusable config.json is one problem, naming the file, and the rest is not checked."""
    m, t = cfg.model, cfg.topology
    target_dir = Path(str(m.target_path))
    if not (target_dir / "config.json").is_file():
        return [
            f"model.target_path={str(m.target_path)!r}: no config.json there; point it at a local "
            "HF-format model directory"
        ]
    try:
        target = checked_target_config(str(target_dir))
    except TargetConfigError as e:
        return [str(e)]  # it names the file
    problems = structure_problems(m, target_dir)
    if m.arch == "dflash2":
        _validate_dflash2_against_target(problems, m, target)
    problems += _layer_problems(cfg, target)
    problems += [] if problems else _cut_problems(cfg, target)
    problems += mask_token_problems(m, target_dir)
    problems += target_parallel_head_problems(t.target_parallel, target)
    if isinstance(t.target_parallel, int) and t.target_parallel > 1:
        # torch and transformers come in only for a replica that needs them.
        from dflash_mp.models.tensor_parallel import plan_problems

        problems += plan_problems(target, t.target_parallel)
    max_positions = target.get("max_position_embeddings")
    if max_positions is not None and cfg.data.max_length > max_positions:
        problems.append(
            f"data.max_length={cfg.data.max_length}: exceeds the target's max_position_embeddings "
            f"({max_positions})"
        )
    return problems


def target_tensors_cache() -> Path:
    """Where the names of targets' embedding and LM head tensors are kept once found
    (models/target_structure.py): the preflight finds them, the drafter ranks read them."""
    return cache_dir() / "target-tensors"


def structure_problems(m: Any, target_dir: Path) -> list[str]:
    """Whether the trainer finds the target's decoder layers, input embedding and LM head in its
    model and checkpoint (models/target_structure.py): a target whose parts it cannot find fails
    here, naming the part, not in a rank after the preflight."""
    from dflash_mp.models.target_structure import structure_problem

    problem = structure_problem(target_dir, bool(m.trust_remote_code), target_tensors_cache())
    if problem is None:
        return []
    return [f"model.target_path={str(m.target_path)!r}: {problem}; see docs/TARGETS.md"]


def _layer_problems(cfg: DictConfig | RootConfig, target: dict[str, Any]) -> list[str]:
    """model.draft_layers and model.target_layer_ids against the target's layers, then the drafter
    config they give."""
    m, num_layers = cfg.model, int(target["num_hidden_layers"])
    if not (1 <= m.draft_layers <= num_layers):
        return [
            f"model.draft_layers={m.draft_layers!r}: must be in [1, {num_layers}] "
            f"(the target has {num_layers} layers)"
        ]
    problems = []
    ids = resolved_target_layer_ids(cfg, num_layers)
    bad = [i for i in ids if not (0 <= i < num_layers)]
    if bad:
        problems.append(
            f"model.target_layer_ids={ids!r}: ids {bad} are outside the target's layers [0, {num_layers - 1}]"
        )
    if len(set(ids)) != len(ids):
        problems.append(f"model.target_layer_ids={ids!r}: ids must be distinct")
    if not bad:
        problems += drafter_config_problems(m, target, ids)
    return problems


def _cut_problems(cfg: DictConfig | RootConfig, target: dict[str, Any]) -> list[str]:
    """Whether the target cut after the last layer the drafter reads builds as the target ranks
    build it (asked once nothing else is wrong with the target)."""
    from dflash_mp.models.target_structure import cut_problem

    m = cfg.model
    ids = resolved_target_layer_ids(cfg, int(target["num_hidden_layers"]))
    problem = cut_problem(Path(str(m.target_path)), max(ids) + 1, bool(m.trust_remote_code)) if ids else None
    return [] if problem is None else [f"model.target_path={str(m.target_path)!r}: {problem}"]


def _validate_dflash2_against_target(problems: list[str], m: Any, target: dict[str, Any]) -> None:
    hidden, vocab = int(target["hidden_size"]), int(target["vocab_size"])
    if isinstance(m.conv_group_size, int) and m.conv_group_size >= 1 and hidden % m.conv_group_size:
        divisors = [g for g in (8, 16, 32, 64) if hidden % g == 0]
        problems.append(
            f"model.conv_group_size={m.conv_group_size}: must divide the target's hidden size {hidden}"
            + (f" (e.g. {divisors[0]})" if divisors else "")
        )
    if isinstance(m.selector_top_k, int) and m.selector_top_k > vocab:
        problems.append(f"model.selector_top_k={m.selector_top_k}: exceeds the target's vocab_size {vocab}")


def drafter_config_problems(m: Any, target: dict[str, Any], layer_ids: list[int]) -> list[str]:
    """Whether the drafter's config builds from the target's config.json (its RoPE, heads, MLP), as
    training will build it: a target the drafter cannot follow fails here, not 20 s into a job."""
    from dflash_mp.models.drafter_config import build_drafter_config

    try:
        build_drafter_config(
            target,
            draft_layers=m.draft_layers,
            target_layer_ids=layer_ids,
            block_size=max(2, m.block_size),
            mask_token_id=0,  # the other fields are checked on their own above
        )
    except ValueError as error:
        return [
            f"model.target_path={str(m.target_path)!r}: its config.json gives no drafter config "
            f"({error}); see docs/TARGETS.md for what each target family gives the drafter"
        ]
    return []


def target_parallel_head_problems(k: Any, target: dict[str, Any]) -> list[str]:
    """Tensor parallelism splits attention by heads and the MLP by columns: with `k` ranks per
    replica, the target's (config.json) head counts and intermediate_size must divide by `k`."""
    if not (isinstance(k, int) and k > 1):
        return []
    problems = []
    heads = int(target["num_attention_heads"])
    kv_heads = int(target.get("num_key_value_heads") or heads)
    if heads % k or kv_heads % k:
        fitting = [d for d in range(2, kv_heads + 1) if heads % d == 0 and kv_heads % d == 0]
        problems.append(
            f"topology.target_parallel={k}: the target's num_attention_heads={heads} and "
            f"num_key_value_heads={kv_heads} must both divide by it; use "
            + (f"one of {fitting}" if fitting else "topology.target_parallel=1 (no split fits these heads)")
        )
    intermediate = target.get("intermediate_size")
    if isinstance(intermediate, int) and intermediate % k:
        problems.append(
            f"topology.target_parallel={k}: the target's intermediate_size={intermediate} does not "
            f"divide by it; use a topology.target_parallel that divides it"
        )
    return problems
