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
(SDPA then loses its causal fast path). A target row here is one sequence from position 0 (right
padding only), so `single_sequence_rows` answers that check without reading the device.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch

log = logging.getLogger(__name__)

Forward = Callable[[torch.Tensor], torch.Tensor]


@contextmanager
def single_sequence_rows() -> Iterator[None]:
    """Within: transformers' masks treat every row as one unpacked sequence, and do not take a
    CUDA graph capture for tracing (they build what an eager forward builds)."""
    try:
        from transformers import masking_utils
    except ImportError:
        yield
        return
    saved = {
        name: getattr(masking_utils, name, None) for name in ("find_packed_sequence_indices", "is_tracing")
    }
    if saved["find_packed_sequence_indices"] is not None:
        masking_utils.find_packed_sequence_indices = _no_packed_sequences
    if saved["is_tracing"] is not None:
        masking_utils.is_tracing = _tracing_but_not_capturing(saved["is_tracing"])
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is not None:
                setattr(masking_utils, name, value)


def _no_packed_sequences(position_ids: torch.Tensor) -> None:
    return None


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
    """`forward(input_ids) -> features` replayed from one CUDA graph per input shape.

    The first call of a shape runs eagerly twice (compiled code and autotuned kernels settle)
    and captures; later calls copy the ids in, replay, and return a copy of the output. Every
    graph writes its output into one storage of `output_elements` (or the first output's size),
    so graphs cost no memory per shape beyond their pool; a shape whose output does not fit, and
    shapes beyond `max_graphs`, run eagerly. A capture that fails (an operation that cannot be
    captured) turns graphs off for the rest of the job with one warning naming the cause; the
    eager forward keeps running.
    """

    def __init__(self, forward: Forward, max_graphs: int = 64, output_elements: int = 0) -> None:
        self.forward = forward
        self.max_graphs = max_graphs
        self.output_elements = output_elements
        self.graphs: dict[tuple[int, ...], tuple[torch.cuda.CUDAGraph, torch.Tensor, torch.Tensor]] = {}
        self.eager_shapes: set[tuple[int, ...]] = set()
        self.pool = torch.cuda.graph_pool_handle()
        self.output: torch.Tensor | None = None  # the storage every graph's output is a view of
        self.off_because: str | None = None

    @torch.inference_mode()
    def __call__(self, input_ids: torch.Tensor) -> torch.Tensor:
        key = tuple(input_ids.shape)
        if self.off_because is not None or not input_ids.is_cuda or key in self.eager_shapes:
            return self.forward(input_ids)
        entry = self.graphs.get(key)
        if entry is None:
            entry = self._capture(input_ids) if len(self.graphs) < self.max_graphs else None
            if entry is None:
                self.eager_shapes.add(key)
                return self.forward(input_ids)
        graph, static_ids, static_features = entry
        static_ids.copy_(input_ids)
        graph.replay()
        return static_features.clone()

    def _capture(self, input_ids: torch.Tensor):
        static_ids = input_ids.clone()
        side = torch.cuda.Stream(device=input_ids.device)
        side.wait_stream(torch.cuda.current_stream(input_ids.device))
        with torch.cuda.stream(side):
            for _ in range(2):
                eager = self.forward(static_ids)
        torch.cuda.current_stream(input_ids.device).wait_stream(side)
        if self.output is None:
            size = max(self.output_elements, eager.numel())
            self.output = torch.empty(size, dtype=eager.dtype, device=eager.device)
        if eager.numel() > self.output.numel() or eager.dtype != self.output.dtype:
            log.info(
                "target forward of input shape %s runs eagerly (its output exceeds the graphs')",
                list(input_ids.shape),
            )
            return None
        static_features = self.output[: eager.numel()].view(eager.shape)
        del eager
        graph = torch.cuda.CUDAGraph()
        try:
            with torch.cuda.graph(graph, pool=self.pool):
                static_features.copy_(self.forward(static_ids))
        except Exception as e:  # noqa: BLE001 - any capture failure leaves the eager forward correct
            self.off_because = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self.graphs.clear()
            torch.cuda.synchronize(input_ids.device)
            release_generator_from_capture(input_ids.device)
            log.warning("CUDA graphs off for the target forward (eager from now on): %s", self.off_because)
            return None
        entry = self.graphs[tuple(input_ids.shape)] = (graph, static_ids, static_features)
        log.info(
            "captured the target forward for input shape %s (%d graphs)",
            list(input_ids.shape),
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
