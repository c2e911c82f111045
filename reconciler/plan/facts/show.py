"""PURE: systemd's reading of units, `systemctl show` as it prints it (reconciler/sh/show.sh):
the health watch's tick reads every unit being watched on a host in one call.

Values are looked up by key, never by position; a property systemd leaves out is missing, not
empty. Several units come as blocks apart by an empty line, each keyed by its Id.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import ClassVar

from ...frames import HostProgram, Param, Records


def parse_show(text: str) -> dict[str, dict[str, str]]:
    """`systemctl show` output for one or more units -> {unit Id: {Key: value}}.

    Blocks are separated by blank lines; values are looked up by key; missing keys are fine.
    """
    out: dict[str, dict[str, str]] = {}
    for block in text.split("\n\n"):
        props: dict[str, str] = {}
        for line in block.split("\n"):   # not splitlines(): a value may hold \u2028 or \x1c
            key, sep, value = line.partition("=")
            if sep:
                props[key] = value
        if props.get("Id"):
            out[props["Id"]] = props
    return out


class UnitShow(HostProgram[dict[str, dict[str, str]]], frozen=True):
    """reconciler/sh/show.sh: these units' properties, {unit Id: {Key: value}}. Its answer runs to
    the end of the output (the shell becomes systemctl), so in a batch it goes last."""

    name: ClassVar[str] = "show"
    last: ClassVar[bool] = True
    units: Sequence[str]
    props: str

    def params(self) -> Mapping[str, Param]:
        return {"unit": list(self.units), "props": self.props}

    def parse(self, answer: Records) -> dict[str, dict[str, str]]:
        _, mark, shown = answer.stdout.partition(f"{answer.token} S -\n")
        return parse_show(shown) if mark else {}
