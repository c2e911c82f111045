"""PURE: the host record by itself (reconciler/sh/host-record.sh), for pull mode: the revision
the host last applied is where its choice of revision starts (pull/_run.py). The planner reads
the same file in the observation (plan/facts/observe.py); this is the read without the rest.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import ClassVar

from ...errors import ObserveError
from ...frames import HostProgram, Records, malformed
from ..layout import HOST_RECORD
from ..records import HostRecord


def parse_host_record(answer: Records) -> HostRecord | None:
    """The record (HostRecord.parse: lenient, as every record is read), or None where the host
    has none. An answer cut short, or a line that is not one of the program's, is an
    ObserveError: a record read in part is no record."""
    lines: list[str] = []
    for f in answer.whole("host record read cut short"):
        op, _, rest = f.payload.partition(" ")
        if f.kind != "H" or op not in ("L", "P", "F", "-"):
            raise malformed(answer.host, "host record", f)
        if op == "-":
            return None
        if op == "F":
            return HostRecord.parse("".join(lines))
        lines.append(rest + "\n" if op == "L" else rest)
    raise ObserveError(answer.host, "host record read without its end")


class HostRecordRead(HostProgram["HostRecord | None"], frozen=True):
    """reconciler/sh/host-record.sh: the host record, or None where there is none."""

    name: ClassVar[str] = "host-record"
    constants: ClassVar[Mapping[str, str]] = {"HOST_RECORD": HOST_RECORD}

    def parse(self, answer: Records) -> HostRecord | None:
        return parse_host_record(answer)
