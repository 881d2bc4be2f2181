"""The drafter's optimizer step: schedule, non-finite handling, metrics without secrets."""

from __future__ import annotations

import math
import warnings
from dataclasses import replace

import pytest
import torch

from dflash_mp.config.schema import compose_config, to_dataclass
from dflash_mp.data import JsonlIndex
from dflash_mp.runtime.roles import (
    hidden_states_for_drafter,
    make_feature_extractor,
    make_reader,
)
from dflash_mp.training.features import features_of
from dflash_mp.training.recipe import lr_at
from dflash_mp.training.trainer import DrafterTrainer, NonFiniteStep


def test_schedule_warms_up_then_decays_to_the_floor():
    lrs = [lr_at(s, 100, 1e-3, 0.04, 0.1) for s in range(100)]
    assert lrs[0] == pytest.approx(2.5e-4) and lrs[3] == pytest.approx(1e-3)
    assert all(a >= b for a, b in zip(lrs[3:], lrs[4:], strict=False))
    assert lrs[-1] == pytest.approx(1e-4, rel=1e-2)


def _micro_batch(cfg):
    reader = make_reader(cfg, JsonlIndex(list(cfg.data.train_files)))
    extractor = make_feature_extractor(cfg, torch.float32, torch.device("cpu"))
    batch = reader.read(0)
    return features_of(batch, hidden_states_for_drafter(extractor, batch, torch.float32, torch.device("cpu")))


