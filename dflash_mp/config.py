"""Typed configuration: Hydra ConfigStore schemas and validation at the edge.

Every field carries a one-line comment. `validate(cfg)` checks the composed config
before any process allocates a device, and reports *all* problems at once, each naming
the field and what would be valid.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from hydra.core.config_store import ConfigStore
from omegaconf import MISSING, DictConfig, OmegaConf

from dflash_mp.embedded import embedded_path, target_dir
from dflash_mp.mask_token import mask_token_id, mask_token_problems
from dflash_mp.topology import target_parallel_head_problems, target_parallel_problems


class ConfigError(ValueError):
    """A configuration that cannot run; the message lists every problem found."""


@dataclass
class ModelConfig:
    # Local HF-format directory of the frozen target (config.json + safetensors + tokenizer).
    target_path: str = MISSING
    # Allow custom modelling code shipped with the target (off unless you trust the directory).
    trust_remote_code: bool = False
    # Number of DFlash (draft) transformer layers.
    draft_layers: int = 1
    # Target layers whose outputs feed the drafter (0-based); null = DFlash default spacing.
    target_layer_ids: list[int] | None = None
    # Tokens per draft block: one known token followed by block_size-1 MASK tokens.
    block_size: int = 16
    # Token used for the masked block positions; added to the run's tokenizer when the target lacks it.
    mask_token: str = "<|MASK|>"
    # Pins the mask token's id (< the target's vocab_size); null: the tokenizer's id of mask_token,
    # else the next free id len(tokenizer) (151669 for Qwen3, as the published Qwen3 drafters).
    mask_token_id: int | None = None
    # Drafter architecture: "dflash", or "dflash2" (convolutions around each sublayer + candidate selector).
    arch: str = "dflash"
    # dflash2: taps of the grouped dynamic depthwise convolution (over block positions).
    conv_kernel_size: int = 2
    # dflash2: channels per group of the convolution's dynamic kernel; must divide the hidden size.
    conv_group_size: int = 16
    # dflash2: rank of the selector's predecessor/successor codebooks.
    selector_rank: int = 256
    # dflash2: candidates (the target head's top-K at each block position) the selector chooses among.
    selector_top_k: int = 16
    # dflash2: weight of the selector's K-way cross-entropy next to the DFlash loss.
    selector_loss_alpha: float = 1.0
    # dflash2: a label outside the top-K is "drop"ped from the selector term or "inject"ed as the last candidate.
    selector_gold_outside_top_k: str = "drop"
    # Attention of each draft layer, "full_attention" or "sliding_attention"; null: all full.
    layer_types: list[str] | None = None
    # sliding_attention layers see keys less than this many positions from the query (reference rule).
    sliding_window: int | None = None
    # Factor on the block tokens' embeddings, for targets that scale theirs (Gemma: sqrt(hidden_size)).
    input_embedding_scale: float = 1.0
    # Factor on the draft logits (targets with a logit multiplier).
    output_multiplier: float = 1.0
    # Soft cap c on the draft logits, c * tanh(logits / c) after the multiplier; null: none.
    final_logit_softcapping: float | None = None


@dataclass
class DataConfig:
    # JSONL files, one record per line: {"messages"|"conversations": [{"role", "content"}]},
    # ShareGPT {"conversations": [{"from", "value"}]} or {"text": ..., "loss_spans": [[start, end]]}.
    train_files: list[str] = field(default_factory=list)
    # Held-out prompts (JSONL, same format) for acceptance-length evaluation.
    eval_files: list[str] = field(default_factory=list)
    # Longest tokenized sequence kept (prompt + response), in tokens.
    max_length: int = 3072
    # Micro-batches are right-padded to a multiple of this many tokens (fewer shapes to compile).
    pad_to_multiple: int = 64
    # Anchor positions sampled per sequence (each starts one draft block).
    num_anchors: int = 512
    # What to do with a malformed record: skip it (counted, logged with file:line) or fail.
    on_bad_record: str = "skip"
    # A record longer than max_length: truncate it (loss mask kept aligned) or skip it.
    on_too_long: str = "truncate"
    # Fail (preflight sample, and each target rank while training) above this fraction of bad records.
    max_bad_fraction: float = 0.05
    # A jinja chat template file that replaces the tokenizer's own ("": the tokenizer's).
    chat_template: str = ""
    # Extra variables for the chat template, e.g. {enable_thinking: false}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TopologyConfig:
    # "split": target and drafter ranks apart; "colocated": every rank runs the target and trains (targets 0).
    layout: str = "split"
    # Ranks running the frozen target forward (global ranks 0..targets-1).
    targets: int = 2
    # Ranks training the drafter, data-parallel among themselves (the following ranks);
    # colocated: null is the torchrun world size (the launcher: one per visible GPU).
    drafters: int | None = 1
    # Micro-batch sends a target rank may have in flight before it waits (bounds memory).
    max_inflight_sends: int = 2
    # Target ranks per target replica, sharded tensor-parallel (for a target that does not fit
    # one GPU); must divide topology.targets and the target's attention and KV head counts.
    target_parallel: int = 1


@dataclass
class OptimConfig:
    # AdamW peak learning rate.
    lr: float = 6e-4
    # AdamW decoupled weight decay.
    weight_decay: float = 0.0
    # AdamW betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Fraction of the optimizer steps spent in linear warm-up before the cosine decay.
    warmup_ratio: float = 0.04
    # Final learning rate as a fraction of the peak.
    min_lr_ratio: float = 0.0
    # Gradient-norm clipping threshold (0 disables clipping).
    grad_clip: float = 1.0


@dataclass
class LoggerConfig:
    # "none" or "wandb" (wandb logs from the first drafter rank only).
    backend: str = "none"
    # wandb project name.
    project: str = "dflash_mp"
    # wandb mode: offline (default, no network), online, or disabled.
    mode: str = "offline"
    # Print a progress line every this many optimizer steps on the first drafter rank.
    progress_every: int = 10


@dataclass
class TrainConfig:
    # Optimizer steps to run; -1 derives them from `epochs` and the data size.
    max_steps: int = -1
    # Passes over the training data when max_steps is -1.
    epochs: int = 6
    # Sequences per micro-batch (one transport message).
    micro_batch_size: int = 1
    # Micro-batches accumulated per drafter rank per optimizer step.
    grad_accum: int = 1
    # Seed for data order, anchors and drafter init; the same seed gives the same run.
    seed: int = 0
    # Loss decay over block positions: weight exp(-(k-1)/gamma); null: 1 + 3*block_size/8
    # (7 for block 16 as in the paper, 4 for block 8 as the published block-8 recipes).
    gamma: float | None = None
    # Save a checkpoint every this many optimizer steps (0: only at the end).
    checkpoint_every: int = 0
    # Checkpoints kept on disk (oldest removed first).
    keep_checkpoints: int = 2
    # Continue from the newest complete checkpoint in run_dir/checkpoints.
    resume: bool = False
    # Clear run_dir of an earlier run (checkpoints, metrics, config, logs but job.log) before a fresh
    # start; without it a fresh start in a used run_dir is refused.
    overwrite: bool = False
    # Non-finite loss or gradient: "skip" the optimizer step or "stop" the job.
    on_nonfinite: str = "stop"
    # "auto" (cuda when available), "cuda" or "cpu".
    device: str = "auto"
    # Drafter training dtype: "auto" (bf16 autocast on GPU, fp32 on CPU), "float32", "bfloat16".
    dtype: str = "auto"
    # Attention kernel for the block-sparse mask: "auto" (flex on GPU, sdpa on CPU), "flex", "sdpa".
    attention: str = "auto"
    # torch.compile the drafter's and the target's layers, per process: "auto" (on for GPU), true or false.
    compile: str = "auto"
    # Write the HF-format drafter to run_dir/export at the end of training.
    export: bool = True


@dataclass
class WatchdogConfig:
    # Seconds without progress after which a rank is reported hung and the job torn down (0 disables).
    # Generous: a large target can take minutes to load, and a cold torch.compile of the first
    # steps (25 s at Qwen3-8B shape on an H200, BENCHMARKS.md) must not read as a hang either.
    timeout_s: float = 900.0


@dataclass
class EvalConfig:
    # Measure acceptance length every this many steps during training (0 disables).
    every: int = 0
    # Held-out prompts used per measurement.
    num_prompts: int = 8
    # New tokens generated per prompt.
    max_new_tokens: int = 64


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


CONF_DIR = Path(__file__).resolve().parent.parent / "conf"


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
# validation


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


def read_target_config(target_path: str) -> dict[str, Any]:
    """The target's config.json as a dict (cheap: no model import)."""
    with open(Path(target_path) / "config.json") as f:
        config = json.load(f)
    # Multimodal wrappers keep the language model under text_config.
    return config.get("text_config", config) if "num_hidden_layers" not in config else config


