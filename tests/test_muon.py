"""optim=muon (training/muon.py): the parameter split and the update against speculators 0.9.0's
`build_optimizers` (torch.optim.Muon + AdamW), the trainer's step path (multiplier, a skipped step)
and a resume through a checkpoint on disk that continues bit for bit, working weights included."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.run import checkpoint
from dflash_mp.training.muon import MuonAdamW, build_optimizer, muon_split
from dflash_mp.training.trainer import DrafterTrainer
from tests.speculators_reference import speculators_module
from tests.test_flash_attention import tiny_problem
from tests.test_trainer import _micro_batch

DFLASH2 = {
    "arch": "dflash2",
    "dflash2": dict(conv_kernel_size=2, conv_group_size=16, selector_rank=8, selector_top_k=4),
}
# speculators' trainer defaults (train/config/schema.py OptimizerArgs), AdamW's betas and eps torch's.
OPTIM = SimpleNamespace(
    name="muon",
    lr=1e-3,
    betas=(0.9, 0.999),
    weight_decay=0.01,
    muon_momentum=0.95,
    muon_nesterov=True,
    muon_weight_decay=0.1,
    muon_ns_steps=5,
    muon_adjust_lr="match_rms_adamw",
)


@pytest.mark.parametrize("options", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_the_split_is_speculators_and_keeps_tables_and_norms_on_adamw(options) -> None:
    drafter = tiny_problem(1, **options)[0]
    names = {id(p): name for name, p in drafter.named_parameters()}
    matrices, others = muon_split(drafter)
    reference = speculators_module("train.optimizers")
    theirs, their_others = reference.split_named_params_for_muon(drafter)
    assert [names[id(p)] for p in matrices] == [name for name, _ in theirs]
    assert [names[id(p)] for p in others] == [name for name, _ in their_others]
    chosen = {names[id(p)] for p in matrices}
    assert "fc.weight" in chosen and "layers.0.self_attn.q_proj.weight" in chosen
    assert not any("norm" in name for name in chosen)
    if options:  # the codebooks are vocabulary tables; the base kernels are 3-D
        assert "candidate_selector.hidden_projection.weight" in chosen
        assert "layers.0.mlp_conv.kernel_projection.weight" in chosen
        assert not any("codebook" in name or "base_kernel" in name for name in chosen)


def _random_grads(params, step: int) -> list[torch.Tensor]:
    generator = torch.Generator().manual_seed(100 + step)
    return [torch.randn(p.shape, generator=generator) for p in params]


@pytest.mark.parametrize("options", [{}, DFLASH2], ids=["dflash", "dflash2"])
def test_steps_equal_speculators_muon_and_adamw_bit_for_bit(options) -> None:
    ours_model = tiny_problem(1, **options)[0]
    theirs_model = tiny_problem(1, **options)[0]
    ours = build_optimizer(OPTIM, ours_model)
    config = SimpleNamespace(
        optimizer="muon", lr=OPTIM.lr, weight_decay=OPTIM.weight_decay, muon_lr=OPTIM.lr,
        muon_momentum=OPTIM.muon_momentum, muon_weight_decay=OPTIM.muon_weight_decay,
        muon_ns_steps=OPTIM.muon_ns_steps, muon_adjust_lr_fn=OPTIM.muon_adjust_lr,
    )  # fmt: skip
    theirs = speculators_module("train.optimizers").build_optimizers(theirs_model, config)
    assert [type(o).__name__ for o in theirs] == ["Muon", "AdamW"]
    multiplier = torch.tensor(0.5)
    for step in range(3):
        grads = _random_grads(list(ours_model.parameters()), step)
        for p, g in zip(ours_model.parameters(), grads, strict=True):
            p.grad = g.clone()
        for p, g in zip(theirs_model.parameters(), grads, strict=True):
            p.grad = g * multiplier  # the trainer's clip and rescale, applied by ours inside the step
        ours.step(grad_multiplier=multiplier, applies=torch.tensor(True))
        for optimizer in theirs:
            optimizer.step()
        ours.zero_grad()
    for (name, mine), other in zip(ours_model.named_parameters(), theirs_model.parameters(), strict=True):
        assert torch.equal(mine, other), name
    moved = [
        n
        for n, p in ours_model.named_parameters()
        if not torch.equal(p, tiny_problem(1, **options)[0].get_parameter(n))
    ]
    assert "fc.weight" in moved and "norm.weight" in moved


def test_a_step_that_does_not_apply_changes_nothing() -> None:
    model = tiny_problem(1)[0]
    optimizer = build_optimizer(OPTIM, model)
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    for p, g in zip(model.parameters(), _random_grads(list(model.parameters()), 0), strict=True):
        p.grad = g
    optimizer.step(grad_multiplier=torch.tensor(1.0), applies=torch.tensor(False))
    optimizer.uncount_last_step()
    assert all(torch.equal(p, before[n]) for n, p in model.named_parameters())
    assert not optimizer.muon.state and not optimizer.adamw.state


def _trainer(working: bool, steps: int = 3) -> DrafterTrainer:
    cfg = to_dataclass(compose_config(["optim=muon", f"train.max_steps={steps}", "train.micro_batch_size=2"]))
    trainer = DrafterTrainer(cfg, torch.device("cpu"), steps, working_weights=working)
    if working:  # CPU bf16 autocast, as CUDA's (test_working_weights)
        trainer.autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    return trainer


def _step(trainer: DrafterTrainer, batch) -> dict:
    trainer.micro_step(batch, last_of_step=True)
    return trainer.optimizer_step()


@pytest.mark.parametrize("working", [False, True], ids=["fp32", "working-weights"])
def test_a_resume_with_muon_continues_bit_for_bit(tmp_path, working: bool) -> None:
    straight = _trainer(working)
    assert isinstance(straight.optimizer, MuonAdamW)
    batch = _micro_batch(straight.cfg)
    records = [_step(straight, batch) for _ in range(3)]

    first = _trainer(working)
    _step(first, batch)
    checkpoint.save(tmp_path, first.training_state(), keep=1)
    resumed = _trainer(working)
    resumed.load_training_state(checkpoint.load(checkpoint.latest(tmp_path)))
    again = [_step(resumed, batch) for _ in range(2)]
    assert [r["loss"] for r in again] == [r["loss"] for r in records[1:]]  # bitwise: same floats
    ours, theirs = resumed.training_state(), straight.training_state()
    for name, value in theirs.model.items():
        assert torch.equal(ours.model[name], value), name
    for part in ("muon", "adamw"):
        mine, other = ours.optimizer[part]["state"], theirs.optimizer[part]["state"]
        assert mine.keys() == other.keys() and mine
        for index, state in other.items():
            assert all(torch.equal(mine[index][key], value) for key, value in state.items()), (part, index)
    if working:
        for param, master in resumed.working.master_of.items():
            assert torch.equal(param.detach(), master.bfloat16())
    with pytest.raises(ValueError, match="resume with the optim it was saved with"):
        resumed.optimizer.load_state_dict(resumed.optimizer.adamw.state_dict())


def test_muon_options_are_checked_by_name() -> None:
    validate(compose_config(["optim=muon"]))
    for override, named in (
        ("optim.name=sgd", "optim.name='sgd': must be one of 'adamw', 'muon'"),
        ("optim.muon_momentum=1.0", "optim.muon_momentum=1.0: must be in [0, 1)"),
        ("optim.muon_ns_steps=0", "optim.muon_ns_steps=0: must be an integer in [1, 100)"),
        ("optim.muon_adjust_lr=moonshot", "optim.muon_adjust_lr='moonshot': must be one of"),
    ):
        with pytest.raises(ConfigError) as refused:
            validate(compose_config(["optim=muon", override]))
        assert named in str(refused.value)
