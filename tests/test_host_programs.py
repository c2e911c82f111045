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
            "HEALTH_SECTIONS": gpu.HEALTH_SECTIONS, "XID_LINES": str(gpu.XID_LINES)},
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


def test_gpu_health_through_the_stand_in_nvidia_smi_journalctl_and_dcgmi(tmp_path: Path):
    """gpu.sh with health asked for, on this machine: the project's stand-in nvidia-smi (its -q in
    nvidia-smi's own layout, faults from a file), a journalctl that prints what the kernel log
    would (and records how it was asked) and a dcgmi; the parser finds each fault."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    (bin_ / "nvidia-smi").symlink_to(STANDIN_SMI)
    (bin_ / "journalctl").write_text(
        f"#!/bin/sh\necho \"$@\" > {tmp_path}/journalctl.args\n"
        "echo '1796288718.801337 h kernel: NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, "
        "GPU has fallen off the bus.'\n"
        "echo '1796288718.9 h kernel: usb 1-1: new high-speed USB device'\n"
        "echo '1796288719.1 h kernel: NVRM: Xid (PCI:0000:18:00): 13, Graphics Exception'\n")
    (bin_ / "dcgmi").write_text("#!/bin/sh\necho 'Error: Health watches not enabled. Please enable watches. '\n"
                                "exit 1\n")
    for f in ("journalctl", "dcgmi"):
        (bin_ / f).chmod(0o755)
    faults = tmp_path / "faults"
    faults.write_text("1 ecc-uncorrectable 2\n1 remap-pending\n")
    cmd, token = gpu.gpu_command(device_prefix=str(tmp_path / "nvidia"), health_since=1796288000)
    res = subprocess.run(["/bin/sh", str(SH / "gpu.sh"), *cmd.args], capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_}:/usr/bin:/bin", "FAKE_GPU_FAULTS": str(faults)})
    assert res.returncode == 0, res.stderr
    h = gpu.parse_gpu(res.stdout, token, "here").health
    assert (tmp_path / "journalctl.args").read_text().split() == [
        "-k", "-q", "--no-pager", "-o", "short-unix", "--since", "@1796288000"]
    assert h is not None and h.read and h.now > 1796288000
    assert h.faults == ("GPU 00000000:2A:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2",
                        "NVRM: Xid (PCI:0000:18:00): 79, pid=1, name=python3, GPU has fallen off the bus. "
                        "[Xid 79: GPU has fallen off the bus (RESTART_BM)]")
    assert h.signs == ()        # the Xid 13 is the application's
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
