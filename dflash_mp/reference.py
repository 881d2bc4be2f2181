"""Single-process reference trainer: target forward and drafter step in one process.

The ground truth the multi-process runtime must reproduce (same micro-batches, same order,
same math), and the colocated baseline the benchmarks compare against.
"""

from __future__ import annotations

import torch

from dflash_mp.config.precision import resolve_precision
from dflash_mp.config.schema import RootConfig
from dflash_mp.data import open_records
from dflash_mp.runtime.roles import (
    data_order,
    hidden_states_for_drafter,
    make_feature_extractor,
    make_reader,
    total_steps,
)
from dflash_mp.runtime.topology import Topology
from dflash_mp.training.features import features_of
from dflash_mp.training.trainer import DrafterTrainer


def reference_train(cfg: RootConfig, device: torch.device | str = "cpu", on_step=None) -> DrafterTrainer:
    """Train as a 1-target + 1-drafter job would; `on_step(record)` sees every step's metrics."""
    device = torch.device(device)
    topology = Topology(targets=1, drafters=1, grad_accum=cfg.train.grad_accum)
    index = open_records(list(cfg.data.train_files))
    order = data_order(cfg, index)
    steps = total_steps(cfg, order, topology)
    dtype, _, compile_layers = resolve_precision(cfg, device)
    reader = make_reader(cfg, index, order)
    extractor = make_feature_extractor(cfg, dtype, device, compile_layers)
    trainer = DrafterTrainer(cfg, device, steps)
    bad_before = too_long_before = 0
    for step in range(steps):
        for m in topology.micro_batches_of_drafter(0, step):
            batch = reader.read(m)
            hidden = hidden_states_for_drafter(extractor, batch, dtype, device)
            bad, bad_before = reader.bad_records - bad_before, reader.bad_records
            too_long, too_long_before = reader.too_long_records - too_long_before, reader.too_long_records
            trainer.micro_step(
                features_of(batch, hidden, bad, too_long),
                last_of_step=m == (step + 1) * cfg.train.grad_accum - 1,
            )
        record = trainer.optimizer_step()
        if on_step is not None:
            on_step(record)
    return trainer


def main(argv: list[str] | None = None) -> None:
    """`python -m dflash_mp.reference [key=value ...]`: train in one process, print the loss curve."""
    import sys

    from dflash_mp.config.schema import compose_config, to_dataclass
    from dflash_mp.config.validation import validate
    from dflash_mp.runtime.distributed import pick_device

    try:
        cfg = to_dataclass(compose_config(sys.argv[1:] if argv is None else argv))
        validate(cfg)
    except Exception as e:  # Hydra's refusal of an override, or every invalid field (ConfigError)
        print(f"dflash_mp.reference: {e}", file=sys.stderr)
        sys.exit(2)  # a config error, as on the other entry points (1 is a failed run)
    records: list[dict] = []
    reference_train(cfg, device=pick_device(cfg.train.device, local_rank=0), on_step=records.append)
    records = [r for r in records if r["loss"] is not None]  # steps skipped for want of loss tokens
    window = max(1, min(20, len(records) // 10))
    first = sum(r["loss"] for r in records[:window]) / window
    last = sum(r["loss"] for r in records[-window:]) / window
    for r in records[:: max(1, len(records) // 10)] + records[-1:]:
        print(f"step {r['step']:5d}  loss {r['loss']:.4f}  acc@1 {r['acc'][0]:.3f}")
    print(f"mean loss over the first {window} steps {first:.4f} -> last {window} steps {last:.4f}")


if __name__ == "__main__":
    main()
