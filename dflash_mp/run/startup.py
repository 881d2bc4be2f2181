"""Fewer garbage-collector passes while a process imports its stack.

Importing torch, transformers and Hydra creates about half a million objects that live as long as
the process, and Python's collector walks all of them again each time its oldest generation fills
while they are created: about 2 of a rank's 11 CPU-seconds of imports on a 2-core machine. The
entry points call `pause()` before their imports, which makes the youngest generation very large
(the collector still runs, rarely: a process that never reaches `resume()` cannot leak), and
`resume()` once they are done: what exists then is frozen (gc.freeze: left out of every later pass,
which also keeps a forked child's copies of those pages shared) and the usual thresholds return.
"""

from __future__ import annotations

import atexit
import gc
import sys

STARTUP_THRESHOLD = 100_000  # youngest-generation allocations between passes (Python's default: 700)
_saved: tuple[int, ...] | None = None


def pause() -> None:
    global _saved
    if _saved is None:
        _saved = gc.get_threshold()
        gc.set_threshold(STARTUP_THRESHOLD, *_saved[1:])


def resume() -> None:
    """Freeze the imported stack and restore the thresholds; a no-op unless paused."""
    global _saved
    if _saved is not None:
        gc.freeze()
        gc.set_threshold(*_saved)
        _saved = None
        atexit.unregister(_unfreeze_for_triton)  # once, however often resumed
        atexit.register(_unfreeze_for_triton)


def _unfreeze_for_triton() -> None:
    """At exit, give frozen objects back to the collector when Triton's native library is loaded:
    its teardown reports every object still alive then as a leak (~60 lines on stderr), and frozen
    ones never are collected. Elsewhere the exit skips that last pass over the frozen stack."""
    if "triton._C.libtriton" in sys.modules:
        gc.unfreeze()
