"""Typed configuration: the root schema, its Hydra composition and what follows from a config.

The groups' fields, each with a one-line comment, are in fields.py.
`dflash_mp.config.validation.validate(cfg)` checks the composed config before any process allocates
a device, and reports *all* problems at once, each naming the field and what would be valid.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf

from dflash_mp.config.fields import (
    DataConfig,
    EvalConfig,
    LoggerConfig,
    ModelConfig,
    OptimConfig,
    TopologyConfig,
    TrainConfig,
    WatchdogConfig,
)
from dflash_mp.config.mask_token import mask_token_id
from dflash_mp.embedded import embedded_path, target_dir
from dflash_mp.models.target_fields import REQUIRED_TARGET_FIELDS, with_standard_names


class ConfigError(ValueError):
    """A configuration that cannot run; the message lists every problem found."""


@dataclass
class RootConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    topology: TopologyConfig = field(default_factory=TopologyConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    watchdog: WatchdogConfig = field(default_factory=WatchdogConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    # The job's run directory, identical for every rank; empty: rank 0 picks runs/<name>-<time>
    # and shares it with the other ranks through the rendezvous store.
    run_dir: str = ""
    # Free-form experiment name (shows in logs and wandb).
    name: str = "dflash"
    # The conf/experiment preset that set the recipe (each preset names itself); the embedded one
    # refuses a real target, whose recipe it is not.
    preset: str = ""


CONF_DIR = Path(__file__).resolve().parents[2] / "conf"


def register_configs() -> None:
    """Register the schemas so conf/*.yaml are type-checked when Hydra composes them."""
    ConfigStore.instance().store(name="schema", node=RootConfig)


register_configs()


def compose_config(overrides: list[str] | tuple[str, ...] = ()) -> DictConfig:
    """conf/ composed with `overrides`, outside a Hydra app (tests, eval, benchmarks)."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=str(CONF_DIR), version_base=None):
        return compose("config", overrides=list(overrides))


if not OmegaConf.has_resolver("embedded"):
    # `${embedded:data/train.jsonl}` names a bundled asset; the tiny target is built on first use.
    OmegaConf.register_new_resolver("embedded", lambda name: str(embedded_path(name)))


# ----------------------------------------------------------------------------------------
# what follows from a config


def default_target_layer_ids(num_target_layers: int, num_draft_layers: int) -> list[int]:
    """DFlash's default: evenly spaced from layer 1 to layer L-3 (one draft layer: L//2).

    On targets too shallow for that to give distinct layers (e.g. 2 draft layers over 4), the
    span widens towards the last layer instead of repeating one (the reference would repeat).
    """
    if num_draft_layers == 1:
        return [num_target_layers // 2]
    start, end = 1, num_target_layers - 3
    if end - start < num_draft_layers - 1:
        end = min(num_target_layers - 1, start + num_draft_layers - 1)
    return [round(start + i * (end - start) / (num_draft_layers - 1)) for i in range(num_draft_layers)]


class TargetConfigError(ConfigError):
    """The target's config.json cannot be read as a model's config; the message names the file."""


def read_target_config(target_path: str) -> dict[str, Any]:
    """The target's config.json as a dict (cheap: no model import), the text config of a multimodal
    one, under the field names the trainer reads (models/target_fields.py). TargetConfigError when
    the file cannot be read or is not a JSON object."""
    path = Path(target_path) / "config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except OSError as e:
        raise TargetConfigError(f"{path}: cannot be read ({e.strerror or e})") from e
    except ValueError as e:  # JSONDecodeError, or bytes that are not UTF-8
        raise TargetConfigError(f"{path}: not valid JSON ({e}); is the file complete?") from e
    if not isinstance(config, dict):
        raise TargetConfigError(
            f"{path}: holds a JSON {type(config).__name__}, not an object of model fields"
        )
    # Multimodal wrappers keep the language model under text_config.
    text = config.get("text_config", config) if "num_hidden_layers" not in config else config
    if not isinstance(text, dict):
        raise TargetConfigError(f"{path}: its text_config is a {type(text).__name__}, not an object")
    return with_standard_names(text)


def checked_target_config(target_path: str) -> dict[str, Any]:
    """read_target_config, refusing (TargetConfigError) a config that lacks a field of
    REQUIRED_TARGET_FIELDS or holds one that is not a positive integer."""
    config = read_target_config(target_path)
    missing = [key for key in REQUIRED_TARGET_FIELDS if key not in config]
    wrong = [
        f"{key}={config[key]!r}"
        for key in REQUIRED_TARGET_FIELDS
        if key in config and not (type(config[key]) is int and config[key] > 0)
    ]
    layers = " (nor a list of layer types to count)" if "num_hidden_layers" in missing else ""
    what = ([f"lacks {', '.join(missing)}{layers}"] if missing else []) + (
        [f"{', '.join(wrong)}: not a positive integer"] if wrong else []
    )
    if what:
        raise TargetConfigError(
            f"{Path(target_path) / 'config.json'}: {'; '.join(what)} (fields of a causal LM's config "
            "that the trainer reads)"
        )
    return config


def resolved_target_layer_ids(cfg: DictConfig | RootConfig, num_target_layers: int) -> list[int]:
    ids = cfg.model.target_layer_ids
    if ids is None:
        return default_target_layer_ids(num_target_layers, cfg.model.draft_layers)
    return list(ids)


def is_embedded_target(target_path: str) -> bool:
    return Path(target_path).resolve() == target_dir().resolve()


def default_gamma(block_size: int) -> float:
    """The loss decay for a block size: 7 for 16 (the paper), 4 for 8 (the published block-8
    recipes), and on the line through those two, 1 + 3*block_size/8, for the others."""
    return 1.0 + 3.0 * block_size / 8.0


def run_config(cfg: RootConfig) -> DictConfig:
    """What RUN_DIR/config.yaml records: every field, train.gamma, model.mask_token_id and the
    target's scaling fields resolved, so that exports and evaluations of the run's checkpoints use
    what it trained with."""
    resolved = OmegaConf.structured(cfg)
    resolved.model.mask_token_id = mask_token_id(cfg.model)
    from dflash_mp.models.drafter_config import SCALING_DEFAULTS, target_scaling

    derived = target_scaling(read_target_config(cfg.model.target_path))
    for key in SCALING_DEFAULTS:  # null: what the target does, written out
        if getattr(cfg.model, key) is None:
            resolved.model[key] = derived[key]
    return resolved


def to_dataclass(cfg: DictConfig) -> RootConfig:
    """The composed DictConfig as a typed RootConfig (fully resolved, defaults that depend on
    other fields filled in: train.gamma from model.block_size)."""
    root: RootConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RootConfig), cfg))  # type: ignore[assignment]
    if root.train.gamma is None:
        root.train.gamma = default_gamma(root.model.block_size)
    return root
