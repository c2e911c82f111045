"""The observation parser on captured output, and the executor over a fake transport."""

from __future__ import annotations

import asyncio
import base64
import os
import re
import shutil
import stat
import subprocess
from collections.abc import Mapping
from typing import ClassVar

import pytest

from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
from reconciler.errors import CommandError, ObserveError
from reconciler.host.apply import apply_plan, parse_results, write_record
from reconciler.host.script import build_script
from reconciler.host.transport import Completed
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, Observe, ServiceFacts, parse_observation, parse_show
from reconciler.plan.model import Context, Kind
from reconciler.plan.records import ServiceRecord
from tests.host.programs import answer

# Captured on a test host (systemd 252): two units in one `systemctl show` call.
SHOW = """Id=crashy.service
Result=exit-code
NRestarts=3
ExecMainStatus=1
ActiveState=activating
SubState=auto-restart

Id=missing.service
LoadState=not-found
ActiveState=inactive
"""


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_parse_show_by_key_and_blocks():
    out = parse_show(SHOW)
    assert out["crashy.service"]["SubState"] == "auto-restart"
    assert out["crashy.service"]["NRestarts"] == "3"
    assert out["missing.service"]["LoadState"] == "not-found"
    assert "Result" not in out["missing.service"]   # missing keys are fine


def test_parse_observation():
    t = "tok"
    out = "\n".join([
        f"{t} H - L {{\"applied_revision\": \"abc\"}}", f"{t} H - F",
        f"{t} R crashy P {{\"hash\": \"h\"}}", f"{t} R crashy F",
        f"{t} U crashy L [Service]", f"{t} U crashy F",
        f"{t} E crashy -",
        "noise line from a login banner",
        f"{t} S -",                    # systemctl show, as it is, up to the END line
        SHOW,
        f"{t} END",
    ]) + "\n"
    f = parse_observation(out, t)
    assert f.record is not None and f.record.applied_revision == "abc"
    s = f.services["crashy"]
    assert s.unit_text == "[Service]\n" and s.env_text is None and s.managed
    assert s.props["SubState"] == "auto-restart" and s.running
    assert f.inventory == {"crashy"}


def test_truncated_observation_is_an_error():
    with pytest.raises(ObserveError):
        parse_observation("tok H - -\n", "tok")
    with pytest.raises(ObserveError):        # cut inside systemctl's output
        parse_observation(f"tok H - -\ntok S -\n{SHOW[:40]}", "tok")


def test_show_output_cannot_end_the_observation_early():
    """A property value is systemd's text (a Description= anyone may write): only the END line
    with this observation's random token ends it."""
    show = "Id=x.service\nDescription=tok END\nSubState=running\n"
    f = parse_observation(f"tok U x P [Service]\ntok U x F\ntok S -\n{show}\ntok END\n", "tok")
    assert f.services["x"].props["SubState"] == "running"


