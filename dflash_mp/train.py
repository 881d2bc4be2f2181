"""Entry point: `torchrun ... -m dflash_mp.train [overrides]`, or `python -m dflash_mp.train`.

Under torchrun every process is one rank of the job (dflash_mp.launch.rank: join the job, run its
role, leave). Started without torchrun (plain python, `make train`, a Hydra sweep with -m), it
launches one local torchrun job per config through the launcher (dflash_mp.launch.sweep) and waits.
Neither path imports torch here: the launcher takes the run directory and prints its paths before
anything heavy is imported.
"""

from __future__ import annotations

import sys

import hydra
from omegaconf import DictConfig

from dflash_mp.config.schema import CONF_DIR
from dflash_mp.launch import rank
from dflash_mp.launch.outcome import EXIT_PREFLIGHT
from dflash_mp.launch.sweep import launch_from_hydra
from dflash_mp.run import startup

_composed = False  # Hydra composed the command line and called main()


@hydra.main(config_path=str(CONF_DIR), config_name="config", version_base=None)
def main(dict_cfg: DictConfig) -> int:
    global _composed
    _composed = True
    if __name__ == "__main__":  # the program (a launcher or a fresh rank), before torch is imported
        startup.pause()  # resumed once its stack is imported
    if rank.under_torchrun():
        return rank.run_recorded(dict_cfg)
    return launch_from_hydra(dict_cfg)


def _run_as_program() -> None:
    """main(), with a command line Hydra cannot compose (an unknown key, a value of the wrong type, a
    group option that does not exist) ending as the config error it is: Hydra exits 1 there, before
    main() runs; the launcher's preflight exits 2 for the same mistakes."""
    try:
        main()
    except SystemExit as e:
        if e.code == 1 and not _composed:
            print("dflash_mp: the overrides above were refused; nothing was run", file=sys.stderr)
            raise SystemExit(EXIT_PREFLIGHT) from None
        raise


if __name__ == "__main__":
    _run_as_program()
