"""The acceptance table of a drafter on standard benchmarks (`python -m dflash_mp.eval --benchmarks`).

Every benchmark (`dflash_mp.data.benchmark_sets`) is decoded at each temperature and, where the chat
template has an `enable_thinking` switch, with thinking on and off; each cell gives tau, tokens
per target forward, the acceptance-length histogram and the speed-up over the target alone.
A multi-turn record (MT-Bench) asks its next turn after the drafter-assisted answer to the one
before, as the DFlash authors' evaluation does (github.com/z-lab/dflash, dflash/benchmark.py).

Sampling follows what a serving engine does by default for the target: greedy at temperature 0;
above it, the top_k/top_p of the target's generation_config.json (vLLM applies them to requests
that do not set them, its default --generation-config auto), unless --top-k/--top-p are given.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from dflash_mp.data.benchmark_sets import Benchmark, Conversation, load_conversations, resolve_benchmark
from dflash_mp.evaluation.acceptance import (
    acceptance_summary,
    check_drafter_fits,
    check_prompt_lengths,
    stop_token_ids,
)
from dflash_mp.evaluation.decoding import autoregressive_generate, speculative_generate
from dflash_mp.evaluation.length_buckets import (
    BUCKET_HEADER,
    LengthBuckets,
    bucket_columns,
    training_length_note,
)
from dflash_mp.evaluation.prompts import EvalError, Prompt

if TYPE_CHECKING:  # annotations only: the preflight imports this without the models
    from dflash_mp.models.drafter import DFlashDrafter

# generation_config.json fields a serving engine also applies by default, which this table does not.
UNAPPLIED_DEFAULTS = {"min_p": 0.0, "repetition_penalty": 1.0, "presence_penalty": 0.0}


@dataclass(frozen=True)
class Sampling:
    """How tokens are chosen in one column of the table, and where the settings come from."""

    temperature: float
    top_k: int = 0  # 0: no top-k cut
    top_p: float = 1.0  # 1: no top-p cut
    source: str = "greedy"

    def as_kwargs(self) -> dict[str, Any]:
        return {"temperature": self.temperature, "top_k": self.top_k, "top_p": self.top_p}


def serving_sampling(
    target_path: str | Path, temperature: float, top_k: int | None = None, top_p: float | None = None
) -> Sampling:
    """Greedy at temperature 0; else the target's generation_config.json top_k/top_p (what vLLM
    applies by default), each replaced by `top_k`/`top_p` when given."""
    if temperature <= 0:
        return Sampling(0.0)
    path = Path(target_path) / "generation_config.json"
    try:
        config = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError):
        config = {}
    config = config if isinstance(config, dict) else {}
    parts = []
    if top_k is None and "top_k" in config:
        top_k = int(config["top_k"])
        parts.append(f"top_k {top_k}")
    if top_p is None and "top_p" in config:
        top_p = float(config["top_p"])
        parts.append(f"top_p {top_p:g}")
    source = f"{', '.join(parts)} from {path}" if parts else f"no top_k/top_p in {path}"
    unapplied = [k for k, neutral in UNAPPLIED_DEFAULTS.items() if config.get(k, neutral) != neutral]
    if unapplied:
        source += f" (not applied here: {', '.join(f'{k} {config[k]}' for k in unapplied)})"
    # A negative top_k (vLLM's -1) is no cut, as 0 is here.
    return Sampling(temperature, max(top_k or 0, 0), 1.0 if top_p is None else top_p, source)


def has_thinking_switch(renderer: Any) -> bool:
    """Whether the chat template renders a prompt differently with enable_thinking on and off."""
    from dflash_mp.data import ChatRenderer

    user = [{"role": "user", "content": "What is 1 + 1?"}]
    texts = set()
    for thinking in (True, False):
        switched = ChatRenderer(
            renderer.tokenizer,
            renderer.chat_template,
            {**renderer.template_kwargs, "enable_thinking": thinking},
        )
        texts.add(switched.apply(user, generation_prompt=True))
    return len(texts) == 2


def thinking_modes(renderer: Any, wanted: str) -> list[bool | None]:
    """enable_thinking values to decode with: `wanted` is both, on or off; None: the template has
    no switch (then only "both" is accepted, as the one mode there is)."""
    if not has_thinking_switch(renderer):
        if wanted != "both":
            raise EvalError(
                f"--thinking {wanted}: the chat template has no enable_thinking switch; leave --thinking out"
            )
        return [None]
    return {"both": [True, False], "on": [True], "off": [False]}[wanted]


def _with_thinking(renderer: Any, thinking: bool | None) -> Any:
    from dflash_mp.data import ChatRenderer

    if thinking is None:
        return renderer
    kwargs = {**renderer.template_kwargs, "enable_thinking": thinking}
    return ChatRenderer(renderer.tokenizer, renderer.chat_template, kwargs)


def _render(renderer: Any, messages: list[dict[str, str]], source: str) -> Prompt:
    text = renderer.apply(messages, generation_prompt=True)
    return Prompt(source, list(renderer.tokenizer(text, add_special_tokens=False)["input_ids"]))


def _first_turn(renderer: Any, conversation: Conversation) -> Prompt:
    return _render(renderer, [{"role": "user", "content": conversation.user_turns[0]}], conversation.source)


def decode_benchmark(
    drafter: DFlashDrafter,
    target: nn.Module,
    renderer: Any,
    conversations: Sequence[Conversation],
    max_new_tokens: int,
    sampling: Sampling,
    seed: int = 0,
    baseline: bool = True,
    per_prompt: bool = False,
    lengths: LengthBuckets | None = None,
) -> dict[str, Any]:
    """Speculative (and, with `baseline`, autoregressive) decoding of every user turn; a later turn
    follows the speculative answer to the turn before. `acceptance_summary` of all turns (with
    `lengths`, bucketed by each turn's prompt length)."""
    tokenizer = renderer.tokenizer
    stops = stop_token_ids(tokenizer, target)
    device = target.get_input_embeddings().weight.device
    context = getattr(target.config.get_text_config(), "max_position_embeddings", None)

    def seeded() -> torch.Generator | None:
        return torch.Generator(device=device).manual_seed(seed) if sampling.temperature > 0 else None

    speculative_generator, plain_generator = seeded(), seeded()
    prompts, runs, plain = [], [], []
    was_training = drafter.training
    drafter.eval()
    try:
        for conversation in conversations:
            messages: list[dict[str, str]] = []
            for turn, text in enumerate(conversation.user_turns, start=1):
                messages.append({"role": "user", "content": text})
                multi_turn = len(conversation.user_turns) > 1
                prompt = _render(
                    renderer,
                    messages,
                    f"{conversation.source} turn {turn}" if multi_turn else conversation.source,
                )
                check_prompt_lengths([prompt], max_new_tokens, context)
                run = speculative_generate(
                    drafter,
                    target,
                    prompt.input_ids,
                    max_new_tokens,
                    stops,
                    generator=speculative_generator,
                    **sampling.as_kwargs(),
                )
                if baseline:
                    plain.append(
                        autoregressive_generate(
                            target,
                            prompt.input_ids,
                            max_new_tokens,
                            stops,
                            generator=plain_generator,
                            **sampling.as_kwargs(),
                        )
                    )
                answer = tokenizer.decode(run.new_tokens, skip_special_tokens=True)
                messages.append({"role": "assistant", "content": answer})
                prompts.append(prompt)
                runs.append(run)
    finally:
        drafter.train(was_training)
    return acceptance_summary(
        prompts,
        runs,
        plain if baseline else None,
        drafter.block_size,
        max_new_tokens,
        sampling.temperature,
        per_prompt,
        lengths,
    )


@dataclass
class TablePlan:
    """What a table decodes, read and checked before the target is loaded."""

    benchmarks: list[tuple[Benchmark, list[Conversation]]]
    settings: list[Sampling]  # one per temperature
    modes: list[bool | None]  # enable_thinking values; [None]: the template has no switch
    renderer: Any
    max_new_tokens: int
    limit: int | None
    lengths: LengthBuckets | None = None  # tau by prompt length in every row


def plan_table(
    renderer: Any,
    benchmarks: Sequence[Benchmark],
    target_path: str | Path,
    *,
    limit: int | None,
    max_new_tokens: int,
    temperatures: Sequence[float] = (0.0, 1.0),
    thinking: str = "both",
    top_k: int | None = None,
    top_p: float | None = None,
    lengths: LengthBuckets | None = None,
) -> TablePlan:
    """Every benchmark's records, the sampling settings and the thinking modes; EvalError or
    BenchmarkError when a first-turn prompt does not fit the target's context (config.json)."""
    from dflash_mp.config.schema import read_target_config

    modes = thinking_modes(renderer, thinking)
    settings = [serving_sampling(target_path, t, top_k, top_p) for t in temperatures]
    context = read_target_config(str(target_path)).get("max_position_embeddings")
    loaded = []
    for benchmark in benchmarks:
        conversations = load_conversations(benchmark, limit)
        for mode in modes:
            firsts = [_first_turn(_with_thinking(renderer, mode), c) for c in conversations]
            check_prompt_lengths(firsts, max_new_tokens, context)
        loaded.append((benchmark, conversations))
    return TablePlan(loaded, settings, modes, renderer, max_new_tokens, limit, lengths)


def run_table(plan: TablePlan, drafter: DFlashDrafter, target: nn.Module, seed: int = 0) -> dict[str, Any]:
    """Every benchmark x temperature x thinking mode of `plan`: the table as a JSON-able dict."""
    check_drafter_fits(drafter, target.config)
    rows = []
    for benchmark, conversations in plan.benchmarks:
        for sampling in plan.settings:
            for mode in plan.modes:
                summary = decode_benchmark(
                    drafter,
                    target,
                    _with_thinking(plan.renderer, mode),
                    conversations,
                    plan.max_new_tokens,
                    sampling,
                    seed,
                    lengths=plan.lengths,
                )
                rows.append(
                    {
                        "benchmark": benchmark.name,
                        "format": benchmark.format.name,
                        "thinking": mode,
                        "top_k": sampling.top_k,
                        "top_p": sampling.top_p,
                        "conversations": len(conversations),
                        **summary,
                    }
                )
    return {
        "block_size": drafter.block_size,
        "max_new_tokens": plan.max_new_tokens,
        "limit": plan.limit,
        "seed": seed,
        "benchmarks": {b.name: {"path": b.path, "format": b.format.name} for b, _ in plan.benchmarks},
        "sampling": {f"{s.temperature:g}": {**s.as_kwargs(), "source": s.source} for s in plan.settings},
        "thinking": "no enable_thinking switch"
        if plan.modes == [None]
        else "enable_thinking " + " and ".join(_thinking_label(m) for m in plan.modes),
        "rows": rows,
    }


def _thinking_label(mode: bool | None) -> str:
    return "-" if mode is None else ("on" if mode else "off")


def format_benchmark_table(table: dict[str, Any]) -> str:
    """The table for the console: one line per benchmark, temperature and thinking mode."""
    block, limit = table["block_size"], table["limit"]
    lines = [
        f"block size {block}, at most {table['max_new_tokens']} new tokens per turn, "
        f"{'all' if limit is None else f'the first {limit}'} records of each benchmark"
    ]
    lines += [f"temperature {t}: {s['source']}" for t, s in table["sampling"].items()]
    lines.append(f"thinking: {table['thinking']}")
    header = f"{'benchmark':<16}{'temp':>5}  {'think':<6}{'turns':>6}{'tau':>8}{'tok/fwd':>9}{'speedup':>9}"
    lines += ["", header + "   acceptance length: % of verify rounds at 1.." + str(block)]
    for row in table["rows"]:
        rounds = sum(row["acceptance_length_counts"]) or 1
        histogram = " ".join(f"{100 * n / rounds:.0f}" for n in row["acceptance_length_counts"])
        lines.append(
            f"{row['benchmark']:<16}{row['temperature']:>5g}  {_thinking_label(row['thinking']):<6}"
            f"{row['num_prompts']:>6}{row['tau']:>8.2f}{row['tokens_per_target_forward']:>9.2f}"
            f"{row['speedup']:>8.2f}x   {histogram}"
        )
    differed = [r["benchmark"] for r in table["rows"] if r.get("matches_autoregressive") is False]
    if differed:  # exact in fp32; in bf16 a near-tie can flip the argmax of one of the two forwards
        lines.append(f"note: at temperature 0 speculative and plain decoding gave other tokens on {differed}")
    return "\n".join(lines + _length_lines(table["rows"]))


def _length_lines(rows: list[dict[str, Any]]) -> list[str]:
    """tau by prompt length: one line per row and non-empty bucket (each turn counts by its own
    prompt, earlier turns and answers included)."""
    if not rows or "length_buckets" not in rows[0]:
        return []
    lines = ["", f"tau by prompt length ({training_length_note(rows[0])})"]
    lines.append(f"  {'benchmark':<16}{'temp':>5}  {'think':<7}{BUCKET_HEADER}")
    for row in rows:
        key = f"  {row['benchmark']:<16}{row['temperature']:>5g}  {_thinking_label(row['thinking']):<7}"
        lines += [key + bucket_columns(bucket) for bucket in row["length_buckets"]]
    return lines


class TrainingBenchmarks:
    """eval.benchmarks during training: eval.num_prompts records of each, greedy, eval.max_new_tokens
    per turn, the run's chat template and kwargs; `taus` gives {"tau/<name>": tau}."""

    def __init__(self, cfg: Any, tokenizer: Any) -> None:
        from dflash_mp.data import ChatRenderer, read_chat_template

        self.renderer = ChatRenderer(
            tokenizer, read_chat_template(cfg.data.chat_template), dict(cfg.data.chat_template_kwargs)
        )
        self.max_new_tokens = cfg.eval.max_new_tokens
        self.conversations = {
            name: load_conversations(resolve_benchmark(str(path), name), cfg.eval.num_prompts)
            for name, path in cfg.eval.benchmarks.items()
        }

    def first_turn_prompts(self) -> list[Prompt]:
        """Every benchmark's first-turn prompts, for the preflight's context check."""
        return [_first_turn(self.renderer, c) for cs in self.conversations.values() for c in cs]

    def taus(self, drafter: DFlashDrafter, target: nn.Module) -> dict[str, float]:
        greedy = Sampling(0.0)
        return {
            f"tau/{name}": decode_benchmark(
                drafter, target, self.renderer, conversations, self.max_new_tokens, greedy, baseline=False
            )["tau"]
            for name, conversations in self.conversations.items()
        }
