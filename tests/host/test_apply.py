"""The executor: a plan's steps as calls of reconciler/sh/apply.sh's functions (host/script.py),
its answer read by plan/facts/apply.py. The calls are checked as the plan's order needs them;
the functions run by sh on this machine in a scratch root (apply_here: apply.sh's constants'
paths moved there), with stand-in systemctl and friends that log their calls; the executor over
a fake transport that answers as the program frames its records."""

from __future__ import annotations

import asyncio
import re
import shutil
import stat
import subprocess

import pytest

from reconciler.desired.spec import HostSpec, ServiceSpec, SSHSpec
from reconciler.errors import CommandError
from reconciler.frames import Records
from reconciler.host import script as scripts
from reconciler.host.apply import apply_plan, write_record
from reconciler.host.script import ApplyScript, call, record_calls, steps
from reconciler.host.transport import Completed
from reconciler.plan import confirm, layout
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.facts.apply import parse_apply
from reconciler.plan.model import Context, Kind
from reconciler.plan.records import ServiceRecord
from reconciler.shell import program
from tests.host.programs import apply_here, token_of

INSTALLED = "[Service]\nExecStart=/bin/{}\n\n[Install]\nWantedBy=multi-user.target\n"


class FakeTransport:
    """Records commands; answers as the apply script frames its records (`out`, `err`: with
    {T} for the script's token). For executor unit tests only."""

    host = "h1"

    def __init__(self, out: str = "", err: str = "", status: int = 0):
        self.out, self.err, self.status = out, err, status
        self.calls: list[tuple[str, str | None]] = []

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        self.calls.append((cmd, input))
        tok = token_of(input or "")
        return Completed(self.status, self.out.format(T=tok), self.err.format(T=tok))


def _plan():
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", "[Service]\nExecStart=/bin/x\n", {"A": "1"})})
    return plan_host(h, HostFacts(services={}), Context("f" * 40))


def _at(lines: list[str], prefix: str) -> int:
    return next(i for i, x in enumerate(lines) if x.startswith(prefix))


def test_script_records_intent_then_writes_atomically_then_reloads_once_then_records_last():
    p = _plan()
    lines = steps(p, p.actions, 0)
    assert lines[0] == "now" and lines[-1] == "finish units=m.service"
    assert sum(x.startswith("reload ") for x in lines) == 1
    intent = _at(lines, "stage_file step=0 path=/var/lib/reconciler/services/m.json")
    # the intents are a batch of their own, committed before any unit file is staged: the next
    # batch's commit syncs their directory with its own temps, before it renames anything
    first_commit = lines.index("commit")
    unit = _at(lines, "stage_file step=1 path=/etc/systemd/system/m.service")
    assert intent < first_commit < unit < lines.index("commit", unit) < _at(lines, "reload ")
    assert _at(lines, "start step=7 unit=m.service ") < max(i for i, x in enumerate(lines) if "host.json" in x)
    text = ApplyScript.text()
    assert f"TEMP={layout.TEMP}\n" in text and 't="$d/$TEMP.$$.' in text  # the temps' names: this script's own
    assert "rm -f $TMPS" in text                                          # the clean-up: only those
    assert "rm -f /etc/systemd/system/.reconciler-tmp.*" not in text


