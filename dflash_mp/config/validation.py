"""Validation at the edge: every problem of a composed config at once, before any device work.

Each message names the field and what would be valid (litgpt's `validate_args` style).
"""

from __future__ import annotations

import math
import os
from typing import Any

from omegaconf import DictConfig

from dflash_mp.config.dspark_checks import dspark_problems
from dflash_mp.config.schema import CONF_DIR, ConfigError, RootConfig, is_embedded_target
from dflash_mp.config.target_checks import target_problems
from dflash_mp.config.xpress_checks import xpress_problems


def _validate_muon(problems: list[str], o: Any) -> None:
    """optim.name and, for optim=muon, the Muon fields (training/muon.py)."""
    _choice(problems, "optim.name", o.name, ("adamw", "muon"))
    if o.name != "muon":
        return
    if not (isinstance(o.muon_momentum, (int, float)) and 0.0 <= o.muon_momentum < 1.0):
        problems.append(f"optim.muon_momentum={o.muon_momentum!r}: must be in [0, 1), e.g. 0.95")
    _at_least(problems, "optim.muon_weight_decay", o.muon_weight_decay, 0.0)
    if not (isinstance(o.muon_ns_steps, int) and 1 <= o.muon_ns_steps < 100):
        problems.append(f"optim.muon_ns_steps={o.muon_ns_steps!r}: must be an integer in [1, 100), e.g. 5")
    _choice(problems, "optim.muon_adjust_lr", o.muon_adjust_lr, ("match_rms_adamw", "original"))
    if not isinstance(o.muon_nesterov, bool):
        problems.append(f"optim.muon_nesterov={o.muon_nesterov!r}: must be true or false")


def _choice(problems: list[str], name: str, value: Any, allowed: tuple) -> None:
    if value not in allowed:
        problems.append(f"{name}={value!r}: must be one of {', '.join(map(repr, allowed))}")


def _at_least(problems: list[str], name: str, value: float, low: float, hint: str = "") -> None:
    if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= low):
        problems.append(f"{name}={value!r}: must be >= {low}{hint}")


def _validate_dflash2(problems: list[str], m: Any) -> None:
    _choice(problems, "model.arch", m.arch, ("dflash", "dflash2", "xpress", "dspark"))
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
        if value is not None and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            problems.append(
                f"model.{name}={value!r}: must be a finite number > 0 (1: no scaling; null: the target's)"
            )
    if m.final_logit_softcapping is not None:
        _at_least(
            problems,
            "model.final_logit_softcapping",
            m.final_logit_softcapping,
            0.0,
            " (0: none; null: the target's)",
        )


def target_parallel_problems(targets: Any, k: Any) -> list[str]:
    """What is wrong with splitting `targets` target ranks into replicas of `k` (empty: nothing)."""
    if not (isinstance(k, int) and k >= 1):
        return [f"topology.target_parallel={k!r}: must be >= 1 (1: one rank per target replica)"]
    if isinstance(targets, int) and targets >= 1 and targets % k:
        return [
            f"topology.targets={targets} is not a multiple of topology.target_parallel={k} "
            f"(targets counts ranks, each replica takes {k}): set topology.targets to "
            f"{max(k, targets // k * k)} or another multiple of {k}"
        ]
    return []


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


def preset_problems(cfg: DictConfig | RootConfig) -> list[str]:
    """A real target under the embedded experiment, whose lr, drafter shape, sequence length and
    data are sized for the tiny target: refused, naming the presets that fit a real one."""
    if cfg.preset != "embedded" or is_embedded_target(str(cfg.model.target_path)):
        return []
    presets = sorted(
        p.stem
        for p in (CONF_DIR / "experiment").glob("*.yaml")
        if p.stem not in ("embedded", "smoke", "custom")
    )
    return [
        f"model.target_path={str(cfg.model.target_path)!r} under experiment=embedded, whose recipe is "
        f"the tiny target's (optim.lr={cfg.optim.lr:g}, model.draft_layers={cfg.model.draft_layers}, "
        f"model.block_size={cfg.model.block_size}, data.max_length={cfg.data.max_length}, toy data and "
        f"eval prompts): pick your target's preset, experiment=<{' | '.join(presets)}>, or "
        "experiment=custom (the paper's recipe) with model.target_path, data.train_files and data.eval_files"
    ]


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