def resolved_target_layer_ids(cfg: DictConfig | RootConfig, num_target_layers: int) -> list[int]:
    ids = cfg.model.target_layer_ids
    if ids is None:
        return default_target_layer_ids(num_target_layers, cfg.model.draft_layers)
    return list(ids)


def is_embedded_target(target_path: str) -> bool:
    return Path(target_path).resolve() == target_dir().resolve()


def _choice(problems: list[str], name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        problems.append(f"{name}={value!r}: must be one of {', '.join(map(repr, allowed))}")


def _at_least(problems: list[str], name: str, value: float, low: float, hint: str = "") -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
        problems.append(f"{name}={value!r}: must be >= {low}{hint}")


def _validate_dflash2(problems: list[str], m: Any) -> None:
    _choice(problems, "model.arch", m.arch, ("dflash", "dflash2"))
    if m.arch != "dflash2":
        return
    for name in ("conv_kernel_size", "conv_group_size", "selector_rank", "selector_top_k"):
        _at_least(problems, f"model.{name}", getattr(m, name), 1)
    _at_least(
        problems,
        "model.selector_loss_alpha",
        m.selector_loss_alpha,
        0.0,
        " (0: train the selector not at all)",
    )
    _choice(problems, "model.selector_gold_outside_top_k", m.selector_gold_outside_top_k, ("drop", "inject"))


def _validate_layers_and_scaling(problems: list[str], m: Any) -> None:
    types = m.layer_types
    if types is not None:
        if len(types) != m.draft_layers or any(
            t not in ("full_attention", "sliding_attention") for t in types
        ):
            problems.append(
                f"model.layer_types={list(types)!r}: must list 'full_attention' or 'sliding_attention' "
                f"for each of the model.draft_layers={m.draft_layers} layers (null: all full)"
            )
        elif "sliding_attention" in types and m.sliding_window is None:
            problems.append("model.sliding_window=None: sliding_attention layers need a window (e.g. 2048)")
    if m.sliding_window is not None:
        _at_least(problems, "model.sliding_window", m.sliding_window, 1)
    for name in ("input_embedding_scale", "output_multiplier"):
        value = getattr(m, name)
        if not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(f"model.{name}={value!r}: must be a finite number > 0 (1: no scaling)")
    if m.final_logit_softcapping is not None:
        _at_least(problems, "model.final_logit_softcapping", m.final_logit_softcapping, 0.0, " (null: none)")


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


def _validate_split(problems: list[str], t: Any, world_size: int | None) -> None:
    _at_least(problems, "topology.targets", t.targets, 1, " (no target ranks: topology=colocated)")
    _at_least(problems, "topology.drafters", t.drafters, 1, " (null only with topology.layout=colocated)")
    problems += target_parallel_problems(t.targets, t.target_parallel)
    if t.drafters is not None and world_size is not None and t.targets + t.drafters != world_size:
        problems.append(
            f"topology.targets + topology.drafters = {t.targets} + {t.drafters} = "
            f"{t.targets + t.drafters}, but WORLD_SIZE is {world_size}: set them to sum to "
            f"{world_size} (for example topology.targets={max(world_size - t.drafters, 1)} "
            f"topology.drafters={min(t.drafters, world_size - 1)}) or launch with "
            f"--nproc-per-node {t.targets + t.drafters}"
        )


def _validate_colocated(problems: list[str], t: Any, world_size: int | None) -> None:
    if t.targets != 0:
        problems.append(
            f"topology.targets={t.targets!r}: the colocated layout has no target ranks (every rank runs "
            "the target for its own micro-batches): set topology.targets=0, or pick topology=colocated, "
            "or topology.layout=split to keep target ranks"
        )
    if t.target_parallel != 1:
        problems.append(
            f"topology.target_parallel={t.target_parallel!r}: the colocated layout runs a whole target in "
            "every rank; tensor-parallel target replicas need topology.layout=split with target ranks"
        )
    if t.drafters is None:
        return
    _at_least(problems, "topology.drafters", t.drafters, 1, " (null: every rank of the job)")
    if world_size is not None and t.drafters != world_size:
        problems.append(
            f"topology.drafters={t.drafters} with topology.layout=colocated, but WORLD_SIZE is "
            f"{world_size}: every rank trains, so leave topology.drafters=null (the world size) or "
            f"launch with --nproc-per-node {t.drafters}"
        )


def processes_per_job(cfg: DictConfig | RootConfig, visible_gpus: int) -> int | None:
    """The processes a local launch of `cfg` starts: targets + drafters; colocated with
    topology.drafters null: one per visible GPU (`visible_gpus`), None on CPU, where the user
    must give topology.drafters."""
    t = cfg.topology
    if t.drafters is not None:
        return t.targets + t.drafters
    if t.layout == "colocated" and cfg.train.device != "cpu" and visible_gpus > 0:
        return visible_gpus
    return None


def validate(cfg: DictConfig | RootConfig, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem in `cfg` (fields named, valid ranges given)."""
    problems: list[str] = []
    m, d, t, o, tr = cfg.model, cfg.data, cfg.topology, cfg.optim, cfg.train

    _choice(problems, "topology.layout", t.layout, ("split", "colocated"))
    if t.layout == "colocated":
        _validate_colocated(problems, t, world_size)
    else:
        _validate_split(problems, t, world_size)
    _at_least(problems, "topology.max_inflight_sends", t.max_inflight_sends, 1)

    if not (isinstance(o.lr, (int, float)) and 0 < o.lr < 1):
        problems.append(f"optim.lr={o.lr!r}: must be in (0, 1), e.g. 6e-4")
    _at_least(problems, "optim.weight_decay", o.weight_decay, 0.0)
    if not (0.0 <= o.warmup_ratio < 1.0):
        problems.append(f"optim.warmup_ratio={o.warmup_ratio!r}: must be in [0, 1)")
    if not (0.0 <= o.min_lr_ratio <= 1.0):
        problems.append(f"optim.min_lr_ratio={o.min_lr_ratio!r}: must be in [0, 1]")
    _at_least(problems, "optim.grad_clip", o.grad_clip, 0.0, " (0 disables clipping)")
    if len(o.betas) != 2 or not all(0.0 <= b < 1.0 for b in o.betas):
        problems.append(f"optim.betas={list(o.betas)!r}: must be two numbers in [0, 1)")

    if tr.max_steps != -1:
        _at_least(problems, "train.max_steps", tr.max_steps, 1, " (or -1 to derive from train.epochs)")
    _at_least(problems, "train.epochs", tr.epochs, 1)
    _at_least(problems, "train.micro_batch_size", tr.micro_batch_size, 1)
    _at_least(problems, "train.grad_accum", tr.grad_accum, 1)
    _at_least(problems, "train.seed", tr.seed, 0)
    if tr.gamma is not None and not (isinstance(tr.gamma, (int, float)) and tr.gamma > 0):
        problems.append(f"train.gamma={tr.gamma!r}: must be > 0, or null for the block size's default")
    _at_least(problems, "train.checkpoint_every", tr.checkpoint_every, 0, " (0: only at the end)")
    _at_least(problems, "train.keep_checkpoints", tr.keep_checkpoints, 1)
    if tr.resume and tr.overwrite:
        problems.append(
            "train.overwrite=true clears run_dir, train.resume=true continues it: pick one (or a new run_dir)"
        )
    _choice(problems, "train.on_nonfinite", tr.on_nonfinite, ("skip", "stop"))
    _choice(problems, "train.device", tr.device, ("auto", "cuda", "cpu"))
    _choice(problems, "train.dtype", tr.dtype, ("auto", "float32", "bfloat16"))
    _choice(problems, "train.attention", tr.attention, ("auto", "flex", "sdpa"))
    _choice(problems, "train.compile", str(tr.compile).lower(), ("auto", "true", "false"))

    _at_least(problems, "watchdog.timeout_s", cfg.watchdog.timeout_s, 0.0, " (0 disables)")
    _at_least(problems, "eval.every", cfg.eval.every, 0, " (0 disables)")
    if cfg.eval.every and not cfg.data.eval_files and not is_embedded_target(str(m.target_path)):
        # The embedded toy prompts say nothing about a real target's acceptance length.
        problems.append(
            f"eval.every={cfg.eval.every} measures tau on held-out prompts, but data.eval_files is empty: "
            "set data.eval_files=[/path/eval.jsonl] (prompts in the training data's format, not in "
            "data.train_files), or eval.every=0 to train without it"
        )
    _choice(problems, "logger.backend", cfg.logger.backend, ("none", "wandb"))
    _choice(problems, "logger.mode", cfg.logger.mode, ("offline", "online", "disabled"))

    if m.block_size < 2:
        problems.append(f"model.block_size={m.block_size!r}: must be >= 2 (one known token + masks)")
    _validate_dflash2(problems, m)
    _validate_layers_and_scaling(problems, m)
    _at_least(problems, "data.max_length", d.max_length, 8)
    _at_least(problems, "data.num_anchors", d.num_anchors, 1)
    _at_least(problems, "data.pad_to_multiple", d.pad_to_multiple, 1)
    _choice(problems, "data.on_bad_record", d.on_bad_record, ("skip", "fail"))
    _choice(problems, "data.on_too_long", d.on_too_long, ("truncate", "skip"))
    if not (isinstance(d.max_bad_fraction, (int, float)) and 0.0 <= d.max_bad_fraction <= 1.0):
        problems.append(f"data.max_bad_fraction={d.max_bad_fraction!r}: must be in [0, 1], e.g. 0.05")
    if d.chat_template and not os.path.isfile(str(d.chat_template)):
        problems.append(
            f"data.chat_template={d.chat_template!r}: file does not exist (a jinja chat template)"
        )
    if not isinstance(d.chat_template_kwargs, (dict, DictConfig)):
        problems.append(
            f"data.chat_template_kwargs={d.chat_template_kwargs!r}: must be a mapping, e.g. {{enable_thinking: false}}"
        )
    if not d.train_files:
        problems.append("data.train_files is empty: give at least one JSONL file")
    for i, path in enumerate(list(d.train_files) + list(d.eval_files)):
        key = (
            f"data.train_files[{i}]"
            if i < len(d.train_files)
            else f"data.eval_files[{i - len(d.train_files)}]"
        )
        if not os.path.isfile(path):
            problems.append(f"{key}={path!r}: file does not exist")

    target_dir = Path(str(m.target_path))
    if m.arch == "dflash2" and (target_dir / "config.json").is_file():
        _validate_dflash2_against_target(problems, m, read_target_config(str(target_dir)))
    if not (target_dir / "config.json").is_file():
        problems.append(
            f"model.target_path={str(m.target_path)!r}: no config.json there; point it at a local "
            "HF-format model directory"
        )
    else:
        target = read_target_config(str(target_dir))
        num_layers = int(target["num_hidden_layers"])
        if not (1 <= m.draft_layers <= num_layers):
            problems.append(
                f"model.draft_layers={m.draft_layers!r}: must be in [1, {num_layers}] "
                f"(the target has {num_layers} layers)"
            )
        else:
            ids = resolved_target_layer_ids(cfg, num_layers)
            bad = [i for i in ids if not (0 <= i < num_layers)]
            if bad:
                problems.append(
                    f"model.target_layer_ids={ids!r}: ids {bad} are outside the target's "
                    f"layers [0, {num_layers - 1}]"
                )
            if len(set(ids)) != len(ids):
                problems.append(f"model.target_layer_ids={ids!r}: ids must be distinct")
        problems += mask_token_problems(cfg.model, target_dir)
        problems += target_parallel_head_problems(t.target_parallel, target)
        max_positions = target.get("max_position_embeddings")
        if max_positions is not None and d.max_length > max_positions:
            problems.append(
                f"data.max_length={d.max_length}: exceeds the target's max_position_embeddings "
                f"({max_positions})"
            )

    if problems:
        raise ConfigError(
            f"{len(problems)} configuration problem(s):\n" + "\n".join(f"  - {p}" for p in problems)
        )


def default_gamma(block_size: int) -> float:
    """The loss decay for a block size: 7 for 16 (the paper), 4 for 8 (the published block-8
    recipes), and on the line through those two, 1 + 3*block_size/8, for the others."""
    return 1.0 + 3.0 * block_size / 8.0


def run_config(cfg: RootConfig) -> DictConfig:
    """What RUN_DIR/config.yaml records: every field, train.gamma and model.mask_token_id resolved,
    so that exports and evaluations of the run's checkpoints use the ids it trained with."""
    resolved = OmegaConf.structured(cfg)
    resolved.model.mask_token_id = mask_token_id(cfg.model)
    return resolved


def to_dataclass(cfg: DictConfig) -> RootConfig:
    """The composed DictConfig as a typed RootConfig (fully resolved, defaults that depend on
    other fields filled in: train.gamma from model.block_size)."""
    root: RootConfig = OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(RootConfig), cfg))  # type: ignore[assignment]
    if root.train.gamma is None:
        root.train.gamma = default_gamma(root.model.block_size)
    return root
