"""Peak GPU memory of one rank, predicted from shapes alone: a colocated rank, a target rank and a
drafter rank of a split layout (`python -m dflash_mp.plan memory`, and the preflight's memory line).

A rank's peak is what stays resident for the whole job (weights, the optimizer's state, the
gradients, which live from the first backward of a step to its update) plus the larger of its
phases: the target's forward, or the drafter step (its micro-batch's features, the activations
the backward needs, one layer's backward in flight, the loss). Every term is a count of elements
from the shapes times bytes, with its constant in `Constants`: the defaults follow what the code
keeps alive (bf16 activations, fp32 masters and AdamW moments, chunked LM-head CE) with copy
counts fitted to the benchmark's measured peaks (bench/bench.py; BENCHMARKS.md, "Long rows"), so
a measured peak that disagrees is fixed by changing a constant, not the formulas.

Imports nothing heavy: the shapes come from dflash_mp.plan.costs (a config.json's numbers).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from dflash_mp.plan.costs import ModelShape, layer_params, target_layer_params
from dflash_mp.plan.memory_heads import head_parameters, loss_rows, vocabulary_work

GIB = 2**30
BF16, FP32 = 2, 4


@dataclass(frozen=True)
class Constants:
    """The model's adjustable numbers: bytes per parameter, copies of a width kept per token."""

    # Drafter training state, bytes per parameter. Matmul weights have bf16 working copies, fp32
    # masters and AdamW's fp32 m and v (training/working_weights.py); norms and DFlash 2's modules
    # are fp32 parameters with the same moments.
    working_weight_bytes: float = 2.0
    master_bytes: float = 4.0
    adam_bytes: float = 8.0
    # Gradients: bf16 on a working weight; an fp32 sum beside it with train.grad_accum > 1 or
    # several drafters (DDP), whose flat buckets add a bf16 copy; fp32 on an fp32 parameter.
    working_grad_bytes: float = 2.0
    fp32_grad_bytes: float = 4.0
    ddp_bucket_bytes: float = 2.0
    # Drafter activations kept for the backward, per block token (anchors x block size) and layer,
    # in bf16 copies of a width: hidden size, query width (heads x head_dim), KV width, MLP width.
    block_hidden: float = 2.0
    block_query: float = 2.0
    block_kv: float = 2.0
    block_mlp: float = 2.0
    block_conv: float = 4.0  # DFlash 2: the convolutions' inputs and outputs, x hidden size
    lse_bytes: float = 4.0  # the attention's fp32 log-sum-exp, per head
    # Per context token (the row's S positions) and layer: its projected k (before and after the
    # norm) and v, in copies of the KV width.
    context_kv: float = 3.0
    # Per context token, shared by the layers: fc's output, the normed context and its bf16 cast.
    context_bytes_per_hidden: float = 8.0
    # With activation checkpointing only each layer's input is kept: copies of the hidden size.
    checkpoint_hidden: float = 1.0
    # One layer's backward in flight: gradients of its activations, per block token (hidden and
    # MLP widths) and per context + block token (KV width).
    backward_hidden: float = 2.0
    backward_mlp: float = 2.0
    backward_kv: float = 2.0
    # The loss: per scored row (anchors x (block size - 1); every block row for DSpark and XPress)
    # the final hidden state and the gradient the chunked CE writes for it, fp32; one chunk of
    # logits at a time (objective/lm_head_loss.py). Per arch: memory_heads.py.
    loss_row_bytes_per_hidden: float = 8.0
    lm_head_chunk_rows: int = 2048
    lm_head_bytes_per_logit: float = 4.0
    # DSpark: fp32 copies of one chunk's [rows, V] (objective/dspark_rows.py, the gradient taken in
    # the forward): on the torch path the draft's logits (reused for the log-softmax and the
    # gradient), its softmax and the teacher's (a fourth with soft-capping; 3.09 chunks measured on
    # CPU); the fused CUDA path (kernels/fused_dspark.py) holds the matmuls' bf16 outputs alone,
    # 1.5, so this errs high by ~0.4 GiB at the Qwen3-8B shape. XPress, per element of its chunk of
    # blocks (objective/xpress_rows.py, the gradient taken in the forward): each pass's bias, then its
    # dz, in the matmul dtype (bf16: 2 B a pass); on the torch path beside them the raw logits (bf16),
    # fp32 z_0, one pass's fp32 z, logsumexp's fp32 temporary and the bias's fp32 copy (18 B); the
    # fused path holds 4 of those 18, and no pass slot for the base anchor.
    # tests/test_plan_memory_heads.py measures the CPU's fp32 peak.
    dspark_chunk_copies: float = 3.0
    xpress_chunk_bytes: float = 18.0
    xpress_pass_bytes: float = 2.0
    # Features [S, K x hidden] in bf16: on a drafter rank the micro-batch trained on and the next,
    # being received; on a colocated rank the one trained on; on a target rank the sends in flight
    # (topology.max_inflight_sends) besides the forward's own.
    drafter_feature_copies: float = 2.0
    colocated_feature_copies: float = 1.0
    # The target's forward: the captured layer outputs and their concatenation, and one layer's
    # transients per token (bf16 copies of the hidden, q + k + v and MLP widths). With CUDA graphs
    # these stay in the graphs' pool for the whole job, with the graphs' output storage beside them.
    forward_feature_copies: float = 2.0
    graph_output_copies: float = 1.0
    target_hidden: float = 4.0
    target_qkv: float = 1.0
    target_mlp: float = 3.0
    # Beyond torch's allocations: the CUDA context and the allocator's rounding and fragmentation,
    # which the GPU's memory must hold too (the preflight adds them before comparing).
    reserve_gib: float = 1.0
    reserve_fraction: float = 0.05


