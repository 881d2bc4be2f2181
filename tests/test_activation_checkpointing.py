"""train.activation_checkpointing: each draft layer's forward runs again in the backward, with the
same loss and gradients as when its activations are kept (DFlash and DFlash 2, eager and compiled)."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_mp.config.schema import ConfigError, compose_config, to_dataclass
from dflash_mp.config.validation import validate
from dflash_mp.data import JsonlIndex
from dflash_mp.runtime.roles import hidden_states_for_drafter, make_feature_extractor, make_reader
from dflash_mp.training.features import features_of
from dflash_mp.training.trainer import DrafterTrainer

DFLASH2 = ("model.arch=dflash2", "model.selector_rank=16")
ARCHS = {"dflash": (), "dflash2": DFLASH2}


def _config(checkpointing: bool, *overrides: str):
    return to_dataclass(
        compose_config(
            [
                "train.max_steps=2",
                "train.micro_batch_size=2",
                "data.num_anchors=16",
                f"train.activation_checkpointing={str(checkpointing).lower()}",
                *overrides,
            ]
        )
    )


def _micro_batch(cfg):
    reader = make_reader(cfg, JsonlIndex(list(cfg.data.train_files)))
    extractor = make_feature_extractor(cfg, torch.float32, torch.device("cpu"))
    batch = reader.read(0)
    return features_of(batch, hidden_states_for_drafter(extractor, batch, torch.float32, torch.device("cpu")))


def _step(cfg, batch, compiled: bool = False) -> tuple[float, dict[str, torch.Tensor], int]:
    """One micro-step and optimizer step in fp32 on CPU: the step's loss, every gradient and how
    many times a draft layer's forward ran."""
    trainer = DrafterTrainer(cfg, torch.device("cpu"), total_steps=2)
    if compiled:  # as on GPU, with a backend that runs on CPU without a C++ toolchain
        trainer.drafter.compile_layers(backend="aot_eager", dynamic=True)
    forwards = []
    for layer in trainer.drafter.layers:
        layer.register_forward_pre_hook(lambda *_: forwards.append(1))
    trainer.micro_step(batch, last_of_step=True)
    grads = {n: p.grad.clone() for n, p in trainer.drafter.named_parameters() if p.grad is not None}
    record = trainer.optimizer_step()
    return record["loss"], grads, len(forwards)


@pytest.mark.parametrize("arch", ARCHS)
def test_checkpointed_layers_give_the_same_loss_and_gradients(arch: str) -> None:
    kept, checkpointed = _config(False, *ARCHS[arch]), _config(True, *ARCHS[arch])
    batch = _micro_batch(kept)
    loss, grads, forwards = _step(kept, batch)
    loss_again, grads_again, forwards_again = _step(checkpointed, batch)

    layers = kept.model.draft_layers
    assert (forwards, forwards_again) == (layers, 2 * layers)  # recomputed in the backward
    assert loss_again == pytest.approx(loss, abs=1e-6)
    assert grads.keys() == grads_again.keys() and len(grads) > 0
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=0, atol=1e-6, msg=name)


def test_checkpointing_composes_with_compiled_layers() -> None:
    """One layer: one graph (compact input rows and scored output rows at once), forward and
    backward, compiled once and replayed by the recompute (about 10 CPU-s)."""
    kept, checkpointed = _config(False, "model.draft_layers=1"), _config(True, "model.draft_layers=1")
    batch = _micro_batch(kept)
    loss, grads, _ = _step(kept, batch)
    loss_again, grads_again, forwards = _step(checkpointed, batch, compiled=True)
    assert forwards == 2
    assert loss_again == pytest.approx(loss, abs=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grads_again[name], grad, rtol=0, atol=1e-6, msg=name)


def test_a_non_bool_is_refused_naming_the_field() -> None:
    cfg = _config(False)
    cfg.train = replace(cfg.train, activation_checkpointing="yes")
    with pytest.raises(ConfigError, match="train.activation_checkpointing='yes': must be true or false"):
        validate(cfg, world_size=3)
