"""Regenerate a chat data set's assistant turns with the target itself (the DFlash recipe, §3):
`python -m dflash_mp.regenerate`, whose help (cli.py's docstring) says what it does and how.

The package's rooms: records.py (settings, records being answered), parts.py (the part files,
their settings, resume and merge), finish.py (cut answers, the floors), progress.py, local.py,
served.py (the two backends), cli.py, and serve.py (a small OpenAI-compatible server around a local target, for
smoke tests).
"""

from dflash_mp.regenerate.cli import main
from dflash_mp.regenerate.local import RoundTripSafe, regenerate, regenerate_batch
from dflash_mp.regenerate.parts import merge, read_parts
from dflash_mp.regenerate.records import (
    Conversation,
    RegenerateError,
    Settings,
    parse_conversation,
    split_reasoning,
)
from dflash_mp.regenerate.served import RecordsFailed, ServerSettings, regenerate_served

__all__ = [
    "Conversation",
    "RecordsFailed",
    "RegenerateError",
    "RoundTripSafe",
    "ServerSettings",
    "Settings",
    "main",
    "merge",
    "parse_conversation",
    "read_parts",
    "regenerate",
    "regenerate_batch",
    "regenerate_served",
    "split_reasoning",
]