DEFAULT_CONSTANTS = Constants()


@dataclass(frozen=True)
class TrainingShape:
    """What one training job's memory depends on: the target's shape and the recipe."""

    target: ModelShape  # dflash_mp.plan.costs.shape_from_hf_config; the drafter's layers copy it
    target_layers_kept: int  # max(target_layer_ids) + 1: the target runs up to its last one
    feature_layers: int  # K = len(target_layer_ids): the features are K x hidden wide
    draft_layers: int
    block_size: int
    seq_len: int  # tokens per row: data.max_length, padded up to data.pad_to_multiple
    num_anchors: int
    micro_batch: int = 1
    grad_accum: int = 1
    drafters: int = 1  # drafter ranks (DDP over them when > 1)
    activation_checkpointing: bool = False
    arch: str = "dflash"
    conv_kernel_size: int = 2  # DFlash 2's convolutions and selector
    conv_group_size: int = 16
    selector_rank: int = 256
    markov_rank: int = 256  # DSpark's heads and XPress's refiner (memory_heads.py)
    markov_head_type: str = "vanilla"
    confidence_head: bool = True
    confidence_head_with_markov: bool = True
    xpress_rank: int = 256
    xpress_mlp_ratio: int = 2
    xpress_passes: int = 5  # passes whose gradient XPress's loss holds (memory_heads.xpress_ce_passes)
    vocabulary_chunk_rows: int | None = None  # the loss's (train.vocabulary_chunk_rows; None: the arch's)
    teacher_layer: bool = False  # DSpark: the last of the feature layers is the teacher's, not fc's input
    target_mlp_width: int = 0  # one token's MLP activations in the target (0: the dense width)
    target_parallel: int = 1
    max_inflight_sends: int = 2
    cuda_graphs: bool = True


@dataclass(frozen=True)
class Term:
    name: str
    bytes: float
    formula: str


@dataclass
class Breakdown:
    """One rank's peak: resident terms plus the larger phase."""

    rank: str  # "colocated", "target rank", "drafter rank"
    resident: list[Term]
    phases: dict[str, list[Term]] = field(default_factory=dict)
    constants: Constants = DEFAULT_CONSTANTS

    def phase_bytes(self, name: str) -> float:
        return sum(t.bytes for t in self.phases[name])

    @property
    def peak_phase(self) -> str | None:
        return max(self.phases, key=self.phase_bytes) if self.phases else None

    @property
    def peak_bytes(self) -> float:
        phase = self.peak_phase
        return sum(t.bytes for t in self.resident) + (self.phase_bytes(phase) if phase else 0.0)

    @property
    def peak_gib(self) -> float:
        """What torch.cuda.max_memory_allocated would read at the peak."""
        return self.peak_bytes / GIB

    @property
    def needed_gib(self) -> float:
        """The peak with the CUDA context and the allocator's reserve: what the GPU must hold."""
        k = self.constants
        return self.peak_gib * (1 + k.reserve_fraction) + k.reserve_gib

    def lines(self) -> list[str]:
        """The breakdown as text: each term in GiB with its formula, the phases' sums, the peak."""
        out = [
            f"{self.rank}: predicted peak {self.peak_gib:.2f} GiB ({self.needed_gib:.2f} GiB with the reserve)"
        ]
        out += [_line(t) for t in self.resident]
        for name, terms in self.phases.items():
            mark = "  <- the peak" if name == self.peak_phase else ""
            out.append(f"  phase {name}: {self.phase_bytes(name) / GIB:.2f} GiB{mark}")
            out += ["  " + _line(t) for t in terms]
        return out

    def as_dict(self) -> dict:
        return {
            "rank": self.rank,
            "peak_gib": self.peak_gib,
            "needed_gib": self.needed_gib,
            "peak_phase": self.peak_phase,
            "resident": {t.name: t.bytes / GIB for t in self.resident},
            "phases": {name: {t.name: t.bytes / GIB for t in terms} for name, terms in self.phases.items()},
        }


