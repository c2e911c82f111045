"""L13 of the 2026-12-02 review: the host records (they quote a failed server's journal lines)
are written 0600, root's alone, by a deploy's script and by a verdict alike."""

from __future__ import annotations

import asyncio
import os
import re
import stat

from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
from reconciler.host.apply import write_record
from reconciler.host.script import call, steps
from reconciler.host.transport import Completed
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts
from reconciler.plan.layout import HOST_RECORD, record_path
from reconciler.plan.model import Context
from reconciler.plan.records import ServiceRecord
from tests.host.programs import apply_here

UNIT = "[Service]\nExecStart=/bin/{}\n\n[Install]\nWantedBy=multi-user.target\n"
RECORDS = (re.escape(HOST_RECORD), re.escape(record_path("m")))
# A record written by a script: staged (a batch) or written by itself, with its mode.
WRITTEN = re.compile(rf"(?:stage_file|write_file) step=\d+ path=({'|'.join(RECORDS)}) mode=(\d+) ")


class Recorder:
    """A transport that records the script it is given and answers that it ran."""

    host = "h1"

    def __init__(self) -> None:
        self.scripts: list[str] = []

    async def run(self, cmd: str, *, input: str | None = None, **_kw: object) -> Completed:
        self.scripts.append(input or "")
        return Completed(0, "", "")


def test_a_deploy_writes_every_record_0600():
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", UNIT.format("m"), {"A": "1"})})
    plan = plan_host(h, HostFacts(services={}), Context("f" * 40))
    written = WRITTEN.findall("\n".join(steps(plan, plan.actions, 0)))
    assert {p for p, _ in written} == {HOST_RECORD, record_path("m")}, written   # the intent, the record, the host's
    assert len(written) >= 3 and {m for _, m in written} == {"0600"}, written


def test_a_verdict_writes_its_record_0600():
    t = Recorder()
    asyncio.run(write_record(t, "m", ServiceRecord(hash="h", revision="f" * 40)))   # type: ignore[arg-type]
    assert WRITTEN.findall(t.scripts[0]) == [(record_path("m"), "0600")]


def test_mode_0600_makes_a_file_nobody_else_can_read(tmp_path):
    """What apply.sh's write_file does with that mode, run by sh under the script's umask 022."""
    path = tmp_path / "services" / "m.json"
    answer, res = apply_here([call("write_file", step=0, path=str(path), mode="0600", text="{}"), "finish"])
    assert res.returncode == 0 and answer.fatal is None, res.stderr
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
