"""What a target rank and a drafter rank do for the length of a job."""

from __future__ import annotations

import itertools

import torch
from torch.distributed.device_mesh import DeviceMesh

from dflash_mp.config.dspark_checks import feature_layer_ids
from dflash_mp.config.precision import resolve_cuda_graphs
from dflash_mp.config.schema import RootConfig, read_target_config, resolved_target_layer_ids
from dflash_mp.data import DataOrder, MicroBatch, MicroBatchReader, Records, packing, padded_width
from dflash_mp.data.chat import load_renderer
from dflash_mp.data.reader import PackedMicroBatchReader
from dflash_mp.run.logs import get_logger
from dflash_mp.runtime.distributed import Job
from dflash_mp.runtime.topology import Topology
from dflash_mp.runtime.transport import Receiver, Sender, pack_tokens
from dflash_mp.runtime.watchdog import Preempted, beat
from dflash_mp.training.features import Features
from dflash_mp.training.trainer import PreparedBatch


def data_order(cfg: RootConfig, records: Records, renderer=None):
    """Micro-batch -> records of this job's data: DataOrder, or PackedOrder under data.packing
    (which reads the packing index: every record's token count, cached)."""
    if not cfg.data.packing:
        return DataOrder(len(records), cfg.train.micro_batch_size, cfg.train.seed)
    renderer = renderer or _renderer(cfg)
    lengths = packing.job_lengths(records, renderer, cfg.data, get_logger(), lambda: beat("index", 0))
    order = packing.PackedOrder(
        lengths.lengths, cfg.data.max_length, cfg.train.micro_batch_size, cfg.train.seed
    )
    order.record_lengths = lengths
    return order


def total_steps(cfg: RootConfig, order, topology: Topology) -> int:
    """Optimizer steps of the run: train.max_steps, or whole steps in train.epochs passes."""
    if cfg.train.max_steps > 0:
        return cfg.train.max_steps
    steps = order.micro_batches(cfg.train.epochs) // topology.micro_batches_per_step
    if steps == 0:
        unit = "packed rows" if cfg.data.packing else "sequences"
        raise ValueError(
            f"the data ({order.micro_batches(cfg.train.epochs)} micro-batches in {cfg.train.epochs} epoch(s)) "
            f"makes no whole optimizer step of {topology.micro_batches_per_step} micro-batches x "
            f"{cfg.train.micro_batch_size} {unit}: lower train.grad_accum / train.micro_batch_size or add data"
        )
    return steps


def _renderer(cfg: RootConfig):
    d = cfg.data
    return load_renderer(
        cfg.model.target_path, cfg.model.trust_remote_code, d.chat_template, d.chat_template_kwargs
    )


def make_reader(cfg: RootConfig, index: Records, order=None) -> MicroBatchReader:
    """The reader of a target rank; `order`: this job's `data_order` (packed data reuses its index)."""
    d = cfg.data
    renderer = _renderer(cfg)
    options = dict(
        index=index,
        tokenizer=renderer.tokenizer,
        max_length=cfg.data.max_length,
        on_bad_record=cfg.data.on_bad_record,
        micro_batch_size=cfg.train.micro_batch_size,
        seed=cfg.train.seed,
        logger=get_logger(),
        pad_to_multiple=cfg.data.pad_to_multiple,
        renderer=renderer,
        on_too_long=d.on_too_long,
        max_bad_fraction=d.max_bad_fraction,
    )
    if not d.packing:
        from dflash_mp.data.validity import full_pass

        # Every record checked (no tokenizer; ~1 s per 100k records) so the bad fraction is the one
        # the preflight judged, wherever the bad records sit.
        return MicroBatchReader(**options, full=full_pass(index))
    if order is None or not hasattr(order, "record_lengths"):
        order = data_order(cfg, index, renderer)
    return PackedMicroBatchReader(**options, lengths=order.record_lengths)


