"""Served acceptance (`python -m dflash_mp.eval --server URL`) against stand-in servers on localhost:
one imitates vLLM (OpenAI chat completions and Prometheus /metrics with vLLM 0.33.0's counter names
and labels), one SGLang (0.5.23's sglext.spec_tokens_details), both with counts the tests choose.
They check the numbers printed, the warning when served and local tau differ, and the errors."""

from __future__ import annotations

import argparse
import json
import socket
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from omegaconf import OmegaConf

from dflash_mp.embedded import embedded_path
from dflash_mp.eval import main
from dflash_mp.evaluation.prompts import prompt_records
from dflash_mp.evaluation.served_acceptance import ServedAcceptance, measure_served, prometheus_samples
from dflash_mp.evaluation.served_comparison import served_summary
from dflash_mp.export.hf import export_drafter
from dflash_mp.training.trainer import build_drafter
from tests.drafters import embedded_config

BLOCK_SIZE = 8  # the embedded config's
TARGET = str(embedded_path("target"))  # what the evaluation uses with an export outside a run
EVAL_FILE = str(embedded_path("data/eval.jsonl"))
# Accepted drafts of each verify round, request by request (cycled): tau = 1 + 22 / 8 = 3.75 over 3 prompts.
SCRIPT = [[3, 0, 7], [1, 1]]


class FakeEngine(ThreadingHTTPServer):
    """A stand-in vLLM or SGLang server. Request i reports the rounds of script[i % len(script)]."""

    def __init__(self, engine: str, script: list[list[int]], **options) -> None:
        super().__init__(("127.0.0.1", 0), _Handler)
        self.engine, self.script = engine, script
        self.model = options.get("model", "tiny")
        self.root = options.get("root", TARGET)
        self.drafted_per_round = options.get("drafted_per_round", BLOCK_SIZE - 1)
        self.drafter = options.get("drafter", True)
        self.metrics_model = options.get("metrics_model", self.model)
        self.prompt_tokens = options.get("prompt_tokens", [11])
        self.lag_reads = options.get(
            "lag_reads", 0
        )  # /metrics reads after a reply that still show old counts
        self.extra_tokens = options.get("extra_tokens", 0)  # other clients' tokens counted per request
        self.requests: list[dict] = []
        # vLLM: per data-parallel engine, counts from traffic before the test's.
        self.counters = [self._zero(drafts=100, accepted=150, generation=900) for _ in range(2)]
        self.pending: list[tuple[int, dict]] = []
        self.reads_since_reply = 0
        self.lock = threading.Lock()

    def _zero(self, drafts: int = 0, accepted: int = 0, generation: int = 0) -> dict:
        per_position = [drafts // (k + 1) for k in range(self.drafted_per_round)]
        return dict(drafts=drafts, draft_tokens=drafts * self.drafted_per_round, accepted=accepted,
                    per_position=per_position, generation=generation)  # fmt: skip

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def chat(self, body: dict) -> dict:
        with self.lock:
            index = len(self.requests)
            self.requests.append(body)
        rounds = self.script[index % len(self.script)]
        completion = 1 + sum(a + 1 for a in rounds)  # the prefill's token, then accepted + bonus per round
        prompt_tokens = self.prompt_tokens[index % len(self.prompt_tokens)]
        reply = {
            "id": f"chatcmpl-{index}",
            "object": "chat.completion",
            "model": body["model"],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "..."}, "finish_reason": "length"}
            ],
            "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": completion},
        }
        histogram = [sum(a == j for a in rounds) for j in range(max(rounds) + 1)]
        if self.engine == "sglang" and self.drafter and body.get("return_spec_tokens_details"):
            reply["sglext"] = {"spec_tokens_details": {
                "spec_verify_ct": len(rounds), "spec_num_correct_drafts": sum(rounds),
                "spec_num_proposed_drafts": len(rounds) * self.drafted_per_round,
                "spec_accept_length": completion / len(rounds), "spec_correct_drafts_histogram": histogram,
            }}  # fmt: skip
        if self.engine == "vllm":
            step = self._zero(len(rounds), sum(rounds), completion + self.extra_tokens)
            step["per_position"] = [sum(a > k for a in rounds) for k in range(self.drafted_per_round)]
            with self.lock:
                self.pending.append((index % 2, step))
                self.reads_since_reply = 0
        return reply

    def metrics(self) -> str:
        with self.lock:
            if self.reads_since_reply >= self.lag_reads:
                for engine, step in self.pending:
                    totals = self.counters[engine]
                    for key in ("drafts", "draft_tokens", "accepted", "generation"):
                        totals[key] += step[key]
                    totals["per_position"] = [
                        a + b for a, b in zip(totals["per_position"], step["per_position"], strict=True)
                    ]
                self.pending.clear()
            self.reads_since_reply += 1
            counters = [dict(c) for c in self.counters]
        # prometheus_client's text format: HELP/TYPE lines, labels sorted by name, *_created samples.
        lines = ["# HELP vllm:num_requests_running Number of requests in model execution batches."]
        lines += ["# TYPE vllm:num_requests_running gauge", 'vllm:num_requests_running{engine="0"} 0.0']
        names = {"generation": "vllm:generation_tokens"}
        if self.drafter:
            names.update(drafts="vllm:spec_decode_num_drafts", draft_tokens="vllm:spec_decode_num_draft_tokens",
                         accepted="vllm:spec_decode_num_accepted_tokens")  # fmt: skip
        for key, name in names.items():
            lines += [f"# HELP {name}_total Count.", f"# TYPE {name}_total counter"]
            for engine, totals in enumerate(counters):
                labels = f'engine="{engine}",model_name="{self.metrics_model}"'
                lines += [
                    f"{name}_total{{{labels}}} {float(totals[key])}",
                    f"{name}_created{{{labels}}} 1.7e+09",
                ]
        if self.drafter:
            name = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
            for engine, totals in enumerate(counters):
                for position, value in enumerate(totals["per_position"]):
                    labels = f'engine="{engine}",model_name="{self.metrics_model}",position="{position}"'
                    lines.append(f"{name}{{{labels}}} {float(value)}")
        return "\n".join(lines) + "\n"


