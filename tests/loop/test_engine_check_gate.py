"""When a run's pre-flight runs the engine check (loop/preview.py `engine_check`), as a table:
a preview runs nothing of the revision, unless its trust policy verified it or the operator
asks for it."""

from __future__ import annotations

import pytest

from reconciler.loop.preview import EngineCheck, engine_check


@pytest.mark.parametrize(("dry_run", "asked", "signer", "expected"), [
    (False, False, None, EngineCheck(True, "a real run")),
    (False, True, None, EngineCheck(True, "a real run")),
    (False, False, "ops@example", EngineCheck(True, "a real run")),
    (True, False, None, EngineCheck(False, "the revision is not signed; --engine-check runs it")),
    (True, True, None, EngineCheck(True, "--engine-check")),
    (True, False, "ops@example", EngineCheck(True, "signed by ops@example")),
    (True, True, "ops@example", EngineCheck(True, "signed by ops@example")),
])
def test_when_the_engine_check_runs(dry_run: bool, asked: bool, signer: str | None, expected: EngineCheck):
    assert engine_check(dry_run, asked, signer) == expected


@pytest.mark.parametrize(("gate", "line"), [
    (EngineCheck(False, "the revision is not signed; --engine-check runs it"),
     "engine check skipped: the revision is not signed; --engine-check runs it"),
    (EngineCheck(True, "signed by ops@example"), "engine check ran: signed by ops@example"),
    (EngineCheck(True, "--engine-check"), "engine check ran: --engine-check"),
])
def test_what_a_dry_run_says(gate: EngineCheck, line: str):
    assert gate.line() == line