def _line(term: Term) -> str:
    return f"  {term.name:<28} {term.bytes / GIB:8.2f} GiB  {term.formula}"


# ----------------------------------------------------------------------------- widths and counts


def _widths(s: ModelShape) -> tuple[int, int, int, int]:
    """Hidden size, query width, KV width, MLP width of a drafter layer (the target's shape)."""
    return s.hidden, s.heads * s.head_dim, s.kv_heads * s.head_dim, s.intermediate


def drafter_parameters(t: TrainingShape) -> tuple[int, int]:
    """(matmul parameters, which get bf16 working copies; fp32 parameters: norms, DFlash 2's modules,
    DSpark's heads, XPress's refiner)."""
    s, h = t.target, t.target.hidden
    norms_per_layer = 2 * h + 2 * s.head_dim
    matmul = (
        t.draft_layers * (layer_params(s) - norms_per_layer) + (t.feature_layers - t.teacher_layer) * h * h
    )
    fp32 = t.draft_layers * norms_per_layer + 2 * h
    if t.arch == "dflash2":
        groups = h // t.conv_group_size
        conv = 2 * t.conv_kernel_size * h + h * 2 * t.conv_kernel_size * groups
        fp32 += t.draft_layers * 2 * conv + 2 * s.vocab * t.selector_rank + h * t.selector_rank
    return matmul, fp32 + head_parameters(t)


def block_tokens(t: TrainingShape) -> int:
    return t.micro_batch * t.num_anchors * t.block_size


def feature_bytes(t: TrainingShape) -> float:
    """One micro-batch's features [B, S, K x hidden] in bf16."""
    return float(BF16 * t.micro_batch * t.seq_len * t.feature_layers * t.target.hidden)


# ----------------------------------------------------------------------------- the target


def target_weights(t: TrainingShape) -> Term:
    s, k = t.target, t.target_parallel
    layers = t.target_layers_kept * target_layer_params(s)
    shard = f" / {k} (tensor-parallel)" if k > 1 else ""
    return Term(
        "target weights",
        BF16 * (s.vocab * s.hidden + s.hidden + layers / k),
        f"bf16 x (embedding V*H + {t.target_layers_kept} layers kept{shard})",
    )


def target_forward(t: TrainingShape, c: Constants) -> list[Term]:
    """The forward's own memory: the captured features and one layer's transients."""
    s, k = t.target, t.target_parallel
    h, q, kv, mlp = _widths(s)
    mlp = t.target_mlp_width or mlp
    tokens = t.micro_batch * t.seq_len
    per_token = c.target_hidden * h + c.target_qkv * (q + 2 * kv) / k + c.target_mlp * mlp / k
    return [
        Term(
            "target layer transients",
            BF16 * tokens * per_token,
            f"bf16 x B*S x ({c.target_hidden:g}H + {c.target_qkv:g}(q+2kv) + {c.target_mlp:g}*MLP {mlp})",
        ),
        Term(
            "target features",
            c.forward_feature_copies * feature_bytes(t),
            f"{c.forward_feature_copies:g} x bf16 B*S*K*H (captured outputs, concatenation)",
        ),
    ]


def cuda_graph_pool(t: TrainingShape, c: Constants) -> list[Term]:
    """With CUDA graphs the forward's memory stays in the graphs' pool, the output storage beside it."""
    pool = sum(term.bytes for term in target_forward(t, c))
    return [
        Term("CUDA graphs' pool", pool, "the target forward's memory, kept by the graphs"),
        Term(
            "CUDA graphs' output",
            c.graph_output_copies * feature_bytes(t),
            f"{c.graph_output_copies:g} x bf16 B*S*K*H",
        ),
    ]


# ----------------------------------------------------------------------------- the drafter


def drafter_state(t: TrainingShape, c: Constants) -> list[Term]:
    """Frozen embedding and LM head, the trainable parameters with AdamW's state, the gradients."""
    s = t.target
    matmul, fp32 = drafter_parameters(t)
    frozen = s.vocab * s.hidden * (1 if s.tied_embeddings else 2)
    weights = matmul * (c.working_weight_bytes + c.master_bytes + c.adam_bytes)
    weights += fp32 * (c.master_bytes + c.adam_bytes)
    summed = t.grad_accum > 1 or t.drafters > 1
    per_matmul = c.working_grad_bytes + (c.fp32_grad_bytes if summed else 0.0)
    per_matmul += c.ddp_bucket_bytes if t.drafters > 1 else 0.0
    return [
        Term("drafter embedding + head", BF16 * frozen, "bf16, frozen (the target's)"),
        Term(
            "drafter weights + AdamW",
            weights,
            f"{matmul / 1e6:.1f}M matmul x {c.working_weight_bytes + c.master_bytes + c.adam_bytes:g} B "
            f"+ {fp32 / 1e6:.2f}M fp32 x {c.master_bytes + c.adam_bytes:g} B",
        ),
        Term(
            "drafter gradients",
            matmul * per_matmul + fp32 * c.fp32_grad_bytes,
            f"matmul x {per_matmul:g} B + fp32 x {c.fp32_grad_bytes:g} B"
            + (" (fp32 sums: grad_accum or DDP)" if summed else ""),
        ),
    ]


