"""The frozen target: hidden states for the drafter, and its embedding and LM head for the loss.

Target ranks run `TargetFeatureExtractor`; drafter ranks only need the target's embedding and
LM head matrices, which `load_embedding_and_head` (models/target_structure.py) reads straight
from the safetensors files so a 70B target is never instantiated there. Where the decoder and its
layers sit in the model is found by walking it (models/target_structure.py). Given a DeviceMesh, a target rank holds its share of a
tensor-parallel replica (dflash_mp.models.tensor_parallel); the features come out whole. Rows
that pack several documents (`document_ids`) give each document's features as if it ran alone
(dflash_mp.models.packed_target).
"""

from __future__ import annotations

import copy
import importlib.util
import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, PretrainedConfig

from dflash_mp.models import packed_check, packed_target, target_graphs, target_kernels
from dflash_mp.models.target_checkpoint import checkpoint_bytes
from dflash_mp.models.target_structure import (
    cut_to_layers,
    decoder_layers,
    find_decoder,
    load_embedding_and_head,
    locate_decoder,
)

__all__ = ["TargetFeatureExtractor", "checkpoint_bytes", "load_embedding_and_head", "load_target_config"]


def _tp() -> Any:
    """dflash_mp.models.tensor_parallel, imported when a target is sharded: it loads torch's DTensor
    (a second of CPU), which a one-rank target and every drafter rank do without."""
    from dflash_mp.models import tensor_parallel

    return tensor_parallel


log = logging.getLogger(__name__)


def load_target_config(path: str | Path, trust_remote_code: bool = False) -> PretrainedConfig:
    """The target's HF config, from the local directory only."""
    return AutoConfig.from_pretrained(path, local_files_only=True, trust_remote_code=trust_remote_code)


def _check_layer_ids(layer_ids: list[int], num_layers: int) -> None:
    if not layer_ids or any(not 0 <= i < num_layers for i in layer_ids):
        raise ValueError(
            f"model.target_layer_ids={list(layer_ids)} is invalid for a target with {num_layers} layers: "
            f"use a non-empty list of layer indices in [0, {num_layers - 1}]"
        )