def _validate_topology(problems: list[str], t: Any, world_size: int | None) -> None:
    """topology.*: the layout's own fields (split or colocated) and the transport's."""
    _choice(problems, "topology.layout", t.layout, ("split", "colocated"))
    if t.layout == "colocated":
        _validate_colocated(problems, t, world_size)
    else:
        _validate_split(problems, t, world_size)
    _at_least(problems, "topology.max_inflight_sends", t.max_inflight_sends, 1)


def _validate_optim(problems: list[str], o: Any) -> None:
    """optim.*: the learning-rate schedule, AdamW's fields and Muon's."""
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
    _validate_muon(problems, o)


def _validate_train(problems: list[str], tr: Any) -> None:
    """train.*: the length of the run, the loss weights, checkpoints, and what runs on the device."""
    if tr.max_steps != -1:
        _at_least(problems, "train.max_steps", tr.max_steps, 1, " (or -1 to derive from train.epochs)")
    _at_least(problems, "train.epochs", tr.epochs, 1)
    _at_least(problems, "train.micro_batch_size", tr.micro_batch_size, 1)
    _at_least(problems, "train.grad_accum", tr.grad_accum, 1)
    _at_least(problems, "train.seed", tr.seed, 0)
    if tr.gamma is not None and not (isinstance(tr.gamma, (int, float)) and tr.gamma > 0):
        problems.append(f"train.gamma={tr.gamma!r}: must be > 0, or null for the block size's default")
    _choice(problems, "train.position_weights", tr.position_weights, ("decay", "dpace"))
    if not (isinstance(tr.dpace_alpha, (int, float)) and 0.0 < tr.dpace_alpha <= 1.0):
        problems.append(
            f"train.dpace_alpha={tr.dpace_alpha!r}: must be in (0, 1], e.g. 0.5 (D-PACE's smoothing "
            "of the confidences; 0 would let one unlikely position zero every later weight)"
        )
    _at_least(problems, "train.checkpoint_every", tr.checkpoint_every, 0, " (0: only at the end)")
    _at_least(problems, "train.keep_checkpoints", tr.keep_checkpoints, 1)
    if tr.resume and tr.overwrite:
        problems.append(
            "train.overwrite=true clears run_dir, train.resume=true continues it: pick one (or a new run_dir)"
        )
    _choice(problems, "train.on_nonfinite", tr.on_nonfinite, ("skip", "stop"))
    _at_least(problems, "train.max_nonfinite_in_a_row", tr.max_nonfinite_in_a_row, 0, " (0: no limit)")
    _choice(problems, "train.device", tr.device, ("auto", "cuda", "cpu"))
    _choice(problems, "train.dtype", tr.dtype, ("auto", "float32", "bfloat16"))
    _choice(problems, "train.attention", tr.attention, ("auto", "flex", "flash", "sdpa"))
    if tr.attention == "flash" and (tr.dtype == "float32" or tr.device == "cpu"):
        problems.append(
            f"train.attention=flash runs FlashAttention 4's bf16 GPU kernels, not train.device={tr.device} "
            f"with train.dtype={tr.dtype}: use train.attention=flex (GPU) or sdpa (CPU)"
        )
    _choice(problems, "train.compile", str(tr.compile).lower(), ("auto", "true", "false"))
    if not isinstance(tr.activation_checkpointing, bool):
        problems.append(
            f"train.activation_checkpointing={tr.activation_checkpointing!r}: must be true or false"
        )
    chunk = tr.vocabulary_chunk_rows
    if chunk is not None and not (isinstance(chunk, int) and not isinstance(chunk, bool) and chunk >= 1):
        problems.append(
            f"train.vocabulary_chunk_rows={chunk!r}: must be a number of rows >= 1 (rounded down to "
            "whole blocks, at least one), or null for the default"
        )
    _choice(problems, "train.cuda_graphs", str(tr.cuda_graphs).lower(), ("auto", "true", "false"))
    if str(tr.cuda_graphs).lower() == "true" and tr.device == "cpu":
        problems.append("train.cuda_graphs=true needs a GPU, not train.device=cpu: use auto or false")