# cuda: the update is queued before the read-back and skipped on the device (StreamingAdamW)
DEVICES = [
    "cpu",
    pytest.param(
        "cuda",
        marks=[pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")],
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("policy", ["skip", "stop"])
def test_a_non_finite_loss_skips_the_step_or_stops_naming_it(policy, device):
    cfg = to_dataclass(compose_config(["train.max_steps=4", f"train.on_nonfinite={policy}"]))
    trainer = DrafterTrainer(cfg, torch.device(device), total_steps=4)
    batch = _batch_on(_micro_batch(cfg), device, trainer.hidden_dtype)
    trainer.micro_step(batch, last_of_step=True)
    assert not trainer.optimizer_step()["skipped"]
    before = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    batch.hidden_states[0, 0, 0] = math.nan
    trainer.micro_step(batch, last_of_step=True)
    if policy == "stop":
        with pytest.raises(FloatingPointError, match="at step 2.*train.on_nonfinite=skip"):
            trainer.optimizer_step()
        return
    record = trainer.optimizer_step()
    assert record["skipped"] and record["step"] == 2
    for name, value in trainer.drafter.state_dict().items():
        assert torch.equal(value, before[name]), name
    assert all(p.grad is None for p in trainer.drafter.parameters())
    assert all(float(s["step"]) == 1 for s in trainer.optimizer.state.values())  # AdamW's count too


def test_skipping_non_finite_steps_stops_once_too_many_come_in_a_row():
    cfg = to_dataclass(
        compose_config(["train.max_steps=10", "train.on_nonfinite=skip", "train.max_nonfinite_in_a_row=3"])
    )
    trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=10)
    good = _batch_on(_micro_batch(cfg), "cpu", trainer.hidden_dtype)
    bad = _batch_on(_micro_batch(cfg), "cpu", trainer.hidden_dtype)
    bad.hidden_states[0, 0, 0] = math.nan

    def step(batch):
        trainer.micro_step(batch, last_of_step=True)
        return trainer.optimizer_step()

    # Two in a row, then an applied step resets the count; the third of the next run stops.
    assert [step(b)["skip_reason"] for b in (good, bad, bad, good, bad, bad)] == [
        None,
        "nonfinite",
        "nonfinite",
        None,
        "nonfinite",
        "nonfinite",
    ]
    with pytest.raises(FloatingPointError, match=r"steps 5 to 7: 3 steps in a row.*max_nonfinite_in_a_row"):
        step(bad)


def test_the_non_finite_step_that_stops_the_job_has_its_line_in_metrics_jsonl(tmp_path):
    """The step train.on_nonfinite=stop ends on is written like a skipped one (every field of a
    step, loss null), marked stopped_the_job, before the job fails."""
    from types import SimpleNamespace

    from dflash_mp.run.metrics import MetricsLogger
    from dflash_mp.runtime.job import train
    from tests.conftest import read_metrics

    cfg = to_dataclass(compose_config(["train.max_steps=4", "train.on_nonfinite=stop"]))
    trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=4)
    good = _batch_on(_micro_batch(cfg), "cpu", trainer.hidden_dtype)
    bad = _batch_on(_micro_batch(cfg), "cpu", trainer.hidden_dtype)
    bad.hidden_states[0, 0, 0] = math.nan

    def run_role(cfg, job, trainer, start_step, steps, on_step) -> None:
        for batch in (good, bad, good):
            trainer.micro_step(batch, last_of_step=True)
            on_step(trainer.optimizer_step())

    metrics = MetricsLogger(tmp_path, 4, 0, cfg.logger, {})
    recorder = SimpleNamespace(metrics=metrics, record=metrics.log)
    with pytest.raises(NonFiniteStep, match="at step 2"):
        train(cfg, None, trainer, 0, 4, run_role, recorder)
    first, last = read_metrics(tmp_path)
    assert last["step"] == 2 and last["skipped"] and last["skip_reason"] == "nonfinite", last
    assert last["stopped_the_job"] and last["loss"] is None and set(first) < set(last)


def test_wandb_runs_offline_and_never_writes_the_api_key(tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    from dflash_mp.run.metrics import MetricsLogger

    secret = "0123456789abcdef0123456789abcdef01234567"
    monkeypatch.setenv("WANDB_API_KEY", secret)
    monkeypatch.setenv("WANDB_SILENT", "true")
    cfg = to_dataclass(compose_config(["logger=wandb"]))
    assert cfg.logger.mode == "offline"
    metrics = MetricsLogger(tmp_path, 2, 0, cfg.logger, {"optim": {"lr": 1e-3}})
    for step in (1, 2):
        metrics.log({"step": step, "loss": 1.0 / step, "lr": 1e-3, "samples_per_s": 1.0, "acc": [0.5]})
    metrics.close()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert any("wandb" in p.parts for p in files)  # an offline run was written for `wandb sync`
    for path in files:
        assert secret.encode() not in path.read_bytes(), path


def _empty_like(batch):
    """What a drafter receives when every record of its micro-batch was skipped as bad."""
    from dataclasses import replace

    no_rows = torch.empty(0, 0, dtype=torch.long)
    return replace(
        batch,
        input_ids=no_rows,
        loss_mask=no_rows,
        lengths=torch.empty(0, dtype=torch.long),
        sample_ids=torch.empty(0, dtype=torch.long),
        hidden_states=torch.empty(0, 0, batch.hidden_states.shape[-1]),
        bad_records=1,
    )


def test_an_empty_micro_batch_adds_exactly_zero_gradient_and_does_not_dilute_the_step():
    overrides = ["train.max_steps=4", "train.micro_batch_size=2"]
    with_empty = DrafterTrainer(
        to_dataclass(compose_config([*overrides, "train.grad_accum=2"])), torch.device("cpu"), total_steps=4
    )
    alone = DrafterTrainer(
        to_dataclass(compose_config([*overrides, "train.grad_accum=1"])), torch.device("cpu"), total_steps=4
    )
    batch = _micro_batch(alone.cfg)
    with_empty.micro_step(_empty_like(batch), last_of_step=False)
    assert all(p.grad is not None and not p.grad.any() for p in with_empty.drafter.parameters())
    with_empty.micro_step(batch, last_of_step=True)
    alone.micro_step(batch, last_of_step=True)
    mixed, single = with_empty.optimizer_step(), alone.optimizer_step()
    assert mixed["micro_batches_without_loss"] == 1 and not mixed["skipped"]
    assert mixed["loss"] == single["loss"] and mixed["grad_norm"] == single["grad_norm"]
    expected = alone.drafter.state_dict()
    for name, value in with_empty.drafter.state_dict().items():
        assert torch.equal(value, expected[name]), name


def test_micro_batches_prepared_while_the_update_runs_train_exactly_as_unprepared_ones():
    # The runtime's loop (roles.run_drafter): the next step's first micro-batch is received and
    # its blocks queued inside optimizer_step, once the update is queued; an empty one included.
    cfg = to_dataclass(
        compose_config(["train.max_steps=3", "train.grad_accum=2", "train.micro_batch_size=2"])
    )
    plain = DrafterTrainer(cfg, torch.device("cpu"), total_steps=3)
    early = DrafterTrainer(cfg, torch.device("cpu"), total_steps=3)
    batch = _micro_batch(cfg)
    steps = [(batch, _empty_like(batch)), (_empty_like(batch), batch), (batch, batch)]
    plain_records = []
    for first, second in steps:
        plain.micro_step(first, last_of_step=False)
        plain.micro_step(second, last_of_step=True)
        plain_records.append(plain.optimizer_step())

    queued = [early.prepare(steps[0][0])]
    early_records, updated_when_preparing = [], []
    for step, (_, second) in enumerate(steps):
        early.micro_step(queued.pop(), last_of_step=False)
        early.micro_step(early.prepare(second), last_of_step=True)
        before = early.drafter.fc.weight.detach().clone()

        def prepare_next(step=step, before=before):
            # The update is queued (on CPU: done) before the host turns to the next micro-batch.
            updated_when_preparing.append(not torch.equal(early.drafter.fc.weight, before))
            if step + 1 < len(steps):
                queued.append(early.prepare(steps[step + 1][0]))

        early_records.append(early.optimizer_step(while_waiting=prepare_next))
    assert updated_when_preparing == [True, True, True]
    for mine, theirs in zip(early_records, plain_records, strict=True):
        assert (mine["loss"], mine["grad_norm"], mine["acc"]) == (
            theirs["loss"],
            theirs["grad_norm"],
            theirs["acc"],
        )
        assert (
            mine["micro_batches_without_loss"]
            == theirs["micro_batches_without_loss"]
            == 1 - (mine["step"] == 3)
        )
    expected = plain.drafter.state_dict()
    for name, value in early.drafter.state_dict().items():
        assert torch.equal(value, expected[name]), name


@pytest.mark.parametrize("device", DEVICES)
def test_a_step_without_loss_tokens_leaves_weights_and_optimizer_alone(device):
    cfg = to_dataclass(compose_config(["train.max_steps=4", "train.micro_batch_size=2"]))
    trainer = DrafterTrainer(cfg, torch.device(device), total_steps=4)
    batch = _micro_batch(cfg)
    trainer.micro_step(_batch_on(batch, device, trainer.hidden_dtype), last_of_step=True)
    trainer.optimizer_step()  # AdamW now has momentum that a zero gradient would still apply
    weights = {k: v.clone() for k, v in trainer.drafter.state_dict().items()}
    adam_steps = [s["step"].clone() for s in trainer.optimizer.state.values()]
    trainer.micro_step(_batch_on(_empty_like(batch), device, trainer.hidden_dtype), last_of_step=True)
    record = trainer.optimizer_step()
    assert record["skipped"] and record["skip_reason"] == "no_loss_tokens" and record["loss"] is None
    assert record["step"] == 2 and record["bad_records"] == 1 and record["micro_batches_without_loss"] == 1
    for name, value in trainer.drafter.state_dict().items():
        assert torch.equal(value, weights[name]), name
    assert [s["step"] for s in trainer.optimizer.state.values()] == adam_steps


def test_wandb_gets_every_per_position_list_flattened(tmp_path):
    from dflash_mp.run.metrics import MetricsLogger

    logged = []

    class FakeRun:
        def log(self, flat, step):
            logged.append((step, flat))

    metrics = MetricsLogger(tmp_path, 1, 0, to_dataclass(compose_config([])).logger, {})
    metrics.wandb = FakeRun()
    metrics.log(
        {"step": 1, "loss": 2.0, "lr": 1e-3, "samples_per_s": 1.0, "acc": [0.5, 0.25], "topk_recall": [0.9]}
    )
    metrics.wandb = None
    metrics.close()
    step, flat = logged[0]
    assert step == 1 and flat["acc/pos2"] == 0.25 and flat["topk_recall/pos1"] == 0.9 and flat["loss"] == 2.0


@pytest.mark.gpu
def test_a_warm_drafter_step_synchronises_with_the_host_once():
    cfg = to_dataclass(
        compose_config(["train.max_steps=8", "train.grad_accum=2", "train.micro_batch_size=2"])
    )
    device = torch.device("cuda")
    trainer = DrafterTrainer(cfg, device, total_steps=8)  # compiled, flex attention, the Triton AdamW
    batch = _batch_on(_micro_batch(cfg), device, trainer.hidden_dtype)

    early = [trainer.prepare(batch)]

    def step() -> dict:  # as roles.run_drafter: the next step's first micro-batch prepared early
        trainer.micro_step(early.pop(), last_of_step=False)
        trainer.micro_step(batch, last_of_step=True)
        return trainer.optimizer_step(while_waiting=lambda: early.append(trainer.prepare(batch)))

    for _ in range(2):  # compiles, creates AdamW's state
        step()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            record = step()
    finally:
        torch.cuda.set_sync_debug_mode("default")
    syncs = [f"{w.filename}:{w.lineno}" for w in caught if "synchroniz" in str(w.message)]
    # Exactly the optimizer step's one read-back (none at all would mean the count is broken).
    assert len(syncs) == 1, syncs
    assert not record["skipped"] and math.isfinite(record["loss"]) and record["grad_norm"] > 0


def _batch_on(batch, device, dtype):
    return replace(
        batch,
        input_ids=batch.input_ids.to(device),
        loss_mask=batch.loss_mask.to(device),
        lengths=batch.lengths.to(device),
        sample_ids=batch.sample_ids.to(device),
        hidden_states=batch.hidden_states.to(device, dtype),
    )


@pytest.mark.parametrize(
    "device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
)  # cuda: the Triton pass multiplies inside its update
@pytest.mark.parametrize("grad_clip", [0.0, 1e-3])
def test_the_step_is_adamw_on_the_clipped_gradient(grad_clip, device):
    """The rescale and the clip reach AdamW as one multiplier; the update must equal AdamW on
    torch's own clip_grad_norm_ of the same gradient, and the recorded norm the unclipped one."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU (run on the device machine)")
    cfg = to_dataclass(compose_config(["train.max_steps=4", f"optim.grad_clip={grad_clip}"]))
    trainer = DrafterTrainer(cfg, torch.device(device), total_steps=4)
    trainer.micro_step(_batch_on(_micro_batch(cfg), device, trainer.hidden_dtype), last_of_step=True)
    # What the optimizer updates: the parameters, or on CUDA the fp32 masters of the bf16 working
    # weights, whose gradients are their copies' (bf16 matmul results either way).
    optimizer = trainer.optimizer
    params = [
        p for group in optimizer.param_groups for p in group["params"] if optimizer.gradient(p) is not None
    ]
    assert all(p.dtype == torch.float32 for p in params)
    shadow = [p.detach().clone().requires_grad_(True) for p in params]
    for copy, param in zip(shadow, params, strict=True):
        copy.grad = optimizer.gradient(param).float().clone()
    expected_norm = float(torch.nn.utils.clip_grad_norm_(shadow, grad_clip if grad_clip > 0 else math.inf))
    o = cfg.optim
    lr = lr_at(0, 4, o.lr, o.warmup_ratio, o.min_lr_ratio)
    fused = device == "cuda"
    torch.optim.AdamW(shadow, lr=lr, betas=tuple(o.betas), weight_decay=o.weight_decay, fused=fused).step()
    record = trainer.optimizer_step()
    assert record["grad_norm"] == pytest.approx(expected_norm, rel=1e-5)
    assert grad_clip == 0 or expected_norm > grad_clip  # when set, the clip did act
    for copy, param in zip(shadow, params, strict=True):
        torch.testing.assert_close(param.detach(), copy.detach(), rtol=1e-5, atol=1e-7)
    if trainer.working is not None:  # the working copies were written from the updated masters
        assert all(torch.equal(p.detach(), m.bfloat16()) for p, m in trainer.working.master_of.items())


def _stop_vote(rank: int, results) -> None:
    import torch.distributed as dist

    cfg = to_dataclass(compose_config(["train.max_steps=4"]))
    # Only rank 1 is asked to stop; the step's one all-reduce must make both stop together.
    trainer = DrafterTrainer(
        cfg, torch.device("cpu"), 4, group=dist.group.WORLD, stop_requested=lambda: rank == 1
    )
    trainer.micro_step(_micro_batch(cfg), last_of_step=True)
    trainer.optimizer_step()
    results[rank] = trainer.stop_agreed


def test_a_stop_asked_of_one_drafter_is_agreed_by_all_in_the_optimizer_step():
    import socket

    from tests import spawn_pool

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    with spawn_pool.manager() as manager:
        results = manager.dict()
        spawn_pool.start_processes(spawn_pool.in_gloo_group, args=(2, port, _stop_vote, results), nprocs=2)
        assert dict(results) == {0: True, 1: True}


def test_a_slow_path_is_in_every_step_record(monkeypatch):
    """A fused loss path that turned itself off (objective/fused_check.py) rides in each metrics
    record for the progress line; a run without one has no such field."""
    from dflash_mp.objective import fused_check

    cfg = to_dataclass(compose_config(["train.max_steps=2"]))
    trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=2)
    monkeypatch.setattr(fused_check, "_slow_paths", {})
    trainer.micro_step(_micro_batch(cfg), last_of_step=True)
    assert "slow_paths" not in trainer.optimizer_step()
    monkeypatch.setattr(fused_check, "_slow_paths", {"XPress's fused loss kernels": "why"})
    trainer.micro_step(_micro_batch(cfg), last_of_step=True)
    assert trainer.optimizer_step()["slow_paths"] == "XPress's fused loss kernels"