def test_the_observation_reads_files_exactly_with_no_process_per_file(tmp_path):
    """The host's shell prints each file line by line (builtins only) and the parser puts back
    exactly its bytes: spaces, tabs, backslashes, %, a carriage return or form feed inside a
    line, a last line without newline, an empty file, text that looks like the framing; and a
    drop-in whose name has a space."""
    state, units, dropins = tmp_path / "state", tmp_path / "units", tmp_path / "run"
    (state / "services").mkdir(parents=True)
    units.mkdir()
    tricky = ("[Service]\n  Environment=\"A=%s %d \\\\ \\n\"\t\nExecStart=/bin/x \\\n  --y\r\n"
              "Description=a\x0cb\u2028c \u00e9\ntok U m F\n-\n\nlast line, no newline")
    (units / "m.service").write_text(tricky)
    (units / "m.service.d").mkdir()
    (units / "m.service.d/50-reconciler-env.conf").write_text("")
    (state / "services/m.json").write_text('{"hash": "h"}\n')
    (dropins / "m.service.d").mkdir(parents=True)
    (dropins / "m.service.d/my drop in.conf").write_text("[Service]\nNice=5\n")
    (tmp_path / "env").mkdir()
    (tmp_path / "env/m.env").write_text('A="1 $x"\nB="2"')
    class Here(Observe):      # the host's directories, under tmp_path
        constants: ClassVar[Mapping[str, str]] = {
            **Observe.constants, "D": str(state), "UNIT_DIR": str(units), "ENV_DIR": str(tmp_path / "env"),
            "DROPIN_DIRS": str(dropins)}
    bindir = tmp_path / "bin"          # systemctl shows the one unit
    bindir.mkdir()
    (bindir / "systemctl").write_text("#!/bin/sh\nprintf 'Id=m.service\\n'\n")
    (bindir / "systemctl").chmod(0o755)
    f = answer(Here(("m", "gone")), path=f"{bindir}:{os.environ['PATH']}")
    m = f.services["m"]
    assert m.unit_text == tricky and m.env_text == "" and m.record is not None and m.record.hash == "h"
    assert m.envfile_text == 'A="1 $x"\nB="2"' and f.services["gone"].envfile_text is None
    assert m.dropins == {f"{dropins}/m.service.d/my drop in.conf": "[Service]\nNice=5\n"}
    assert f.services["gone"].unit_text is None and f.record is None and f.services["m"].props["Id"] == "m.service"


def test_the_observation_names_its_services_and_secret_files_as_named_parameters():
    stdin = Observe(("b", "a"), ("/s/x", "/s/x", "/s/a b")).stdin("T")
    assert stdin == "token=T\nservice=a\nservice=b\nsecret=/s/a b\nsecret=/s/x\n\n"
    assert Observe(("a",)).stdin("T") == "token=T\nservice=a\n\n"          # no secret asked: none hashed


class FakeTransport:
    """Records commands; answers with a canned result. For executor unit tests only."""

    host = "h1"

    def __init__(self, result: Completed):
        self.result = result
        self.calls: list[tuple[str, str | None]] = []

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        self.calls.append((cmd, input))
        return self.result


def _plan():
    from reconciler.plan.facts import HostFacts
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", "[Service]\nExecStart=/bin/x\n", {"A": "1"})})
    return plan_host(h, HostFacts(services={}), Context("f" * 40))


def test_script_records_intent_then_writes_atomically_then_reloads_once_then_records_last():
    p = _plan()
    script = build_script(p, p.actions, 0)
    assert script.count("systemctl daemon-reload") == 1
    intent = script.index("mv -f \"$W1\" /var/lib/reconciler/services/m.json")
    # the intent is renamed into place and its directory synced before any unit file is renamed:
    # that fsync is the next batch's (with its temps), one process fewer than a sync of its own
    durable = script.index("sync /var/lib/reconciler/services \"$W2\"")
    reload = script.index("systemctl daemon-reload")
    assert intent < script.index("stage /etc/systemd/system/m.service") < durable
    assert durable < script.index("mv -f \"$W2\" /etc/systemd/system/m.service ") < reload
    assert script.index("u_start 1.00 m.service") < script.index("/var/lib/reconciler/host.json")
    assert '/.reconciler-tmp.$$.' in script
    # the clean-up removes only this script's own temp files
    assert 'rm -f $TMPS' in script and "rm -f /etc/systemd/system/.reconciler-tmp.*" not in script