def test_write_file_in_the_hosts_shell_keeps_content_and_modes_and_leaves_no_temp(tmp_path):
    """apply.sh's write_file, run by sh: exact bytes, the mode asked for (a 0600 file is never
    created readable by others), no temp file left behind, and a failure stops the script."""
    calls = [call("write_file", step=1, path=f"{tmp_path}/new/dir/a.conf", mode="0644", text="x=1\n\u00e9\n"),
             call("write_file", step=2, path=f"{tmp_path}/secret", mode="0600", text="s3cret"),
             call("write_file", step=3, path=f"{tmp_path}/run.sh", mode="0700", text="#!/bin/sh\n"),
             call("write_file", step=4, path=f"{tmp_path}/nul", mode="0644", base64="YQBi"),
             "umask >&2",
             call("write_file", step=5, path=f"{tmp_path}/secret/cannot", mode="0644", text="x"), "echo not-reached"]
    answer, r = apply_here(calls)
    assert (tmp_path / "new/dir/a.conf").read_text() == "x=1\n\u00e9\n"
    assert (tmp_path / "secret").read_text() == "s3cret" and (tmp_path / "nul").read_bytes() == b"a\x00b"
    assert stat.S_IMODE((tmp_path / "secret").stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "run.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "new/dir/a.conf").stat().st_mode) == 0o644
    assert "\n0022\n" in r.stderr                         # a 0600 write puts the umask back
    assert answer.fatal is not None and answer.fatal.step == 5 and "File exists" in answer.fatal.message
    assert "not-reached" not in r.stdout and r.returncode == 1
    assert not list(tmp_path.rglob(".reconciler-tmp.*"))


def test_a_batch_of_writes_in_the_hosts_shell_fsyncs_once_renames_each_and_names_the_failed_step(tmp_path):
    """Consecutive file steps go as one batch (one fsync of all temps, a rename each, the fsync of
    the directories left to the end): exact bytes and modes, no temp left, and a step that cannot
    write stops the script with its own step number before anything of the batch is renamed."""
    root = tmp_path / "root"
    (root / "var/lib/reconciler/services").mkdir(parents=True)
    (root / "var/lib/reconciler/services/gone.json").write_text("old")
    ok = [call("stage_file", step=3, path=f"{tmp_path}/a/x.conf", mode="0644", text="x='1'\n\u00e9 $HOME `id`\n"),
          call("drop_record", step=4, service="gone"),
          call("stage_file", step=4, path=f"{tmp_path}/b/run.sh", mode="0700", text="#!/bin/sh\n"),
          call("stage_file", step=4, path=f"{tmp_path}/a/y.conf", mode="0644", text=""),
          "commit", 'echo "left:$TMPS.$DEFERRED" >&2', "finish"]
    answer, r = apply_here(ok, root=root)
    assert r.returncode == 0 and answer.fatal is None, r.stdout + r.stderr
    assert (tmp_path / "a/x.conf").read_text() == "x='1'\n\u00e9 $HOME `id`\n"
    assert (tmp_path / "a/y.conf").read_text() == "" and not (root / "var/lib/reconciler/services/gone.json").exists()
    assert stat.S_IMODE((tmp_path / "b/run.sh").stat().st_mode) == 0o700
    assert stat.S_IMODE((tmp_path / "a/x.conf").stat().st_mode) == 0o644
    assert f"left:.{tmp_path}/a {tmp_path}/b" in r.stderr      # nothing for the clean-up; the fsync left to the end
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro/dir").write_text("a file where a directory must be")
    bad = [call("stage_file", step=1, path=f"{tmp_path}/a/x.conf", mode="0644", text="new\n"),
           call("stage_file", step=2, path=f"{tmp_path}/ro/dir/z.conf", mode="0644", text="z\n"), "commit"]
    answer, r = apply_here(bad)
    assert answer.fatal is not None and answer.fatal.step == 2 and r.returncode == 1
    assert (tmp_path / "a/x.conf").read_text().startswith("x=")      # the batch renamed nothing
    assert not list(tmp_path.rglob(".reconciler-tmp.*"))


def test_an_installed_switch_unit_leaves_the_batch_directories_deferred_past_the_restart(tmp_path):
    """arm_timer syncs the last batch's directories only where it writes the re-arm unit (a
    host's first deploy): on every later deploy they stay deferred to the batch after the
    restart, one sync process fewer per deploy."""
    root = tmp_path / "root"
    (root / "var/lib/reconciler/services").mkdir(parents=True)
    steps_ = [call("stage_file", step=0, path=f"{tmp_path}/env/m.env", mode="0600", text="A=1\n"), "commit",
              call("arm_timer", step=1, service="m", script="#!/bin/sh\n", unit="[Unit]\n"),
              'echo "deferred:$DEFERRED" >&2']
    answer, r = apply_here(steps_, root=root)           # first deploy: the unit is written, all settled
    assert r.returncode == 0 and answer.fatal is None, r.stderr
    assert (root / layout.REARM_PATH.lstrip("/")).is_file() and "deferred:\n" in r.stderr
    answer, r = apply_here(steps_, root=root)           # installed: nothing written, the fsync deferred
    assert r.returncode == 0 and answer.fatal is None, r.stderr
    assert f"deferred:{tmp_path}/env\n" in r.stderr


def test_one_daemon_reload_per_apply_even_when_it_enables():
    """`systemctl enable` (and disable, mask, ...) run a daemon-reload of their own unless given
    --no-reload: after the plan's daemon-reload that would be a second full reload of the host's
    systemd per apply (issue 15). A plan that writes, arms, enables and starts two services has
    exactly one; every enable or disable in apply.sh says --no-reload."""
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {
        "m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"}),
        "n": ServiceSpec("n", INSTALLED.format("n"), {})})
    p = plan_host(h, HostFacts(services={}), Context("f" * 40, confirm_margin=60.0))
    assert {Kind.WRITE, Kind.ARM, Kind.DAEMON_RELOAD, Kind.ARM_TIMER, Kind.ENABLE, Kind.START} <= \
        {a.kind for a in p.actions}
    lines = steps(p, p.actions, 0)
    assert sum(x.startswith("reload ") for x in lines) == 1
    reload = _at(lines, "reload ")
    assert reload < _at(lines, "enable_now ") and [x.split()[0] for x in lines].count("enable_now") == 2
    assert max(_at(lines, f"stage_file step={i} path=/etc/systemd/system/{n}.service")
               for i, a in enumerate(p.actions) for n in "mn"
               if a.kind is Kind.WRITE and a.path == f"/etc/systemd/system/{n}.service") < reload
    verbs = re.findall(r"systemctl (?:[-\w]+ )*?(?:enable|disable|reenable|preset|mask|unmask|link)\b[^\n;&|]*",
                       program("apply"))
    assert len(verbs) >= 3 and all("--no-reload" in v for v in verbs), verbs
    assert "daemon-reload" not in program("apply").replace("systemctl daemon-reload || fatal", "")

    # The verdict that follows (record, disarm the switch, stop on a failure) reloads nothing: its
    # disarm removes the timer's enablement link itself, and stops the switch's timer only where
    # one is loaded (a builtin test first), queued
    assert record_calls("m", ServiceRecord(hash="h", revision="f" * 40), stop=True)[1:] == (
        "disarm service=m", "stop step=1 unit=m.service", "finish")
    disarm = program("apply").split("\ndisarm() {", 1)[1].split("\n}\n", 1)[0]
    assert '"$WANTS/$n.timer"' in disarm and "stop_if_armed" in disarm and "daemon-reload" not in disarm
    stop_if_armed = program("apply").split("\nstop_if_armed() {", 1)[1].split("\n}\n", 1)[0]
    assert 'if [ -e "$TRANSIENT/$n.timer" ]' in stop_if_armed and "systemctl stop --no-block" in stop_if_armed


