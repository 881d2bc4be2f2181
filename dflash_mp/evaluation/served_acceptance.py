"""Acceptance length as a running vLLM or SGLang server counts it, beside our tau.

    python -m dflash_mp.eval RUN_DIR | EXPORT_DIR --server http://localhost:8000 [--engine auto|vllm|sglang]
        [--served-model NAME] [--tolerance 0.1] [--served-only] [the evaluation's other options]

The evaluation prompts go one at a time to the server's /v1/chat/completions with the local
evaluation's max tokens and temperature, plain sampling (top-p 1, no top-k or min-p) and the run's
data.chat_template_kwargs. The engine's counters give its mean acceptance length as
1 + accepted drafts / verify rounds: the bonus token once per round and the prefill's token not,
as tau in `dflash_mp.evaluation.decoding`. docs/evaluation-and-serving.md ("Served acceptance") has what is compared and why they differ.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import re
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from omegaconf import OmegaConf

from dflash_mp.evaluation.prompts import EvalError, prompt_records

DEFAULT_TOLERANCE = 0.10
REQUEST_TIMEOUT_S = 600.0
COUNTERS_WAIT_S = 10.0  # how long vLLM's counters may trail the last reply
API_KEY_ENV = "OPENAI_API_KEY"

# vLLM 0.33.0: SpecDecodingProm (vllm/v1/spec_decode/metrics.py) counts these, labelled model_name (the
# first served name) and engine (one per data-parallel engine; vllm/v1/metrics/loggers.py), only with a
# speculative config and without --disable-log-stats. They count the whole server: read before and after.
VLLM_DRAFTS = "vllm:spec_decode_num_drafts_total"
VLLM_DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
VLLM_ACCEPTED = "vllm:spec_decode_num_accepted_tokens_total"
VLLM_ACCEPTED_PER_POSITION = "vllm:spec_decode_num_accepted_tokens_per_pos_total"
VLLM_GENERATION_TOKENS = "vllm:generation_tokens_total"  # recorded in the same call as the above
VLLM_SPEC_COUNTERS = (VLLM_DRAFTS, VLLM_DRAFT_TOKENS, VLLM_ACCEPTED, VLLM_ACCEPTED_PER_POSITION)

COUNTED_BY = {
    "vllm": f"{VLLM_DRAFTS} and friends at /metrics, after minus before",
    "sglang": "sglext.spec_tokens_details of each reply, summed",
}
START_HINT = (
    "start it with the drafter as docs/evaluation-and-serving.md, 'Serve it', shows (`vllm serve TARGET "
    '--speculative-config \'{..."method": "dflash"...}\'` or `python -m sglang.launch_server ... '
    "--speculative-algorithm DFLASH`) and pass its address to --server"
)


def add_served_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--server", help="URL of a vLLM or SGLang server with the drafter, to compare with")
    parser.add_argument("--engine", default="auto", choices=("auto", "vllm", "sglang"))
    parser.add_argument("--served-model", help="served model name (default: the only one the server lists)")
    parser.add_argument(
        "--tolerance",
        type=float,
        default=DEFAULT_TOLERANCE,
        help="|served/local tau - 1| above which the check fails (exit 1)",
    )
    parser.add_argument("--served-only", action="store_true", help="with --server: skip the local evaluation")


@dataclass
class ServedAcceptance:
    """What the engine counted for our prompts (sums over them)."""

    engine: str
    url: str
    model: str
    block_size: int
    drafts: int  # verify rounds that carried drafts
    draft_tokens: int
    accepted_tokens: int  # accepted drafts, bonus excluded
    accepted_per_position: list[int]  # [k]: rounds that accepted block index k+1
    sources: list[str]  # file:line of each prompt
    prompt_tokens: list[int]  # per prompt, as the server tokenized it
    completion_tokens: list[int]
    engine_accept_length: float | None = None  # SGLang's own number (prefill token included)
    notes: list[str] = field(default_factory=list)  # causes of a difference seen while measuring

    @property
    def tau(self) -> float:
        return 1 + self.accepted_tokens / self.drafts


class _Server:
    """Plain urllib requests to one server; every failure is an EvalError naming the URL."""

    def __init__(self, url: str) -> None:
        if not url.startswith(("http://", "https://")):
            raise EvalError(f"--server={url!r}: give an http:// or https:// URL, e.g. http://localhost:8000")
        self.url = url.rstrip("/").removesuffix("/v1")
        self._api_key = os.environ.get(API_KEY_ENV) or None  # never printed

    def text(self, path: str, body: dict | None = None) -> str:
        headers = {"Content-Type": "application/json"}
        if self._api_key is not None:
            headers["Authorization"] = f"Bearer {self._api_key}"
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data=data, headers=headers)
        try:
            with urllib.request.urlopen(request, timeout=REQUEST_TIMEOUT_S) as response:
                return response.read().decode("utf-8", errors="replace")
        except urllib.error.HTTPError as e:
            message = e.read().decode("utf-8", errors="replace").strip()[:300] or e.reason
            hint = f" (set ${API_KEY_ENV} to the server's API key)" if e.code in (401, 403) else ""
            raise EvalError(f"{self.url}{path}: HTTP {e.code}: {message}{hint}") from None
        except (urllib.error.URLError, OSError) as e:
            reason = getattr(e, "reason", e)
            raise EvalError(f"cannot reach the server at {self.url} ({reason}): {START_HINT}") from None

    def json(self, path: str, body: dict | None = None) -> dict:
        payload = self.text(path, body)
        with contextlib.suppress(ValueError):
            if isinstance(reply := json.loads(payload), dict):
                return reply
        raise EvalError(f"{self.url}{path}: not a JSON object: {payload[:200]!r}")


# ----------------------------------------------------------------------------------------
# reading the engines' counts

_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{(.*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')


def prometheus_samples(text: str) -> list[tuple[str, dict[str, str], float]]:
    """(name, labels, value) of every sample in Prometheus text format (comments skipped)."""
    samples = []
    for match in filter(None, map(_SAMPLE.match, text.splitlines())):
        labels = {
            key: re.sub(r"\\(.)", lambda m: "\n" if m.group(1) == "n" else m.group(1), value)
            for key, value in _LABEL.findall(match.group(2) or "")
        }
        samples.append((match.group(1), labels, float(match.group(3))))
    return samples


def read_vllm_counters(text: str, url: str, served_names: list[str]) -> dict[tuple[str, str | None], float]:
    """{(counter, position label or None): value} for `served_names`, summed over vLLM's engines."""
    samples = [s for s in prometheus_samples(text) if s[0] in (*VLLM_SPEC_COUNTERS, VLLM_GENERATION_TOKENS)]
    spec = [s for s in samples if s[0] in VLLM_SPEC_COUNTERS]
    if not spec:
        raise EvalError(
            f"{url}/metrics has no speculative-decoding counters ({VLLM_DRAFTS} and friends): the server "
            f"runs without the drafter (or with --disable-log-stats); {START_HINT}"
        )
    ours = [s for s in samples if s[1].get("model_name", served_names[0]) in served_names]
    if not any(s[0] in VLLM_SPEC_COUNTERS for s in ours):
        counted = sorted({s[1].get("model_name", "") for s in spec})
        raise EvalError(
            f"model name mismatch: {url}/metrics counts drafts for model_name {counted}, but {url}/v1/models "
            f"serves {served_names}: point --server at the vLLM server itself (not a proxy for several)"
        )
    totals: dict[tuple[str, str | None], float] = {}
    for name, labels, value in ours:
        key = (name, labels.get("position"))
        totals[key] = totals.get(key, 0.0) + value
    return totals