def test_atomic_write_in_the_hosts_shell_keeps_content_and_modes_and_leaves_no_temp(tmp_path):
    """The prelude's atomic_write, run by sh: exact bytes, the mode asked for (a 0600 file is
    never created readable by others), no temp file left behind, and a failure stops the script."""
    from reconciler.host.script import PRELUDE as _PRELUDE
    from reconciler.host.script import _write
    body = "\n".join([_write(f"{tmp_path}/new/dir/a.conf", "x=1\n\u00e9\n") + " || fatal 1 $?",
                      _write(f"{tmp_path}/secret", "s3cret", "0600") + " || fatal 2 $?",
                      _write(f"{tmp_path}/run.sh", "#!/bin/sh\n", "0700") + " || fatal 3 $?",
                      'echo "umask $(umask)"',
                      _write(f"{tmp_path}/secret/cannot", "x") + " || fatal 4 $?", "echo not-reached"])
    r = subprocess.run(["sh", "-s"], input=_PRELUDE + body + "\n", capture_output=True, text=True, timeout=10)
    assert (tmp_path / "new/dir/a.conf").read_text() == "x=1\n\u00e9\n"
    assert (tmp_path / "secret").read_text() == "s3cret"
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new/dir/a.conf").stat().st_mode) == 0o644
    assert "umask 0022" in r.stdout                      # a 0600 write puts the umask back
    assert "@@fatal 4" in r.stdout and "not-reached" not in r.stdout and r.returncode == 1
    assert not [p for p in tmp_path.rglob(".reconciler-tmp.*")]


def test_a_batch_of_writes_in_the_hosts_shell_fsyncs_once_renames_each_and_names_the_failed_step(tmp_path):
    """Consecutive file steps go as one batch (one fsync of all temps, a rename each, one fsync
    of the directories): exact bytes and modes, no temp left, and a step that cannot write stops
    the script with its own step number before anything of the batch is renamed."""
    from reconciler.host.script import PRELUDE as _PRELUDE
    from reconciler.host.script import _batch
    ok = _batch([(3, "", [(f"{tmp_path}/a/x.conf", "x='1'\n\u00e9 $HOME `id`\n", "0644")]),
                 (4, f"rm -f {tmp_path}/gone", [(f"{tmp_path}/b/run.sh", "#!/bin/sh\n", "0700"),
                                               (f"{tmp_path}/a/y.conf", "", "0644")])], 0)[0]
    (tmp_path / "gone").write_text("old")
    r = subprocess.run(["sh", "-s"], input=_PRELUDE + "\n".join(ok) + "\necho \"left:$TMPS.\"\n", capture_output=True,
                       text=True, timeout=10)
    assert r.returncode == 0, r.stdout + r.stderr
    assert (tmp_path / "a/x.conf").read_text() == "x='1'\n\u00e9 $HOME `id`\n"
    assert (tmp_path / "a/y.conf").read_text() == "" and not (tmp_path / "gone").exists()
    assert stat.S_IMODE((tmp_path / "b/run.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a/x.conf").stat().st_mode) == 0o644
    assert "left:." in r.stdout                                    # nothing left for the clean-up
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro/dir").write_text("a file where a directory must be")
    bad = _batch([(1, "", [(f"{tmp_path}/a/x.conf", "new\n", "0644")]),
                  (2, "", [(f"{tmp_path}/ro/dir/z.conf", "z\n", "0644")])], 0)[0]
    r = subprocess.run(["sh", "-s"], input=_PRELUDE + "\n".join(bad) + "\n", capture_output=True, text=True, timeout=10)
    assert "@@fatal 2" in r.stdout and r.returncode == 1
    assert (tmp_path / "a/x.conf").read_text().startswith("x=")      # the batch renamed nothing
    assert not [p for p in tmp_path.rglob(".reconciler-tmp.*")]


INSTALLED = "[Service]\nExecStart=/bin/{}\n\n[Install]\nWantedBy=multi-user.target\n"
# systemctl verbs that reload the daemon by themselves unless given --no-reload
RELOADING = re.compile(r"(?:systemctl|job [0-9.]+) (?:[-\w]+ )*?"
                       r"(?:enable|disable|reenable|preset|mask|unmask|link)\b[^\n;&|]*")