def test_a_failing_start_is_reported_and_the_script_goes_on():
    p = _plan()
    start = next(i for i, a in enumerate(p.actions) if a.kind is Kind.START)
    t = FakeTransport(f"{{T}} now 5\n{{T}} fail {start} 1\n",
                      f"{{T}} step {start}\nFailed to start m.service: Unit m.service has a bad setting.\n"
                      "{T} step done\n")
    applied = asyncio.run(apply_plan(t, p, now=0))
    assert applied.host_clock == 5.0
    f = applied.failed("m")
    assert f is not None and "bad setting" in f.message and f.exit_status == 1
    assert len(t.calls) == 1 and t.calls[0][0] == "sh -s"     # the whole plan is one round trip, on stdin


def test_a_failing_file_step_stops_the_script_and_names_the_step():
    p = _plan()
    write = next(i for i, a in enumerate(p.actions) if a.kind is Kind.WRITE)
    stderr = f"{{T}} step 0\n{{T}} step {write}\nbase64: write error: No space left on device\n"
    t = FakeTransport(f"{{T}} now 1\n{{T}} fatal {write} 1\n", stderr, status=1)
    with pytest.raises(CommandError) as e:
        asyncio.run(apply_plan(t, p, now=0))
    assert "write /etc/systemd/system/m" in str(e.value) and "No space left" in str(e.value)
    answer = parse_apply(Records(f"T fatal {write} 1\n", "T", "h", stderr.format(T="T")), len(p.actions))
    assert answer.fatal is not None and answer.fatal.step == write and answer.failures == ()


