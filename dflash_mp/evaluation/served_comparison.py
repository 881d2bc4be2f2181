"""Served acceptance beside the local evaluation: the comparison, its console report and the usual
causes of a disagreement (docs/evaluation-and-serving.md, "Served acceptance"); `served_acceptance` measures it."""

from __future__ import annotations

import json
import sys
from dataclasses import asdict
from typing import Any

from dflash_mp.evaluation.served_acceptance import COUNTED_BY, ServedAcceptance

USUAL_CAUSES = (
    "thinking mode on/off: requests carry the run's data.chat_template_kwargs, but a server default "
    "(--default-chat-template-kwargs) fills in what the run leaves out",
    "sampling: requests ask for plain sampling at --temperature (top_p 1, top_k -1, min_p 0); "
    "vLLM's --override-generation-config or a server-side sampling default overrides it",
    "target layer ids: training feeds the drafter the outputs of the layers in dflash_config."
    "target_layer_ids (HF hidden_states[i + 1]); an engine reading another offset feeds it other features",
    "chat template: the server renders the messages with its own template (--chat-template), the "
    "local evaluation with the run's data.chat_template or the target's",
    "draft tokens vs block size: vLLM needs num_speculative_tokens = block_size - 1, SGLang "
    "--speculative-num-draft-tokens = block_size",
    "target revision or dtype: the server must serve the checkpoint the drafter was trained on; the "
    "local evaluation runs bf16 on a GPU and fp32 on a CPU (--dtype picks)",
)


def relative_difference(served_tau: float, local_tau: float) -> float:
    """|served - local| / local: 0.1 is a 10% difference."""
    return abs(served_tau - local_tau) / local_tau if local_tau > 0 else float("inf")


def served_summary(served: ServedAcceptance, local: dict | None, tolerance: float) -> dict[str, Any]:
    """The served counts, and beside a local evaluation's result the comparison, as plain JSON."""
    entry = asdict(served)
    entry.update(
        tau=served.tau,
        draft_tokens_per_round=served.draft_tokens / served.drafts,
        acceptance_rate=[a / served.drafts for a in served.accepted_per_position],
    )
    if local is None:
        return entry
    local_lengths = {p["source"]: p["prompt_tokens"] for p in local.get("prompts", [])}
    differing = [
        (source, count, local_lengths[source])
        for source, count in zip(served.sources, served.prompt_tokens, strict=True)
        if local_lengths.get(source, count) != count
    ]
    if differing:  # the same messages rendered to other tokens
        source, count, ours = differing[0]
        entry["notes"].append(
            f"{len(differing)} of {len(served.sources)} prompts have another length on the server (e.g. "
            f"{source}: {count} tokens served, {ours} local): the chat template or its kwargs differ"
        )
    difference = relative_difference(served.tau, local["tau"])
    entry.update(
        local_tau=local["tau"],
        local_acceptance_rate=local["acceptance_rate"],
        relative_difference=difference,
        tolerance=tolerance,
        agrees=difference <= tolerance,
    )
    return entry


def print_served(entry: dict[str, Any]) -> None:
    """The summary for the console; the warning, when served and local tau disagree, on stderr."""
    lines = [
        f"served by {entry['engine']} at {entry['url']} (model {entry['model']}), {len(entry['sources'])} prompts",
        f"  counters: {COUNTED_BY[entry['engine']]}",
        f"  verify rounds {entry['drafts']}, draft tokens {entry['draft_tokens']} "
        f"({entry['draft_tokens_per_round']:.2f} per round), accepted {entry['accepted_tokens']}",
        f"  served tau (1 + accepted / rounds)   {entry['tau']:.3f}",
    ]
    if entry["engine_accept_length"] is not None:
        lines.append(
            f"  SGLang's spec_accept_length         {entry['engine_accept_length']:.3f} (prefill token in)"
        )
    if "local_tau" in entry:
        lines.append(f"  local tau                            {entry['local_tau']:.3f}")
        lines.append(f"  relative difference                  {entry['relative_difference']:.1%}")
    local_rates = entry.get("local_acceptance_rate", [])
    lines.append("  block index   served rate" + ("   local rate" if local_rates else ""))
    for k, rate in enumerate(entry["acceptance_rate"]):
        lines.append(
            f"  {k + 1:>11}   {rate:11.3f}" + (f"   {local_rates[k]:10.3f}" if k < len(local_rates) else "")
        )
    print("\n".join(lines + [f"  check: {note}" for note in entry["notes"]]))
    if entry.get("agrees") is False:
        causes = "\n".join(f"  - {cause}" for cause in [*entry["notes"], *USUAL_CAUSES])
        print(
            f"WARNING: served tau {entry['tau']:.3f} and local tau {entry['local_tau']:.3f} differ by "
            f"{entry['relative_difference']:.1%}, more than the tolerance of {entry['tolerance']:.1%} "
            f"(--tolerance). Usual causes:\n{causes}",
            file=sys.stderr,
        )


def report_served_only(served: ServedAcceptance, args: Any) -> int:
    """--served-only: print the served counts (and write them to --out, if given)."""
    entry = served_summary(served, None, args.tolerance)
    print_served(entry)
    if args.out is not None:
        args.out.write_text(json.dumps({"served": entry}, indent=2) + "\n")
        print(f"wrote {args.out}")
    return 0
