"""Regeneration through an OpenAI-compatible server: a real HTTP server on localhost (the package's
smoke-test server around the embedded target, in a subprocess), answers equal to the local backend's,
chat template kwargs, bounded concurrency, retries, failures, resume after a kill, bad options."""

from __future__ import annotations

import json
import shutil
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from dflash_mp.embedded import embedded_path
from dflash_mp.regenerate import (
    RecordsFailed,
    RegenerateError,
    ServerSettings,
    Settings,
    main,
    read_parts,
    regenerate,
    regenerate_served,
    split_reasoning,
)
from tests.conftest import REPO, job_env

NEW_TOKENS = 10
RECORDS = 8  # of the bundled eval set: one to three turns each
API_KEY_ENV = "DFLASH_TEST_API_KEY"
THINKING_OFF = {"enable_thinking": False}


def _settings(**changes) -> Settings:
    values = dict(
        max_length=128,
        max_new_tokens=NEW_TOKENS,
        temperature=0.0,
        seed=0,
        batch_size=1,
        on_bad_record="fail",
        chat_template_kwargs=THINKING_OFF,
        # The tiny random target seldom stops by itself: these tests check the answers, cut or not.
        on_length="keep",
        min_finished_fraction=0.0,
    )
    return Settings(**{**values, **changes})


def _server_settings(url: str, **changes) -> ServerSettings:
    return ServerSettings(**{"url": url, "concurrency": 3, "retry_backoff": 0.01, **changes})