def test_the_switch_timer_is_made_only_when_the_controller_goes(tmp_path):
    """A deploy arms no timer: its step installs, once per host, the unit and script that arm
    pending switches (at boot, and for the lock's holder), and stops a timer an earlier
    controller's holder left loaded, only where one is (a builtin test: no process otherwise).
    The lock holder's last act (reconciler/sh/holder.sh, as it lets go) arms each switch whose
    script is still there by that script, its window from the script, and runs nothing when
    none is. Run by sh, with a fake systemd-run and systemctl that log their calls, in a scratch
    root."""
    from reconciler.host import lock
    from tests.host.programs import moved
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"})})
    p = plan_host(h, HostFacts(services={}), Context("f" * 40, confirm_margin=60.0))
    assert any(a.kind is Kind.ARM_TIMER for a in p.actions)
    root = tmp_path / "root"
    rearm = tmp_path / "rearm.sh"           # the re-arm script as installed, its paths under root
    from reconciler import shell
    rearm_text = shell.with_constants(program("rearm"), moved(confirm.REARM_CONSTANTS, root))
    holder = tmp_path / "holder.sh"          # the lock holder, its state directory under root
    holder.write_text(shell.with_constants(program("holder"), {**moved(lock.holder_constants(), root),
                                                                "REARM": str(rearm)}))
    rearm.write_text(rearm_text)
    bindir = tmp_path / "bin"
    bindir.mkdir()
    for tool in ("systemd-run", "systemctl"):
        (bindir / tool).write_text(f'#!/bin/sh\necho "{tool} $*" >> "$LOG"\n')
        (bindir / tool).chmod(0o755)
    transient = root / layout.TRANSIENT[1:]
    transient.mkdir(parents=True)
    log = tmp_path / "log"
    env = {"PATH": f"{bindir}:/usr/bin:/bin", "LOG": str(log)}

    def deploy() -> list[str]:
        log.unlink(missing_ok=True)
        answer, r = apply_here([call("arm_timer", step=4, service="m", script=rearm_text,
                                     unit=confirm.REARM_UNIT_TEXT), 'echo "left:$TMPS." >&2', "finish"],
                               root=root, path=env["PATH"], env=env)
        assert r.returncode == 0 and answer.fatal is None, r.stdout + r.stderr
        assert "left:." in r.stderr
        return log.read_text().splitlines() if log.exists() else []

    def let_go() -> list[str]:
        """The holder, its controller gone at once (EOF), as it lets go."""
        log.unlink(missing_ok=True)
        r = subprocess.run(["sh", str(holder)], input=lock.holder_stdin("T", 1, "test owner").split("\n\n", 1)[1],
                           capture_output=True, text=True, timeout=10, env=env)
        assert r.returncode == 0, r.stdout + r.stderr
        return log.read_text().splitlines() if log.exists() else []

    assert deploy() == []                             # no timer made, no process
    assert not list(root.rglob(".reconciler-tmp.*"))  # no temp left
    assert (root / layout.REARM_PATH[1:]).read_text() == confirm.REARM_UNIT_TEXT
    script = root / layout.REARM_SCRIPT[1:]
    assert script.read_text() == rearm_text
    link = root / layout.REARM_LINK[1:]
    assert link.is_symlink() and str(link.readlink()).endswith(layout.REARM_PATH)
    script.write_text(script.read_text() + "# kept\n")
    # a timer an earlier, dead controller's holder armed is still loaded: stopped, and only then
    (transient / "reconciler-confirm-m.timer").write_text("")
    assert deploy() == ["systemctl stop --no-block reconciler-confirm-m.timer reconciler-confirm-m.service"]
    assert script.read_text().endswith("# kept\n")       # installed once only
    (transient / "reconciler-confirm-m.timer").unlink()

    # the holder lets go after a verdict: no script, nothing armed, no process
    assert let_go() == []
    # ... and with a deploy that got none: its switch armed, the window from its script
    pending = root / confirm.script_path("m")[1:]
    pending.parent.mkdir(parents=True, exist_ok=True)
    pending.write_text("#!/bin/sh\n# window=77\n")
    armed = let_go()
    assert len(armed) == 1 and armed[0].startswith("systemd-run --quiet --collect --unit=reconciler-confirm-m "), armed
    assert "--on-active=77s" in armed[0] and "(armed as the controller went)" in armed[0]
    assert f"{root}{confirm.script_path('m')}" in armed[0]