def layer_activation_bytes(t: TrainingShape, c: Constants) -> float:
    """What one draft layer keeps for its backward over a micro-batch."""
    h, q, kv, mlp = _widths(t.target)
    per_block = BF16 * (c.block_hidden * h + c.block_query * q + c.block_kv * kv + c.block_mlp * mlp)
    per_block += c.lse_bytes * t.target.heads
    if t.arch == "dflash2":
        per_block += BF16 * c.block_conv * h
    per_context = BF16 * c.context_kv * kv
    return block_tokens(t) * per_block + t.micro_batch * t.seq_len * per_context


def drafter_step(t: TrainingShape, c: Constants, feature_copies: float) -> list[Term]:
    """The drafter step's activations at the start of its backward."""
    h, q, kv, mlp = _widths(t.target)
    tokens, context = block_tokens(t), t.micro_batch * t.seq_len
    one_layer = layer_activation_bytes(t, c)
    if t.activation_checkpointing:
        layers = Term(
            "draft layer activations",
            t.draft_layers * BF16 * c.checkpoint_hidden * tokens * h + one_layer,
            f"checkpointed: {t.draft_layers} layers x {c.checkpoint_hidden:g} bf16 N*Bs*H inputs "
            "+ one layer recomputed",
        )
    else:
        layers = Term(
            "draft layer activations",
            t.draft_layers * one_layer,
            f"{t.draft_layers} layers x N*Bs x ({c.block_hidden:g}H + {c.block_query:g}q + "
            f"{c.block_kv:g}kv + {c.block_mlp:g}MLP) + S x {c.context_kv:g}kv, bf16",
        )
    backward = BF16 * tokens * (c.backward_hidden * h + c.backward_mlp * mlp)
    backward += BF16 * (tokens + context) * c.backward_kv * kv
    rows, rows_formula = loss_rows(t)
    return [
        Term("features", feature_copies * feature_bytes(t), f"{feature_copies:g} x bf16 B*S*K*H"),
        Term(
            "context (fc, norm)",
            context * h * c.context_bytes_per_hidden,
            f"B*S*H x {c.context_bytes_per_hidden:g} B",
        ),
        layers,
        Term("one layer's backward", backward, "bf16 N*Bs x (H, MLP) + (S + N*Bs) x kv gradients"),
        Term(
            "loss rows",
            rows * h * c.loss_row_bytes_per_hidden,
            f"{rows_formula} x H x {c.loss_row_bytes_per_hidden:g} B",
        ),
        Term(*vocabulary_work(t, c)),
    ]


# ----------------------------------------------------------------------------- ranks


def colocated_rank(t: TrainingShape, c: Constants = DEFAULT_CONSTANTS) -> Breakdown:
    """A rank running the target's forward and the drafter step (topology=colocated)."""
    resident = [target_weights(t)]
    phases = {"drafter step": drafter_step(t, c, c.colocated_feature_copies)}
    if t.cuda_graphs:
        resident += cuda_graph_pool(t, c)
    else:
        phases = {"target forward": target_forward(t, c), **phases}
    return Breakdown("colocated", resident + drafter_state(t, c), phases, c)


def target_rank(t: TrainingShape, c: Constants = DEFAULT_CONSTANTS) -> Breakdown:
    """A target rank of a split layout (its tensor-parallel share with topology.target_parallel)."""
    sends = Term(
        "features in flight",
        t.max_inflight_sends * feature_bytes(t),
        f"topology.max_inflight_sends={t.max_inflight_sends} x bf16 B*S*K*H",
    )
    resident = [target_weights(t), sends]
    if t.cuda_graphs:
        return Breakdown("target rank", resident + cuda_graph_pool(t, c), {}, c)
    return Breakdown("target rank", resident, {"target forward": target_forward(t, c)}, c)


def drafter_rank(t: TrainingShape, c: Constants = DEFAULT_CONSTANTS) -> Breakdown:
    """A drafter rank of a split layout."""
    phases = {"drafter step": drafter_step(t, c, c.drafter_feature_copies)}
    return Breakdown("drafter rank", drafter_state(t, c), phases, c)


def with_checkpointing(t: TrainingShape) -> TrainingShape:
    return replace(t, activation_checkpointing=True)
