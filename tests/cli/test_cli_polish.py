"""Terminal output, tried as a new user would (issue 14, item 4): --help without a type after
every flag, an apply's diff printed before its health progress, and `validate` saying that a
fleet-wide [rollout] shapes only shared definitions."""

from __future__ import annotations

import io
import re

import pytest
from click.testing import CliRunner
from rich.console import Console

from reconciler import cli
from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.loop.report import PhaseView, print_result
from reconciler.loop.results import FleetResult, HostResult
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts
from reconciler.plan.model import Context
from reconciler.preflight import check_desired, load_rules
from tests.plan.test_plan import REV, host, svc


@pytest.mark.parametrize("command", [[], ["validate"], ["status"], ["watch"], ["init-repo"], ["secrets", "encrypt"]])
def test_help_shows_no_type_after_flags(command):
    res = CliRunner().invoke(cli.app, [*command, "--help"], env={"COLUMNS": "140"})
    assert res.exit_code == 0, res.output
    assert "--help" in res.output
    assert not re.search(r"<(bool|str|int|float|path|list\[str\])>", res.output), res.output


def test_help_names_values_not_types():
    out = CliRunner().invoke(cli.app, ["--help"], env={"COLUMNS": "140"}).output
    row = {w.rstrip(","): ln for ln in out.splitlines() if ln.startswith("  -") for w in ln.split()[:2]}
    assert "PATH|URL" in row["--repo"] and "REV" in row["--rev"] and "KEYFILE" in row["--identity"]
    assert row["--dry-run"].split()[:3] == ["-n,", "--dry-run", "Show"]   # nothing between the flag and its help


def _result() -> HostResult:
    r = HostResult("gpu-1", "127.0.0.2")
    r.plan = plan_host(host(svc(env={"A": "2"})), HostFacts({}), Context(REV))
    return r


def test_the_diff_comes_before_the_health_progress_and_is_not_repeated():
    buf = io.StringIO()
    out = Console(file=buf, width=160, highlight=False)
    r = _result()
    with PhaseView(out, plans=out) as view:
        view.planned(r)
        view("gpu-1", "m", "starting", 0.5, 10)
        view("gpu-1", "m", "healthy", 1.0, 10)
    res = FleetResult(REV, False, [r])
    print_result(out, res, shown=view.shown)
    text = buf.getvalue()
    assert text.index('+A="2"') < text.index("gpu-1 m: starting") < text.index("revision")
    assert text.count("── gpu-1") == 1


def test_without_a_report_console_nothing_is_printed_early():
    buf = io.StringIO()
    out = Console(file=buf, width=160)
    view = PhaseView(out)                  # --json / --dry-run: the report comes at the end only
    view.planned(_result())
    assert buf.getvalue() == "" and view.shown == set()


UNIT = "[Service]\nExecStart=/usr/bin/server\n"


def test_validate_says_inline_services_do_not_roll_out_in_waves():
    files = {"fleet.toml": "[rollout]\ncanary = 1\nmax_unavailable = 1\n", "units/s.service": UNIT,
             "services/shared.toml": 'unit_file = "units/s.service"\n'}
    for n in ("a", "b", "c"):
        files[f"hosts/{n}.toml"] = (f'address = "127.0.0.{ord(n) - 90}"\n'
                                    '[services.inline]\nunit_file = "units/s.service"\n'
                                    '[services.shared]\nuse = "shared"\n')
    snap = MemorySnapshot(files)
    _, warnings = check_desired(load_desired(snap), load_rules(snap), snap.read)
    rollout = [w for w in warnings if w.startswith("fleet.toml: rollout:")]
    assert len(rollout) == 1, warnings
    assert "service inline is defined inline on hosts a, b, c" in rollout[0] and "waves" in rollout[0]
    # without a fleet-wide [rollout] there is nothing to expect, so nothing to say
    del files["fleet.toml"]
    snap = MemorySnapshot(files)
    _, warnings = check_desired(load_desired(snap), load_rules(snap), snap.read)
    assert not [w for w in warnings if "rollout" in w]


def test_drain_program_reaches_the_runs_options(monkeypatch):
    """`--drain-program` (repeatable) is the command line's allow-list of the programs a [drain]
    `controller` call may run (issue 42); without it a run allows none."""
    import importlib
    app_module = importlib.import_module("reconciler.cli.app")
    seen = []
    monkeypatch.setattr(app_module, "converge", lambda opts, **kw: seen.append(opts.drain_programs))
    for args, want in ((["--drain-program", "socat", "--drain-program", "lbctl"], ("socat", "lbctl")), ([], ())):
        res = CliRunner().invoke(cli.app, ["--repo", ".", "--dry-run", *args])
        assert res.exit_code == 0, res.output
        assert seen.pop() == want