class _DropLoadReport(logging.Filter):
    """Hides transformers' load report, which lists every weight of the layers we drop on purpose."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "LOAD REPORT" not in record.getMessage()


@contextmanager
def _without_load_report() -> Iterator[None]:
    hf_logger = logging.getLogger("transformers.modeling_utils")
    report_filter = _DropLoadReport()
    hf_logger.addFilter(report_filter)
    try:
        yield
    finally:
        hf_logger.removeFilter(report_filter)


class TargetFeatureExtractor(nn.Module):
    """Frozen target truncated after its last needed layer; returns the drafter's context features."""

    def __init__(
        self,
        path: str | Path,
        layer_ids: list[int],
        dtype: torch.dtype,
        device: torch.device | str,
        trust_remote_code: bool = False,
        mesh: DeviceMesh | None = None,
    ) -> None:
        """`mesh`: shard the layers tensor-parallel over this 1-D mesh (this rank's replica)."""
        super().__init__()
        config = load_target_config(path, trust_remote_code=trust_remote_code)
        text_config = config.get_text_config()
        self.num_target_layers: int = text_config.num_hidden_layers
        _check_layer_ids(layer_ids, self.num_target_layers)
        self.layer_ids = list(layer_ids)
        self.hidden_size: int = text_config.hidden_size

        # Build only the layers we read, so the later ones are never materialised (their weights are skipped).
        kept_layers = cut_to_layers(text_config, max(layer_ids) + 1)
        device = torch.device(device)
        if mesh is not None:
            _tp().check_divisible(text_config, _tp().parallel_degree(mesh))
        # Loading straight onto an accelerator needs `accelerate`; without it, load on CPU and move.
        # A sharded target loads on CPU and goes to the device layer by layer, sharded.
        load_on_device = (
            mesh is None and device.type != "cpu" and importlib.util.find_spec("accelerate") is not None
        )
        with _without_load_report():
            model, info = AutoModelForCausalLM.from_pretrained(
                path,
                config=config,
                dtype=dtype,
                local_files_only=True,
                trust_remote_code=trust_remote_code,
                device_map=str(device) if load_on_device else None,
                output_loading_info=True,
            )
        broken = sorted(info["missing_keys"]) + [str(k) for k in info["mismatched_keys"]]
        if broken:
            raise ValueError(f"target checkpoint {path} does not match its config: {broken[:8]}")
        # Keep the decoder stack only; the LM head (and the rest of the wrapper) is dropped with `model`.
        decoder = find_decoder(model, kept_layers)
        del model
        if mesh is None:
            decoder.to(device)
        else:
            _place_sharded(decoder, device, mesh, _tp().layer_plan(text_config))
        self._attach(decoder)
        log.info(
            "target %s: running layers 0..%d of %d%s",
            path,
            kept_layers - 1,
            self.num_target_layers,
            f", tensor-parallel over {_tp().parallel_degree(mesh)} ranks" if mesh is not None else "",
        )

    def _attach(self, decoder: nn.Module) -> None:
        """Freeze `decoder` (layers 0..max(layer_ids)) and capture the outputs of layers `layer_ids`."""
        self.decoder = decoder.eval().requires_grad_(False)
        self.layers = decoder_layers(decoder)
        self._captured: dict[int, torch.Tensor] = {}
        self._graphed: target_graphs.GraphedForward | None = None
        self._packing: packed_target.PackingPlan | None = None
        self._packed_forward_ran = False
        self._calls_with_nothing_to_check = 0
        for layer_id in set(self.layer_ids):
            self.layers[layer_id].register_forward_hook(self._capture_hook(layer_id))

    @classmethod
    def build_random(
        cls,
        config: PretrainedConfig,
        layer_ids: list[int],
        dtype: torch.dtype,
        device: torch.device | str,
        seed: int = 0,
        mesh: DeviceMesh | None = None,
    ) -> TargetFeatureExtractor:
        """A randomly initialised target of `config`'s shape, built in memory on `device` (benchmarks, tests).

        Same truncation and outputs as a loaded target; no checkpoint is read or written. The
        layers are built one at a time on `device` (each from its own seed) and, with `mesh`,
        sharded at once: a target too large for one device never exists whole on any of them,
        and the weights do not depend on the mesh.
        """
        text_config = copy.deepcopy(config.get_text_config())
        num_layers = text_config.num_hidden_layers
        _check_layer_ids(layer_ids, num_layers)
        kept_layers = cut_to_layers(text_config, max(layer_ids) + 1)
        if mesh is not None:
            _tp().check_divisible(text_config, _tp().parallel_degree(mesh))
        device = torch.device(device)
        # The skeleton on "meta" allocates nothing; the embedding, norm and rotary tables are
        # built for real (small), then each layer is materialised on `device`.
        with torch.device("meta"):
            model = AutoModel.from_config(text_config, dtype=dtype)
        path, layers = locate_decoder(model, kept_layers)
        decoder = model.get_submodule(path)
        shell_config = copy.deepcopy(text_config)
        cut_to_layers(shell_config, 0)
        with _seeded(device, seed):
            shell = AutoModel.from_config(shell_config, dtype=dtype).to(device)
        for name, child in shell.get_submodule(path).named_children():
            if name != layers:
                setattr(decoder, name, child)
        plan = _tp().layer_plan(text_config) if mesh is not None else None
        for index, layer in enumerate(getattr(decoder, layers)):
            layer.to_empty(device=device)
            with _seeded(device, seed * 100_003 + index + 1), torch.no_grad():
                for module in layer.modules():
                    decoder._init_weights(module)
            if mesh is not None:
                _tp().shard_layer(layer, plan, mesh)
        left_on_meta = [n for n, t in [*decoder.named_parameters(), *decoder.named_buffers()] if t.is_meta]
        if left_on_meta:
            raise RuntimeError(
                f"build_random left tensors unbuilt (an unexpected model layout): {left_on_meta[:8]}"
            )
        self = cls.__new__(cls)
        nn.Module.__init__(self)
        self.num_target_layers = num_layers
        self.layer_ids = list(layer_ids)
        self.hidden_size = text_config.hidden_size
        self._attach(decoder)
        return self

    def use_fast_kernels(self, packed_rows: bool = False) -> dict[str, str]:
        """Sink attention on flex, grouped-GEMM experts (same features); returns the kernels in use.
        `packed_rows` (data.packing): attention on flex with a block mask per document."""
        self.kernels = target_kernels.use_fast_kernels(self.decoder, packed_rows)
        return self.kernels

    def compile_layers(self, **compile_options: Any) -> dict[str, int]:
        """torch.compile the layers (fused norms, RoPE, SiLU), leaving fla's linear attention eager."""
        return target_kernels.compile_layers(self.layers, **compile_options)

    def _capture_hook(self, layer_id: int) -> Callable[[nn.Module, tuple, Any], None]:
        def hook(module: nn.Module, args: tuple, output: Any) -> None:
            # Decoder layers return a tensor in transformers 5 and a tuple in older remote code.
            self._captured[layer_id] = output[0] if isinstance(output, tuple) else output

        return hook

    def use_cuda_graphs(self, max_tokens: int = 0, max_graphs: int = 64) -> None:
        """Replay the forward from CUDA graphs, one per input shape (models/target_graphs.py);
        `max_tokens`: the most tokens (batch x length) of any call, which sizes the output
        storage the graphs share (0: the first call's)."""
        feature_size = self.hidden_size * len(self.layer_ids)
        self._graphed = target_graphs.GraphedForward(
            self._forward_eager, max_graphs, max_tokens * feature_size
        )

    @property
    def cuda_graphs_off_because(self) -> str | None:
        """Why graphs were turned off after a failed capture; None while they run (or were never on)."""
        return self._graphed.off_because if self._graphed is not None else None

    @property
    def packing(self) -> packed_target.PackingPlan:
        """How packed rows run on this target (decided at the first packed call, once its kernels are set)."""
        if self._packing is None:
            self._packing = packed_target.plan(self.decoder)
            log.info("target %s: %s", type(self.decoder).__name__, self._packing.describe())
        return self._packing

    def forward(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Concatenated outputs of target layers `layer_ids`: [B, S, K*H] (causal; no attention mask).

        `document_ids` [B, S] (packed rows, models/packed_rows.py): positions restart at every
        document and nothing crosses from one to the next; None: each row is one sequence from 0.
        """
        if document_ids is None:
            if self._graphed is not None:
                return self._graphed(input_ids)
            return self._forward_eager(input_ids)
        if document_ids.shape != input_ids.shape:
            raise ValueError(f"document_ids {list(document_ids.shape)} for input_ids {list(input_ids.shape)}")
        document_ids = document_ids.to(input_ids.device)
        if self.packing.in_rows_of(input_ids.shape[1]) and not self._packed_forward_ran:
            features = self._first_forward_in_rows(input_ids, document_ids)
            if features is not None:
                return features
        if self.packing.in_rows_of(input_ids.shape[1]):
            return self._forward_in_rows(input_ids, document_ids)
        with torch.inference_mode():
            return packed_target.per_document_forward(self._forward_eager, input_ids, document_ids)

    def _first_forward_in_rows(
        self, input_ids: torch.Tensor, document_ids: torch.Tensor
    ) -> torch.Tensor | None:
        """The in-rows forward until one has run and been checked (`packed_target.crossing`); None
        after falling back to one row per document, when it failed or let documents cross."""
        try:
            features = self._forward_in_rows(input_ids, document_ids)
            vocab = self.decoder.get_input_embeddings().num_embeddings
            reason = packed_check.crossing(self._forward_eager, input_ids, document_ids, features, vocab)
        except torch.OutOfMemoryError:
            raise
        except packed_check.NothingToCheck:  # no row with two documents yet: a later call checks
            self._calls_with_nothing_to_check += 1
            if self._calls_with_nothing_to_check >= packed_check.CALLS_TO_WAIT:
                # Each look reads the device back; data whose rows hold one record each cannot cross.
                self._packed_forward_ran = True
                log.info(
                    "packed rows: not checked, none of %d calls had two documents in a row",
                    packed_check.CALLS_TO_WAIT,
                )
            return features
        except Exception as e:  # noqa: BLE001 - a decoder the structural checks did not foresee
            reason = f"its forward with documents in the rows failed: {type(e).__name__}: " + (
                str(e).splitlines()[0] if str(e) else ""
            )
        if reason is None:
            self._packed_forward_ran = True
            return features
        self._packing = packed_target.PackingPlan(False, reason)
        log.warning("target %s: %s", type(self.decoder).__name__, self._packing.describe())
        if getattr(self, "kernels", {}).get("attention") == target_kernels.DOCUMENT_FLEX:
            # The rows run one per document now: causal SDPA, not the kernel that may have failed.
            self.decoder.config._attn_implementation = "sdpa"
            self.kernels["attention"] = "sdpa"
        return None

    def _forward_in_rows(self, input_ids: torch.Tensor, document_ids: torch.Tensor) -> torch.Tensor:
        if self._graphed is not None:
            return self._graphed(input_ids, document_ids)
        return self._forward_eager(input_ids, document_ids)

    @torch.inference_mode()
    def _forward_eager(
        self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None
    ) -> torch.Tensor:
        self._captured.clear()
        if document_ids is None:
            with target_graphs.single_sequence_rows():  # each row is one sequence: no packed-mask sync
                last_hidden_state = self.decoder(input_ids=input_ids, use_cache=False).last_hidden_state
        else:
            rows = target_graphs.PackedRows.of(document_ids)
            with packed_target.documents_in_rows(self.decoder, rows, self.packing):
                last_hidden_state = self.decoder(
                    input_ids=input_ids, position_ids=rows.positions, use_cache=False
                ).last_hidden_state
        # HF's hidden_states[-1] carries the final norm, so the reference sees the normed last layer.
        features = [
            last_hidden_state if i == self.num_target_layers - 1 else self._captured[i]
            for i in self.layer_ids
        ]
        self._captured.clear()
        return torch.cat(features, dim=-1)


@contextmanager
def _seeded(device: torch.device, seed: int) -> Iterator[None]:
    """Draws on `device` from a forked RNG seeded by `seed` (the caller's RNG is left as it was)."""
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []), device:
        torch.manual_seed(seed)
        yield


def _place_sharded(decoder: nn.Module, device: torch.device, mesh: DeviceMesh, plan: dict) -> None:
    """Move a CPU-loaded decoder to `device`, sharding each layer as it arrives (one full layer
    at a time on the device)."""
    layers = decoder_layers(decoder)
    for child in decoder.children():
        if child is not layers:
            child.to(device)
    for layer in layers:
        _tp().shard_layer(layer.to(device), plan, mesh)
