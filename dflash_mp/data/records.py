"""Record formats: one JSONL line -> a conversation (role/content messages) or a pre-rendered text.

Accepted, per record (what SpecForge and speculators users already have):
  {"messages": [{"role", "content", "reasoning_content"?}, ...]}   (content: a string, or
                                                          OpenAI-style text parts)
  {"conversations": [{"role", "content"}, ...]}
  {"conversations": [{"from": "human"|"gpt"|"system", "value"}, ...]}   (ShareGPT)
  {"text": "...", "loss_spans"?: [[start, end], ...]}   (pre-rendered; loss on every token, or on
                                                          the given character spans, end exclusive)
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

ACCEPTED_FORMATS = (
    '{"messages": [{"role", "content"}]}, {"conversations": [{"role", "content"}]}, '
    'ShareGPT {"conversations": [{"from": "human"|"gpt"|"system", "value"}]}, '
    'or {"text": ..., "loss_spans": [[start, end], ...] (optional)}'
)
SHAREGPT_ROLES = {
    "human": "user",
    "user": "user",
    "gpt": "assistant",
    "assistant": "assistant",
    "system": "system",
    # Assistants named by their model in the ShareGPT dumps.
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
}
THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


class RecordError(ValueError):
    """Why one record cannot be used; `kind` is the short label the preflight groups by."""

    def __init__(self, kind: str, detail: str | None = None) -> None:
        super().__init__(detail or kind)
        self.kind = kind


@dataclass
class Conversation:
    """Messages with str role and content, and an optional str reasoning_content on assistant turns."""

    messages: list[dict[str, Any]]


@dataclass
class TextRecord:
    """A pre-rendered text; loss on the character spans (None: on every token)."""

    text: str
    loss_spans: list[tuple[int, int]] | None = field(default=None)


def decode_line(raw: bytes | str) -> str:
    """The record's text: strict UTF-8 (a bad byte makes the record bad), a byte-order mark dropped."""
    if isinstance(raw, bytes):
        try:
            raw = raw.decode("utf-8")
        except UnicodeDecodeError as e:
            raise RecordError(
                "not UTF-8",
                f"not valid UTF-8 (byte {raw[e.start]:#04x} at byte {e.start + 1}); re-encode the file as UTF-8",
            ) from None
    return raw.removeprefix("\ufeff")


def malformed_json(e: json.JSONDecodeError) -> str:
    """json's complaint with its column ("Unterminated string starting at" ends in "at" itself)."""
    return f"malformed JSON ({e.msg.removesuffix(' at')} at column {e.colno})"


def parse_json(text: str) -> Any:
    try:
        return json.loads(text)
    except json.JSONDecodeError as e:
        raise RecordError("malformed JSON", malformed_json(e)) from None
    except RecursionError:
        raise RecordError("malformed JSON", "malformed JSON (nested too deeply to parse)") from None


def to_record(obj: Any) -> Conversation | TextRecord:
    """The record in one of the accepted formats, or RecordError saying what is wrong."""
    if "messages" in obj or "conversations" in obj:
        return Conversation(_with_assistant(chat_turns(obj)))
    if "text" in obj:
        return _text_record(obj)
    raise _unknown_format(obj)


def chat_turns(obj: Any) -> list[dict[str, Any]]:
    """The messages of a record in one of the conversation formats, assistant turn or not
    (evaluation and regeneration read prompt-only records); RecordError says what is wrong."""
    if isinstance(obj, dict) and "messages" in obj:
        return _role_messages(obj["messages"], "messages")
    if isinstance(obj, dict) and "conversations" in obj:
        turns = obj["conversations"]
        if isinstance(turns, list) and turns and isinstance(turns[0], dict) and "from" in turns[0]:
            return _sharegpt_messages(turns)
        return _role_messages(turns, "conversations")
    if isinstance(obj, dict) and "text" in obj:
        raise RecordError(
            "unknown format", 'a pre-rendered {"text": ...} record has no turns; give a conversation'
        )
    raise _unknown_format(obj)


def _unknown_format(obj: Any) -> RecordError:
    if not isinstance(obj, dict):
        return RecordError(
            "unknown format",
            f"a record must be a JSON object, got {type(obj).__name__}; accepted: {ACCEPTED_FORMATS}",
        )
    keys = ", ".join(sorted(map(str, obj))[:10]) or "none"
    return RecordError(
        "unknown format", f"unknown record format (keys: {keys}); accepted: {ACCEPTED_FORMATS}"
    )