def _usage(reply: dict, url: str) -> tuple[int, int]:
    usage = reply.get("usage") or {}
    if "completion_tokens" not in usage:
        raise EvalError(f"{url}/v1/chat/completions: the reply has no usage counts: {reply!r:.200}")
    return int(usage.get("prompt_tokens") or 0), int(usage["completion_tokens"])


def _measure_vllm(server: _Server, names: list[str], bodies: list[dict]) -> dict[str, Any]:
    before = read_vllm_counters(server.text("/metrics"), server.url, names)
    usages = [_usage(server.json("/v1/chat/completions", body), server.url) for body in bodies]
    expected = sum(completion for _, completion in usages)
    deadline = time.monotonic() + COUNTERS_WAIT_S
    while True:  # the spec-decode counters move with generation_tokens: wait until all ours are in
        after = read_vllm_counters(server.text("/metrics"), server.url, names)
        delta = {key: value - before.get(key, 0.0) for key, value in after.items()}
        generated = delta.get((VLLM_GENERATION_TOKENS, None))
        if generated is None or generated >= expected or time.monotonic() > deadline:
            break
        time.sleep(0.1)
    notes = []
    if generated is not None and generated != expected:
        why = "other clients' requests were counted too (measure on an idle server)"
        if generated < expected:
            why = f"the counters had not caught up after {COUNTERS_WAIT_S:.0f} s"
        notes.append(f"{VLLM_GENERATION_TOKENS} rose by {generated:.0f}, our replies had {expected}: {why}")
    if not delta.get((VLLM_DRAFTS, None)):
        raise EvalError(
            f"{server.url} counted no drafts for {len(bodies)} prompt(s): the drafter never ran (raise "
            "--max-new-tokens, or read the server's log)"
        )
    positions = sorted(int(position) for name, position in delta if name == VLLM_ACCEPTED_PER_POSITION)
    return dict(
        drafts=round(delta.get((VLLM_DRAFTS, None), 0.0)),
        draft_tokens=round(delta.get((VLLM_DRAFT_TOKENS, None), 0.0)),
        accepted_tokens=round(delta.get((VLLM_ACCEPTED, None), 0.0)),
        accepted_per_position=[round(delta[(VLLM_ACCEPTED_PER_POSITION, str(k))]) for k in positions],
        usages=usages,
        notes=notes,
    )