def test_a_new_service_is_enabled_and_started_by_one_systemctl_and_a_failure_names_its_step(tmp_path):
    """A service's enable and its first start go as one `systemctl enable --now` (one process
    fewer per new service). When that fails, each step runs again by itself, so a failure is
    reported by the step it belongs to, as without the pairing. The calls run by sh with a fake
    systemctl that logs its calls and fails the verbs it is told to."""
    h = HostSpec("h1", SSHSpec("127.0.0.2"), {"m": ServiceSpec("m", INSTALLED.format("m"), {"A": "1"}),
                                              "n": ServiceSpec("n", INSTALLED.format("n"), {})})
    new = {n: ServiceFacts(n, props={"LoadState": "not-found", "ActiveState": "inactive"}) for n in "mn"}
    p = plan_host(h, HostFacts(services=new), Context("f" * 40))
    at = {(a.kind, a.service): i for i, a in enumerate(p.actions)}
    body = [x for x in steps(p, p.actions, 0) if x.startswith("enable_now ")]
    assert len(body) == 2
    fake = tmp_path / "systemctl"
    fake.write_text('#!/bin/sh\necho "$*" >> "$LOG"\n'
                    'case " $* " in *" $FAIL "*) echo "Failed: $FAIL refused" >&2; exit 1 ;; esac\n')
    fake.chmod(0o755)

    def run(fail: str) -> tuple[list[str], dict[int, str]]:
        log = tmp_path / f"log-{len(fail)}"
        answer, r = apply_here(body, steps=len(p.actions), path=f"{tmp_path}:/usr/bin:/bin",
                               env={"LOG": str(log), "FAIL": fail})
        assert r.returncode == 0, r.stdout + r.stderr
        return log.read_text().splitlines(), {f.step: f.message for f in answer.failures}

    calls, failed = run("--nothing--")
    assert calls == ["enable --now --quiet --no-reload m.service", "enable --now --quiet --no-reload n.service"]
    assert failed == {}
    # n's start is refused: n's pair is run again step by step, and the start step says why
    calls, failed = run("n.service")
    assert calls[0] == "enable --now --quiet --no-reload m.service"
    assert calls[1:] == ["enable --now --quiet --no-reload n.service",
                         "enable --quiet --no-reload n.service", "start n.service"]
    assert sorted(failed) == [at[(Kind.ENABLE, "n")], at[(Kind.START, "n")]]
    assert "refused" in failed[at[(Kind.START, "n")]]
    # only the enable (not the start) fails: the start still runs, and only the enable step failed
    calls, failed = run("--quiet")
    assert calls[-1] == "start n.service"
    assert sorted(failed) == [at[(Kind.ENABLE, "m")], at[(Kind.ENABLE, "n")]]


def test_a_restart_waits_briefly_for_its_job_and_a_job_that_ran_and_failed_is_the_watchs(tmp_path):
    """job() in apply.sh: a start or restart waits for its job at most its share of JOB_WAIT (so
    the script's own reading is settled where the job was quick), and leaves a longer one running
    (timeout ends only the client). A job that ran and failed is no step failure (the watch
    judges the unit, as after a queued job); systemctl refusing the request is. Without
    timeout(1) the request is queued (--no-block). Run by sh with a fake systemctl, and for the
    slow job a `timeout` that notes what it was asked and how it ended (124: it had to end the
    client), so no wall time is measured; that run's wait is cut to 0.2 s."""
    from tests.plan.test_plan import OLD, on_host, plan_of, svc, verified
    was = svc(env={"A": "1"})
    p = plan_of((svc(env={"A": "2"}),), (on_host(was, verified(was, OLD)),))
    restart = next(i for i, a in enumerate(p.actions) if a.kind is Kind.RESTART)
    line = next(x for x in steps(p, p.actions, 0) if x.startswith(f"start step={restart} "))
    assert line == f"start step={restart} unit=m.service wait=1.00 restart=1"
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
        (bare / tool).symlink_to(shutil.which(tool) or tool)

    def run(mode: str, path: str = "/usr/bin:/bin", step: str = line) -> tuple[dict[int, str], list[str], str]:
        log = tmp_path / f"log-{mode}-{len(path)}"
        answer, r = apply_here([step], steps=len(p.actions), path=f"{fake.parent}:{path}",
                               env={"LOG": str(log), "MODE": mode})
        assert r.returncode == 0, r.stdout + r.stderr
        return {f.step: f.message for f in answer.failures}, log.read_text().splitlines(), r.stdout

    failed, calls, out = run("ok")
    assert (failed, calls) == ({}, ["restart m.service"]) and f"T0 ok {restart}\n" in out
    # the client is ended after its wait (timeout says 124); the job is systemd's: no step failure
    failed, calls, _ = run("slow", f"{noted}:/usr/bin:/bin", line.replace(" wait=1.00 ", " wait=0.20 "))
    assert failed == {} and calls[-1] == "timeout 0.20 systemctl restart m.service -> 124", calls
    assert run("failed")[0] == {}
    failed, _, _ = run("refused")
    assert list(failed) == [restart] and "masked" in failed[restart]
    failed, calls, _ = run("ok", str(bare))
    assert failed == {} and calls == ["restart m.service --no-block"]