def _check_list(turns: Any, key: str) -> list:
    if not isinstance(turns, list):
        raise RecordError("bad conversation", f'"{key}" must be a list, got {type(turns).__name__}')
    if not turns:
        raise RecordError("empty conversation")
    return turns


def _role_messages(turns: Any, key: str) -> list[dict[str, Any]]:
    messages = []
    for i, message in enumerate(_check_list(turns, key)):
        if not isinstance(message, dict):
            raise RecordError(
                "bad conversation", f"message {i} must be an object, got {type(message).__name__}"
            )
        for name in ("role", "content"):
            if name not in message:
                raise RecordError("bad conversation", f'message {i} has no "{name}"')
        if not isinstance(message["role"], str):
            raise RecordError(
                "bad conversation",
                f'message {i}: "role" must be a string, got {type(message["role"]).__name__}',
            )
        reasoning = message.get("reasoning_content")
        if reasoning is not None and not isinstance(reasoning, str):
            raise RecordError("bad conversation", f'message {i}: "reasoning_content" must be a string')
        content = message["content"]
        if content is None and message.get("tool_calls"):
            content = ""  # OpenAI's assistant turn that only calls tools
        messages.append({**message, "content": _content_text(content, i)})
    return messages


def _content_text(content: Any, i: int) -> str:
    """A message's content as text: a string, or OpenAI-style parts that are all text, joined with
    newlines as vLLM joins them for a chat template."""
    if isinstance(content, str):
        return content
    parts = content if isinstance(content, list) else None
    if parts is None or not all(isinstance(part, dict) for part in parts):
        raise RecordError(
            "bad conversation",
            f'message {i}: "content" must be a string or a list of {{"type": "text", "text": ...}} '
            f"parts, got {type(content).__name__}",
        )
    other = sorted({str(part.get("type")) for part in parts} - {"text"})
    if other:
        raise RecordError(
            "non-text content",
            f"message {i}: content parts of type {other}: the drafter trains on text only; drop them",
        )
    if not all(isinstance(part.get("text"), str) for part in parts):
        raise RecordError("bad conversation", f'message {i}: a "text" part without a "text" string')
    return "\n".join(part["text"] for part in parts)


def _sharegpt_messages(turns: list) -> list[dict[str, Any]]:
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or not isinstance(turn.get("value"), str):
            raise RecordError(
                "bad conversation", f'ShareGPT turn {i} must be {{"from": ..., "value": "..."}}'
            )
        role = SHAREGPT_ROLES.get(turn.get("from"))  # type: ignore[arg-type]
        if role is None:
            raise RecordError(
                "bad conversation",
                f'ShareGPT turn {i}: unknown "from" {turn.get("from")!r} (expected one of {sorted(SHAREGPT_ROLES)})',
            )
        messages.append({"role": role, "content": turn["value"]})
    return messages


def _with_assistant(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    if not any(message["role"] == "assistant" for message in messages):
        raise RecordError("no assistant turn")
    return messages


def _text_record(obj: dict) -> TextRecord:
    text = obj["text"]
    if not isinstance(text, str) or not text:
        raise RecordError("bad text", '"text" must be a non-empty string')
    spans = obj.get("loss_spans")
    if spans is None:
        return TextRecord(text)
    if not isinstance(spans, list) or not all(
        isinstance(s, list)
        and len(s) == 2
        and all(type(x) is int for x in s)
        and 0 <= s[0] < s[1] <= len(text)
        for s in spans
    ):
        raise RecordError(
            "bad text",
            f'"loss_spans" must be [[start, end], ...] with 0 <= start < end <= {len(text)} (characters)',
        )
    return TextRecord(text, [(s[0], s[1]) for s in spans])


def split_inline_reasoning(messages: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Assistant turns with an inline <think>...</think> prefix get it as reasoning_content.

    Mirrors how Qwen3-style templates read inline reasoning, so a template that renders
    reasoning_content treats both spellings alike.
    """
    out = []
    for message in messages:
        content = message["content"]
        if message["role"] == "assistant" and THINK_CLOSE in content:
            if isinstance(message.get("reasoning_content"), str):
                raise RecordError(
                    "bad conversation", "an assistant turn has both reasoning_content and an inline </think>"
                )
            parts = content.split(THINK_CLOSE)
            message = {
                **message,
                "reasoning_content": parts[0].rstrip("\n").split(THINK_OPEN)[-1].lstrip("\n"),
                "content": parts[-1].lstrip("\n"),
            }
        out.append(message)
    return out
