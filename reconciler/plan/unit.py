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
    n = number(text or "", 19)
    return n if n is not None else 0


class UnitState(msgspec.Struct, frozen=True):
    """What systemd says about one unit right now (the properties the reconciler reads)."""

    id: str = ""
    load_state: str = ""             # loaded | not-found | bad-setting | masked ...
    active_state: str = ""           # active | activating | failed | inactive ...
    sub_state: str = ""              # running | auto-restart | dead ...
    result: str = ""                 # success | exit-code | start-limit-hit | resources ...
    n_restarts: int = 0              # automatic restarts since the last start (a restart keeps counting)
    exec_main_pid: int = 0           # the main process (0: none)
    exec_main_code: str = ""         # how it ended: 1 exited, 2 killed, 3 dumped (CLD_* codes)
    exec_main_status: str = ""       # its exit status or signal
    invocation_id: str = ""          # changes with every start
    # ActiveEnterTimestampMonotonic as printed: "0" never active, None not said (judged a crash)
    active_enter: str | None = None
    job: str = ""                    # a queued job's id ("" or "0": none)
    unit_file_state: str = ""        # enabled | disabled | static ...
    fragment_path: str = ""          # the unit file systemd loaded
    need_daemon_reload: bool = False

    @classmethod
    def parse(cls, props: Mapping[str, str]) -> UnitState:
        """A unit's `systemctl show` properties (parse_show's mapping), typed (pure, total)."""
        g = props.get
        return cls(id=g("Id", ""), load_state=g("LoadState", ""), active_state=g("ActiveState", ""),
                   sub_state=g("SubState", ""), result=g("Result", ""), n_restarts=_count(g("NRestarts")),
                   exec_main_pid=_count(g("ExecMainPID")), exec_main_code=g("ExecMainCode", ""),
                   exec_main_status=g("ExecMainStatus", ""), invocation_id=g("InvocationID", ""),
                   active_enter=g("ActiveEnterTimestampMonotonic"), job=g("Job", ""),
                   unit_file_state=g("UnitFileState", ""), fragment_path=g("FragmentPath", ""),
                   need_daemon_reload=g("NeedDaemonReload") == "yes")

    @property
    def up(self) -> bool:
        """Up, or on its way up by a start job: not failed, stopped, or waiting out a restart."""
        return self.active_state in UP and not self.sub_state.startswith("auto-restart")

    @property
    def has_job(self) -> bool:
        """A job is queued for it (a start still waiting, a stop)."""
        return self.job not in ("", "0")
