"""The DSpark fields' checks (model.arch=dspark; docs/drafter.md, DSpark), for `validate`, and
what a DSpark run asks of the target ranks: its normed last hidden state, the teacher's."""

from __future__ import annotations

import math
from typing import Any

from dflash_mp.models.dspark_fields import DSPARK_FIELDS, MARKOV_HEAD_TYPES

ALPHAS = ("dspark_ce_alpha", "dspark_kl_alpha", "dspark_tv_alpha", "dspark_confidence_alpha")


def _number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def dspark_fields(m: Any) -> dict[str, Any]:
    """The drafter config's DSpark fields (`DSPARK_FIELDS`) from model.*."""
    return {key: getattr(m, key) for key in DSPARK_FIELDS}


def needs_teacher(m: Any) -> bool:
    """Whether the loss reads the target's distribution: the KL and TV terms and the confidence
    head's target (1 - TV) do; the CE on the data token alone does not."""
    return m.arch == "dspark" and bool(m.dspark_kl_alpha or m.dspark_tv_alpha or m.enable_confidence_head)


def feature_layer_ids(layer_ids: list[int], num_layers: int, m: Any) -> list[int]:
    """The target layers whose outputs the target ranks send: the drafter's `layer_ids`, and for a
    DSpark loss that needs it the last layer (its output is the normed last hidden state, from which
    the drafter rank's copy of the LM head makes the teacher's logits)."""
    return [*layer_ids, num_layers - 1] if needs_teacher(m) else list(layer_ids)


def dspark_problems(cfg: Any) -> list[str]:
    """What is wrong with the DSpark fields when model.arch=dspark, each naming the key and the fix."""
    m = cfg.model
    if m.arch != "dspark":
        return []
    problems = []
    rank = m.markov_rank
    if not (isinstance(rank, int) and not isinstance(rank, bool) and rank >= 0):
        problems.append(
            f"model.markov_rank={rank!r}: must be an integer >= 0 (256 in the references; 0: no Markov head)"
        )
    if m.markov_head_type not in MARKOV_HEAD_TYPES:
        problems.append(
            f"model.markov_head_type={m.markov_head_type!r}: must be one of {', '.join(MARKOV_HEAD_TYPES)}"
        )
    for name in ("enable_confidence_head", "confidence_head_with_markov", "sample_from_anchor"):
        if not isinstance(getattr(m, name), bool):
            problems.append(f"model.{name}={getattr(m, name)!r}: must be true or false")
    if m.enable_confidence_head and m.confidence_head_with_markov and rank == 0:
        problems.append(
            "model.confidence_head_with_markov=true reads the Markov head's embedding, but model.markov_rank=0: "
            "set model.markov_rank > 0 or model.confidence_head_with_markov=false"
        )
    for name in ALPHAS:
        if not (_number(getattr(m, name)) and getattr(m, name) >= 0):
            problems.append(
                f"model.{name}={getattr(m, name)!r}: must be a number >= 0 (0 leaves the term out)"
            )
    if not problems and not (m.dspark_ce_alpha or m.dspark_kl_alpha or m.dspark_tv_alpha):
        problems.append(
            "model.dspark_ce_alpha, model.dspark_kl_alpha and model.dspark_tv_alpha are all 0: nothing trains "
            "the draft logits; set one > 0 (the recipe: dspark_ce_alpha=0.1 dspark_tv_alpha=1.8)"
        )
    if m.enable_confidence_head and m.dspark_confidence_alpha == 0:
        problems.append(
            "model.dspark_confidence_alpha=0 with model.enable_confidence_head=true: the head would never train "
            "(and data-parallel ranks would wait for its gradient); set model.enable_confidence_head=false or an alpha > 0"
        )
    # DSpark sits on the plain DFlash backbone in both references; DFlash 2's convolutions are not
    # part of it, so a conv setting here would be silently ignored.
    for name, default in (("conv_kernel_size", 2), ("conv_group_size", 16)):
        if getattr(m, name) != default:
            problems.append(
                f"model.{name}={getattr(m, name)!r} is a DFlash 2 setting: DSpark (speculators and ModelOpt alike) "
                "runs on the DFlash backbone without the convolutions; drop it, or use model.arch=dflash2"
            )
    return problems
