"""The colocated layout: its validation, its routing, the launcher's process count and a stop.

The end-to-end equality with the split layout and the resume are in test_runtime_e2e.py, which
shares the split runs they compare against.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import processes_per_job, validate
from dflash_mp.launch import doctor
from dflash_mp.launch.outcome import role_of_rank
from dflash_mp.runtime.topology import Role, Topology
from dflash_mp.runtime.watchdog import EXIT_PREEMPTED, read_heartbeats
from tests.conftest import NO_PLOTS, REPO, job_env, read_metrics


def _cfg(*overrides: str):
    return to_dataclass(compose_config(list(overrides)))


def _problems(cfg, world_size: int | None = None) -> str:
    with pytest.raises(ConfigError) as info:
        validate(cfg, world_size=world_size)
    return str(info.value)


def test_colocated_takes_its_size_from_the_world():
    cfg = _cfg("topology=colocated")
    assert (cfg.topology.layout, cfg.topology.targets, cfg.topology.drafters) == ("colocated", 0, None)
    for world_size in (1, 2, 8):
        validate(cfg, world_size=world_size)
    validate(_cfg("topology=colocated", "topology.drafters=4"), world_size=4)


def test_colocated_with_target_ranks_is_refused_naming_the_fix():
    message = _problems(_cfg("topology.layout=colocated"), world_size=3)  # the default 2t1d's targets=2
    assert "topology.targets=2: the colocated layout has no target ranks" in message
    assert "topology.targets=0" in message and "topology=colocated" in message


def test_colocated_drafters_must_equal_the_world_size():
    message = _problems(_cfg("topology=colocated", "topology.drafters=4"), world_size=8)
    assert "topology.drafters=4 with topology.layout=colocated, but WORLD_SIZE is 8" in message
    assert "topology.drafters=null" in message and "--nproc-per-node 4" in message
    assert "topology.drafters=0: must be >= 1" in _problems(_cfg("topology=colocated", "topology.drafters=0"))


def test_split_layout_problems_point_at_colocated_where_it_fits():
    assert "topology.layout='mixed': must be one of 'split', 'colocated'" in _problems(
        _cfg("topology.layout=mixed")
    )
    message = _problems(_cfg("topology.targets=0", "topology.drafters=2"), world_size=2)
    assert "topology.targets=0: must be >= 1 (no target ranks: topology=colocated)" in message
    message = _problems(_cfg("topology.drafters=null"), world_size=3)
    assert "topology.drafters=None: must be >= 1 (null only with topology.layout=colocated)" in message


def test_processes_per_job():
    assert processes_per_job(_cfg("topology=1t2d"), visible_gpus=8) == 3
    assert processes_per_job(_cfg("topology=colocated", "topology.drafters=3"), visible_gpus=8) == 3
    assert processes_per_job(_cfg("topology=colocated", "train.device=auto"), visible_gpus=8) == 8
    assert processes_per_job(_cfg("topology=colocated", "train.device=cpu"), visible_gpus=8) is None
    assert processes_per_job(_cfg("topology=colocated", "train.device=auto"), visible_gpus=0) is None


def test_doctor_asks_for_the_number_of_ranks_on_cpu(tmp_path):
    checks = doctor.preflight(compose_config(["topology=colocated", "train.device=cpu"]), tmp_path / "run")
    assert [c.message for c in doctor.failed(checks)] == [doctor.UNKNOWN_WORLD]
    checks = doctor.preflight(
        compose_config(["topology=colocated", "topology.drafters=2", "train.device=cpu"]), tmp_path / "run"
    )
    assert not doctor.failed(checks)
    assert any(c.message == "valid for a world of 2 process(es)" for c in checks)


def test_colocated_routes_as_the_split_with_as_many_drafters():
    colocated, split = Topology(0, 3, 2), Topology(2, 3, 2)
    assert colocated.colocated and not split.colocated
    assert colocated.world_size == 3
    assert {colocated.role_of(rank) for rank in range(3)} == {Role.COLOCATED}
    for step in range(4):
        for d in range(3):
            assert colocated.micro_batches_of_drafter(d, step) == split.micro_batches_of_drafter(d, step)
    for m in range(4 * colocated.micro_batches_per_step):
        assert colocated.drafter_rank(m) == colocated.drafter_index(m) == split.drafter_index(m)


def test_a_colocated_rank_reads_the_next_steps_first_micro_batch_while_the_update_runs():
    # The host's work at a step's start (reading, tokenizing, the target's forward, the blocks)
    # happens once the update is queued, so the device does not wait for it (DESIGN.md).
    import torch

    from dflash_mp.data import MicroBatch
    from dflash_mp.runtime.colocated import run_colocated

    events = []
    topology = Topology(0, 2, 2)  # 2 colocated ranks, 2 micro-batches per drafter and step

    class Reader:
        bad_records = too_long_records = 0

        def read(self, m):
            events.append(("read", m))
            ids = torch.full((1, 4), m)
            return MicroBatch(
                m, 0, ids, torch.ones(1, 4), torch.full((1,), 4), torch.zeros(1, dtype=torch.long)
            )

    class Trainer:
        step, stop_agreed = 0, False

        def prepare(self, batch):
            events.append(("prepare", batch.index))
            return batch

        def micro_step(self, batch, last_of_step):
            events.append(("compute", batch.index))

        def optimizer_step(self, while_waiting=None):
            events.append(("update queued", self.step))
            if while_waiting is not None:
                while_waiting()
            self.step += 1
            events.append(("read back", self.step))
            return {"step": self.step}

    def extractor(input_ids):
        return torch.zeros(*input_ids.shape, 8)

    job = type("Job", (), {"topology": topology, "drafter_index": 1, "device": torch.device("cpu")})()
    run_colocated(
        _cfg("train.grad_accum=2"), job, Trainer(), 0, 3, lambda r: None, Reader(), extractor, torch.float32
    )
    # Rank 1 trains on micro-batches 2, 3 of step 0, 6, 7 of step 1, 10, 11 of step 2.
    assert [m for kind, m in events if kind == "compute"] == [2, 3, 6, 7, 10, 11]
    for step, first in ((0, 6), (1, 10)):
        queued, read_back = events.index(("update queued", step)), events.index(("read back", step + 1))
        assert queued < events.index(("read", first)) < events.index(("prepare", first)) < read_back
    assert ("read", 14) not in events  # nothing is read ahead of the last step


def test_role_of_a_rank_that_failed_before_its_heartbeat():
    assert [role_of_rank(r, 2) for r in range(4)] == ["target", "target", "drafter", "drafter"]
    assert role_of_rank(1, 0) == "colocated"
    assert role_of_rank(1, None) == "role unknown"


@pytest.mark.slow
def test_a_stop_signal_checkpoints_every_colocated_rank_at_the_same_step(tmp_path):
    """SIGTERM from outside: the ranks agree on a step over the default group, the first one
    checkpoints, and all leave with EXIT_PREEMPTED."""
    run, steps = tmp_path / "stopped", 400  # long enough to be running when the signal comes
    cmd = [sys.executable, "-m", "dflash_mp.launch", "run", f"run_dir={run}", "topology=colocated"]
    cmd += [
        "topology.drafters=2",
        f"train.max_steps={steps}",
        "train.export=false",
        "logger.progress_every=1000",
        NO_PLOTS,
    ]
    with open(tmp_path / "job.out", "w") as out:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=job_env(), stdout=out, stderr=subprocess.STDOUT, start_new_session=True
        )
        try:
            deadline = time.monotonic() + 120
            metrics = run / "metrics.jsonl"
            while proc.poll() is None and time.monotonic() < deadline:
                if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
                    break
                time.sleep(0.05)
            assert proc.poll() is None, (tmp_path / "job.out").read_text()[-3000:]
            os.killpg(proc.pid, signal.SIGTERM)
            assert proc.wait(timeout=120) == EXIT_PREEMPTED
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    stopped_at = json.loads((run / "PREEMPTED").read_text())["step"]
    assert 3 <= stopped_at < steps
    assert [r["step"] for r in read_metrics(run)] == list(range(1, stopped_at + 1))
    assert (run / "checkpoints" / f"step_{stopped_at:08d}" / "drafter.safetensors").is_file()
    beats = read_heartbeats(run)
    assert {b["role"] for b in beats.values()} == {"colocated"}
    assert {b["state"] for b in beats.values()} == {"preempted"}
    assert "job PREEMPTED: exit code 75" in (run / "logs" / "job.log").read_text()


def test_a_micro_batch_moves_whole_and_unchanged():
    import torch

    from dflash_mp.data.reader import collate_packed
    from dflash_mp.data.samples import Sample

    rows = [[Sample(7, [1, 2, 3], [0, 1, 1]), Sample(9, [4, 5], [0, 1])], [Sample(3, [6], [1])]]
    batch = collate_packed(2, 1, rows, pad_id=0, pad_to_multiple=4)
    moved = batch.to(torch.device("cpu"))
    assert (moved.index, moved.epoch) == (2, 1)
    for name in ("input_ids", "loss_mask", "lengths", "sample_ids", "document_ids"):
        before, after = getattr(batch, name), getattr(moved, name)
        assert after.dtype == before.dtype and torch.equal(after, before), name
    assert moved.document_ids.tolist() == [[7, 7, 7, 9, 9, -1, -1, -1], [3, -1, -1, -1, -1, -1, -1, -1]]


@pytest.mark.gpu
def test_a_warm_colocated_step_on_packed_rows_synchronises_with_the_host_once():
    """Reading, the copy to the GPU, the target's forward of packed rows and the next blocks are
    queued behind the update without waiting for it; each step reads back once. A micro-batch
    copied from pageable memory waits for the whole queue first, and the device then idles while
    the host prepares the next step (9% of a packed chat step at the Qwen3-8B shape on an H100)."""
    import traceback
    import warnings

    import torch

    from dflash_mp.data import JsonlIndex
    from dflash_mp.runtime.colocated import run_colocated
    from dflash_mp.runtime.roles import make_feature_extractor, make_reader
    from dflash_mp.training.trainer import DrafterTrainer

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    steps = 5
    cfg = _cfg(
        "topology=colocated", "data.packing=true", "data.pad_to_multiple=128", f"train.max_steps={steps}"
    )
    device = torch.device("cuda")
    trainer = DrafterTrainer(cfg, device, total_steps=steps)
    reader = make_reader(cfg, JsonlIndex(list(cfg.data.train_files)))
    extractor = make_feature_extractor(cfg, trainer.hidden_dtype, device, compile_layers=True)
    job = type("Job", (), {"topology": Topology(0, 1, 1), "drafter_index": 0, "device": device})()
    syncs: list[list[traceback.FrameSummary]] = []  # the stack of each synchronising call, step 3 on

    def on_step(record):
        if record["step"] == 2:  # compiled, graphs captured, AdamW's state created
            torch.cuda.synchronize()
            torch.cuda.set_sync_debug_mode("warn")

    def note(message, *args, **kwargs):
        if "synchroniz" in str(message):
            syncs.append(traceback.extract_stack())

    with warnings.catch_warnings():
        warnings.simplefilter("always")
        warnings.showwarning = note
        try:
            run_colocated(cfg, job, trainer, 0, steps, on_step, reader, extractor, trainer.hidden_dtype)
        finally:
            torch.cuda.set_sync_debug_mode("default")

    def through(stack, *functions: str) -> bool:
        return any(frame.name in functions for frame in stack)

    read_backs = [stack for stack in syncs if any(f.filename.endswith("step_totals.py") for f in stack)]
    # The next step's early work: reading, the copy to the GPU, the target, the blocks.
    early = [stack for stack in syncs if through(stack, "through_target", "prepare")]
    shown = "\n\n".join("".join(traceback.format_list(s[-12:])) for s in syncs if s not in read_backs)
    print(f"synchronising calls besides the read-backs:\n{shown or 'none'}")  # -rA shows it
    assert len(read_backs) == steps - 2 and not early, shown  # steps 3..5: one read-back each
    assert trainer.step == steps
