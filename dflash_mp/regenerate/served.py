"""The server backend: prompts sent to an OpenAI-compatible /v1/chat/completions (vLLM, SGLang).

Records are answered by a pool of --concurrency threads, one record per thread (its turns one
after another), so at most that many requests are in flight. Connection errors, timeouts, 408,
429 and 5xx are retried with exponential backoff (or the server's Retry-After); a request the
server refuses (another 4xx, e.g. a prompt over its context) makes the record a bad record
(--on-bad-record); 401, 403 and 404 stop the run, since every request would get them.

A record whose requests still fail after --max-retries is not written: the run goes on with the
others and then exits with FAILED_EXIT_CODE without writing OUTPUT (--on-failed-request fail), or
writes OUTPUT without those records (skip); either way a rerun of the same command retries only
them. When 2 × concurrency records fail in a row the server is taken to be down and the run stops.
"""

from __future__ import annotations

import http.client
import json
import logging
import os
import random
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from dflash_mp.regenerate.finish import take_answer
from dflash_mp.regenerate.parts import RecordJob, append_entries, made_with
from dflash_mp.regenerate.progress import Progress
from dflash_mp.regenerate.records import (
    Conversation,
    RegenerateError,
    Settings,
    prompt_and_budget,
    split_reasoning,
    stable_seed,
    template_tail,
)

log = logging.getLogger("dflash_mp.regenerate")

FAILED_EXIT_CODE = 3
_RETRIED_STATUSES = {408, 429, 500, 502, 503, 504}
_FATAL_STATUSES = {401: "check the API key", 403: "check the API key", 404: "check --server and --model"}
_MAX_WAIT_SECONDS = 60.0
T = TypeVar("T")


class RecordsFailed(Exception):
    """Records whose requests failed after every retry; a rerun retries them."""


class TransientError(Exception):
    """A request that may succeed when sent again (after `retry_after` seconds, if the server said)."""

    def __init__(self, message: str, retry_after: float = 0.0) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class RequestRefused(Exception):
    """The server refused this request (a 4xx about its content): the record is bad."""


@dataclass
class ServerSettings:
    """Where and how requests are sent."""

    url: str  # http://host:port, with or without /v1
    model: str | None = None  # the served model name; None: the only one the server lists
    concurrency: int = 8  # requests in flight at most
    max_retries: int = 5  # retries of one request after its first attempt
    timeout: float = 600.0  # seconds per request
    retry_backoff: float = 1.0  # seconds before the first retry, doubled for each next one
    api_key_env: str = "OPENAI_API_KEY"  # the environment variable holding the API key, if any
    on_failed_request: str = "fail"  # "fail" or "skip"

    def __post_init__(self) -> None:
        problems = [
            f"{name}={value!r}: must be >= {low}"
            for name, value, low in (
                ("--concurrency", self.concurrency, 1),
                ("--max-retries", self.max_retries, 0),
                ("--retry-backoff", self.retry_backoff, 0.0),
            )
            if not value >= low
        ]
        if not self.timeout > 0:
            problems.append(f"--timeout={self.timeout!r}: must be > 0")
        if not self.url.startswith(("http://", "https://")):
            problems.append(
                f"--server={self.url!r}: must be an http:// or https:// URL, e.g. http://localhost:8000"
            )
        if self.on_failed_request not in ("fail", "skip"):
            problems.append(f"--on-failed-request={self.on_failed_request!r}: must be 'fail' or 'skip'")
        if problems:
            raise RegenerateError("; ".join(problems))
        self.url = self.url.rstrip("/").removesuffix("/v1")


@dataclass
class Reply:
    content: str
    reasoning: str | None
    completion_tokens: int | None
    finish_reason: str | None


