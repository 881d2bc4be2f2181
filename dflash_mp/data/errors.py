"""The two kinds of data problems: one that stops the job, and one record that cannot be used."""

from __future__ import annotations


class DataError(Exception):
    """A data problem the job cannot continue past; the message names file:line where it applies."""


class EmptyData(DataError):
    """The inputs hold no record at all."""


class BadRecord(Exception):
    """One record that cannot be used; skipped or fatal depending on data.on_bad_record.

    `kind` is a short fixed label (the preflight groups records by it), `reason` the detail.
    """

    def __init__(self, path: str, line: int, reason: str, kind: str = "bad record") -> None:
        super().__init__(f"{path}:{line}: {reason}")
        self.path, self.line, self.reason, self.kind = path, line, reason, kind