def _commands(script: str) -> str:
    """The script without the contents of the files it stages (a switch's own script names
    systemctl verbs that this script does not run)."""
    return re.sub(r"(stage \S+ \d+ )'.*?' && (\w+=)", r"\1... && \2", script, flags=re.S)


def test_one_daemon_reload_per_apply_even_when_it_enables():
    """`systemctl enable` (and disable, mask, ...) run a daemon-reload of their own unless given
    --no-reload: after the plan's daemon-reload that would be a second full reload of the host's
    systemd per apply (issue 15). A plan that writes, arms, enables and starts two services has
    exactly one."""
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {
        "m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"}),
        "n": ServiceSpec("n", INSTALLED.format("n"), {})})
    p = plan_host(h, HostFacts(services={}), Context("f" * 40, confirm_margin=60.0))
    assert {Kind.WRITE, Kind.ARM, Kind.DAEMON_RELOAD, Kind.ARM_TIMER, Kind.ENABLE, Kind.START} <= \
        {a.kind for a in p.actions}
    script = _commands(build_script(p, p.actions, 0))
    assert script.count("daemon-reload") == 1
    verbs = RELOADING.findall(script)
    assert len(verbs) >= 4 and all("--no-reload" in v for v in verbs), verbs    # 2 enable --now, their 2 fallbacks
    reload = script.index("systemctl daemon-reload")
    assert reload < min(script.index(v) for v in verbs) and reload < script.index("u_start 0.50 m.service")
    assert max(script.index(f" /etc/systemd/system/{n}.service ||") for n in "mn") < reload

    # The verdict that follows (record, disarm the switch, stop on a failure) reloads nothing.
    t = FakeTransport(Completed(0, "", ""))
    asyncio.run(write_record(t, "m", ServiceRecord(hash="h", revision="f" * 40), stop=True))
    (_, verdict), = t.calls
    assert verdict is not None and "daemon-reload" not in verdict
    # the verdict's disarm reloads nothing either: it removes the timer's enablement link itself
    assert all("--no-reload" in v for v in RELOADING.findall(verdict))
    assert "/etc/systemd/system/timers.target.wants/reconciler-confirm-m.timer" in verdict
    # and it stops the switch's timer only where one is loaded (a builtin test first), queued
    assert "if [ -e /run/systemd/transient/reconciler-confirm-m.timer ]" in verdict
    assert "systemctl stop --no-block reconciler-confirm-m.timer reconciler-confirm-m.service" in verdict



def test_a_failing_start_is_reported_and_the_script_goes_on():
    p = _plan()
    start = next(i for i, a in enumerate(p.actions) if a.kind is Kind.START)
    err = base64.b64encode(b"Failed to start m.service: Unit m.service has a bad setting.").decode()
    out = f"@@now 5\n@@fail {start} 1 {err}\n"
    t = FakeTransport(Completed(0, out, f"@@step {start}\n@@step done\n"))
    applied = asyncio.run(apply_plan(t, p, now=0))
    assert applied.host_clock == 5.0
    f = applied.failed("m")
    assert f is not None and "bad setting" in f.message and f.exit_status == 1
    assert len(t.calls) == 1   # the whole plan is one round trip


def test_a_failing_file_step_stops_the_script_and_names_the_step():
    p = _plan()
    write = next(i for i, a in enumerate(p.actions) if a.kind is Kind.WRITE)
    stderr = f"@@step 0\n@@step {write}\nbase64: write error: No space left on device\n"
    t = FakeTransport(Completed(1, f"@@now 1\n@@fatal {write} 1\n", stderr))
    with pytest.raises(CommandError) as e:
        asyncio.run(apply_plan(t, p, now=0))
    assert "write /etc/systemd/system/m" in str(e.value) and "No space left" in str(e.value)
    clock, failures, fatal = parse_results(p, f"@@fatal {write} 1\n", stderr)
    assert fatal is not None and fatal[0] == write and failures == []