class ChatClient:
    """Requests to one server, retried; safe to share between threads (one connection per request)."""

    def __init__(self, settings: ServerSettings) -> None:
        self.settings = settings
        # Read once and kept out of every message and log line.
        self._api_key = os.environ.get(settings.api_key_env) or None

    def _send(self, method: str, path: str, body: dict[str, Any] | None = None) -> Any:
        """One attempt; the decoded JSON reply, else TransientError, RequestRefused or RegenerateError."""
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.settings.url + path, data=data, headers=headers, method=method)
        try:
            with urllib.request.urlopen(request, timeout=self.settings.timeout) as response:
                payload = response.read()
        except urllib.error.HTTPError as e:
            reason = f"HTTP {e.code} from {method} {path}: {_error_message(e)}"
            if e.code in _RETRIED_STATUSES or e.code >= 500:
                raise TransientError(reason, _retry_after(e.headers.get("Retry-After"))) from None
            if e.code in _FATAL_STATUSES:
                hint = _FATAL_STATUSES[e.code]
                if e.code in (401, 403):
                    hint += f" in ${self.settings.api_key_env} (--api-key-env names another variable)"
                raise RegenerateError(f"{self.settings.url}: {reason}; {hint}") from None
            raise RequestRefused(reason) from None
        except (urllib.error.URLError, http.client.HTTPException, OSError) as e:
            raise TransientError(f"{method} {self.settings.url}{path}: {getattr(e, 'reason', e)}") from None
        try:
            return json.loads(payload)
        except ValueError:
            raise TransientError(f"{method} {path}: the reply is not JSON: {payload[:200]!r}") from None

    def _with_retries(self, attempt: Callable[[], T]) -> T:
        for retry in range(self.settings.max_retries + 1):
            try:
                return attempt()
            except TransientError as e:
                if retry == self.settings.max_retries:
                    attempts = self.settings.max_retries + 1
                    raise TransientError(f"{e} (after {attempts} attempt{'s' * (attempts > 1)})") from None
                backoff = min(self.settings.retry_backoff * 2**retry, _MAX_WAIT_SECONDS)
                # Jitter spreads the retries of many threads that failed together.
                wait_s = max(backoff * random.uniform(0.5, 1.0), e.retry_after)
                log.debug("retrying in %.2f s: %s", wait_s, e)
                time.sleep(wait_s)
        raise AssertionError("unreachable")

    def served_models(self) -> list[str]:
        reply = self._with_retries(lambda: self._send("GET", "/v1/models"))
        try:
            return [str(model["id"]) for model in reply["data"]]
        except (KeyError, TypeError):
            raise RegenerateError(
                f"{self.settings.url}/v1/models: not an OpenAI model list: {reply!r:.200}"
            ) from None

    def chat(self, body: dict[str, Any]) -> Reply:
        def attempt() -> Reply:
            reply = self._send("POST", "/v1/chat/completions", body)
            try:
                choice = reply["choices"][0]
                message = choice["message"]
                usage = reply.get("usage") or {}
                return Reply(
                    content=message.get("content") or "",
                    # vLLM's reasoning parsers fill "reasoning_content" (newer ones "reasoning").
                    reasoning=message.get("reasoning_content") or message.get("reasoning"),
                    completion_tokens=usage.get("completion_tokens"),
                    finish_reason=choice.get("finish_reason"),
                )
            except (KeyError, IndexError, TypeError, AttributeError):
                raise TransientError(f"not a chat completion: {reply!r:.200}") from None

        return self._with_retries(attempt)


def _error_message(error: urllib.error.HTTPError) -> str:
    """The server's own message (vLLM: {"message"}, OpenAI/SGLang: {"error": {"message"}}), shortened."""
    try:
        body = error.read().decode("utf-8", errors="replace")
    except OSError:
        return str(error.reason)
    try:
        parsed = json.loads(body)
        inner = parsed.get("error", parsed)
        message = inner.get("message", body) if isinstance(inner, dict) else inner
    except (ValueError, AttributeError):
        message = body
    return str(message).strip()[:300] or str(error.reason)


def _retry_after(value: str | None) -> float:
    try:
        return min(float(value), _MAX_WAIT_SECONDS) if value else 0.0
    except ValueError:
        return 0.0  # an HTTP date: the backoff applies


def choose_model(client: ChatClient, model: str | None) -> str:
    """The served model to ask: --model if the server serves it, else the only one it serves."""
    try:
        served = client.served_models()
    except TransientError as e:
        raise RegenerateError(
            f"cannot reach the server: {e}; is it running at --server {client.settings.url}?"
        ) from None
    if model is not None:
        if model not in served:
            raise RegenerateError(
                f"--model {model!r} is not served at {client.settings.url} (it serves {served})"
            )
        return model
    if len(served) != 1:
        raise RegenerateError(f"{client.settings.url} serves {served}: pick one with --model")
    return served[0]


class _RecordAnswerer:
    """Answers one record's turns through the server; called from the pool's threads."""

    def __init__(self, client: ChatClient, model: str, settings: Settings, tokenizer: Any | None) -> None:
        self.client, self.model, self.settings, self.tokenizer = client, model, settings, tokenizer
        self.tail = template_tail(tokenizer) if tokenizer is not None else 0
        self._tokenizer_lock = threading.Lock()  # a fast tokenizer is not safe to share between threads

    def __call__(self, conversation: Conversation) -> str | None:
        """Answer every turn; the reason when a request failed after its retries (None otherwise)."""
        settings = self.settings
        while (messages := conversation.next_prompt()) is not None:
            max_tokens = settings.max_new_tokens
            if self.tokenizer is not None:
                with self._tokenizer_lock:
                    fitted = prompt_and_budget(conversation, self.tokenizer, messages, self.tail, settings)
                if fitted is None:
                    return None
                max_tokens = fitted[1]
            body: dict[str, Any] = {
                "model": self.model,
                "messages": messages,
                "max_tokens": max_tokens,
                "temperature": settings.temperature,
            }
            if settings.temperature > 0:
                body["seed"] = stable_seed(
                    settings.seed, conversation.index, len(conversation.response_tokens)
                )
            for name in ("top_p", "top_k"):  # None: the server's default (vLLM: generation_config)
                if getattr(settings, name) is not None:
                    body[name] = getattr(settings, name)
            if settings.chat_template_kwargs:
                body["chat_template_kwargs"] = settings.chat_template_kwargs
            try:
                reply = self.client.chat(body)
            except TransientError as e:
                return str(e)
            except RequestRefused as e:
                conversation.problem = f"the server refused turn {len(conversation.response_tokens) + 1}: {e}"
                return None
            content, reasoning = split_reasoning(reply.content, reply.reasoning)
            finished = reply.finish_reason == "stop"
            kept = reasoning if settings.keep_reasoning else None
            take_answer(conversation, settings, content, reply.completion_tokens, finished, None, kept)
        return None


