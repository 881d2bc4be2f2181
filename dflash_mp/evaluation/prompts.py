"""The prompts an evaluation decodes: chat records from JSONL files (a held-out split of the
training data's format, or the embedded eval set), rendered and tokenized, with where each came from."""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any


class EvalError(ValueError):
    """Input the evaluation cannot run on; the message names the file or setting and the fix."""


@dataclass
class Prompt:
    """A tokenized prompt and where it came from (file:line), for error messages."""

    source: str
    input_ids: list[int]


# ----------------------------------------------------------------------------------------
# prompts


def chat_messages(record: Any) -> list[dict[str, str]]:
    """The role/content pairs of a chat record in any accepted conversation format
    (dflash_mp.data.records); ValueError says what is wrong."""
    from dflash_mp.data.records import chat_turns

    return [{"role": m["role"], "content": m["content"]} for m in chat_turns(record)]


def prompt_messages(record: Any) -> list[dict[str, str]]:
    """The messages of a chat record before its first assistant turn; they must end with a user turn."""
    messages = chat_messages(record)
    replies = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompt = messages[: replies[0]] if replies else messages
    if not prompt or prompt[-1]["role"] != "user":
        raise ValueError("the messages before the first assistant turn must end with a user turn")
    return prompt


def prompt_records(paths: Sequence[str | Path], limit: int | None = None) -> list[tuple[str, list[dict]]]:
    """(file:line, prompt messages) of the first `limit` records of chat JSONL files.

    A record's prompt is its messages before the first assistant turn (all of them for a
    prompt-only record), so training files and held-out conversations both serve as prompts.
    """
    from dflash_mp.data import DataError, EmptyData, open_records

    if not paths:
        raise EvalError("no prompt files given: pass --prompts FILE.jsonl (or set data.eval_files)")
    try:
        records = open_records([str(path) for path in paths])
    except EmptyData:
        raise EvalError(
            f"no prompts in {', '.join(map(str, paths))}: every file is empty or blank. Give JSONL "
            'files with one {"messages": [{"role": "user", "content": ...}, ...]} record per line.'
        ) from None
    except DataError as e:
        raise EvalError(f"cannot read the prompts: {e}") from None
    prompts: list[tuple[str, list[dict]]] = []
    for i in range(len(records) if limit is None else min(limit, len(records))):
        path, line_number, line = records.read(i)
        source = f"{path}:{line_number}"
        try:
            prompts.append((source, prompt_messages(json.loads(line))))
        except json.JSONDecodeError as e:
            from dflash_mp.data.records import malformed_json

            raise EvalError(f"{source}: {malformed_json(e)}") from None
        except ValueError as e:
            raise EvalError(f"{source}: {e}") from None
    return prompts


def load_prompts(
    paths: Sequence[str | Path], tokenizer: Any, limit: int | None = None, renderer: Any = None
) -> list[Prompt]:
    """The first `limit` prompts of chat JSONL files (`prompt_records`), rendered with the
    generation prompt. `renderer` (a dflash_mp.data.ChatRenderer) applies the run's
    data.chat_template and its kwargs, so prompts are rendered the way training rendered conversations.
    """
    from dflash_mp.data import ChatRenderer

    renderer = renderer or ChatRenderer(tokenizer)
    prompts: list[Prompt] = []
    for source, messages in prompt_records(paths, limit):
        text = renderer.apply(messages, generation_prompt=True)
        input_ids = tokenizer(text, add_special_tokens=False)["input_ids"]
        prompts.append(Prompt(source=source, input_ids=list(input_ids)))
    return prompts


def held_out_prompt_files(eval_files: Sequence[str], target_path: str) -> list[str]:
    """`eval_files`, or the embedded eval set for the embedded target; a real target without
    held-out prompts is an error (toy prompts say nothing of its acceptance length)."""
    from dflash_mp.config.schema import is_embedded_target
    from dflash_mp.embedded import embedded_path

    if eval_files:
        return list(eval_files)
    if not is_embedded_target(target_path):
        raise EvalError(
            f"no held-out prompts for the target at {target_path}: set data.eval_files=[FILE.jsonl] "
            "(or pass --prompts FILE.jsonl); the embedded toy prompts only fit the embedded target"
        )
    return [str(embedded_path("data/eval.jsonl"))]


def has_held_out_prompts(cfg: Any) -> bool:
    """Whether training evaluates held-out prompts (data.eval_files, or the embedded target's own);
    without them eval.every measures eval.benchmarks only."""
    from dflash_mp.config.schema import is_embedded_target

    return bool(cfg.data.eval_files) or is_embedded_target(cfg.model.target_path)


def load_eval_prompts(cfg: Any, tokenizer: Any) -> list[Prompt]:
    """The held-out prompts for evaluation during training: cfg.eval.num_prompts of cfg.data.eval_files
    (the embedded eval set for the embedded target), rendered with the run's chat template."""
    from dflash_mp.data import ChatRenderer, read_chat_template

    files = held_out_prompt_files(cfg.data.eval_files, cfg.model.target_path)
    renderer = ChatRenderer(
        tokenizer, read_chat_template(cfg.data.chat_template), dict(cfg.data.chat_template_kwargs)
    )
    return load_prompts(files, tokenizer, limit=cfg.eval.num_prompts, renderer=renderer)