def test_the_switch_timer_is_made_only_when_the_controller_goes(tmp_path):
    """A deploy arms no timer: its step installs, once per host, the unit and script that arm
    pending switches (at boot, and for the lock's holder), and stops a timer an earlier
    controller's holder left loaded, only where one is (a builtin test: no process otherwise).
    The lock holder's last act (reconciler/sh/holder.sh, as it lets go) arms each switch whose
    script is still there by that script, its window from the script, and runs nothing when
    none is. Run by sh, with a
    fake systemd-run and systemctl that log their calls, in a scratch root."""
    from reconciler.host import lock
    from reconciler.host.script import PRELUDE as _PRELUDE
    from reconciler.host.script import _fatal
    from reconciler.plan import confirm, layout
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"})})
    p = plan_host(h, HostFacts(services={}), Context("f" * 40, confirm_margin=60.0))
    arm = next(a for a in p.actions if a.kind is Kind.ARM_TIMER)
    root = tmp_path / "root"
    # the step, its paths moved under the scratch root
    paths = sorted({confirm.REARM_PATH, confirm.REARM_LINK, confirm.REARM_SCRIPT, confirm.REARM_LINK.rsplit("/", 1)[0],
                    confirm.REARM_PATH.rsplit("/", 1)[0], confirm.REARM_SCRIPT.rsplit("/", 1)[0],
                    confirm.CONFIRM_DIR, confirm.TRANSIENT, layout.STATE_DIR}, key=len, reverse=True)
    moved = re.compile("|".join(map(re.escape, paths)))
    step = moved.sub(lambda m: f"{root}{m.group(0)}", _fatal(arm, p, 0))
    holder = tmp_path / "holder.sh"          # the lock holder, its state directory under root
    holder.write_text(moved.sub(lambda m: f"{root}{m.group(0)}", lock.installed_texts()[0]))
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("systemd-run", "systemctl"):
        (bindir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "$LOG"\n')
        (bindir / tool).chmod(0o755)
    transient = root / confirm.TRANSIENT[1:]
    transient.mkdir(parents=True)
    log = tmp_path / "log"

    def run(script: str | None) -> list[str]:
        """The script by sh; None: the holder, its controller gone at once (EOF), as it lets go."""
        log.unlink(missing_ok=True)
        argv = ["sh", "-s"] if script is not None else ["sh", str(holder)]
        stdin = script if script is not None else lock.holder_stdin("T", 1, "test owner").split("\n\n", 1)[1]
        r = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=10,
                           env={"PATH": f"{bindir}:/usr/bin:/bin", "LOG": str(log)})
        assert r.returncode == 0, r.stdout + r.stderr
        return log.read_text().splitlines() if log.exists() else []

    deploy = _PRELUDE + step + ' || exit 3\necho "left:$TMPS." >&2\n'
    assert run(deploy) == []                      # no timer made, no process
    assert not list(root.rglob(".reconciler-tmp.*"))   # no temp left

    def text(path: str) -> str:
        return (root / path[1:]).read_text().replace(str(root), "")
    assert text(confirm.REARM_PATH) == confirm.REARM_UNIT_TEXT and text(confirm.REARM_SCRIPT) == confirm.REARM_TEXT
    link = root / confirm.REARM_LINK[1:]
    assert link.is_symlink() and str(link.readlink()).endswith(confirm.REARM_PATH)
    script = (root / confirm.REARM_SCRIPT[1:])
    script.write_text(script.read_text() + "# kept\n")
    # a timer an earlier, dead controller's holder armed is still loaded: stopped, and only then
    (transient / "reconciler-confirm-m.timer").write_text("")
    assert run(deploy) == ["systemctl stop --no-block reconciler-confirm-m.timer reconciler-confirm-m.service"]
    assert script.read_text().endswith("# kept\n")       # installed once only
    (transient / "reconciler-confirm-m.timer").unlink()

    # the holder lets go after a verdict: no script, nothing armed, no process
    assert run(None) == []
    # ... and with a deploy that got none: its switch armed, the window from its script
    pending = root / confirm.script_path("m")[1:]
    pending.parent.mkdir(parents=True, exist_ok=True)
    pending.write_text("#!/bin/sh\n# window=77\n")
    armed = run(None)
    assert len(armed) == 1 and armed[0].startswith("systemd-run --quiet --collect --unit=reconciler-confirm-m "), armed
    assert "--on-active=77s" in armed[0] and "(armed as the controller went)" in armed[0]
    assert f"{root}{confirm.script_path('m')}" in armed[0]
    sh = subprocess.run(["sh", "-n"], input=confirm.REARM_TEXT, capture_output=True, text=True, timeout=10)
    assert sh.returncode == 0, sh.stderr


