"""bf16 working weights with fp32 masters: the same training as fp32 weights under autocast.

On CUDA the trainer uses them by default; here, on CPU, both trainers run under CPU bf16 autocast
and must agree bit for bit (the optimizer's torch-AdamW path; its Triton pass is tested in
test_streaming_adamw)."""

from __future__ import annotations

import socket

import pytest
import torch

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.training.trainer import DrafterTrainer
from tests import spawn_pool
from tests.test_trainer import _micro_batch

OVERRIDES = ["train.max_steps=4", "train.micro_batch_size=2"]


def _trainers(
    grad_accum: int, group=None, arch: str = "dflash", optim: str = "adamw"
) -> tuple[DrafterTrainer, DrafterTrainer]:
    overrides = [*OVERRIDES, f"train.grad_accum={grad_accum}", f"model.arch={arch}", f"optim={optim}"]
    cfg = to_dataclass(compose_config(overrides))
    working = DrafterTrainer(cfg, torch.device("cpu"), 4, group=group, working_weights=True)
    reference = DrafterTrainer(cfg, torch.device("cpu"), 4, group=group, working_weights=False)
    reference.autocast = torch.autocast("cpu", dtype=torch.bfloat16)  # fp32 weights, cast by autocast
    return working, reference


def _step(trainer: DrafterTrainer, batches) -> dict:
    for index, batch in enumerate(batches):
        trainer.micro_step(batch, last_of_step=index == len(batches) - 1)
    return trainer.optimizer_step()


def _assert_same_training(working: DrafterTrainer, reference: DrafterTrainer) -> None:
    ours, theirs = working.training_state(), reference.training_state()
    assert ours.model.keys() == theirs.model.keys()
    for name, value in theirs.model.items():
        assert ours.model[name].dtype == value.dtype and torch.equal(ours.model[name], value), name
    for mine, other in zip(ours.optimizer["state"].values(), theirs.optimizer["state"].values(), strict=True):
        assert all(torch.equal(mine[key], other[key]) for key in ("step", "exp_avg", "exp_avg_sq"))


@pytest.mark.parametrize(("grad_accum", "arch"), [(1, "dflash"), (2, "dflash"), (2, "dflash2")])
def test_steps_with_working_weights_equal_steps_with_fp32_weights(grad_accum, arch) -> None:
    # DFlash 2: the convolutions and the selector keep fp32 weights beside the bf16 projections.
    working, reference = _trainers(grad_accum, arch=arch)
    batch = _micro_batch(working.cfg)
    assert working.drafter.fc.weight.dtype == torch.bfloat16
    assert working.drafter.norm.weight.dtype == torch.float32  # norms keep computing from fp32
    if arch == "dflash2":
        assert working.drafter.candidate_selector is not None
        assert all(p.dtype == torch.float32 for p in working.drafter.candidate_selector.parameters())
    for _ in range(2):
        ours, theirs = _step(working, [batch] * grad_accum), _step(reference, [batch] * grad_accum)
        assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"]
    _assert_same_training(working, reference)
    for param, master in working.working.master_of.items():
        assert torch.equal(param.detach(), master.bfloat16())  # the copies follow the masters


def test_a_checkpoint_of_working_weights_is_fp32_and_resumes_the_same() -> None:
    working, reference = _trainers(1)
    batch = _micro_batch(working.cfg)
    _step(working, [batch])
    _step(reference, [batch])
    state = working.training_state()
    assert all(value.dtype == torch.float32 for value in state.model.values())  # the layout of fp32 weights
    resumed, _ = _trainers(1)
    resumed.load_training_state(state)
    for param, master in resumed.working.master_of.items():
        assert torch.equal(param.detach(), master.bfloat16())
    _step(resumed, [batch])
    _step(reference, [batch])
    _assert_same_training(resumed, reference)


def test_evaluation_computes_with_the_masters() -> None:
    working, reference = _trainers(1)
    batch = _micro_batch(working.cfg)
    _step(working, [batch])
    _step(reference, [batch])
    features = batch.hidden_states[:1, :5]
    copies = {name: (param.dtype, param.data_ptr()) for name, param in working.drafter.named_parameters()}
    with working.full_precision_weights(), torch.no_grad():
        assert working.drafter.fc.weight.dtype == torch.float32
        ours = working.drafter.fc(features)  # no autocast: fp32 in, fp32 weights
    restored = {name: (param.dtype, param.data_ptr()) for name, param in working.drafter.named_parameters()}
    assert restored == copies
    with torch.no_grad():
        assert torch.equal(ours, reference.drafter.fc(features))


def _data_parallel(rank: int, grad_accums: tuple[int, ...], results) -> None:
    import torch.distributed as dist

    for grad_accum in grad_accums:
        working, reference = _trainers(grad_accum, group=dist.group.WORLD)
        batch = _micro_batch(working.cfg)
        # Different data per drafter, so the all-reduce has something to average.
        if rank == 1:
            batch = type(batch)(**{**vars(batch), "sample_ids": batch.sample_ids + 7})
        for _ in range(2):
            ours, theirs = _step(working, [batch] * grad_accum), _step(reference, [batch] * grad_accum)
            assert ours["grad_norm"] == theirs["grad_norm"]
        _assert_same_training(working, reference)
        results[rank, grad_accum] = True
    # optim=muon (training/muon.py): both drafters take the same update from the all-reduced
    # gradients, with working weights as with fp32 ones.
    working, reference = _trainers(2, group=dist.group.WORLD, optim="muon")
    batch = _micro_batch(working.cfg)
    if rank == 1:
        batch = type(batch)(**{**vars(batch), "sample_ids": batch.sample_ids + 7})
    for _ in range(2):
        ours, theirs = _step(working, [batch] * 2), _step(reference, [batch] * 2)
        assert ours["loss"] == theirs["loss"] and ours["grad_norm"] == theirs["grad_norm"]
    weights = torch.cat([p.detach().flatten() for p in working.drafter.state_dict().values()])
    gathered = [torch.empty_like(weights) for _ in range(2)]
    dist.all_gather(gathered, weights)
    assert torch.equal(gathered[0], gathered[1])  # the drafters stay identical
    ours_state, theirs_state = working.training_state(), reference.training_state()
    for name, value in theirs_state.model.items():
        assert torch.equal(ours_state.model[name], value), name
    results[rank, "muon"] = True


def test_data_parallel_drafters_reduce_working_gradients_in_fp32() -> None:
    """Accumulating over 1 and 2 micro-batches, in one pair of processes (forked from
    tests/spawn_pool.py's forkserver)."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with spawn_pool.manager() as manager:
        results = manager.dict()
        spawn_pool.start_processes(
            spawn_pool.in_gloo_group, args=(2, port, _data_parallel, (1, 2), results), nprocs=2
        )
        expected = {(rank, accum): True for rank in (0, 1) for accum in (1, 2, "muon")}
        assert dict(results) == expected