def make_feature_extractor(
    cfg: RootConfig,
    dtype: torch.dtype,
    device: torch.device,
    compile_layers: bool = False,
    mesh: DeviceMesh | None = None,
):
    """The target of `cfg` on `device`; `mesh`: sharded tensor-parallel over this rank's replica."""
    from dflash_mp.models.target import TargetFeatureExtractor
    from dflash_mp.models.target_kernels import format_kernels

    num_layers = int(read_target_config(cfg.model.target_path)["num_hidden_layers"])
    extractor = TargetFeatureExtractor(
        cfg.model.target_path,
        # DSpark's loss also reads the normed last layer (the teacher's distribution): dspark_checks.py.
        feature_layer_ids(resolved_target_layer_ids(cfg, num_layers), num_layers, cfg.model),
        dtype=dtype,
        device=device,
        trust_remote_code=cfg.model.trust_remote_code,
        mesh=mesh,
    )
    # The fast kernels are the GPU default, like compiling; a CPU target stays on HF's own paths.
    kernels = (
        extractor.use_fast_kernels(packed_rows=cfg.data.packing)
        if device.type == "cuda"
        else {"attention": "HF default (CPU)"}
    )
    plans = extractor.compile_layers() if compile_layers else {}
    graphs = resolve_cuda_graphs(cfg, device, tensor_parallel=mesh is not None)
    if graphs:
        width = padded_width(cfg.data.max_length, cfg.data.pad_to_multiple)
        extractor.use_cuda_graphs(max_tokens=cfg.train.micro_batch_size * width)
    elif mesh is not None and str(cfg.train.cuda_graphs).lower() == "true":
        get_logger().warning("train.cuda_graphs=true: a tensor-parallel target runs without graphs")
    get_logger().info(
        "target kernels: %s; compiled: %s; CUDA graphs: %s",
        format_kernels(kernels),
        ", ".join(f"{plan} x{n}" for plan, n in plans.items()) or "nothing",
        "one per input shape" if graphs else "no",
    )
    return extractor


def hidden_states_for_drafter(extractor, batch: MicroBatch, dtype: torch.dtype, device: torch.device):
    if batch.input_ids.shape[0] == 0:
        return torch.empty(0, 0, extractor.hidden_size * len(extractor.layer_ids), dtype=dtype, device=device)
    batch = batch.to(device)  # a no-op when the caller moved it already
    if batch.document_ids is None:
        return extractor(batch.input_ids).to(dtype)
    return extractor(batch.input_ids, batch.document_ids).to(dtype)  # packed rows (data.packing)


def run_target(cfg: RootConfig, job: Job, start_step: int, steps: int, reader, extractor, dtype) -> None:
    """Produce this rank's micro-batches: `reader.read(m)` -> MicroBatch, `extractor(ids)` -> features.

    Every rank of a replica reads and computes the same micro-batches (the forward is one
    tensor-parallel computation); only the replica's leader sends.
    """
    log = get_logger()
    topology = job.topology
    leader = topology.is_replica_leader(job.rank)
    sender = Sender(job.meta_group, None, job.device, cfg.topology.max_inflight_sends)
    start = start_step * topology.micro_batches_per_step
    stop = steps * topology.micro_batches_per_step
    mine = topology.micro_batches_of_target(job.rank, start, stop)
    feature_size = extractor.hidden_size * len(extractor.layer_ids)
    log.info(
        "producing %d micro-batches in [%d, %d) every %d%s",
        len(mine),
        start,
        stop,
        topology.replicas,
        ""
        if leader
        else f" (computing only; rank {topology.replica_ranks(topology.replica_of(job.rank))[0]} sends)",
    )
    bad_before, too_long_before = reader.bad_records, reader.too_long_records
    for m in mine:
        step = m // topology.micro_batches_per_step
        beat("tokenize", step)
        with sender.clock.busy():
            batch = reader.read(m)
        dst = topology.drafter_rank(m)
        bad, bad_before = reader.bad_records - bad_before, reader.bad_records
        too_long, too_long_before = reader.too_long_records - too_long_before, reader.too_long_records
        batch_size, seq_len = batch.input_ids.shape
        # The header goes out before the forward, so the drafter can post its receives early.
        if leader:
            packed = batch.document_ids is not None
            sender.send_header(
                dst, m, batch.epoch, batch_size, seq_len, feature_size, dtype, bad, too_long, packed=packed
            )
        beat("forward", step)
        with sender.clock.busy():
            hidden = hidden_states_for_drafter(extractor, batch, dtype, job.device)
        tokens = pack_tokens(
            batch.input_ids, batch.loss_mask, batch.lengths, batch.sample_ids, batch.document_ids
        )
        beat("send", step)
        if leader:
            sender.send_tensors(dst, tokens, hidden)
    beat("send", steps)
    for drafter, m_end in topology.end_of_data_indices(stop).items():
        if topology.target_rank(m_end) == job.rank:
            sender.send_end_of_data(topology.targets + drafter, m_end)
    sender.close()
    log.info(
        "done: sent %.1f MB, busy %.1fs, waited %.1fs, %d bad records%s",
        sender.bytes_sent / 1e6,
        sender.clock.busy_s,
        sender.clock.wait_s,
        reader.bad_records,
        f", peak GPU memory {torch.cuda.max_memory_allocated(job.device) / 2**30:.1f} GiB"
        if job.device.type == "cuda"
        else "",
    )