def regenerate_served(
    inputs: Sequence[str | Path],
    output: str | Path,
    server: ServerSettings,
    settings: Settings,
    tokenizer_path: str | Path | None = None,
    rank: int = 0,
    world_size: int = 1,
    work_dir: str | Path | None = None,
    limit: int | None = None,
    trust_remote_code: bool = False,
) -> dict[str, Any] | None:
    """This job's share of the records answered by the server, then the merge if every record is
    done (its summary; else None). With `tokenizer_path` (the served model's), every response gets
    the room left within --max-length and every record is checked as the trainer will tokenize it.
    Raises RecordsFailed when records failed after their retries (with on_failed_request fail)."""
    if settings.round_trip_safe:
        raise RegenerateError("--round-trip-safe needs the local backend (it constrains the sampling itself)")
    tokenizer_source = str(Path(tokenizer_path).resolve()) if tokenizer_path is not None else ""
    made = made_with(settings, server=server.url, model=server.model, target=tokenizer_source)
    job = RecordJob(inputs, output, settings, rank, world_size, work_dir, limit, made)
    failed: dict[int, str] = {}
    if job.pending:
        tokenizer = None
        if tokenizer_path is not None:
            from dflash_mp.data import load_tokenizer

            tokenizer = load_tokenizer(tokenizer_path, trust_remote_code=trust_remote_code)
        client = ChatClient(server)
        model = choose_model(client, server.model)
        job.made["model"] = model  # checked against the parts' when this rank opens its part
        log.info("asking %s at %s, %d requests at a time", model, server.url, server.concurrency)
        answer = _RecordAnswerer(client, model, settings, tokenizer)
        with job.open_part() as part:
            failed, gave_up = _answer_all(job, answer, tokenizer, server.concurrency, part)
        if gave_up:
            raise RecordsFailed(
                f"stopped after {len(failed)} records in a row failed: the server at {server.url} looks "
                f"down (last error: {list(failed.values())[-1]}). Rerun the same command to resume."
            )
    if failed:
        listed = "; ".join(f"{job.source(i)}: {reason}" for i, reason in list(failed.items())[:5])
        more = f" (and {len(failed) - 5} more)" if len(failed) > 5 else ""
        if server.on_failed_request == "fail":
            raise RecordsFailed(
                f"{len(failed)} record(s) failed after {server.max_retries} retries, so {job.output} is not "
                f"written: {listed}{more}. Rerun the same command to retry only them "
                "(--on-failed-request skip writes the output without them)."
            )
        log.warning("left out %d record(s) that failed: %s%s", len(failed), listed, more)
    return job.merge(left_out=failed.keys())


def _answer_all(
    job: RecordJob, answer: _RecordAnswerer, tokenizer: Any | None, concurrency: int, part: Any
) -> tuple[dict[int, str], bool]:
    """Every pending record through the pool, each written as soon as it is done; the failures,
    and whether it gave up early because every recent record failed."""
    pending = iter(job.pending)
    running: dict[Future[str | None], Conversation] = {}
    failed: dict[int, str] = {}
    failures_in_a_row, exhausted = 0, False
    progress = Progress(len(job.pending), job.rank)
    with ThreadPoolExecutor(max_workers=concurrency, thread_name_prefix="regenerate") as pool:
        try:
            while True:
                # A short queue beyond the threads: records are read as they are needed.
                while len(running) < 2 * concurrency and failures_in_a_row < 2 * concurrency:
                    i = next(pending, None)
                    if i is None:
                        exhausted = True
                        break
                    item = job.conversation(i)
                    if isinstance(item, dict):
                        append_entries(part, [item])
                        progress.advance(1)
                    else:
                        running[pool.submit(answer, item)] = item
                if not running:
                    return failed, not exhausted
                done, _ = wait(running, return_when=FIRST_COMPLETED)
                for future in sorted(done, key=lambda f: running[f].index):
                    conversation = running.pop(future)
                    reason = future.result()
                    if reason is not None:
                        failed[conversation.index] = reason
                        failures_in_a_row += 1
                        log.warning("%s failed: %s", conversation.source, reason)
                        progress.advance(0, failed=1)
                        continue
                    failures_in_a_row = 0
                    append_entries(part, [job.result(conversation, tokenizer)])
                    progress.advance(1)
        finally:
            for future in running:
                future.cancel()  # on an error: the threads finish the requests they are in, no more
