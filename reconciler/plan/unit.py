"""PURE: one systemd unit as `systemctl show` reads it, typed and parsed once.

`systemctl show` prints `Key=value` lines (plan/facts.parse_show reads them into one mapping per
unit); the planner, the live view, the health watch and the GPU gate read a handful of them.
`UnitState.parse` turns that mapping into typed fields, every one total: a property that is
missing or not what systemd prints reads as its empty value (a number as 0), never raises. The
names are systemd's, in snake case (systemd.exec(5), org.freedesktop.systemd1(5)).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from ..frames import number

UP = ("active", "activating", "reloading", "refreshing")   # up, or on its way up by a job


def _count(text: str | None) -> int:
    """A counter or a PID as systemd prints it (decimal, at most 19 digits); 0 for anything else."""
    return number(text or "", 19) or 0


class UnitState(msgspec.Struct, frozen=True):
    """What systemd says about one unit right now (the properties the reconciler reads)."""

    load_state: str = ""             # loaded | not-found | bad-setting | masked ...
    active_state: str = ""           # active | activating | failed | inactive ...
    sub_state: str = ""              # running | auto-restart | dead ...
    n_restarts: int = 0              # automatic restarts since the last start (a restart keeps counting)
    exec_main_pid: int = 0           # the main process (0: none)
    invocation_id: str = ""          # changes with every start
    # ActiveEnterTimestampMonotonic as printed: "0" never active, None not said (judged a crash)
    active_enter: str | None = None
    need_daemon_reload: bool = False

    @classmethod
    def parse(cls, props: Mapping[str, str]) -> UnitState:
        """A unit's `systemctl show` properties (parse_show's mapping), typed (pure, total)."""
        g = props.get
        return cls(load_state=g("LoadState", ""), active_state=g("ActiveState", ""), sub_state=g("SubState", ""),
                   n_restarts=_count(g("NRestarts")), exec_main_pid=_count(g("ExecMainPID")),
                   invocation_id=g("InvocationID", ""), active_enter=g("ActiveEnterTimestampMonotonic"),
                   need_daemon_reload=g("NeedDaemonReload") == "yes")

    @property
    def up(self) -> bool:
        """Up, or on its way up by a start job: not failed, stopped, or waiting out a restart."""
        return self.active_state in UP and not self.sub_state.startswith("auto-restart")
