"""Responses that did not finish: --on-length, the --min-finished-fraction floor, an output
without a record, sampling advice.

A response cut at its token budget (finish_reason "length") has no end of turn, but the trainer
renders every assistant turn with one: kept, the cut turn teaches the drafter to end a turn where
the target would have gone on (and one cut inside its reasoning is stored as empty content after
half a reasoning block). So by default such a turn is dropped: the record ends after its last
finished answer, or is left out when it has none.
"""

from __future__ import annotations

import json
import logging
from collections import Counter
from pathlib import Path
from typing import Any

from dflash_mp.regenerate.records import RegenerateError

log = logging.getLogger("dflash_mp.regenerate")

ON_LENGTH = ("drop", "keep", "fail")
TOO_FEW_FINISHED_EXIT_CODE = 4
# Qwen3's model cards, "Best Practices": thinking mode should sample with these and not decode
# greedily ("can lead to performance degradation and endless repetitions"), e.g.
# https://huggingface.co/Qwen/Qwen3-8B#best-practices
QWEN3_THINKING_SAMPLING = {"temperature": 0.6, "top_p": 0.95, "top_k": 20}


class TooFewFinished(RegenerateError):
    """Fewer responses than --min-finished-fraction ended by themselves; OUTPUT is not written."""


def take_answer(
    conversation: Any,
    settings: Any,
    text: str,
    num_tokens: int | None,
    finished: bool,
    same_tokens: bool | None,
    reasoning: str | None,
) -> None:
    """Give `conversation` its next answer, or apply --on-length to an answer that was cut."""
    if finished or settings.on_length == "keep":
        conversation.answer(text, num_tokens, finished, same_tokens, reasoning)
        return
    turn = len(conversation.response_tokens) + 1
    if settings.on_length == "fail":
        raise RegenerateError(
            f"{conversation.source}: the answer to turn {turn} was cut at its token budget "
            f"({num_tokens} tokens; --max-new-tokens {settings.max_new_tokens}, --max-length "
            f"{settings.max_length}) before its end of turn (--on-length fail). Raise the limits, or "
            "pass --on-length drop to leave such turns out"
        )
    conversation.dropped_turns += 1
    conversation.cut_before_last_prompt()


def summarize(entries: list[dict[str, Any]]) -> dict[str, Any]:
    """What a merge wrote: records, turns, and how many responses finished or were cut."""
    kept = [e for e in entries if "messages" in e]
    turns = [n for e in kept for n in e["response_tokens"]]
    counted = [n for n in turns if n is not None]
    checked = [s for e in kept for s in e["same_tokens"] if s is not None]
    finished = sum(f for e in kept for f in e["finished"])
    dropped = sum(e.get("dropped_turns", 0) for e in entries)
    generated = len(turns) + dropped  # every response the target gave, dropped ones too
    return {
        "records": len(kept),
        "skipped": dict(Counter(e["skipped"] for e in entries if "skipped" in e)),
        "turns": len(turns),
        "mean_response_tokens": sum(counted) / max(len(counted), 1),
        "finished_fraction": finished / max(generated, 1),
        "truncated_turns": generated - finished,
        "dropped_turns": dropped,
        "dropped_records": sum(1 for e in entries if "messages" not in e and e.get("dropped_turns")),
        "same_tokens_fraction": sum(checked) / len(checked) if checked else None,
    }


def check_finished(summary: dict[str, Any], min_fraction: float, output: Path) -> None:
    """TooFewFinished when too few responses ended by themselves for the data to be trusted."""
    fraction, generated = summary["finished_fraction"], summary["turns"] + summary["dropped_turns"]
    if generated == 0 or fraction >= min_fraction:
        return
    raise TooFewFinished(
        f"only {fraction:.1%} of the {generated} responses ended by themselves ({summary['truncated_turns']} "
        f"were cut at their token budget), below --min-finished-fraction {min_fraction}, so {output} is "
        "not written. Raise --max-new-tokens (and --max-length) and regenerate into a new --work-dir, "
        "sample as the target's card advises (--temperature/--top-p/--top-k), or pass "
        "--min-finished-fraction 0 to write it anyway (the same --work-dir then only merges)"
    )


def check_written(summary: dict[str, Any], output: Path) -> None:
    """OUTPUT is never written without a record: TooFewFinished when every answer was cut and
    dropped, RegenerateError when every record was skipped."""
    if summary["records"] > 0:
        return
    skipped = summary["skipped"]
    reasons = "; ".join(f"{n} x {reason}" for reason, n in skipped.items())
    if summary["dropped_records"]:
        raise TooFewFinished(
            f"no record left to write to {output}: {summary['dropped_records']} record(s) lost every "
            f"answer, cut at its token budget (--on-length drop)"
            + (f", {sum(skipped.values())} skipped ({reasons})" if skipped else "")
            + ". Raise --max-new-tokens (and --max-length) and regenerate into a new --work-dir, or "
            "sample as the target's card advises (--temperature/--top-p/--top-k)"
        )
    raise RegenerateError(
        f"no record left to write to {output}: "
        + (f"every record was skipped ({reasons})" if skipped else "the input holds no record")
    )


def thinking_sampling_warning(settings: Any, target: Path | None) -> str | None:
    """A warning when thinking is on but decoding is greedy where the target's advice is to sample."""
    if settings.temperature > 0 or settings.chat_template_kwargs.get("enable_thinking") is False:
        return None
    advice = _advised_sampling(target) if target is not None else None
    explicit = settings.chat_template_kwargs.get("enable_thinking") is True
    if advice is None and not explicit:
        return None
    if advice is None:
        advice = QWEN3_THINKING_SAMPLING  # no target directory to read (--server without --target)
    elif not (explicit or _template_thinks(target)):
        return None
    flags = " ".join(f"--{key.replace('_', '-')} {value}" for key, value in advice.items())
    return (
        "thinking is on and --temperature is 0 (greedy), but the target's generation_config advises "
        f"sampling ({flags}); Qwen3's cards warn that greedy thinking degrades and repeats itself "
        "until the token limit (https://huggingface.co/Qwen/Qwen3-8B#best-practices). Pass "
        f"{flags}, or --thinking off"
    )


def _advised_sampling(target: Path) -> dict[str, Any] | None:
    """The sampling values of the target's generation_config.json when it asks for sampling."""
    try:
        config = json.loads((target / "generation_config.json").read_text(encoding="utf-8"))
    except (OSError, ValueError):
        return None
    if not isinstance(config, dict) or not config.get("do_sample"):
        return None
    return {key: config[key] for key in ("temperature", "top_p", "top_k") if key in config} or None


def _template_thinks(target: Path) -> bool:
    """Whether the target's chat template has a thinking switch (on unless turned off, as Qwen3's)."""
    texts = []
    for name in ("chat_template.jinja", "tokenizer_config.json"):
        try:
            texts.append((target / name).read_text(encoding="utf-8"))
        except OSError:
            continue
    return any("enable_thinking" in text for text in texts)