def drafter_indices(topology: Topology, drafter: int, start_step: int, steps: int):
    """This drafter's micro-batch indices from `start_step`, then its end-of-data index."""
    per_step = (topology.micro_batches_of_drafter(drafter, s) for s in range(start_step, steps))
    end = topology.end_of_data_indices(steps * topology.micro_batches_per_step)[drafter]
    return itertools.chain(itertools.chain.from_iterable(per_step), [end])


def run_drafter(cfg: RootConfig, job: Job, trainer, start_step: int, steps: int, on_step) -> None:
    """Receive, train, report. `on_step(record)` runs after every optimizer step."""
    log = get_logger()
    topology = job.topology
    receiver = Receiver(
        job.meta_group,
        None,
        job.device,
        drafter_indices(topology, job.drafter_index, start_step, steps),
        topology.target_rank,
    )
    target_balance: dict[int, tuple[float, float]] = {}

    def receive() -> Features:
        beat("receive", trainer.step)
        batch = receiver.next()
        if batch.end_of_data:
            raise RuntimeError(f"end of data at micro-batch {batch.index}, before the last step")
        target_balance[topology.target_rank(batch.index)] = (batch.sender_busy_s, batch.sender_wait_s)
        return batch

    # The next step's first micro-batch, received and prepared while the device runs the update:
    # its ~200 small kernels then wait in the queue instead of the device waiting for them.
    early: list[PreparedBatch] = []

    def receive_early() -> None:
        with receiver.clock.paused():
            batch = receive()
        early.append(trainer.prepare(batch))

    for step in range(start_step, steps):
        for micro in range(cfg.train.grad_accum):
            batch = early.pop() if early else receive()
            beat("compute", trainer.step)
            with receiver.clock.busy():
                trainer.micro_step(batch, last_of_step=micro == cfg.train.grad_accum - 1)
            beat("receive", trainer.step)
            receiver.prefetch()
        beat("optimizer", trainer.step)
        with receiver.clock.busy():
            record = trainer.optimizer_step(while_waiting=receive_early if step + 1 < steps else None)
        record.update(_balance(receiver, target_balance))
        on_step(record)
        if trainer.step < steps and trainer.stop_agreed:
            raise Preempted(trainer.step)
    beat("receive", trainer.step)
    final = receiver.next()
    if not final.end_of_data:
        raise RuntimeError(f"expected the end-of-data flag at micro-batch {final.index}")
    log.info(finished_line(cfg, trainer.step))


def finished_line(cfg: RootConfig, step: int) -> str:
    """What ended the run: train.max_steps, or the last whole step of train.epochs passes."""
    if cfg.train.max_steps > 0:
        return f"reached train.max_steps={cfg.train.max_steps} (step {step})"
    return f"end of data after step {step} (train.epochs={cfg.train.epochs})"


def _balance(receiver: Receiver, targets: dict[int, tuple[float, float]]) -> dict:
    """Busy/wait fractions of each role, so a user sees whether to add targets or drafters."""
    busy, wait = receiver.clock.busy_s, receiver.clock.wait_s
    t_busy = sum(b for b, _ in targets.values())
    t_wait = sum(w for _, w in targets.values())
    return {
        "drafter_busy_frac": busy / max(busy + wait, 1e-9),
        "drafter_wait_frac": wait / max(busy + wait, 1e-9),
        "target_busy_frac": t_busy / max(t_busy + t_wait, 1e-9),
        "target_wait_frac": t_wait / max(t_busy + t_wait, 1e-9),
    }
