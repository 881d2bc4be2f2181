"""The drafter memory that grows with the vocabulary, per `model.arch` (memory.py's drafter terms):

- parameters: DSpark's heads (objective/dspark_loss.py's `markov_head`, `confidence_head`) and
  XPress's refiner each hold a rank-r embedding of the vocabulary and a rank-r projection to it,
  fp32 parameters with AdamW's state (training/working_weights.py gives them no bf16 copies);
- the loss's work over the vocabulary:
  - dflash, dflash2: one chunk of the chunked LM-head CE's logits (objective/lm_head_loss.py,
    2048 rows or train.vocabulary_chunk_rows);
  - dspark: one chunk of whole blocks (objective/dspark_rows.py, the gradient taken in the
    forward): the draft's logits, its softmax and the teacher's; the blocks per chunk are the
    code's own (models/dspark_fields.py `vocabulary_chunk_blocks`, train.vocabulary_chunk_rows);
  - xpress: one chunk of whole blocks (objective/xpress_rows.py, the gradient taken in the
    forward): the head's logits, each pass's bias and then its gradient, z_0 and one pass's logits
    in fp32 (torch path); the blocks per chunk are the code's own (models/dspark_fields.py).

Pure Python, as memory.py; the shapes and constants are memory.py's.
"""

from __future__ import annotations

from typing import Any

from dflash_mp.models.dspark_fields import vocabulary_chunk_blocks

# The arguments are memory.py's TrainingShape `t` and Constants `c` (typed Any: memory.py imports
# this module, and the package map allows no circle, type-only imports included).
TrainingShape = Constants = Any


def head_parameters(t: TrainingShape) -> int:
    """fp32 parameters of DSpark's heads or XPress's refiner (0 for DFlash and DFlash 2)."""
    h, v, b = t.target.hidden, t.target.vocab, t.block_size
    if t.arch == "dspark":
        r = t.markov_rank
        mixing = {"gated": (h + r) * r + r, "rnn": (2 * r + h) * 3 * r + 3 * r}.get(t.markov_head_type, 0)
        confidence = h + (r if t.confidence_head_with_markov else 0) + 1 if t.confidence_head else 0
        return 2 * v * r + mixing + confidence
    if t.arch == "xpress":
        r = t.xpress_rank
        # token_embed, readout; down_h, down_g; in_proj; the mixer; the MLP's gate, up and down
        return 2 * v * r + 2 * h * r + 3 * r * r + r * b * b + 3 * r * r * t.xpress_mlp_ratio
    return 0


def xpress_ce_passes(consistency_weight: float, consistency_passes: int, base_anchor_weight: float) -> int:
    """The passes whose gradient XPress's loss holds per chunk: the teacher-forced one, each
    consistency round (with a weight), the base anchor (with a weight), as
    objective/xpress_rows.py `XPressRowOptions.pass_weights` lists them."""
    rounds = consistency_passes if consistency_weight > 0 and consistency_passes > 0 else 0
    return 1 + rounds + (1 if base_anchor_weight > 0 else 0)


def loss_rows(t: TrainingShape) -> tuple[int, str]:
    """(the rows the loss reads a hidden state of, their formula): DFlash's scored block indices
    1..Bs-1; every block row for DSpark (it drafts Bs tokens) and XPress (the refiner's input)."""
    blocks = t.micro_batch * t.num_anchors
    if t.arch in ("dspark", "xpress"):
        return blocks * t.block_size, "N*Bs"
    return blocks * (t.block_size - 1), "N*(Bs-1)"


def loss_chunk_rows(t: TrainingShape, c: Constants) -> int:
    """Rows of one chunk of the loss's work over the vocabulary (train.vocabulary_chunk_rows, or
    the arch's default): whole blocks for DSpark and XPress, the LM-head CE's rows otherwise."""
    if t.arch in ("dspark", "xpress"):
        return vocabulary_chunk_blocks(t.target.vocab, t.block_size, t.vocabulary_chunk_rows) * t.block_size
    return t.vocabulary_chunk_rows or c.lm_head_chunk_rows


def vocabulary_work(t: TrainingShape, c: Constants) -> tuple[str, float, str]:
    """(name, bytes, formula) of what the loss holds over the vocabulary at once (module docstring)."""
    v, chunk = t.target.vocab, loss_chunk_rows(t, c)
    rows, rows_formula = loss_rows(t)
    if t.arch == "dspark":
        return (
            "DSpark vocabulary chunk",
            min(chunk, rows) * v * c.dspark_chunk_copies * 4,
            f"min({chunk}, {rows_formula}) x V x {c.dspark_chunk_copies:g} fp32 "
            "(the draft's logits and softmax, the teacher's softmax)",
        )
    if t.arch == "xpress":
        return (
            "XPress vocabulary chunk",
            min(chunk, rows) * v * (c.xpress_chunk_bytes + t.xpress_passes * c.xpress_pass_bytes),
            f"min({chunk}, {rows_formula}) x V x ({c.xpress_chunk_bytes:g} B + {t.xpress_passes} passes "
            f"x {c.xpress_pass_bytes:g} B) (raw logits, fp32 z_0 and one pass's z; each pass's dz)",
        )
    return (
        "LM-head chunk",
        min(chunk, rows) * v * c.lm_head_bytes_per_logit,
        f"min({chunk}, {rows_formula}) x V x {c.lm_head_bytes_per_logit:g} B",
    )
