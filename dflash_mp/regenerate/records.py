"""What every backend shares: the settings, a record being regenerated, prompts and their budgets.

The part files, the rank's share of the records and the merge into OUTPUT are in parts.py.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from typing import Any

log = logging.getLogger("dflash_mp.regenerate")
# --max-length without a target context to go by, and its cap: the presets' data.max_length.
DEFAULT_MAX_LENGTH = 3072


class RegenerateError(ValueError):
    """Input the regeneration cannot run on; the message names the file:line or option and the fix."""


@dataclass
class Settings:
    """How answers are generated, whichever backend generates them."""

    max_length: int  # longest record (prompt + responses), in tokens
    max_new_tokens: int  # longest single response
    temperature: float  # 0: greedy
    seed: int
    batch_size: int  # local backend: records generated together
    on_bad_record: str  # "fail" or "skip"
    # Local backend: generate only tokens whose text re-tokenizes to the same ids (see RoundTripSafe).
    round_trip_safe: bool = False
    # Extra variables for the chat template, e.g. {"enable_thinking": False} for Qwen3.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)
    # Store the target's reasoning in the assistant turn's reasoning_content (else drop it).
    keep_reasoning: bool = False
    top_p: float | None = None  # None: the server's default; locally no nucleus cut
    top_k: int | None = None  # None: the server's default; locally no top-k cut
    on_length: str = "drop"  # an answer cut at its token budget: drop, keep or fail (finish.py)
    # Below this fraction of responses that ended by themselves, OUTPUT is not written.
    min_finished_fraction: float = 0.5

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r}: must be >= {low}"
            for name, value, low in (
                ("--max-length", self.max_length, 2),
                ("--max-new-tokens", self.max_new_tokens, 1),
                ("--batch-size", self.batch_size, 1),
                ("--temperature", self.temperature, 0.0),
            )
            if not value >= low
        ]
        if self.top_p is not None and not 0 < self.top_p <= 1:
            problems.append(f"--top-p={self.top_p!r}: must be in (0, 1], e.g. 0.95")
        if self.top_k is not None and not self.top_k >= 1:
            problems.append(f"--top-k={self.top_k!r}: must be >= 1, e.g. 20")
        if self.on_length not in ("drop", "keep", "fail"):
            problems.append(f"--on-length={self.on_length!r}: must be drop, keep or fail")
        if not 0 <= self.min_finished_fraction <= 1:
            problems.append(f"--min-finished-fraction={self.min_finished_fraction!r}: must be in [0, 1]")
        if self.on_bad_record not in ("fail", "skip"):
            problems.append(f"--on-bad-record={self.on_bad_record!r}: must be 'fail' or 'skip'")
        if not isinstance(self.chat_template_kwargs, dict):
            problems.append(f"--chat-template-kwargs={self.chat_template_kwargs!r}: must be a JSON object")
        if problems:
            raise RegenerateError("; ".join(problems))


@dataclass
class Conversation:
    """One record being regenerated: what is written so far and the original turns still to come."""

    index: int
    source: str  # file:line, for messages
    done: list[dict[str, str]] = field(default_factory=list)
    rest: list[dict[str, str]] = field(default_factory=list)
    response_tokens: list[int | None] = field(default_factory=list)  # per regenerated turn
    finished: list[bool] = field(default_factory=list)  # per turn: ended with a stop token
    # Per turn: the text re-tokenizes to the same ids (None where the ids are unknown: a server).
    same_tokens: list[bool | None] = field(default_factory=list)
    problem: str | None = None  # why the record cannot be regenerated
    dropped_turns: int = 0  # answers cut at their token budget and left out (--on-length drop)

    def next_prompt(self) -> list[dict[str, str]] | None:
        """The conversation to answer next (roles and contents only), or None when the record is complete.

        Earlier answers go back without their reasoning: Qwen3-style templates drop the reasoning
        of turns before the last user message anyway, and servers need not accept the field.
        """
        while self.rest and self.rest[0]["role"] != "assistant":
            self.done.append(self.rest.pop(0))
        if self.rest or (self.done and self.done[-1]["role"] == "user"):
            return [{"role": m["role"], "content": m["content"]} for m in self.done]
        return None

    def answer(
        self,
        text: str,
        num_tokens: int | None,
        finished: bool,
        same_tokens: bool | None,
        reasoning: str | None = None,
    ) -> None:
        if self.rest:
            self.rest.pop(0)  # the original assistant turn this one replaces
        message = {"role": "assistant", "content": text}
        if reasoning is not None:
            message["reasoning_content"] = reasoning
        self.done.append(message)
        self.response_tokens.append(num_tokens)
        self.finished.append(finished)
        self.same_tokens.append(same_tokens)

    def cut_before_last_prompt(self) -> None:
        """End the conversation after its last assistant turn (the next prompt does not fit)."""
        while self.done and self.done[-1]["role"] != "assistant":
            self.done.pop()
        self.rest = []

    def fit_response(self, prompt_tokens: int, template_tail: int, settings: Settings) -> int | None:
        """Tokens the next response may take within --max-length, or None when it gets none: then
        the record ends after its last answer, or (with no answer yet) has a problem."""
        budget = min(settings.max_new_tokens, settings.max_length - prompt_tokens - template_tail)
        if budget >= 1:
            return budget
        if self.response_tokens:
            self.cut_before_last_prompt()  # keep the turns that fit
        else:
            self.problem = (
                f"the prompt has {prompt_tokens} tokens: no room for a response within "
                f"--max-length {settings.max_length}"
            )
        return None


def parse_conversation(index: int, source: str, text: str) -> Conversation:
    """A record's messages, checked; ValueError says what is wrong."""
    from dflash_mp.evaluation.prompts import chat_messages

    try:
        record = json.loads(text)
    except json.JSONDecodeError as e:
        from dflash_mp.data.records import malformed_json

        raise ValueError(malformed_json(e)) from None
    messages = chat_messages(record)
    for i, message in enumerate(messages):
        if message["role"] == "assistant" and (i == 0 or messages[i - 1]["role"] == "assistant"):
            raise ValueError(f"message {i} is an assistant turn with no prompt before it")
    if not any(m["role"] in ("user", "assistant") for m in messages):
        raise ValueError("no user or assistant turn to regenerate")
    return Conversation(index=index, source=source, rest=messages)