class Server:
    """`python -m dflash_mp.regenerate.serve` in a subprocess, on a free port."""

    def __init__(self, target: Path, log: Path, *flags: str, api_key: str | None = None) -> None:
        self.log = log
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        env = {**job_env(), API_KEY_ENV: api_key} if api_key else job_env()
        flags += ("--api-key-env", API_KEY_ENV) if api_key else ()
        cmd = [sys.executable, "-m", "dflash_mp.regenerate.serve", "--target", str(target), "--port", "0"]
        cmd += ["--served-model-name", "tiny", "--log-requests", str(log), *flags]
        self.process = subprocess.Popen(
            cmd, cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        self._url: str | None = None

    @property
    def url(self) -> str:
        """The address, once the server listens (the test starts it early and waits here)."""
        while self._url is None:
            line = self.process.stdout.readline()
            if not line:
                raise AssertionError(f"the server exited ({self.process.wait()}) before listening")
            if line.startswith("serving "):
                self._url = line.split()[-1]
        return self._url

    def stats(self, reset: bool = False) -> dict[str, int]:
        request = urllib.request.Request(self.url + "/stats" + "?reset=1" * reset, headers=self.headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return json.loads(response.read())

    def requests(self) -> list[dict]:
        return [json.loads(line) for line in self.log.read_text().splitlines()] if self.log.exists() else []

    def stop(self) -> None:
        self.process.terminate()
        self.process.wait(timeout=30)


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The embedded target with a Qwen3-style template: enable_thinking changes the prompt."""
    path = tmp_path_factory.mktemp("target") / "qwen3-style"
    shutil.copytree(embedded_path("target"), path)
    shutil.copy(REPO / "tests/fixtures/qwen3_chat_template.jinja", path / "chat_template.jinja")
    return path


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("data") / "prompts.jsonl"
    lines = embedded_path("data/eval.jsonl").read_text().splitlines()[:RECORDS]
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def expected(target: Path, data: Path, tmp_path_factory: pytest.TempPathFactory) -> str:
    """What the local backend writes (greedy, batches of one)."""
    output = tmp_path_factory.mktemp("local") / "out.jsonl"
    summary = regenerate([data], output, target, _settings())
    assert summary is not None and summary["records"] == RECORDS
    return output.read_text()


@dataclass
class Servers:
    plain: Server  # holds every request 0.15 s: requests overlap, and a client can be killed mid-way
    failing: Server  # answers its first two requests (after each stats reset) with 503; wants a key


@pytest.fixture(scope="module")
def servers(target: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Servers]:
    """Both servers, started together (they load while the local reference is computed)."""
    logs = tmp_path_factory.mktemp("servers")
    started = Servers(
        plain=Server(target, logs / "plain.jsonl", "--delay", "0.15"),
        failing=Server(target, logs / "failing.jsonl", "--fail-first", "2", api_key="secret-key-123"),
    )
    yield started
    started.plain.stop()
    started.failing.stop()


def test_answers_equal_the_local_backend_within_the_concurrency(
    servers: Servers, target: Path, data: Path, expected: str, tmp_path: Path
) -> None:
    server = servers.plain
    server.stats(reset=True)
    output = tmp_path / "out.jsonl"
    summary = regenerate_served(
        [data], output, _server_settings(server.url), _settings(), tokenizer_path=target
    )
    # Greedy decoding of the same prompt ids by the same fp32 weights on the CPU: the server's
    # token-by-token decoding over a KV cache agrees exactly with the local `generate`.
    assert output.read_text() == expected
    assert summary is not None and summary["records"] == RECORDS and summary["same_tokens_fraction"] is None
    stats = server.stats()
    assert stats["requests"] == summary["turns"] and stats["failed"] == 0
    assert stats["max_in_flight"] == 3  # reached, never passed

    sent = server.requests()[-summary["turns"] :]
    for entry in sent:
        request = entry["request"]
        assert request["model"] == "tiny" and request["temperature"] == 0
        assert request["chat_template_kwargs"] == THINKING_OFF
        assert entry["prompt"].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
        assert all(set(m) == {"role", "content"} for m in request["messages"])
    # Later turns are asked with the regenerated answers before them.
    records = [json.loads(line)["messages"] for line in expected.splitlines()]
    asked = {json.dumps(e["request"]["messages"]) for e in sent}
    for messages in records:
        for i, message in enumerate(messages):
            if message["role"] == "assistant":
                assert json.dumps(messages[:i]) in asked


def test_thinking_on_reaches_the_template(servers: Servers, data: Path, tmp_path: Path) -> None:
    server = servers.plain
    before = len(server.requests())
    settings = _settings(chat_template_kwargs={"enable_thinking": True})
    regenerate_served([data], tmp_path / "out.jsonl", _server_settings(server.url), settings, limit=1)
    sent = server.requests()[before:]
    assert sent and all(e["request"]["chat_template_kwargs"] == {"enable_thinking": True} for e in sent)
    assert all(e["prompt"].endswith("<|im_start|>assistant\n") for e in sent)


def test_a_request_the_server_refuses_is_a_bad_record(servers: Servers, tmp_path: Path) -> None:
    data = tmp_path / "long.jsonl"
    data.write_text(json.dumps({"messages": [{"role": "user", "content": " ".join(["Count"] * 300)}]}) + "\n")
    settings = _settings(max_new_tokens=300)  # no tokenizer here to fit it: the server's context is 512
    with pytest.raises(RegenerateError, match=r"long.jsonl:1: the server refused turn 1: HTTP 400 .*context"):
        regenerate_served([data], tmp_path / "a.jsonl", _server_settings(servers.plain.url), settings)
    skip = _settings(max_new_tokens=300, on_bad_record="skip")
    # Skipped, it leaves no record to write: OUTPUT is not written, never an empty file.
    with pytest.raises(
        RegenerateError, match=r"no record left .*every record was skipped \(1 x the server refused"
    ):
        regenerate_served([data], tmp_path / "b.jsonl", _server_settings(servers.plain.url), skip)
    assert not (tmp_path / "b.jsonl").exists()


@pytest.mark.slow
def test_a_killed_run_resumes_without_duplicates_or_gaps(
    servers: Servers, data: Path, target: Path, expected: str, tmp_path: Path
) -> None:
    server = servers.plain
    output = tmp_path / "out.jsonl"
    part = tmp_path / "out.jsonl.parts" / "part-00000.jsonl"
    cmd = [sys.executable, "-m", "dflash_mp.regenerate", "--input", str(data), "--output", str(output)]
    cmd += ["--server", server.url, "--target", str(target), "--concurrency", "1", "--thinking", "off"]
    cmd += ["--max-length", "128", "--max-new-tokens", str(NEW_TOKENS), "--on-length", "keep"]
    cmd += ["--min-finished-fraction", "0"]
    client = subprocess.Popen(cmd, cwd=REPO, env=job_env(), stderr=subprocess.PIPE, text=True)
    while not (part.exists() and part.read_text().count("\n") >= 2):
        assert client.poll() is None, client.stderr.read()
        time.sleep(0.02)
    client.send_signal(signal.SIGKILL)
    client.wait()
    client.stderr.close()
    assert not output.exists()
    written = set(read_parts(part.parent))
    assert 2 <= len(written) < RECORDS

    before = len(server.requests())
    settings = _server_settings(server.url, concurrency=1)
    regenerate_served([data], output, settings, _settings(), tokenizer_path=target)  # the same job
    assert output.read_text() == expected
    indices = [json.loads(line)["index"] for line in part.read_text().splitlines()]
    assert sorted(indices) == list(range(RECORDS))  # each record once: no duplicate, none missed
    first_prompts = {e["request"]["messages"][-1]["content"] for e in server.requests()[before:]}
    records = [json.loads(line)["messages"] for line in expected.splitlines()]
    for i in written:  # what was written before the kill is not asked again
        assert next(m["content"] for m in records[i] if m["role"] == "user") not in first_prompts


def test_retries_failures_and_the_api_key(
    servers: Servers, data: Path, target: Path, expected: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    server = servers.failing
    settings = _settings()
    monkeypatch.setenv(API_KEY_ENV, "wrong-key-456")
    with pytest.raises(RegenerateError, match=rf"HTTP 401 .*check the API key in \${API_KEY_ENV}") as error:
        regenerate_served(
            [data], tmp_path / "x.jsonl", _server_settings(server.url, api_key_env=API_KEY_ENV), settings
        )
    assert "wrong-key-456" not in str(error.value)
    monkeypatch.setenv(API_KEY_ENV, "secret-key-123")

    # Two 503s, then answers: two retries suffice.
    server.stats(reset=True)
    one_at_a_time = _server_settings(server.url, api_key_env=API_KEY_ENV, concurrency=1, max_retries=2)
    out = tmp_path / "a" / "out.jsonl"
    summary = regenerate_served([data], out, one_at_a_time, settings, tokenizer_path=target)
    assert out.read_text() == expected
    assert server.stats(reset=True) == {"requests": summary["turns"] + 2, "failed": 2, "max_in_flight": 1}

    # One retry does not: record 0 fails, the others are written, OUTPUT is not.
    out = tmp_path / "b" / "out.jsonl"
    one_retry = _server_settings(server.url, api_key_env=API_KEY_ENV, concurrency=1, max_retries=1)
    with pytest.raises(RecordsFailed, match=r"1 record\(s\) failed .*prompts.jsonl:1: HTTP 503"):
        regenerate_served([data], out, one_retry, settings, tokenizer_path=target)
    assert not out.exists() and sorted(read_parts(out.parent / "out.jsonl.parts")) == list(range(1, RECORDS))

    # Skipped instead (the 503s again): OUTPUT without record 0; a rerun asks for record 0 only.
    server.stats(reset=True)
    one_retry.on_failed_request = "skip"
    summary = regenerate_served([data], out, one_retry, settings, tokenizer_path=target)
    assert summary is not None and summary["failed"] == 1
    assert out.read_text().splitlines() == expected.splitlines()[1:]
    asked = server.stats()["requests"]
    regenerate_served([data], out, one_retry, settings, tokenizer_path=target)
    assert out.read_text() == expected
    first_turns = sum(m["role"] == "assistant" for m in json.loads(expected.splitlines()[0])["messages"])
    assert server.stats()["requests"] == asked + first_turns


def test_a_run_stops_when_every_record_fails(servers: Servers, data: Path, tmp_path: Path) -> None:
    # The server holds every request 0.15 s, past this client's timeout: every request fails.
    impatient = _server_settings(servers.plain.url, concurrency=1, max_retries=0, timeout=0.05)
    with pytest.raises(
        RecordsFailed, match=r"stopped after 3 records in a row failed: .* looks down .*timed out"
    ):
        regenerate_served([data], tmp_path / "out.jsonl", impatient, _settings())
    # Two failed in a row (2 x concurrency): only the one record already queued was sent after them.
    assert not (tmp_path / "out.jsonl").exists() and read_parts(tmp_path / "out.jsonl.parts") == {}


# ----------------------------------------------------------------------------------------- no server


def test_an_unreachable_server_is_a_clear_error(data: Path, tmp_path: Path) -> None:
    with socket.socket() as probe:  # a port nothing listens on once this closes
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    settings = _server_settings(f"http://127.0.0.1:{port}/v1", max_retries=1)
    with pytest.raises(
        RegenerateError, match=rf"cannot reach the server: .*127.0.0.1:{port}/v1/models.*after 2 attempts"
    ):
        regenerate_served([data], tmp_path / "out.jsonl", settings, _settings())


def test_target_is_required_unless_embedded_is_named(data: Path, tmp_path: Path, capsys) -> None:
    args = ["--input", str(data), "--output", str(tmp_path / "out.jsonl")]
    assert main(args) == 2
    assert "--target is required" in capsys.readouterr().err
    assert main([*args, "--target", str(tmp_path / "nowhere")]) == 2
    assert "no such directory" in capsys.readouterr().err
    assert (
        main(
            [*args, "--target", "embedded", "--limit", "1", "--max-length", "128", "--max-new-tokens", "2"]
            + ["--on-length", "keep", "--min-finished-fraction", "0"]
        )
        == 0
    )
    assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize(
    "options, message",
    [
        (["--chat-template-kwargs", "{enable_thinking: false}"], "is not JSON"),
        (["--chat-template-kwargs", "[1]"], "must be a JSON object"),
        (["--server", "localhost:8000", "--concurrency", "0"], "--concurrency=0: must be >= 1; --server="),
        (["--server", "http://localhost:8000", "--round-trip-safe"], "--round-trip-safe needs the local"),
    ],
)
def test_bad_options_are_clear_errors(options, message, data: Path, tmp_path: Path, capsys) -> None:
    args = ["--input", str(data), "--output", str(tmp_path / "out.jsonl"), *options]
    assert main(args) == 2
    assert message in capsys.readouterr().err


def test_reasoning_is_split_off_the_answer() -> None:
    assert split_reasoning("<think>\nstep 1\n</think>\n\nanswer") == ("answer", "step 1")
    assert split_reasoning("step 1\n</think>\n\nanswer") == ("answer", "step 1")  # opened by the prompt
    assert split_reasoning("\n\nanswer", "from the server") == ("answer", "from the server")
    assert split_reasoning("plain answer") == ("plain answer", None)
    assert split_reasoning("a <think> in the middle </think> of it") == (
        "a <think> in the middle </think> of it",
        None,
    )
