"""The programs that read a host (reconciler/sh/*.sh), each a fact's command next to its pure
parser: their constants are the Python side's, and each runs on its own under sh on this
machine, its answer read by its parser. Batched with one_sh, as the pre-flight runs them, each
parser still finds its own answer."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.host import engine, gpu, versions
from reconciler.loop import checks
from reconciler.plan import facts
from reconciler.preflight import _enginebox, _hostcheck
from reconciler.shell import ShCommand, one_sh, program

SH = Path(__file__).resolve().parents[1] / "reconciler" / "sh"
_ASSIGNMENT = re.compile(r"^([A-Z_][A-Z0-9_]*)=")


def constants(name: str) -> dict[str, str]:
    """The `NAME=value` lines at the top of a program (after its comments), each value as sh
    reads it (quotes, and $NAME of an earlier one)."""
    lines = (SH / f"{name}.sh").read_text().split("\n")
    head: list[str] = []
    names: list[str] = []
    open_quote = False
    for line in lines[1:]:
        if open_quote:                     # a single-quoted value over several lines
            head.append(line)
            open_quote = line.count("'") % 2 == 0
            continue
        m = _ASSIGNMENT.match(line)
        if m:
            names.append(m.group(1))
            head.append(line)
            open_quote = line.count("'") % 2 == 1
        elif line.startswith("#"):
            continue
        else:
            break
    script = "\n".join(head) + "\n" + "".join(f'printf "%s\\0" "${n}"\n' for n in names)
    res = subprocess.run(["sh", "-c", script], capture_output=True, text=True, timeout=10, check=True)
    return dict(zip(names, res.stdout.split("\0")[:-1], strict=True))


EXPECTED = {
    "observe": {"D": facts.STATE_DIR, "LOCK": facts.LOCK, "COUNT": facts.LOCK_COUNT, "OWNER": facts.LOCK_OWNER,
                "CONFIRM": f"{facts.STATE_DIR}/{facts.CONFIRM_SUBDIR}", "UNIT_DIR": facts.UNIT_DIR,
                "ENV_DIR": facts.ENV_DIR, "ENV_DROPIN": facts.ENV_DROPIN, "DROPIN_DIRS": " ".join(facts.DROPIN_DIRS),
                "SHOW_PROPS": facts.SHOW_PROPS},
    "gpu": {"GPU_FIELDS": gpu.GPU_FIELDS, "OLD_GPU_FIELDS": gpu.OLD_GPU_FIELDS,
            "APP_FIELDS": gpu.APP_FIELDS, "SMI_FORMAT": gpu.SMI_FORMAT,
            "HEALTH_SECTIONS": gpu.HEALTH_SECTIONS, "XID_LINES": str(gpu.XID_LINES), "XID_MATCH": gpu.XID_MATCH,
            "XID_FIELDS": gpu.XID_FIELDS, "XID_GREP": gpu.XID_GREP},
    "model-check": {"CONFIG_FILE": _hostcheck.CONFIG_FILE, "INDEX_FILE": _hostcheck.INDEX_FILE},
    "verify": {"ENV_DROPIN": facts.ENV_DROPIN},
    "engine-probe": {"SLICE_BYTES": str(engine.SLICE_BYTES), "ENV_FILE_BYTES": str(engine.ENV_FILE_BYTES),
                     "ENV_ALLOW": " ".join([*(p + "*" for p in _enginebox.ENV_PREFIXES), *_enginebox.ENV_NAMES]),
                     "ENV_DENY": " ".join(_enginebox.ENV_DENY)},
    "versions": {},
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_each_programs_constants_are_the_python_sides(name: str):
    assert constants(name) == EXPECTED[name]


def test_each_fact_runs_its_program_with_the_token_first():
    cases = [(facts.observe_command(["a"])[0], "observe"), (gpu.gpu_command()[0], "gpu"),
             (_hostcheck.model_check_command(["/m"])[0], "model-check"),
             (checks.verify_command({"a": ("[Unit]\n", None)})[0], "verify"),
             (versions.probe_command([versions.Probe("a", "python3", "sglang")])[0], "versions")]
    for cmd, name in cases:
        assert isinstance(cmd, ShCommand) and cmd.script == program(name) and cmd.script.startswith("#!/bin/sh\n")
        assert re.fullmatch(r"[0-9a-f]{16}", cmd.args[0]), (name, cmd.args)
        assert "%(" not in cmd.script


def run(cmd: ShCommand, name: str | None = None, *, stdin: str | None = None, path: str | None = None) -> str:
    """The program's file itself run by sh with the command's arguments (name), else the
    command line as a host runs it."""
    argv = ["/bin/sh", str(SH / f"{name}.sh"), *cmd.args] if name else ["/bin/sh", "-c", cmd]
    res = subprocess.run(argv, input=stdin, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": path} if path is not None else None)
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_observe_a_service_that_does_not_exist():
    """Read-only (no secret files): on this machine, whatever it runs, the service is absent."""
    cmd, token = facts.observe_command(["reconciler-test-no-such-service"])
    f = facts.parse_observation(run(cmd, "observe"), token, "here")
    s = f.services["reconciler-test-no-such-service"]
    assert (s.unit_text, s.env_text, s.envfile_text, s.record, s.dropins) == (None, None, None, None, {})
    assert not s.managed and not s.running and s.foreign_path() is None


def test_observe_hashes_secret_files_with_a_key_of_the_hosts_own(tmp_path: Path):
    state = tmp_path / "state"
    (tmp_path / "secret").write_text("s3cret")
    cmd, token = facts.observe_command([], secret_files=[str(tmp_path / "secret"), str(tmp_path / "gone")])
    script = cmd.script.replace(f"\nD={facts.STATE_DIR}\n", f"\nD={state}\n", 1)
    f = facts.parse_observation(run(ShCommand(script, "reconciler-observe", cmd.args)), token)
    assert re.fullmatch(r"[0-9a-f]{32}", f.secret_files[str(tmp_path / "secret")] or "")
    assert f.secret_files[str(tmp_path / "gone")] is None and f.services == {}
    assert (state / "secret.key").stat().st_mode & 0o077 == 0 and f.lock_count == "0"


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="nvidia-smi is here")
def test_gpu_without_nvidia_smi_or_a_device_node(tmp_path: Path):
    cmd, token = gpu.gpu_command(device_prefix=str(tmp_path / "nvidia"))
    out = run(cmd, "gpu", path="/usr/bin:/bin")
    assert out.startswith(f"{token} BEGIN\n") and out.endswith(f"{token} END\n")
    facts_ = gpu.parse_gpu(out, token, "here")
    assert facts_.summary() == "no GPUs (nvidia-smi not found); no process holds /dev/nvidia*"


def test_model_check_of_a_model_and_of_a_missing_one(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["X"]}))
    (model / "model.safetensors").write_bytes(b"x" * 8)
    cmd, token = _hostcheck.model_check_command([str(model), str(tmp_path / "gone")])
    got = _hostcheck.parse_model_check(run(cmd, "model-check"), token, "here")
    assert got[str(model)].complete and got[str(model)].files == {"model.safetensors": 8}
    assert got[str(tmp_path / "gone")].problems() == [f"model directory {tmp_path / 'gone'} missing"]


def test_verify_without_systemd_analyze(tmp_path: Path):
    units = {"a": ("[Service]\nExecStart=/bin/true\n", None)}
    cmd, stdin, token = checks.verify_command(units)
    assert checks.parse_verify(run(cmd, "verify", stdin=stdin, path=str(tmp_path)), token, units) == ({}, False)


def test_versions_with_no_server_installed():
    probes = [versions.Probe("here", sys.executable, "sglang"), versions.Probe("gone", "/no/such/python3", "sglang")]
    cmd, token = versions.probe_command(probes)
    out = run(cmd, "versions")
    assert out.endswith(f"{token} END\n")
    assert versions.parse_probe(out, token) == {"here": None, "gone": None}


def test_the_preflights_programs_in_one_sh_each_read_by_its_parser(tmp_path: Path):
    """As pre-flight batches them (one_sh: one sh, each program a subshell): the units on stdin
    still reach verify.sh, and each parser finds its own answer by its token."""
    units = {"a": ("[Service]\nExecStart=/bin/true\n", None)}
    vcmd, stdin, vtok = checks.verify_command(units)
    mcmd, mtok = _hostcheck.model_check_command([str(tmp_path)])
    gcmd, gtok = gpu.gpu_command(device_prefix=str(tmp_path / "nvidia"))
    pcmd, ptok = versions.probe_command([versions.Probe("gone", "/no/such/python3", "sglang")])
    out = run(one_sh([vcmd, mcmd, gcmd, pcmd], "reconciler-preflight"), stdin=stdin)
    problems, _ = checks.parse_verify(out, vtok, units)
    assert problems == {}
    assert _hostcheck.parse_model_check(out, mtok)[str(tmp_path)].exists
    assert gpu.parse_gpu(out, gtok).holders == []
    assert versions.parse_probe(out, ptok) == {"gone": None}




STANDIN_SMI = Path(__file__).resolve().parent / "hostpkg" / "nvidia-smi"


def journal_entry(message: str, **fields: str) -> str:
    """One kernel log entry as `journalctl -o json` prints it (systemd 252, the test hosts'), one line."""
    return json.dumps({"__CURSOR": "s=ac1c;i=41", "__REALTIME_TIMESTAMP": "1796288718801337",
                       "_TRANSPORT": "kernel", "SYSLOG_FACILITY": "0", "SYSLOG_IDENTIFIER": "kernel",
                       "PRIORITY": "3", "MESSAGE": message, **fields}, separators=(",", ":"))


XID_79 = "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, GPU has fallen off the bus."
# What gpu.sh must not pass on: a kernel message that quotes a report (a segfault in a file a
# local user named so; the same with a newline in the name, which journald turns back into one),
# and one that the kernel did not write (a userspace write to /dev/kmsg, facility user).
FORGED = ["python3[4242]: segfault at 0 ip 00007f0000001000 sp 00007ffd00000000 error 4 in "
          "NVRM: Xid (PCI:0000:18:00): 79, x[7f0000000000+1000]",
          "python3[4243]: segfault at 0 ip 00007f0000001000 sp 00007ffd00000000 error 4 in "
          "a\nNVRM: Xid (PCI:0000:18:00): 48, x[7f0000000000+1000]"]


# A journalctl that prints what the kernel log would (the entries in the file `journal`, as JSON),
# as journalctl does: -g matches the message field alone (only those entries), --output-fields
# keeps those fields and journalctl's own; and records each call. JOURNALCTL_WITHOUT_GREP: an
# older journalctl, which knows no -g.
FAKE_JOURNALCTL = """#!{python}
import json, os, re, sys
args = sys.argv[1:]
with open(os.path.join({dir!r}, "journalctl.calls"), "a") as f:
    f.write(json.dumps(args) + "\\n")
if os.environ.get("JOURNALCTL_WITHOUT_GREP") and "-g" in args:
    sys.exit("journalctl: unrecognized option '--grep'")
pattern = args[args.index("-g") + 1] if "-g" in args else None
fields = next((a.split("=", 1)[1].split(",") for a in args if a.startswith("--output-fields=")), None)
shown = 0
for line in open(os.path.join({dir!r}, "journal")):
    e = json.loads(line)
    if pattern is None or re.search(pattern, e["MESSAGE"]):
        keep = {{k: v for k, v in e.items() if fields is None or k in fields or k.startswith("__")}}
        print(json.dumps(keep, separators=(",", ":")))
        shown += 1
sys.exit(1 if pattern is not None and not shown else 0)
"""


@pytest.mark.parametrize("without_grep", [False, True])
def test_gpu_health_through_the_stand_in_nvidia_smi_journalctl_and_dcgmi(tmp_path: Path, without_grep: bool):
    """gpu.sh with health asked for, on this machine: the project's stand-in nvidia-smi (its -q in
    nvidia-smi's own layout, faults from a file), a journalctl that prints what the kernel log
    would (with -g, or an older one without) and a dcgmi; the parser finds each fault, and only
    the driver's own Xid reports for this host's GPUs."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").symlink_to(STANDIN_SMI)
    messages = [XID_79, "usb 1-1: new high-speed USB device", "NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception",
                *FORGED, "NVRM: Xid (PCI:0000:2a:00): 48, pid=2, name=python3, DBE",
                "NVRM: Xid (PCI:0000:99:00): 79, pid=1, name=python3, GPU has fallen off the bus."]
    entries = [journal_entry(m, **({"SYSLOG_FACILITY": "1"} if ", DBE" in m else {})) for m in messages]
    (tmp_path / "journal").write_text("".join(e + "\n" for e in entries))
    (bin_ / "journalctl").write_text(FAKE_JOURNALCTL.format(python=sys.executable, dir=str(tmp_path)))
    (bin_ / "dcgmi").write_text("#!/bin/sh\necho 'Error: Health watches not enabled. Please enable watches. '\n"
                                "exit 1\n")
    for f in ("journalctl", "dcgmi"):
        (bin_ / f).chmod(0o755)
    faults = tmp_path / "faults"
    faults.write_text("1 ecc-uncorrectable 2\n1 remap-pending\n")
    cmd, token = gpu.gpu_command(device_prefix=str(tmp_path / "nvidia"), health_since=1796288000)
    env = {**os.environ, "PATH": f"{bin_}:/usr/bin:/bin", "FAKE_GPU_FAULTS": str(faults),
           **({"JOURNALCTL_WITHOUT_GREP": "1"} if without_grep else {})}
    res = subprocess.run(["/bin/sh", str(SH / "gpu.sh"), *cmd.args], capture_output=True, text=True, timeout=60,
                         env=env)
    assert res.returncode == 0, res.stderr
    h = gpu.parse_gpu(res.stdout, token, "here").health
    calls = [json.loads(x) for x in (tmp_path / "journalctl.calls").read_text().splitlines()]
    since = ["-k", "-q", "--no-pager", "-o", "json"]
    with_g = [*since, "--output-fields=MESSAGE,_TRANSPORT,SYSLOG_FACILITY", "--since", "@1796288000", "-g",
              r"^NVRM: Xid \("]
    assert calls == ([with_g, [*since, "--since", "@1796288000"]] if without_grep else [with_g])
    # The host sends only entries whose message opens with a report: the ones quoting one stay there
    sent = [json.loads(ln.split(" ", 2)[2])["MESSAGE"] for ln in res.stdout.splitlines()
            if ln.startswith(f"{token} K ")]
    assert sent == [messages[0], messages[2], messages[5], messages[6]]
    assert h is not None and h.read and h.now > 1796288000
    assert h.faults == ("GPU 00000000:2A:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2",
                        f"{XID_79} [Xid 79: GPU has fallen off the bus (RESTART_BM)]")
    assert h.signs == ()        # the Xid 13 is the application's; 2a's Xid 48 is not the kernel's; 99 is not here
    assert h.notes == ("GPU 00000000:2A:00.0: Remapped Rows / Pending: Yes (it waits for a GPU reset)",
                       "dcgmi health: Error: Health watches not enabled. Please enable watches.")
    # Only the health sections come back, not the whole report (memory, temperature ...)
    kept = [ln for ln in res.stdout.splitlines() if ln.startswith(f"{token} Q ")]
    assert not any("Temperature" in ln or "FB Memory Usage" in ln for ln in kept)
    assert sum("GPU Recovery Action" in ln for ln in kept) == 2


def test_gpu_health_of_a_lost_gpu_and_without_the_health_asked_for(tmp_path: Path):
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").symlink_to(STANDIN_SMI)
    faults = tmp_path / "faults"
    faults.write_text("0 lost\n")
    env = {**os.environ, "PATH": f"{bin_}:/usr/bin:/bin", "FAKE_GPU_FAULTS": str(faults)}
    for since, want in ((0, ("nvidia-smi: Unable to determine the device handle for GPU00000000:18:00.0: GPU is "
                             "lost.  Reboot the system to recover this GPU",)), (None, None)):
        cmd, token = gpu.gpu_command(device_prefix=str(tmp_path / "nvidia"), health_since=since)
        res = subprocess.run(["/bin/sh", str(SH / "gpu.sh"), *cmd.args], capture_output=True, text=True,
                             timeout=60, env=env)
        h = gpu.parse_gpu(res.stdout, token, "here").health
        assert (h.faults if h is not None else None) == want
        assert h is None or h.read          # nvidia-smi -q exited 15, and said why: that is a reading