def split_reasoning(text: str, reasoning: str | None = None) -> tuple[str, str | None]:
    """(answer, reasoning) of a response: a server's separate reasoning, or a <think>...</think>
    block leading the text (templates that open <think> in the generation prompt leave only its end).

    Kept inline, the block would break the trainer's alignment of contents with Qwen3-style
    templates, which move reasoning into a <think> block of their own.
    """
    head, closing, tail = text.partition("</think>")
    if closing and (head.lstrip().startswith("<think>") or "<think>" not in head):
        inline = head.lstrip().removeprefix("<think>")
        reasoning = inline if reasoning is None else reasoning
        text = tail
    elif reasoning is None:
        return text, None
    return text.lstrip("\n"), reasoning.strip("\n")


def render_prompt(tokenizer: Any, messages: list[dict[str, str]], settings: Settings) -> list[int]:
    """Token ids of the conversation with the generation prompt, as the target sees it."""
    encoding = tokenizer.apply_chat_template(
        messages, add_generation_prompt=True, tokenize=True, return_dict=True, **settings.chat_template_kwargs
    )
    return list(encoding["input_ids"])


def prompt_and_budget(
    conversation: Conversation, tokenizer: Any, messages: list[dict[str, str]], tail: int, settings: Settings
) -> tuple[list[int], int] | None:
    """The next prompt's ids and the room for its response, or None when it gets no response (see
    Conversation.fit_response); a template that rejects the conversation gives the record a problem."""
    from jinja2 import TemplateError

    try:
        ids = render_prompt(tokenizer, messages, settings)
    except (ValueError, TemplateError) as e:  # a template's raise_exception() is a TemplateError
        conversation.problem = f"the chat template cannot render the conversation: {e}"
        return None
    budget = conversation.fit_response(len(ids), tail, settings)
    return None if budget is None else (ids, budget)


def template_tail(tokenizer: Any) -> int:
    """Tokens the chat template adds after an assistant content (e.g. <|im_end|> and a newline)."""
    user = [{"role": "user", "content": "x"}]
    prompt = tokenizer.apply_chat_template(user, add_generation_prompt=True, tokenize=True, return_dict=True)
    whole = tokenizer.apply_chat_template(
        user + [{"role": "assistant", "content": ""}], tokenize=True, return_dict=True
    )
    return max(len(whole["input_ids"]) - len(prompt["input_ids"]), 0)


def max_length_problem(max_length: int, context: int, target: object) -> str:
    """Why --max-length does not fit the target, with the value that does."""
    return (
        f"--max-length {max_length} exceeds the target's context of {context} positions "
        f"(max_position_embeddings of {target}): pass --max-length {context} or less, or leave it out "
        f"(the default is the target's context, at most {DEFAULT_MAX_LENGTH})"
    )


def stable_seed(*parts: int) -> int:
    digest = hashlib.blake2b("/".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1