def test_a_new_service_is_enabled_and_started_by_one_systemctl_and_a_failure_names_its_step(tmp_path):
    """A service's enable and its first start go as one `systemctl enable --now` (one process
    fewer per new service). When that fails, each step runs again by itself, so
    a failure is reported by the step it belongs to, as without the pairing. The script's
    steps run by sh with a fake systemctl that logs its calls and fails the verbs it is told to."""
    from reconciler.host.script import PRELUDE as _PRELUDE
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"}),
                                              "n": ServiceSpec("n", INSTALLED.format("n"), {})})
    new = {n: ServiceFacts(n, props={"LoadState": "not-found", "ActiveState": "inactive"}) for n in "mn"}
    p = plan_host(h, HostFacts(services=new), Context("f" * 40))
    steps = {(a.kind, a.service): i for i, a in enumerate(p.actions)}
    script = build_script(p, p.actions, 0)
    body = script[script.index(f"step {steps[(Kind.ENABLE, 'm')]}\n"):script.index("step done")]
    body = body[:body.index(f"step {steps[(Kind.RECORD, 'm')]}\n")]       # enables and starts only
    assert body.count("enable --now --quiet --no-reload") == 2
    fake = tmp_path / "systemctl"
    fake.write_text('#!/bin/sh\necho "$*" >> "$LOG"\n'
                    'case " $* " in *" $FAIL "*) echo "Failed: $FAIL refused" >&2; exit 1 ;; esac\n')
    fake.chmod(0o755)

    def run(fail: str) -> tuple[list[str], str]:
        log = tmp_path / f"log-{len(fail)}"
        r = subprocess.run(["sh", "-s"], input=_PRELUDE + body, capture_output=True, text=True, timeout=10,
                           env={"PATH": f"{tmp_path}:/usr/bin:/bin", "LOG": str(log), "FAIL": fail})
        assert r.returncode == 0, r.stdout + r.stderr
        return log.read_text().splitlines(), r.stdout

    calls, out = run("--nothing--")
    assert calls == ["enable --now --quiet --no-reload m.service",
                     "enable --now --quiet --no-reload n.service"]
    assert "@@fail" not in out
    # n's start is refused: n's pair is run again step by step, and the start step says why
    calls, out = run("n.service")
    assert calls[0] == "enable --now --quiet --no-reload m.service"
    assert calls[1:] == ["enable --now --quiet --no-reload n.service",
                         "enable --quiet --no-reload n.service", "start n.service"]
    failed = [line.split() for line in out.splitlines() if line.startswith("@@fail")]
    assert [int(f[1]) for f in failed] == [steps[(Kind.ENABLE, "n")], steps[(Kind.START, "n")]]
    assert "refused" in base64.b64decode(failed[1][3]).decode()
    # only the enable (not the start) fails: the start still runs, and only the enable step failed
    calls, out = run("--quiet")
    assert calls[-1] == "start n.service"
    assert [int(line.split()[1]) for line in out.splitlines() if line.startswith("@@fail")] == \
        [steps[(Kind.ENABLE, "m")], steps[(Kind.ENABLE, "n")]]


