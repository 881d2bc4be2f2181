"""Export a checkpoint with `python -m dflash_mp.export`, decode with the reference `dflash` package.

The contract of docs/DESIGN.md §3 end to end: the reference's `dflash_generate`, reading our export,
must produce the same tokens and the same acceptance lengths as our own evaluation loop.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch
from dflash import model as reference
from omegaconf import OmegaConf

from dflash_mp.config.schema import compose_config
from dflash_mp.evaluation.acceptance import stop_token_ids
from dflash_mp.evaluation.decoding import speculative_generate
from dflash_mp.evaluation.prompts import load_eval_prompts
from dflash_mp.export.cli import main
from dflash_mp.export.hf import load_exported_drafter
from dflash_mp.run import checkpoint
from dflash_mp.training.recipe import build_drafter
from tests.drafters import embedded_config, embedded_target, train_on_target_tokens

OVERRIDES = ("data.num_anchors=32",)
NEW_TOKENS = 48


@pytest.fixture(scope="module")
def run(tmp_path_factory: pytest.TempPathFactory) -> dict:
    """A run directory as training leaves it (config.yaml, two checkpoints) plus the live pieces."""
    cfg = embedded_config(*OVERRIDES)
    target, tokenizer = embedded_target(cfg)
    prompts = load_eval_prompts(cfg, tokenizer)[:4]
    trainer = train_on_target_tokens(cfg, target, tokenizer, prompts[:2], NEW_TOKENS, steps=150)
    run_dir = tmp_path_factory.mktemp("run")
    OmegaConf.save(compose_config(list(OVERRIDES)), run_dir / "config.yaml", resolve=True)
    # An older checkpoint with other weights, so that picking the step visibly matters.
    checkpoint.save(
        run_dir / "checkpoints", checkpoint.TrainingState(7, build_drafter(cfg).state_dict(), {}, {}), 2
    )
    final = trainer.training_state()
    checkpoint.save(run_dir / "checkpoints", final, keep=2)
    return {"dir": run_dir, "step": final.step, "target": target, "tokenizer": tokenizer, "prompts": prompts}


def test_reference_decoding_of_our_export_matches_our_eval(
    run: dict, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = run["dir"] / "export"
    assert main([str(run["dir"]), "--step", str(run["step"])]) == 0
    # The reference times with torch.cuda.synchronize when asked for stats; this is a CPU run.
    monkeypatch.setattr(reference, "_cuda_time", time.perf_counter)
    draft_model, info = reference.DFlashDraftModel.from_pretrained(
        out, dtype=torch.float32, output_loading_info=True
    )
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    ours = load_exported_drafter(out).float().eval()
    target, stops = run["target"], stop_token_ids(run["tokenizer"], run["target"])
    long_blocks = 0
    for prompt in run["prompts"]:
        expected = reference.dflash_generate(
            draft_model.eval(), target, torch.tensor([prompt.input_ids]), NEW_TOKENS, stops, return_stats=True
        )
        got = speculative_generate(ours, target, prompt.input_ids, NEW_TOKENS, stops)
        assert got.new_tokens == expected.output_ids[0, len(prompt.input_ids) :].tolist(), prompt.source
        assert got.acceptance_lengths == expected.acceptance_lengths, prompt.source
        long_blocks += max(expected.acceptance_lengths) > 4
    assert long_blocks >= 2  # the trained prompts: the comparison covered accepted drafts


def test_export_takes_the_newest_checkpoint_by_default(run: dict, tmp_path: Path) -> None:
    assert main([str(run["dir"]), "--out", str(tmp_path / "newest"), "--dtype", "float32"]) == 0
    assert main([str(run["dir"]), "--step", "7", "--out", str(tmp_path / "s"), "--dtype", "float32"]) == 0
    newest, chosen = load_exported_drafter(tmp_path / "newest"), load_exported_drafter(tmp_path / "s")
    state = checkpoint.load(checkpoint.latest(run["dir"] / "checkpoints")).model
    assert all(torch.equal(newest.state_dict()[name], tensor) for name, tensor in state.items())
    assert not torch.equal(newest.state_dict()["fc.weight"], chosen.state_dict()["fc.weight"])


def test_export_errors_name_the_fix(run: dict, tmp_path: Path, capsys: pytest.CaptureFixture) -> None:
    assert main([str(run["dir"]), "--step", "3", "--out", str(tmp_path / "x")]) == 2
    assert f"no complete checkpoint of step 3 in {run['dir']}; there are steps [7, {run['step']}]" in (
        capsys.readouterr().err
    )
    assert main([str(tmp_path)]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
    assert not (tmp_path / "x").exists()
