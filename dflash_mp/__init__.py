"""dflash_mp: a multi-process trainer for DFlash speculative-decoding drafters."""

import os as _os
import sys as _sys


def _unshadow() -> None:
    """A module run by its file (`torchrun dflash_mp/train.py`) puts its folder first on sys.path,
    where this package's subpackages would shadow top-level modules of the same name: transformers'
    `import kernels` found dflash_mp/kernels and the first model load failed with an ImportError."""
    inside = _os.path.dirname(_os.path.abspath(__file__))
    _sys.path[:] = [
        p for p in _sys.path if not (_os.path.abspath(p or _os.curdir) + _os.sep).startswith(inside + _os.sep)
    ]


_unshadow()
