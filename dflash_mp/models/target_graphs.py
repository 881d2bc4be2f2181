"""The target forward replayed from CUDA graphs, and the one device read HF makes per forward.

A target stage whose kernels are small and many (a MoE layer runs dozens: routing, sort, two
grouped GEMMs, the combine) is paced by the host issuing them, not by the GPU: on an H200 the
Qwen3 MoE stages kept the device busy 59-61% of a forward. A CUDA graph issues the whole forward
at once. One graph is captured per input shape (micro-batches are padded to few widths by
`data.pad_to_multiple`); all share one memory pool, which is safe because replays never overlap
and every graph's input and output stay allocated.

HF's mask preparation checks on each forward whether a row packs several sequences
(`find_packed_sequence_indices`), reading a device value: a host sync that keeps the host from
running ahead of the GPU, and under capture transformers assumes packing and builds a dense mask
(SDPA then loses its causal fast path). An unpacked target row is one sequence from position 0 (right
padding only), so `single_sequence_rows` answers that check without reading the device; a packed
row's documents are known from its `document_ids`, so `packed_sequence_rows` answers it with them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from dflash_mp.models.packed_rows import document_index, document_positions

log = logging.getLogger(__name__)

Forward = Callable[..., torch.Tensor]


@dataclass(frozen=True)
class PackedRows:
    """The documents of packed rows [B, S], derived on the device from `document_ids`."""

    positions: torch.Tensor  # each token's position within its document (0 at every start)
    index: torch.Tensor  # the document's number within its row (the padding run counts as one)

    @classmethod
    def of(cls, document_ids: torch.Tensor) -> PackedRows:
        return cls(document_positions(document_ids), document_index(document_ids))


_active_rows: PackedRows | None = None


def packed_rows() -> PackedRows | None:
    """The rows of the packed forward running now (None outside one): what our own kernels
    (gated deltanet, sink attention) read to keep documents apart."""
    return _active_rows


@contextmanager
def single_sequence_rows() -> Iterator[None]:
    """Within: transformers' masks treat every row as one unpacked sequence, and do not take a
    CUDA graph capture for tracing (they build what an eager forward builds)."""
    with _masks_see(lambda position_ids: None):
        yield


@contextmanager
def packed_sequence_rows(rows: PackedRows, hf_masks: bool = True) -> Iterator[None]:
    """Within: `packed_rows()` is `rows`, and transformers' masks (given `rows.positions` as
    position_ids) keep each document to itself, their sequence indices taken from `rows.index`
    rather than read back from the device. `hf_masks=False`: the masks stay plain causal (or
    sliding) ones, for an attention kernel that adds the documents itself."""
    global _active_rows
    known = (lambda position_ids: rows.index) if hf_masks else (lambda position_ids: None)
    saved, _active_rows = _active_rows, rows
    try:
        with _masks_see(known):
            yield
    finally:
        _active_rows = saved


@contextmanager
def _masks_see(find_packed_sequence_indices: Callable[[torch.Tensor], torch.Tensor | None]) -> Iterator[None]:
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    saved = {
        name: getattr(masking_utils, name, None) for name in ("find_packed_sequence_indices", "is_tracing")
    }
    if saved["find_packed_sequence_indices"] is not None:
        masking_utils.find_packed_sequence_indices = find_packed_sequence_indices
    if saved["is_tracing"] is not None:
        masking_utils.is_tracing = _tracing_but_not_capturing(saved["is_tracing"])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is not None:
                setattr(masking_utils, name, value)


def _tracing_but_not_capturing(is_tracing: Callable[..., bool]) -> Callable[..., bool]:
    def check(tensor: torch.Tensor | None = None) -> bool:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            # Tracing proper (dynamo, fx, fake tensors) is decided from the tensor alone.
            return tensor is not None and _traced_tensor(tensor)
        return is_tracing(tensor)

    return check


def _traced_tensor(tensor: torch.Tensor) -> bool:
    from torch._subclasses.fake_tensor import FakeTensor

    return isinstance(tensor, (FakeTensor, torch.fx.Proxy))


class GraphedForward:
    """`forward(input_ids[, document_ids]) -> features` replayed from one CUDA graph per input shape.

    The first call of a shape runs eagerly twice (compiled code and autotuned kernels settle)
    and captures; later calls copy the inputs in, replay, and return a copy of the output. A call
    with packed rows' `document_ids` has graphs of its own: their positions, masks and document
    resets are derived inside the graph from the static copy of the ids, so a replay follows the
    documents of the call. Every graph writes its output into one storage of `output_elements`
    (or the first output's size), so graphs cost no memory per shape beyond their pool; a shape
    whose output does not fit, and shapes beyond `max_graphs`, run eagerly. A capture that fails
    (an operation that cannot be captured) turns graphs off for the rest of the job with one
    warning naming the cause; the eager forward keeps running.
    """

    def __init__(self, forward: Forward, max_graphs: int = 64, output_elements: int = 0) -> None:
        self.forward = forward
        self.max_graphs = max_graphs
        self.output_elements = output_elements
        self.graphs: dict[tuple, tuple[torch.cuda.CUDAGraph, tuple[torch.Tensor, ...], torch.Tensor]] = {}
        self.eager_shapes: set[tuple] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.output: torch.Tensor | None = None  # the storage every graph's output is a view of
        self.off_because: str | None = None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor, document_ids: torch.Tensor | None = None) -> torch.Tensor:
        inputs = (input_ids,) if document_ids is None else (input_ids, document_ids)
        key = tuple(input_ids.shape) if document_ids is None else ("packed", *input_ids.shape)
        if self.off_because is not None or not input_ids.is_cuda or key in self.eager_shapes:
            return self.forward(*inputs)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(key, inputs) if len(self.graphs) < self.max_graphs else None
            if entry is None:
                self.eager_shapes.add(key)
                return self.forward(*inputs)
        graph, static_inputs, static_features = entry
        for static, value in zip(static_inputs, inputs, strict=True):
            static.copy_(value)
        graph.replay()
        return static_features.clone()

    def _capture(self, key: tuple, inputs: tuple[torch.Tensor, ...]):
        device = inputs[0].device
        static_inputs = tuple(t.clone() for t in inputs)
        side = torch.cuda.Stream(device=device)
        side.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = self.forward(*static_inputs)
        torch.cuda.current_stream(device).wait_stream(side)
        if self.output is None:
            size = max(self.output_elements, eager.numel())
            self.output = torch.empty(size, dtype=eager.dtype, device=eager.device)
        if eager.numel() > self.output.numel() or eager.dtype != self.output.dtype:
            log.info(
                "target forward of input shape %s runs eagerly (its output exceeds the graphs')",
                list(inputs[0].shape),
            )
            return None
        static_features = self.output[: eager.numel()].view(eager.shape)
        del eager
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_features.copy_(self.forward(*static_inputs))
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager forward correct
            self.off_because = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.graphs.clear()
            torch.cuda.synchronize(device)
            release_generator_from_capture(device)
            log.warning("CUDA graphs off for the target forward (eager from now on): %s", self.off_because)
            return None
        entry = self.graphs[key] = (graph, static_inputs, static_features)
        log.info(
            "captured the target forward for input shape %s%s (%d graphs)",
            list(inputs[0].shape),
            " (packed rows)" if len(inputs) > 1 else "",
            len(self.graphs),
        )
        return entry


def release_generator_from_capture(device: torch.device) -> None:
    """Take the device's default generator out of capture mode after a capture that failed.

    A capture registers the default CUDA generator when it begins and releases it when it ends;
    a capture invalidated on the way (a host read, a sync) raises from its end before the release,
    and every later random op of the process then fails with "Offset increment outside graph
    capture encountered unexpectedly" (torch 2.11, seen on an H200). The generator gets a fresh
    state at the same seed and offset: the random stream goes on where it was."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    stuck = torch.cuda.default_generators[index]
    fresh = torch.Generator(device=torch.device("cuda", index))
    fresh.manual_seed(stuck.initial_seed())
    fresh.set_offset(stuck.get_offset())
    stuck.graphsafe_set_state(fresh)
