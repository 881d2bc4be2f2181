"""One dataclass per config group (model, data, topology, optim, logger, train, watchdog, eval),
each field with a one-line comment on what it does and which values it takes.

`dflash_mp.config.schema.RootConfig` gathers them; Hydra composes conf/ against it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING


@dataclass
class ModelConfig:
    # Local HF-format directory of the frozen target (config.json + safetensors + tokenizer).
    target_path: str = MISSING
    # Allow custom modelling code shipped with the target (off unless you trust the directory).
    trust_remote_code: bool = False
    # Number of DFlash (draft) transformer layers.
    draft_layers: int = 1
    # Target layers whose outputs feed the drafter (0-based); null = DFlash default spacing.
    target_layer_ids: list[int] | None = None
    # Tokens per draft block: one known token followed by block_size-1 MASK tokens.
    block_size: int = 16
    # Token used for the masked block positions; added to the run's tokenizer when the target lacks it.
    mask_token: str = "<|MASK|>"
    # Pins the mask token's id (< the target's vocab_size); null: the tokenizer's id of mask_token,
    # else the next free id len(tokenizer) (151669 for Qwen3, as the published Qwen3 drafters).
    mask_token_id: int | None = None
    # Drafter architecture: "dflash", "dflash2" (convolutions around each sublayer + candidate selector)
    # or "xpress" (DFlash plus a causal refiner resolved by Jacobi passes; docs/drafter.md).
    arch: str = "dflash"
    # dflash2: taps of the grouped dynamic depthwise convolution (over block positions).
    conv_kernel_size: int = 2
    # dflash2: channels per group of the convolution's dynamic kernel; must divide the hidden size.
    conv_group_size: int = 16
    # dflash2: rank of the selector's predecessor/successor codebooks.
    selector_rank: int = 256
    # dflash2: candidates (the target head's top-K at each block position) the selector chooses among.
    selector_top_k: int = 16
    # dflash2: weight of the selector's K-way cross-entropy next to the DFlash loss.
    selector_loss_alpha: float = 1.0
    # dflash2: a label outside the top-K is "drop"ped from the selector term or "inject"ed as the last candidate.
    selector_gold_outside_top_k: str = "drop"
    # xpress: rank r of the causal refiner (its embedding, fusion, mixer and MLP live in r dimensions).
    xpress_rank: int = 256
    # xpress: the refiner MLP's width is xpress_rank * xpress_mlp_ratio (released checkpoints: 2).
    xpress_mlp_ratio: int = 2
    # xpress: Jacobi passes K that resolve a block at inference (eval, and the export for vLLM).
    num_jacobi_passes: int = 6
    # xpress: weight of the free-running Jacobi rounds' loss (0: no rounds).
    xpress_consistency_weight: float = 0.3
    # xpress: training rounds, each fed the previous round's argmax (their losses are averaged).
    xpress_consistency_passes: int = 3
    # xpress: weight of the loss on the drafter's own logits, which keeps the Jacobi seed good (0: none).
    xpress_base_anchor_weight: float = 0.6
    # xpress: that loss without the position decay (every scored position weighs 1).
    xpress_base_anchor_full_weight: bool = False
    # dspark: rank r of the Markov logit-bias head, bias = W2 f(W1[previous token]) (0: no Markov head).
    markov_rank: int = 256
    # dspark: "vanilla" (the previous token only), "gated" (gated by the hidden state) or "rnn" (a state over the block).
    markov_head_type: str = "vanilla"
    # dspark: train a head that predicts each position's acceptance probability.
    enable_confidence_head: bool = True
    # dspark: the confidence head also reads the Markov embedding of the previous token.
    confidence_head_with_markov: bool = True
    # dspark: block position k predicts x[a+k+1] (Bs drafts per block), else x[a+k] as DFlash (Bs-1).
    sample_from_anchor: bool = True
    # dspark: weights of the cross-entropy on the data token, KL(target || draft), TV(draft, target) and
    # the confidence head's BCE against 1 - TV (DeepSpec's recipe: 0.1, 0, 1.8 = 0.9 x L1, 1.0).
    dspark_ce_alpha: float = 0.1
    dspark_kl_alpha: float = 0.0
    dspark_tv_alpha: float = 1.8
    dspark_confidence_alpha: float = 1.0
    # Attention of each draft layer, "full_attention" or "sliding_attention"; null: all full.
    layer_types: list[str] | None = None
    # sliding_attention layers see keys less than this many positions from the query (reference rule).
    sliding_window: int | None = None
    # Factor on the block tokens' embeddings; null: the target's (Gemma sqrt(hidden_size), Granite
    # embedding_multiplier, else 1).
    input_embedding_scale: float | None = None
    # Factor on the draft logits; null: the target's (Granite 1/logits_scaling, Cohere logit_scale, else 1).
    output_multiplier: float | None = None
    # Soft cap c on the draft logits, c * tanh(logits / c) after the multiplier; null: the target's
    # final_logit_softcapping (Gemma 2), else none; 0: none.
    final_logit_softcapping: float | None = None


@dataclass
class DataConfig:
    # JSONL files, one record per line: {"messages"|"conversations": [{"role", "content"}]},
    # ShareGPT {"conversations": [{"from", "value"}]} or {"text": ..., "loss_spans": [[start, end]]}.
    train_files: list[str] = field(default_factory=list)
    # Held-out prompts (JSONL, same format) for acceptance-length evaluation.
    eval_files: list[str] = field(default_factory=list)
    # Longest tokenized sequence kept (prompt + response), in tokens.
    max_length: int = 3072
    # Micro-batches are right-padded to a multiple of this many tokens (fewer shapes to compile).
    pad_to_multiple: int = 64
    # Anchor positions sampled per sequence (each starts one draft block); packed rows: per
    # max_length tokens, spread over the documents by their length (docs/data.md, Packing).
    num_anchors: int = 512
    # Pack whole records into rows of at most max_length tokens (each document sees only itself).
    packing: bool = False
    # What to do with a malformed record: skip it (counted, logged with file:line) or fail.
    on_bad_record: str = "skip"
    # A record longer than max_length: truncate it (loss mask kept aligned) or skip it.
    on_too_long: str = "truncate"
    # Fail (preflight sample, and each target rank while training) above this fraction of bad records.
    max_bad_fraction: float = 0.05
    # A jinja chat template file that replaces the tokenizer's own ("": the tokenizer's).
    chat_template: str = ""
    # Extra variables for the chat template, e.g. {enable_thinking: false}.
    chat_template_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass
class TopologyConfig:
    # "split": target and drafter ranks apart; "colocated": every rank runs the target and trains (targets 0).
    layout: str = "split"
    # Ranks running the frozen target forward (global ranks 0..targets-1).
    targets: int = 2
    # Ranks training the drafter, data-parallel among themselves (the following ranks);
    # colocated: null is the torchrun world size (the launcher: one per visible GPU).
    drafters: int | None = 1
    # Micro-batch sends a target rank may have in flight before it waits (bounds memory).
    max_inflight_sends: int = 2
    # Target ranks per target replica, sharded tensor-parallel (for a target that does not fit
    # one GPU); must divide topology.targets and the target's attention and KV head counts.
    target_parallel: int = 1


@dataclass
class OptimConfig:
    # AdamW peak learning rate.
    lr: float = 6e-4
    # AdamW decoupled weight decay.
    weight_decay: float = 0.0
    # AdamW betas.
    betas: list[float] = field(default_factory=lambda: [0.9, 0.95])
    # Fraction of the optimizer steps spent in linear warm-up before the cosine decay.
    warmup_ratio: float = 0.04
    # Final learning rate as a fraction of the peak.
    min_lr_ratio: float = 0.0
    # Gradient-norm clipping threshold (0 disables clipping).
    grad_clip: float = 1.0
    # "adamw", or "muon": Muon on the hidden layers' matrices (nn.Linear weights), AdamW (the
    # fields above) on the rest; both at the scheduled lr (conf/optim/muon.yaml, docs/recipes.md).
    name: str = "adamw"
    # muon: momentum (EMA, Nesterov) of the Muon matrices.
    muon_momentum: float = 0.95
    # muon: Nesterov momentum on the Muon matrices.
    muon_nesterov: bool = True
    # muon: decoupled weight decay of the Muon matrices (optim.weight_decay is the AdamW part's).
    muon_weight_decay: float = 0.1
    # muon: Newton-Schulz iterations per update.
    muon_ns_steps: int = 5
    # muon: per-matrix lr scale, torch.optim.Muon's adjust_lr_fn: "match_rms_adamw" (0.2 *
    # sqrt(max(rows, cols)), Moonshot's; the lr of AdamW carries over) or "original" (Keller Jordan's).
    muon_adjust_lr: str = "match_rms_adamw"


@dataclass
class LoggerConfig:
    # "none" or "wandb" (wandb logs from the first drafter rank only).
    backend: str = "none"
    # wandb project name.
    project: str = "dflash_mp"
    # wandb mode: offline (default, no network), online, or disabled.
    mode: str = "offline"
    # Print a progress line every this many optimizer steps on the first drafter rank.
    progress_every: int = 10
    # Draw the training curves into RUN_DIR/plots/ when the job ends (about 1.5 CPU-seconds on the
    # first drafter); `python -m dflash_mp.plot RUN_DIR` draws them at any time either way.
    plots: bool = True


@dataclass
class TrainConfig:
    # Optimizer steps to run; -1 derives them from `epochs` and the data size.
    max_steps: int = -1
    # Passes over the training data when max_steps is -1.
    epochs: int = 6
    # Sequences per micro-batch (one transport message).
    micro_batch_size: int = 1
    # Micro-batches accumulated per drafter rank per optimizer step.
    grad_accum: int = 1
    # Seed for data order, anchors and drafter init; the same seed gives the same run.
    seed: int = 0
    # Loss decay over block positions: weight exp(-(k-1)/gamma); null: 1 + 3*block_size/8
    # (7 for block 16 as in the paper, 4 for block 8 as the published block-8 recipes).
    gamma: float | None = None
    # Weights of the block positions in the loss: "decay" (the gamma decay above) or "dpace"
    # (D-PACE: from the drafter's own confidences, the field's recipe; objective/position_weights.py).
    position_weights: str = "decay"
    # dpace: smoothing of the confidences toward 1, in (0, 1].
    dpace_alpha: float = 0.5
    # Save a checkpoint every this many optimizer steps (0: only at the end).
    checkpoint_every: int = 0
    # Checkpoints kept on disk (oldest removed first).
    keep_checkpoints: int = 2
    # Continue from the newest complete checkpoint in run_dir/checkpoints.
    resume: bool = False
    # Clear run_dir of an earlier run (checkpoints, metrics, config, logs but job.log) before a fresh
    # start; without it a fresh start in a used run_dir is refused.
    overwrite: bool = False
    # Non-finite loss or gradient: "skip" the optimizer step or "stop" the job.
    on_nonfinite: str = "stop"
    # With on_nonfinite=skip: stop the job after this many skipped non-finite steps in a row (the
    # drafter is then not training; a resume counts afresh); 0: no limit.
    max_nonfinite_in_a_row: int = 20
    # "auto" (cuda when available), "cuda" or "cpu".
    device: str = "auto"
    # Drafter training dtype: "auto" (bf16 autocast on GPU, fp32 on CPU), "float32", "bfloat16".
    dtype: str = "auto"
    # Attention kernel for the block-sparse mask: "flash" (FlashAttention 4's CuTe kernels: Hopper or
    # newer, bf16, the optional package flash-attn-4), "flex" (flex_attention), "sdpa" (dense mask, CPU);
    # "auto": flash where it runs, else flex on GPU, sdpa on CPU.
    attention: str = "auto"
    # torch.compile the drafter's and the target's layers, per process: "auto" (on for GPU), true or false.
    compile: str = "auto"
    # Replay the target's forward from CUDA graphs, one per padded micro-batch shape: "auto" (on for
    # a GPU target that is not tensor-parallel), true or false (models/target_graphs.py).
    cuda_graphs: str = "auto"
    # Recompute each draft layer's forward in its backward instead of keeping its activations (long rows).
    activation_checkpointing: bool = False
    # Rows per chunk of the loss's work over the vocabulary (logits and their gradient); null: 2048
    # for dflash and dflash2, for dspark and xpress 2^27 / vocabulary size, at most 2048 (880 at
    # Qwen3's), rounded down to whole blocks. Smaller holds less memory (`python -m dflash_mp.plan
    # memory` shows the chunk) and fills less of the GPU.
    vocabulary_chunk_rows: int | None = None
    # Write the HF-format drafter to run_dir/export at the end of training.
    export: bool = True


@dataclass
class WatchdogConfig:
    # Seconds without progress after which a rank is reported hung and the job torn down (0 disables).
    # Generous: a large target can take minutes to load, and a cold torch.compile of the first
    # steps (25 s at Qwen3-8B shape on an H200, BENCHMARKS.md) must not read as a hang either.
    timeout_s: float = 900.0


@dataclass
class EvalConfig:
    # Measure acceptance length every this many steps during training (0 disables).
    every: int = 0
    # Held-out prompts used per measurement.
    num_prompts: int = 8
    # New tokens generated per prompt.
    max_new_tokens: int = 64
    # Benchmark files measured too, name: path (JSONL/Parquet as published: GSM8K, MATH-500, AIME,
    # HumanEval, MBPP, LiveCodeBench, MT-Bench, Alpaca; docs/evaluation-and-serving.md, "Acceptance
    # on standard benchmarks"), logged as tau/<name>.
    benchmarks: dict[str, str] = field(default_factory=dict)