def test_secrets_are_delivered_by_apply_sh_with_values_only_on_stdin(tmp_path):
    """A service's secrets: what it had is kept aside for its switch, each age value written
    root's alone, the rest of its credstore removed, its environment file composed on the host
    from the value files and a referenced one (systemd's quoting); with none wanted by env, the
    file goes. Run by sh in a scratch root; the values come on stdin only."""
    root = tmp_path / "root"
    cred = root / layout.CREDSTORE[1:]
    (cred / "m").mkdir(parents=True)
    (cred / "m" / "old").write_text("stale")
    (cred / "m.env").write_text('OLD="1"\n')
    ref = tmp_path / "ref"
    ref.write_text('a "quoted" $value\\')
    env = f"TOKEN={layout.CREDSTORE}/m/token REF={ref}"
    calls = [call("secrets_aside", step=2, service="m"),
             call("secret", step=2, service="m", name="token", base64="czNjcjN0"),
             call("secrets_env", step=2, service="m", keep="token", env=env.replace(layout.CREDSTORE, str(cred))),
             "finish"]
    answer, r = apply_here(calls, root=root)
    assert answer.fatal is None and r.returncode == 0, r.stderr
    assert (cred / "m" / "token").read_text() == "s3cr3t" and not (cred / "m" / "old").exists()
    assert stat.S_IMODE((cred / "m" / "token").stat().st_mode) == 0o600
    assert stat.S_IMODE((cred / "m").stat().st_mode) == 0o700
    assert (cred / "m.env").read_text() == 'TOKEN="s3cr3t"\nREF="a \\"quoted\\" \\$value\\\\"\n'
    assert (cred / ".previous" / "m" / "old").read_text() == "stale"        # kept aside for the switch
    assert (cred / ".previous" / "m.env").read_text() == 'OLD="1"\n'
    answer, _ = apply_here([call("secrets_aside", step=2, service="m"),
                            call("secrets_env", step=2, service="m", keep="", env=""), "finish"], root=root)
    assert answer.fatal is None and not (cred / "m.env").exists() and list((cred / "m").iterdir()) == []
    answer, _ = apply_here([call("refuse", step=2, message="secret x was not decrypted by this controller")],
                           root=root)
    assert answer.fatal is not None and answer.fatal.message == "secret x was not decrypted by this controller"


def test_the_verdict_and_the_gpu_fault_are_one_round_trip_each_and_say_a_failure():
    t = FakeTransport("{T} S -\n\n{T} END\n")
    asyncio.run(write_record(t, "m", ServiceRecord(hash="h", revision="f" * 40)))
    (cmd, stdin), = t.calls
    assert cmd == "sh -s" and stdin is not None
    assert "\nwrite_file step=0 path=/var/lib/reconciler/services/m.json mode=0600 'text={" in stdin
    t = FakeTransport("{T} fatal 0 1\n", "{T} step 0\nmv: cannot move: Read-only file system\n", status=1)
    with pytest.raises(CommandError, match="Read-only file system"):
        asyncio.run(write_record(t, "m", ServiceRecord(hash="h", revision="f" * 40)))


def test_the_apply_program_is_its_file_with_its_constants_its_parameters_then_its_calls(monkeypatch):
    monkeypatch.setenv("RECONCILER_FAULT", "pause-after-temp")
    p = _plan()
    s = ApplyScript.of(p, p.actions, 0)
    stdin = s.stdin("tok")
    text = ApplyScript.text()
    assert stdin.startswith(text) and text.startswith("#!/bin/sh\nSTATE=/var/lib/reconciler\n")
    head, _, calls = stdin[len(text):].partition("now\n")
    assert head.startswith("T=tok\n") and "RC_PAUSE_AFTER_TEMP=" in head
    assert calls == "".join(c + "\n" for c in s.calls[1:])
    assert scripts.call("f", a="x y", b=None, c=3) == "f 'a=x y' c=3"