def test_a_restart_waits_briefly_for_its_job_and_a_job_that_ran_and_failed_is_the_watchs(tmp_path):
    """job() in the apply script: a start or restart waits for its job at most its share of
    JOB_WAIT (so the script's own reading is settled where the job was quick), and leaves a
    longer one running (timeout ends only the client). A job that ran and failed is no step
    failure (the watch judges the unit, as after a queued job); systemctl refusing the request
    is. Without timeout(1) the request is queued (--no-block). Run by sh with a fake systemctl, and
    for the slow job a `timeout` that notes what it was asked and how it ended (124: it had to
    end the client), so no wall time is measured; that run's wait is cut to 0.2 s."""
    from reconciler.host.script import PRELUDE as _PRELUDE
    from tests.plan.test_plan import OLD, on_host, plan_of, svc, verified
    was = svc(env={"A": "1"})
    p = plan_of((svc(env={"A": "2"}),), (on_host(was, verified(was, OLD)),))
    restart = next(i for i, a in enumerate(p.actions) if a.kind is Kind.RESTART)
    script = build_script(p, p.actions, 0)
    line = next(x for x in script.splitlines() if x.startswith(f"soft {restart} "))
    assert line == f"soft {restart} job 1.00 restart m.service"
    fake = tmp_path / "bin" / "systemctl"
    fake.parent.mkdir()
    fake.write_text('#!/bin/sh\necho "$*" >> "$LOG"\ncase "$MODE" in\n'
                    '  slow) exec sleep 5 ;;\n'
                    '  failed) echo "Job for m.service failed because the control process exited" >&2\n'
                    '          echo "See \\"systemctl status m.service\\" for details." >&2; exit 1 ;;\n'
                    '  refused) echo "Failed to restart m.service: Unit m.service is masked." >&2; exit 1 ;;\n'
                    'esac\n')
    fake.chmod(0o755)
    noted = tmp_path / "noted"         # timeout(1), noting its arguments and its exit status
    noted.mkdir()
    (noted / "timeout").write_text(f'#!/bin/sh\n{shutil.which("timeout")} "$@"\nrc=$?\n'
                                   'echo "timeout $* -> $rc" >> "$LOG"\nexit $rc\n')
    (noted / "timeout").chmod(0o755)
    bare = tmp_path / "bare"           # the tools job() needs, but no timeout(1)
    bare.mkdir()
    for tool in ("sh", "cat", "tail", "base64", "sleep"):
        (bare / tool).symlink_to(subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                                                text=True).stdout.strip())

    def run(mode: str, path: str = "/usr/bin:/bin", step: str = line) -> tuple[str, list[str]]:
        log = tmp_path / f"log-{mode}-{len(path)}"
        r = subprocess.run(["sh", "-s"], input=_PRELUDE + step + "\n", capture_output=True, text=True,
                           timeout=10, env={"PATH": f"{fake.parent}:{path}", "LOG": str(log), "MODE": mode})
        assert r.returncode == 0, r.stdout + r.stderr
        return r.stdout.strip(), log.read_text().splitlines()

    assert run("ok") == (f"@@ok {restart}", ["restart m.service"])
    # the client is ended after its wait (timeout says 124); the job is systemd's: no step failure
    out, calls = run("slow", f"{noted}:/usr/bin:/bin", line.replace(" job 1.00 ", " job 0.20 "))
    assert out == f"@@ok {restart}" and calls[-1] == "timeout 0.20 systemctl restart m.service -> 124", calls
    assert run("failed")[0] == f"@@ok {restart}"
    out, _ = run("refused")
    tag, step, status, msg = out.split()
    assert (tag, int(step), status) == ("@@fail", restart, "1")
    assert "masked" in base64.b64decode(msg).decode()
    out, calls = run("ok", str(bare))
    assert out == f"@@ok {restart}" and calls == ["restart m.service --no-block"]
