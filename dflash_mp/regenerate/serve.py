"""A small OpenAI-compatible chat server around a local target, for smoke tests of `--server`.

    python -m dflash_mp.regenerate.serve --target embedded [--port 8000] [--fail-first N] [--delay S]

It serves GET /v1/models, POST /v1/chat/completions (greedy decoding only, with the tokenizer's
chat template and the request's chat_template_kwargs, one request decoded at a time) and
GET /stats (requests, failed, max_in_flight: what a client's concurrency and retries did;
/stats?reset=1 zeroes them after reading). --fail-first N answers the first N chat requests
(after a reset, again) with 503, --delay holds every request that long, --log-requests FILE
appends every request body with the prompt as rendered, and with --api-key-env NAME requests
must carry the key in $NAME. It prints
`serving MODEL at http://HOST:PORT` once it listens (--port 0 picks a free port).
It is not a production server: use vLLM or SGLang for real regeneration.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
import uuid
from collections.abc import Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any


class ChatError(Exception):
    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status


class TargetChat:
    """Greedy chat completions by a local target; counts what clients did, for tests."""

    def __init__(
        self, target: Path, model_name: str, fail_first: int, delay: float, log_requests: Path | None
    ) -> None:
        import torch

        from dflash_mp.data import load_tokenizer
        from dflash_mp.evaluation.acceptance import load_target_model, stop_token_ids

        self.tokenizer = load_tokenizer(target)
        self.model = load_target_model(target, torch.float32, "cpu")
        self.stops = stop_token_ids(self.tokenizer, self.model)
        self.context = getattr(self.model.config.get_text_config(), "max_position_embeddings", None)
        self.model_name, self.fail_first, self.delay = model_name, fail_first, delay
        self.log_requests = log_requests
        self.stats = {"requests": 0, "failed": 0, "max_in_flight": 0}
        self._in_flight = 0
        self._count_lock = threading.Lock()
        self._decode_lock = threading.Lock()  # one model, one decode at a time

    def enter(self) -> bool:
        """Count a chat request in; False when it must fail (--fail-first)."""
        with self._count_lock:
            self.stats["requests"] += 1
            self._in_flight += 1
            self.stats["max_in_flight"] = max(self.stats["max_in_flight"], self._in_flight)
            if self.stats["failed"] < self.fail_first:
                self.stats["failed"] += 1
                return False
            return True

    def leave(self) -> None:
        with self._count_lock:
            self._in_flight -= 1

    def read_stats(self, reset: bool) -> dict[str, int]:
        with self._count_lock:
            stats = dict(self.stats)
            if reset:
                self.stats = {"requests": 0, "failed": 0, "max_in_flight": self._in_flight}
            return stats

    def complete(self, body: Any) -> dict[str, Any]:
        from dflash_mp.evaluation.decoding import autoregressive_generate

        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            raise ChatError(400, '"messages" must be a non-empty list')
        if body.get("model") not in (None, self.model_name):
            raise ChatError(404, f"The model `{body.get('model')}` does not exist.")
        if body.get("stream"):
            raise ChatError(400, "streaming is not supported")
        if float(body.get("temperature") or 0) != 0:
            raise ChatError(400, "this smoke-test server decodes greedily only: send temperature 0")
        kwargs = body.get("chat_template_kwargs") or {}
        if not isinstance(kwargs, dict):
            raise ChatError(400, '"chat_template_kwargs" must be an object')
        try:
            prompt = self.tokenizer.apply_chat_template(
                body["messages"], add_generation_prompt=True, tokenize=True, return_dict=True, **kwargs
            )["input_ids"]
        except Exception as e:  # a malformed message or a template's raise_exception()
            raise ChatError(400, f"cannot render the messages: {e}") from None
        room = (self.context or len(prompt) + 1) - len(prompt)
        max_tokens = body.get("max_tokens") or body.get("max_completion_tokens") or room
        if not isinstance(max_tokens, int) or max_tokens < 1:
            raise ChatError(400, f"max_tokens must be a positive integer, got {max_tokens!r}")
        if max_tokens > room:
            raise ChatError(
                400, f"maximum context length is {self.context} tokens; the prompt has {len(prompt)}"
            )
        with self._decode_lock:
            if self.log_requests is not None:
                text = self.tokenizer.apply_chat_template(
                    body["messages"], add_generation_prompt=True, tokenize=False, **kwargs
                )
                with open(self.log_requests, "a", encoding="utf-8") as f:
                    f.write(json.dumps({"request": body, "prompt": text}) + "\n")
            new_tokens = autoregressive_generate(self.model, list(prompt), max_tokens, self.stops).new_tokens
        finished = new_tokens[-1] in self.stops
        text = self.tokenizer.decode(new_tokens[:-1] if finished else new_tokens, skip_special_tokens=True)
        return {
            "id": f"chatcmpl-{uuid.uuid4().hex}",
            "object": "chat.completion",
            "created": int(time.time()),
            "model": self.model_name,
            "choices": [
                {
                    "index": 0,
                    "message": {"role": "assistant", "content": text},
                    "finish_reason": "stop" if finished else "length",
                }
            ],
            "usage": {
                "prompt_tokens": len(prompt),
                "completion_tokens": len(new_tokens),
                "total_tokens": len(prompt) + len(new_tokens),
            },
        }


def make_handler(chat: TargetChat, api_key: str | None) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 - the base class's name
            pass  # quiet: tests read stdout for the address only

        def _reply(self, status: int, payload: Any) -> None:
            data = json.dumps(payload).encode()
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _error(self, status: int, message: str) -> None:
            self._reply(status, {"object": "error", "message": message})

        def _authorized(self) -> bool:
            if api_key is None or self.headers.get("Authorization") == f"Bearer {api_key}":
                return True
            self._error(401, "invalid API key")
            return False

        def do_GET(self) -> None:  # noqa: N802 - http.server's naming
            if not self._authorized():
                return
            if self.path == "/v1/models":
                self._reply(200, {"object": "list", "data": [{"id": chat.model_name, "object": "model"}]})
            elif self.path in ("/stats", "/stats?reset=1"):
                self._reply(200, chat.read_stats(reset=self.path.endswith("reset=1")))
            else:
                self._error(404, f"no route {self.path}")

        def do_POST(self) -> None:  # noqa: N802
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length)
            if not self._authorized():
                return
            if self.path != "/v1/chat/completions":
                self._error(404, f"no route {self.path}")
                return
            allowed = chat.enter()
            try:
                time.sleep(chat.delay)
                status, payload = 503, {"object": "error", "message": "failing on purpose (--fail-first)"}
                if allowed:
                    status, payload = 200, chat.complete(json.loads(raw))
            except ValueError:
                status, payload = 400, {"object": "error", "message": "the body is not JSON"}
            except ChatError as e:
                status, payload = e.status, {"object": "error", "message": str(e)}
            finally:
                chat.leave()  # before replying: the client may send its next request at once
            self._reply(status, payload)

    return Handler


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m dflash_mp.regenerate.serve",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--target", required=True, help="local HF target directory, or `embedded`")
    parser.add_argument(
        "--served-model-name", help="the model name clients send (default: --target as given)"
    )
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8000, help="0: a free port")
    parser.add_argument("--fail-first", type=int, default=0, help="answer the first N chat requests with 503")
    parser.add_argument("--delay", type=float, default=0.0, help="seconds every chat request is held")
    parser.add_argument("--log-requests", type=Path, help="append every chat request and its rendered prompt")
    parser.add_argument("--api-key-env", help="require the API key held in this environment variable")
    args = parser.parse_args(argv)
    from dflash_mp.embedded import embedded_path

    target = embedded_path("target") if args.target == "embedded" else Path(args.target)
    api_key = os.environ.get(args.api_key_env) if args.api_key_env else None
    if args.api_key_env and not api_key:
        print(f"dflash_mp.regenerate.serve: ${args.api_key_env} is empty", file=sys.stderr)
        return 2
    chat = TargetChat(
        target, args.served_model_name or args.target, args.fail_first, args.delay, args.log_requests
    )
    server = ThreadingHTTPServer((args.host, args.port), make_handler(chat, api_key))
    server.daemon_threads = True
    host, port = server.server_address[:2]
    print(f"serving {chat.model_name} at http://{host}:{port}", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
