"""Control characters never reach a terminal raw (security review L5): a journal line, a host
record or a commit subject with ESC in it is printed with `\\x1b` instead, by rich on a terminal,
by the plain console of a log or a pipe, by the daemon's run log (which `git push -o
reconcile.wait` streams) and by the CLI's one-line messages and tracebacks."""

from __future__ import annotations

import io

import pytest
from rich.console import Console

from reconciler import cli
from reconciler.cli import output
from reconciler.controller import hooks
from reconciler.host.health import Outcome
from reconciler.loop.report import PlainConsole, print_events, print_history, print_result, print_status
from reconciler.loop.results import FleetResult, HostResult, ServiceEvent
from reconciler.plan.records import Result

# An OSC that sets the window title, a CSI that clears the screen, OSC 52 (clipboard), BEL, CR,
# a C1 CSI: what a service's journal line can carry.
NASTY = "boom\x1b]0;owned\x07 \x1b[2J\x1b]52;c;ZXZpbA==\x07\rhidden\x9b31m end"
SHOWN = "boom\\x1b]0;owned\\x07 \\x1b[2J\\x1b]52;c;ZXZpbA==\\x07\\x0dhidden\\x9b31m end"
RAW = ("\x1b]", "\x1b[2J", "\x07", "\r", "\x9b")


def failed_run(text: str = NASTY) -> FleetResult:
    outcome = Outcome("sglang", False, "CrashLoop", f"crash loop: {text}", text)
    return FleetResult("ab" * 20, False, [HostResult(
        "gpu-1", "127.0.0.5", Result.FAILED, reason="FirstDeployFailed", message=f"sglang: {text}",
        events=[ServiceEvent("sglang", "deploy", "ab" * 20, "h1", outcome)], notes=[f"note {text}"])])


def assert_escaped(out: str) -> None:
    assert SHOWN in out
    for raw in RAW:
        assert raw not in out, repr(raw)


def test_a_journal_line_on_a_terminal_is_shown_with_escapes() -> None:
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=400, highlight=False, color_system="standard")
    print_result(console, failed_run())
    out = buf.getvalue()
    assert f"journal: {SHOWN}" in out
    assert "\x1b[1;31m" in out             # rich's own colours still work
    assert_escaped(out)


def test_the_plain_console_of_a_log_or_a_pipe_escapes_too() -> None:
    buf = io.StringIO()
    print_events(PlainConsole(buf, 160), failed_run())
    assert_escaped(buf.getvalue())
    assert f"    journal: {SHOWN}\n" in buf.getvalue()
    buf = io.StringIO()
    PlainConsole(buf, 160).print(f"raw text {NASTY}", markup=False)
    assert buf.getvalue() == f"raw text {SHOWN}\n"


def test_the_daemons_run_log_and_so_the_push_stream_hold_no_raw_control(tmp_path, capsys) -> None:
    """The daemon prints its runs with rich on a file (force_terminal=False), and post-receive
    streams that file to the pusher's terminal."""
    rev = "cd" * 20
    log = io.StringIO()
    print_result(Console(file=log, force_terminal=False, width=160, highlight=False), failed_run())
    assert_escaped(log.getvalue())
    (tmp_path / f"{rev}.log").write_text(log.getvalue())
    (tmp_path / f"{rev}.exit").write_text("1\n")
    hooks._stream(tmp_path, rev, timeout=5)
    assert_escaped(capsys.readouterr().out)


def test_host_records_and_commit_subjects_in_status_and_history_are_escaped() -> None:
    row = {"host": "gpu-1", "service": "sglang", "desired_rev": "ab" * 20, "running_rev": "cd" * 20,
           "health": "unhealthy", "last_event": f"failed: {NASTY}", "quote": NASTY,
           "active_state": "failed\x1b[8m", "sub_state": "dead"}
    buf = io.StringIO()
    print_status(PlainConsole(buf, 400), [row], live="abababa")
    assert "failed\\x1b[8m/dead" in buf.getvalue() and "\x1b" not in buf.getvalue()
    buf = io.StringIO()
    history = [{"at": 0, "service": "sglang", "action": "deploy", "revision": "ab" * 20, "result": "failed",
                "quote": f"subject {NASTY}", "message": "", "seconds": 1.0}]
    print_history(Console(file=buf, force_terminal=True, width=400), "gpu-1", history)
    assert "\x1b]0;owned" not in buf.getvalue() and "\x9b" not in buf.getvalue()


def test_the_clis_messages_and_tracebacks_are_escaped(monkeypatch, capsys) -> None:
    output.say(f"warning: {NASTY}")
    with pytest.raises(SystemExit):
        output.fail(f"cannot: {NASTY}")
    err = capsys.readouterr().err
    assert f"warning: {SHOWN}\n" in err and f"error: cannot: {SHOWN}\n" in err
    for raw in RAW:
        assert raw not in err

    def boom(**_kw: object) -> None:
        raise RuntimeError(f"unexpected: {NASTY}")
    monkeypatch.setattr(cli, "app", boom)
    with pytest.raises(SystemExit):
        cli.main()
    err = capsys.readouterr().err
    assert f"RuntimeError: unexpected: {SHOWN}" in err and "\x1b" not in err


@pytest.mark.parametrize("terminal", [False, True])
def test_a_secret_across_the_tables_cut_leaves_no_fragment(terminal):
    """Review N6: the result table cuts a long detail to the width the other columns leave; the
    text is redacted whole before that (report._t), so no piece of a secret survives the cut."""
    from reconciler import redact
    from tests.test_redact import fresh, leaked, straddling
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    # detail = "FirstDeployFailed: " + message; cut at 37 characters on an 80-column console
    message = straddling(secret, 37 - len("FirstDeployFailed: "), after=" " + "w " * 40)
    res = FleetResult("ab" * 20, False, [HostResult("gpu-1", "127.0.0.5", Result.FAILED, reason="FirstDeployFailed",
                                                    message=message)])
    buf = io.StringIO()
    console = Console(file=buf, force_terminal=True, width=80) if terminal else PlainConsole(buf, 80)
    print_result(console, res)                                      # type: ignore[arg-type]
    out = buf.getvalue()
    assert "FirstDeployFailed: xx" in out and not leaked(secret, out)