def _measure_sglang(server: _Server, bodies: list[dict]) -> dict[str, Any]:
    # SGLang 0.5.23 adds sglext.spec_tokens_details to a reply asked for it: spec_verify_ct (verify rounds),
    # spec_num_correct_drafts (accepted drafts, bonus excluded), spec_num_proposed_drafts, the rounds per
    # number of accepted drafts, and spec_accept_length = completion_tokens / spec_verify_ct, which counts
    # the prefill's token too (_calculate_spec_decoding_metrics, sglang/srt/managers/tokenizer_manager.py;
    # sglang/srt/entrypoints/openai/utils.py). /get_server_info's average since start-up is not a count.
    drafts = draft_tokens = accepted = 0
    histogram: list[int] = []  # [j]: rounds that accepted j drafts
    usages = []
    for body in bodies:
        reply = server.json("/v1/chat/completions", {**body, "return_spec_tokens_details": True})
        usages.append(_usage(reply, server.url))
        details = (reply.get("sglext") or {}).get("spec_tokens_details")
        details = details[0] if isinstance(details, list) and details else details
        if not isinstance(details, dict):
            continue  # no verify round (SGLang leaves the details out then)
        drafts += int(details.get("spec_verify_ct", 0))
        draft_tokens += int(details.get("spec_num_proposed_drafts", 0))
        accepted += int(details.get("spec_num_correct_drafts", 0))
        for j, rounds in enumerate(details.get("spec_correct_drafts_histogram") or []):
            histogram += [0] * (j + 1 - len(histogram))
            histogram[j] += int(rounds)
    if drafts == 0:
        raise EvalError(
            f"{server.url} returned no sglext.spec_tokens_details for {len(bodies)} prompt(s): the server "
            f"runs without the drafter; {START_HINT}"
        )
    return dict(
        drafts=drafts,
        draft_tokens=draft_tokens,
        accepted_tokens=accepted,
        accepted_per_position=[sum(histogram[k + 1 :]) for k in range(len(histogram) - 1)],
        usages=usages,
        engine_accept_length=sum(c for _, c in usages) / drafts,
        notes=[],
    )


# ----------------------------------------------------------------------------------------
# measuring