class _Handler(BaseHTTPRequestHandler):
    server: FakeEngine

    def _send(self, status: int, payload: str, content_type: str = "application/json") -> None:
        data = payload.encode()
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        if self.path == "/v1/models":
            card = {
                "id": self.server.model,
                "object": "model",
                "owned_by": self.server.engine,
                "root": self.server.root,
            }
            self._send(200, json.dumps({"object": "list", "data": [card]}))
        elif self.path == "/metrics" and self.server.engine == "vllm":
            self._send(200, self.server.metrics(), "text/plain; version=0.0.4")
        else:
            self._send(404, json.dumps({"detail": "Not Found"}))

    def do_POST(self) -> None:  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._send(200, json.dumps(self.server.chat(body)))

    def log_message(self, *args) -> None:
        pass


@pytest.fixture
def serve() -> Iterator:
    servers = []

    def start(engine: str, script: list[list[int]] = SCRIPT, **options) -> FakeEngine:
        server = FakeEngine(engine, script, **options)
        threading.Thread(target=server.serve_forever, args=(0.05,), daemon=True).start()
        servers.append(server)
        return server

    yield start
    for server in servers:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def export(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An untrained drafter for the embedded target, exported (tau near 1: it seldom guesses right)."""
    return export_drafter(build_drafter(embedded_config()), tmp_path_factory.mktemp("drafter") / "export")


def _served_only(export: Path, url: str, *flags: str) -> int:
    return main(
        [
            str(export),
            "--server",
            url,
            "--served-only",
            "--num-prompts",
            "3",
            "--max-new-tokens",
            "16",
            *flags,
        ]
    )


def _per_position(script: list[list[int]], requests: int) -> list[float]:
    rounds = [a for i in range(requests) for a in script[i % len(script)]]
    return [sum(a > k for a in rounds) / len(rounds) for k in range(BLOCK_SIZE - 1)]


def _printed_rates(out: str) -> list[float]:
    table = out.split("block index")[1].splitlines()[1:]
    return [float(line.split()[1]) for line in table if line.split() and line.split()[0].isdigit()]


# ----------------------------------------------------------------------------------------- the numbers


def test_vllm_counters_are_read_before_and_after_and_summed_over_engines(
    export: Path, serve, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    server = serve("vllm", lag_reads=2)  # the counters trail the replies by two reads: waited for
    out = tmp_path / "served.json"
    assert _served_only(export, server.url, "--out", str(out)) == 0
    printed = capsys.readouterr().out
    assert "served by vllm" in printed and "served tau (1 + accepted / rounds)   3.750" in printed
    assert "verify rounds 8, draft tokens 56 (7.00 per round), accepted 22" in printed
    assert _printed_rates(printed) == pytest.approx(_per_position(SCRIPT, 3), abs=5e-4)
    assert "check:" not in printed  # the counters caught up, drafts match the block size
    entry = json.loads(out.read_text())["served"]
    assert entry["tau"] == 3.75 and entry["engine"] == "vllm" and "local_tau" not in entry
    # What was asked: the eval prompts' messages, the max tokens, greedy with plain sampling.
    messages = [m for _, m in prompt_records([EVAL_FILE], 3)]
    assert [r["messages"] for r in server.requests] == messages
    for request in server.requests:
        assert request["model"] == "tiny" and request["max_tokens"] == 16 and request["temperature"] == 0.0
        assert (request["top_p"], request["top_k"], request["min_p"]) == (1.0, -1, 0.0)
        assert "seed" not in request and "return_spec_tokens_details" not in request


def test_sglang_details_are_summed_per_request(export: Path, serve, capsys: pytest.CaptureFixture) -> None:
    server = serve("sglang")
    assert _served_only(export, server.url + "/v1/") == 0  # a /v1 suffix is accepted
    printed = capsys.readouterr().out
    assert "served by sglang" in printed and "served tau (1 + accepted / rounds)   3.750" in printed
    # SGLang's own number counts the prefill's token: (14 + 5 + 14) tokens / 8 rounds.
    assert "SGLang's spec_accept_length         4.125" in printed
    assert _printed_rates(printed) == pytest.approx(_per_position(SCRIPT, 3), abs=5e-4)
    assert all(request["return_spec_tokens_details"] is True for request in server.requests)


def test_measurement_notes_what_it_sees(export: Path, serve, capsys: pytest.CaptureFixture) -> None:
    # A server drafting a whole block per round, for another model path, among other clients' requests.
    server = serve("vllm", drafted_per_round=BLOCK_SIZE, root="/models/Qwen3-8B", extra_tokens=5)
    assert _served_only(export, server.url) == 0
    printed = capsys.readouterr().out
    assert (
        f"the server drafts 8.00 tokens per round, the drafter's block size {BLOCK_SIZE} proposes 7"
        in printed
    )
    assert "the server serves 'tiny' (root '/models/Qwen3-8B')" in printed
    assert "other clients' requests were counted too" in printed


def test_requests_carry_the_runs_template_kwargs_and_seeds(serve) -> None:
    server = serve("sglang")
    args = argparse.Namespace(
        server=server.url, served_only=True, tolerance=0.1, served_model="tiny", engine="auto",
        num_prompts=2, max_new_tokens=8, temperature=0.7, seed=5,
    )  # fmt: skip
    run_data = OmegaConf.create(
        {"chat_template_kwargs": {"enable_thinking": False}, "chat_template": "t.jinja"}
    )
    served = measure_served(args, [EVAL_FILE], run_data, TARGET, BLOCK_SIZE)
    assert [r["chat_template_kwargs"] for r in server.requests] == [{"enable_thinking": False}] * 2
    assert [(r["seed"], r["temperature"], r["max_tokens"]) for r in server.requests] == [
        (5, 0.7, 8),
        (6, 0.7, 8),
    ]
    assert any("data.chat_template=t.jinja" in note for note in served.notes)


# ----------------------------------------------------------------------------------------- beside local tau


def test_served_beside_local_tau_warns_only_when_they_differ(
    export: Path, serve, tmp_path: Path, capsys: pytest.CaptureFixture
) -> None:
    common = ["--num-prompts", "2", "--max-new-tokens", "16"]
    assert main([str(export), *common, "--out", str(tmp_path / "local.json")]) == 0
    local = json.loads((tmp_path / "local.json").read_text())
    # A server whose rounds are exactly the local ones, prompts of the same lengths: they agree.
    script = [[n - 1 for n in p["acceptance_lengths"]] for p in local["prompts"]]
    lengths = [p["prompt_tokens"] for p in local["prompts"]]
    agreeing = serve("vllm", script, prompt_tokens=lengths)
    capsys.readouterr()
    assert main([str(export), *common, "--server", agreeing.url, "--out", str(tmp_path / "a.json")]) == 0
    captured = capsys.readouterr()
    entry = json.loads((tmp_path / "a.json").read_text())["served"]
    assert entry["tau"] == pytest.approx(local["tau"]) and entry["agrees"] is True
    assert f"local tau                            {local['tau']:.3f}" in captured.out
    assert "WARNING" not in captured.err and "check:" not in captured.out

    # Every round accepting the whole block, prompts two tokens longer: warned, with the causes,
    # and a failed check (exit 1) once the JSON and the report are written.
    differing = serve("sglang", [[BLOCK_SIZE - 1] * 3], prompt_tokens=[n + 2 for n in lengths])
    assert main([str(export), *common, "--server", differing.url, "--out", str(tmp_path / "d.json")]) == 1
    captured = capsys.readouterr()
    entry = json.loads((tmp_path / "d.json").read_text())["served"]
    assert entry["tau"] == BLOCK_SIZE and entry["agrees"] is False
    assert entry["relative_difference"] == pytest.approx(BLOCK_SIZE / local["tau"] - 1)
    assert f"WARNING: served tau 8.000 and local tau {local['tau']:.3f} differ" in captured.err
    for cause in ("2 of 2 prompts have another length", "thinking mode", "top_p", "target_layer_ids",
                  "chat template", "num_speculative_tokens", "dtype"):  # fmt: skip
        assert cause in captured.err, cause
    # A wide enough tolerance accepts the same difference.
    wide = ["--server", differing.url, "--tolerance", "10", "--out", str(tmp_path / "w.json")]
    assert main([str(export), *common, *wide]) == 0
    assert "WARNING" not in capsys.readouterr().err


def test_the_tolerance_is_relative_to_local_tau() -> None:
    served = ServedAcceptance("vllm", "http://x", "m", 8, 10, 70, 5, [5], ["f:1"], [3], [16])  # tau 1.5
    assert served_summary(served, {"tau": 1.4, "acceptance_rate": []}, 0.1)["agrees"] is True  # 7.1%
    assert served_summary(served, {"tau": 1.25, "acceptance_rate": []}, 0.1)["agrees"] is False  # 20%
    assert served_summary(served, {"tau": 1.25, "acceptance_rate": []}, 0.25)["agrees"] is True


def test_prometheus_text_is_parsed_with_labels_and_escapes() -> None:
    text = (
        "# HELP vllm:x_total A counter.\n# TYPE vllm:x_total counter\n"
        'vllm:x_total{engine="0",model_name="a \\"b\\" c\\\\d"} 3.0\n'
        "vllm:x_created 1.7e+09\nplain 2 1700000000\n"
    )
    assert prometheus_samples(text) == [
        ("vllm:x_total", {"engine": "0", "model_name": 'a "b" c\\d'}, 3.0),
        ("vllm:x_created", {}, 1.7e9),
        ("plain", {}, 2.0),
    ]


# ----------------------------------------------------------------------------------------- errors


def test_an_unreachable_server_is_named_with_how_to_start_it(
    export: Path, capsys: pytest.CaptureFixture
) -> None:
    with socket.socket() as probe:  # a port nothing listens on
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    for flags in (["--served-only"], []):  # before the local target is loaded
        assert main([str(export), "--server", url, *flags]) == 2
        err = capsys.readouterr().err
        assert f"cannot reach the server at {url}" in err and "vllm serve" in err
        assert "docs/evaluation-and-serving.md, 'Serve it'" in err  # where that section is
    assert main([str(export), "--server", "localhost:8000"]) == 2
    assert "give an http:// or https:// URL" in capsys.readouterr().err


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
def test_a_server_without_the_drafter_is_an_error(
    engine: str, export: Path, serve, capsys: pytest.CaptureFixture
) -> None:
    server = serve(engine, drafter=False)
    assert _served_only(export, server.url) == 2
    err = capsys.readouterr().err
    assert "runs without the drafter" in err and "--speculative-algorithm" in err


def test_model_and_engine_mismatches_are_errors(export: Path, serve, capsys: pytest.CaptureFixture) -> None:
    server = serve("vllm", metrics_model="another-model")
    assert _served_only(export, server.url) == 2
    assert "model name mismatch" in (err := capsys.readouterr().err) and "['another-model']" in err
    assert _served_only(export, server.url, "--served-model", "other") == 2
    assert "model name mismatch: --served-model 'other' is not among ['tiny']" in capsys.readouterr().err
    assert _served_only(export, server.url, "--engine", "sglang") == 2
    assert "--engine sglang, but" in capsys.readouterr().err


def test_bad_options_are_errors(export: Path, serve, capsys: pytest.CaptureFixture) -> None:
    assert main([str(export), "--served-only"]) == 2
    assert "--served-only needs --server" in capsys.readouterr().err
    assert _served_only(export, serve("vllm").url, "--tolerance", "-0.1") == 2
    assert "--tolerance=-0.1: must be >= 0" in capsys.readouterr().err
