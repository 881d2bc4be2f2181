"""Synthetic micro-batches and random models, built directly on the device.

Nothing here reads a checkpoint or the network: targets, drafters, embeddings and LM heads are
random tensors, and micro-batches are random tokens of a fixed length (so every compiled shape,
the flex BlockMask included, is static).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from dflash_mp.data import MicroBatch
from dflash_mp.models.drafter import DFlashDrafter
from dflash_mp.models.drafter_config import build_drafter_config
from dflash_mp.models.target import TargetFeatureExtractor
from dflash_mp.runtime.transport import pack_tokens, unpack_document_ids, unpack_tokens
from dflash_mp.training.features import Features
from dflash_mp.training.recipe import drafter_choices

from .shapes import Shape


class SyntheticReader:
    """Stands in for MicroBatchReader: micro-batch m = B random sequences of exactly seq_len tokens.

    The loss mask covers the second half (the "response"); sample ids are distinct per sequence, so
    every micro-batch draws its own anchors. Token rows come from a small pool, so reading is free.
    """

    def __init__(self, shape: Shape, micro_batch: int, seed: int = 0, pool: int = 8) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.shape, self.micro_batch = shape, micro_batch
        # The last id is the drafter's MASK token; keep it out of the data.
        self.pool = [
            torch.randint(0, shape.target.vocab - 1, (micro_batch, shape.seq_len), generator=generator)
            for _ in range(pool)
        ]
        self.loss_mask = torch.zeros(micro_batch, shape.seq_len, dtype=torch.uint8)
        self.loss_mask[:, shape.seq_len // 2 :] = 1
        self.lengths = torch.full((micro_batch,), shape.seq_len, dtype=torch.long)
        self.bad_records = self.too_long_records = 0  # the counters run_target reads
        self.tokens_read = 0  # real tokens of the micro-batches read (all of them: rows are full)

    def read(self, m: int) -> MicroBatch:
        b = self.micro_batch
        self.tokens_read += b * self.shape.seq_len
        return MicroBatch(
            index=m,
            epoch=0,
            input_ids=self.pool[m % len(self.pool)],
            loss_mask=self.loss_mask,
            lengths=self.lengths,
            sample_ids=torch.arange(m * b, (m + 1) * b, dtype=torch.long),
        )


def received_form(batch: MicroBatch, hidden: torch.Tensor, device: torch.device) -> Features:
    """`batch` exactly as a drafter's Receiver hands it over (same views, dtypes, device)."""
    tokens = pack_tokens(
        batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids, batch.document_ids
    ).to(device)
    input_ids, loss_mask, lengths, sample_ids = unpack_tokens(tokens, batch.input_ids.shape[1])
    return Features(
        index=batch.index,
        epoch=batch.epoch,
        input_ids=input_ids,
        loss_mask=loss_mask,
        lengths=lengths,
        sample_ids=sample_ids,
        hidden_states=hidden.contiguous(),
        document_ids=unpack_document_ids(tokens, batch.input_ids.shape[1]),
        nbytes=tokens.numel() * tokens.element_size() + hidden.numel() * hidden.element_size(),
    )


class DeviceInitDrafter(DFlashDrafter):
    """DFlashDrafter initialised on its own device: the drafter's own init (DFlashDrafter.init_weights,
    the distribution and the modules it leaves to their own init) drawing from a generator on that
    device, seeded as the CPU one it is given. Built under `torch.device(device)`, 1B parameters never
    pass through host memory; on CPU it starts from the weights training starts from.
    """

    @torch.no_grad()
    def init_weights(self, generator: torch.Generator) -> None:
        device = next(self.parameters()).device
        with device:
            super().init_weights(torch.Generator(device=device).manual_seed(generator.initial_seed()))


@contextmanager
def seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Draw from the global RNG of `device`, seeded, without disturbing it for anyone else."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def random_drafter(shape: Shape, device: torch.device, seed: int, model_cfg: Any = None) -> DFlashDrafter:
    """`model_cfg` (cfg.model) picks the drafter as training does (recipe.drafter_choices: the
    architecture and its heads, sliding layers, logit scaling); None: plain DFlash."""
    config = build_drafter_config(
        shape.target_config(),
        draft_layers=shape.draft_layers,
        target_layer_ids=shape.layer_ids,
        block_size=shape.block_size,
        mask_token_id=shape.target.vocab - 1,
        **(drafter_choices(model_cfg) if model_cfg is not None else {}),
    )
    with seeded(device, seed), device:
        return DeviceInitDrafter(config, seed=seed)


def random_embed_and_head(shape: Shape, dtype: torch.dtype, device: torch.device, seed: int):
    with seeded(device, seed + 1):
        embed = torch.randn(shape.target.vocab, shape.target.hidden, device=device, dtype=dtype).mul_(0.02)
        head = torch.randn(shape.target.vocab, shape.target.hidden, device=device, dtype=dtype).mul_(0.02)
    return embed, head


def random_target(
    shape: Shape,
    dtype: torch.dtype,
    device: torch.device,
    seed: int,
    compile_layers: bool,
    mesh: DeviceMesh | None = None,
    packed_rows: bool = False,
    layer_ids: list[int] | None = None,
) -> TargetFeatureExtractor:
    """The random target, layer by layer on `device`; with `mesh` this rank's tensor-parallel share
    of it (the same weights for the same seed: a layer is never whole on the device for long).
    On GPU with the runtime's kernels (`packed_rows`: for --data chat-packed, as data.packing).
    `layer_ids`: the layers it sends (default the drafter's; a DSpark teacher's last layer added)."""
    extractor = TargetFeatureExtractor.build_random(
        shape.target_config(), layer_ids or shape.layer_ids, dtype, device, seed=seed, mesh=mesh
    )
    if device.type == "cuda":
        extractor.use_fast_kernels(packed_rows=packed_rows)
    if compile_layers:  # as the runtime does (train.compile)
        extractor.compile_layers()
    return extractor


def count_params(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())