def _model_and_engine(
    server: _Server, requested_model: str | None, requested_engine: str
) -> tuple[dict, str, list[str]]:
    """(the served model's card, the engine, every served name). vLLM's cards say owned_by "vllm"
    (vllm/entrypoints/serve/engine/protocol.py), SGLang's "sglang" (sglang/srt/entrypoints/openai/protocol.py)."""
    models = server.json("/v1/models").get("data")
    if not isinstance(models, list) or not models:
        raise EvalError(f"{server.url}/v1/models lists no model: {models!r:.200}")
    names = [str(m.get("id")) for m in models]
    if requested_model is not None and requested_model not in names:
        raise EvalError(f"model name mismatch: --served-model {requested_model!r} is not among {names}")
    if requested_model is None and len(models) != 1:
        raise EvalError(f"{server.url} serves {names}: pick one with --served-model")
    card = models[names.index(requested_model) if requested_model else 0]
    owners = {str(m.get("owned_by", "")).lower() for m in models}
    found = next((engine for engine in ("vllm", "sglang") if engine in owners), None)
    if requested_engine == "auto" and found is None:
        raise EvalError(f"{server.url}/v1/models does not say its engine (owned_by {owners}): pass --engine")
    if requested_engine not in ("auto", found) and found is not None:
        raise EvalError(f"--engine {requested_engine}, but {server.url} runs {found}: pass --engine {found}")
    return card, (found if requested_engine == "auto" else requested_engine), names


def _request_body(model: str, messages: list[dict], args: Any, index: int, run_data: Any) -> dict:
    # The local sampler's settings: --top-k/--top-p when given, else plain sampling (not the target's
    # generation_config, which the engines would apply by default).
    temperature = args.temperature[0] if isinstance(args.temperature, list) else (args.temperature or 0.0)
    body = dict(model=model, messages=messages, max_tokens=args.max_new_tokens or 64, temperature=temperature)
    top_k, top_p = getattr(args, "top_k", None), getattr(args, "top_p", None)
    body.update(
        top_p=1.0 if top_p is None else top_p,
        top_k=top_k or -1,
        min_p=0.0,
        **({"seed": args.seed + index} if temperature > 0 else {}),
    )
    kwargs = run_data.get("chat_template_kwargs", None)
    if kwargs:
        body["chat_template_kwargs"] = (
            OmegaConf.to_container(kwargs) if OmegaConf.is_config(kwargs) else kwargs
        )
    return body


def measure_served(
    args: Any, prompt_files: list[str], run_data: Any, target_path: str, block_size: int
) -> ServedAcceptance | None:
    """The engine's counts for the evaluation prompts; None without --server."""
    if args.server is None:
        if args.served_only:
            raise EvalError("--served-only needs --server URL")
        return None
    if not args.tolerance >= 0:
        raise EvalError(f"--tolerance={args.tolerance}: must be >= 0 (a relative difference, e.g. 0.1)")
    server = _Server(args.server)
    card, engine, names = _model_and_engine(server, args.served_model, args.engine)
    records = prompt_records(prompt_files, args.num_prompts)
    bodies = [_request_body(str(card["id"]), m, args, i, run_data) for i, (_, m) in enumerate(records)]
    # vLLM labels its counters with the first of the served names.
    measured = _measure_vllm(server, names, bodies) if engine == "vllm" else _measure_sglang(server, bodies)
    usages, notes = measured.pop("usages"), measured.pop("notes")
    if Path(target_path).name not in {Path(str(card.get(key) or "")).name for key in ("id", "root")}:
        notes.append(
            f"the server serves {card.get('id')!r} (root {card.get('root')!r}), the run's target is "
            f"{target_path}: check that it is the same checkpoint"
        )
    per_round = measured["draft_tokens"] / measured["drafts"]
    if abs(per_round - (block_size - 1)) > 1e-6:
        notes.append(
            f"the server drafts {per_round:.2f} tokens per round, the drafter's block size {block_size} "
            f"proposes {block_size - 1}: serve it with num_speculative_tokens {block_size - 1} (vLLM) or "
            f"--speculative-num-draft-tokens {block_size} (SGLang)"
        )
    if run_data.get("chat_template", ""):
        notes.append(
            f"the run renders prompts with data.chat_template={run_data.get('chat_template')}: start the "
            "server with the same template (--chat-template)"
        )
    sources = [source for source, _ in records]
    prompt_tokens, completion_tokens = (list(column) for column in zip(*usages, strict=True))
    return ServedAcceptance(
        engine, server.url, str(card["id"]), block_size, sources=sources, prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens, notes=notes, **measured,
    )  # fmt: skip