def _validate_eval(problems: list[str], cfg: DictConfig | RootConfig) -> None:
    """eval.*: what training measures, on which prompts and benchmark files."""
    _at_least(problems, "eval.every", cfg.eval.every, 0, " (0 disables)")
    benchmarks = cfg.eval.benchmarks
    if (
        cfg.eval.every
        and not cfg.data.eval_files
        and not benchmarks
        and not is_embedded_target(str(cfg.model.target_path))
    ):
        # The embedded toy prompts say nothing about a real target's acceptance length.
        problems.append(
            f"eval.every={cfg.eval.every} measures tau on held-out prompts, but data.eval_files is empty: "
            "set data.eval_files=[/path/eval.jsonl] (prompts in the training data's format, not in "
            "data.train_files) or +eval.benchmarks.NAME=FILE, or eval.every=0 to train without it"
        )
    if benchmarks and not cfg.eval.every:
        problems.append(
            f"eval.benchmarks={dict(benchmarks)!r} are measured every eval.every steps, but eval.every=0: "
            "set eval.every=N (or drop eval.benchmarks and run `python -m dflash_mp.eval RUN_DIR --benchmarks` "
            "after training)"
        )
    from dflash_mp.data.benchmark_sets import benchmark_problem

    for name, path in (benchmarks or {}).items():
        problem = benchmark_problem(str(path), str(name))
        if problem is not None:
            problems.append(f"eval.benchmarks.{name}={path!r}: {problem}")


def _validate_model(problems: list[str], cfg: DictConfig | RootConfig) -> None:
    """model.*: the block, the drafter's architecture and its own fields, the target layers it reads."""
    m = cfg.model
    if m.block_size < 2:
        problems.append(f"model.block_size={m.block_size!r}: must be >= 2 (one known token + masks)")
    _validate_dflash2(problems, m)
    problems.extend(xpress_problems(cfg))
    problems.extend(dspark_problems(cfg))
    _validate_layers_and_scaling(problems, m)


def _validate_data(problems: list[str], d: Any) -> None:
    """data.*: lengths, what to do with bad records, the chat template, and every input file."""
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
        problems.append(
            "data.train_files is empty: give at least one JSONL, Parquet or Arrow file, a save_to_disk "
            "directory or hf:org/name"
        )
    from dflash_mp.data.sources import input_problem  # the data package imports torch

    for i, path in enumerate(list(d.train_files) + list(d.eval_files)):
        key = (
            f"data.train_files[{i}]"
            if i < len(d.train_files)
            else f"data.eval_files[{i - len(d.train_files)}]"
        )
        problem = input_problem(str(path))
        if problem is not None:
            problems.append(f"{key}={path!r}: {problem}")


def validate(cfg: DictConfig | RootConfig, world_size: int | None = None) -> None:
    """Raise ConfigError listing every problem in `cfg` (fields named, valid ranges given)."""
    problems: list[str] = preset_problems(cfg)
    _validate_topology(problems, cfg.topology, world_size)
    _validate_optim(problems, cfg.optim)
    _validate_train(problems, cfg.train)
    _at_least(problems, "watchdog.timeout_s", cfg.watchdog.timeout_s, 0.0, " (0 disables)")
    _validate_eval(problems, cfg)
    _choice(problems, "logger.backend", cfg.logger.backend, ("none", "wandb"))
    _choice(problems, "logger.mode", cfg.logger.mode, ("offline", "online", "disabled"))
    _validate_model(problems, cfg)
    _validate_data(problems, cfg.data)
    problems += target_problems(cfg)
    if problems:
        raise ConfigError(
            f"{len(problems)} configuration problem(s):\n" + "\n".join(f"  - {p}" for p in problems)
        )
