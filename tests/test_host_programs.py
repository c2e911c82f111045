"""The programs run on hosts (reconciler/sh/*.sh), each a file with named parameters and a pure
parser beside it (frames.HostProgram): each runs on its own under sh on this machine, its answer
read by its parser; batched in one sh, as the pre-flight runs them, each parser still finds its
own answer, each program its own parameters. Their constants are the Python side's, generated
into the text they are sent as: never written twice."""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import ClassVar

import pytest

from reconciler import shell
from reconciler.frames import HostProgram, Records, batch
from reconciler.plan.facts.gpu import GpuRead
from reconciler.plan.facts.observe import Observe
from reconciler.plan.facts.verify import Verify
from reconciler.plan.facts.versions import VersionRead, Versions
from reconciler.preflight._hostcheck import ModelCheck
from tests.host.programs import answer, run_here

SH = Path(__file__).resolve().parents[1] / "reconciler" / "sh"
PROGRAMS: list[type[HostProgram[object]]] = [Observe, GpuRead, ModelCheck, Verify, Versions]


@pytest.mark.parametrize("program", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_each_program_is_its_file_with_the_python_sides_constants_in_front(program: type[HostProgram[object]]):
    text = program.text()
    assert text.startswith("#!/bin/sh\n") and text.endswith(shell.program(program.name).split("\n", 1)[1])
    head = text.split("\n")[1:1 + len(program.constants)]
    assert head == [f"{k}={shlex.quote(v)}" for k, v in program.constants.items()]
    # sh reads each constant back as the Python side holds it
    probe = "\n".join(head) + "\n" + "".join(f'printf "%s\\0" "${k}"\n' for k in program.constants)
    got = subprocess.run(["sh", "-c", probe], capture_output=True, text=True, timeout=10, check=True).stdout
    assert dict(zip(program.constants, got.split("\0")[:-1], strict=True)) == dict(program.constants)
    assert "%(" not in text


def test_a_program_reads_its_named_parameters_and_no_value_with_a_line_break_is_sent():
    assert Versions([VersionRead("a", "/p y/python3", "sglang", user="u")]).stdin("T") == (
        "token=T\nservice=a\nexe=/p y/python3\nmodule=sglang\npythonpath=\nuser=u\nusersite=1\n\n")
    with pytest.raises(ValueError, match="line break"):
        Observe(("a\nb",)).stdin("T")


def test_observe_a_service_that_does_not_exist():
    """Read-only (no secret files): on this machine, whatever it runs, the service is absent."""
    f = answer(Observe(("reconciler-test-no-such-service",)))
    s = f.services["reconciler-test-no-such-service"]
    assert (s.unit_text, s.env_text, s.envfile_text, s.record, s.dropins) == (None, None, None, None, {})
    assert not s.managed and not s.running and s.foreign_path() is None


def test_observe_hashes_secret_files_with_a_key_of_the_hosts_own(tmp_path: Path):
    state = tmp_path / "state"
    (tmp_path / "secret").write_text("s3cret")

    class Here(Observe):     # every path of the reconciler's own in tmp: this machine may have its own
        constants: ClassVar[Mapping[str, str]] = {
            **Observe.constants, "D": str(state), "KEY": str(state / "secret.key"), "LOCK": str(state / ".lock"),
            "COUNT": str(state / ".lock.count"), "OWNER": str(state / ".lock.owner"),
            "CONFIRM": str(state / "confirm"), "ROTATION": str(state / "rotation")}
    f = answer(Here((), (str(tmp_path / "secret"), str(tmp_path / "gone"))))
    assert len(f.secret_files[str(tmp_path / "secret")] or "") == 32
    assert f.secret_files[str(tmp_path / "gone")] is None and f.services == {}
    assert (state / "secret.key").stat().st_mode & 0o077 == 0 and f.lock_count == "0"


@pytest.mark.skipif(shutil.which("nvidia-smi", path="/usr/bin:/bin") is not None, reason="nvidia-smi is here")
def test_gpu_without_nvidia_smi_or_a_device_node(tmp_path: Path):
    out = run_here(GpuRead(device_prefix=str(tmp_path / "nvidia")), path="/usr/bin:/bin").stdout
    assert out.startswith("TOKEN0 BEGIN\n") and out.endswith("TOKEN0 END\n")
    facts_ = GpuRead().parse(Records(out, "TOKEN0", "here"))
    assert facts_.summary() == "no GPUs (nvidia-smi not found); no process holds /dev/nvidia*"


def test_a_large_index_comes_whole_in_one_record(tmp_path: Path):
    """A large model's model.safetensors.index.json is megabytes (a tensor a line): it comes in
    one base64 record, which base64(1) reads in blocks, never line by line through sh's `read`,
    a byte per system call. Its shards are judged as from a small one."""
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["X"]}, indent=2))
    weights = {f"model.layers.{i}.mlp.experts.{e}.w{w}.weight": f"model-{i % 3 + 1:05d}-of-00003.safetensors"
               for i in range(64) for e in range(64) for w in (1, 2, 3)}
    index = json.dumps({"metadata": {"total_size": 24}, "weight_map": weights}, indent=2)
    (model / "model.safetensors.index.json").write_text(index)
    assert len(index) > 1_000_000
    for n in (1, 2):
        (model / f"model-0000{n}-of-00003.safetensors").write_bytes(b"x" * 8)
    res = run_here(ModelCheck([str(model)]), tokens=["T0"])
    assert [ln.split(" ", 4)[3] for ln in res.stdout.splitlines()
            if ln.startswith("T0 F model.safetensors.index.json ")] == ["B", "E"]
    got = ModelCheck([str(model)]).parse(Records(res.stdout, "T0"))[str(model)]
    assert got.index == {"metadata": {"total_size": 24}, "weight_map": weights}
    assert got.missing == ["model-00003-of-00003.safetensors"] and got.config == {"architectures": ["X"]}


def test_model_check_of_a_model_and_of_a_missing_one(tmp_path: Path):
    model = tmp_path / "m"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"architectures": ["X"]}, indent=2))
    (model / "model.safetensors").write_bytes(b"x" * 8)
    got = answer(ModelCheck([str(model), str(tmp_path / "gone")]))
    assert got[str(model)].complete and got[str(model)].files == {"model.safetensors": 8}
    assert got[str(model)].config == {"architectures": ["X"]}
    assert got[str(tmp_path / "gone")].problems() == [f"model directory {tmp_path / 'gone'} missing"]


def test_model_check_reads_free_space_only_where_a_fetch_may_fill_it(tmp_path: Path):
    """df runs for the `spaces` alone (a fetch's room); the others' free space stays unknown. A
    path missing reads the space of its nearest existing directory."""
    (tmp_path / "m").mkdir()
    paths = [str(tmp_path / "m"), str(tmp_path / "gone" / "deeper")]
    res = run_here(ModelCheck(paths, [paths[1]]), tokens=["T0"])
    assert [ln.split(" ")[1] for ln in res.stdout.splitlines()].count("A") == 1
    got = ModelCheck(paths, [paths[1]]).parse(Records(res.stdout, "T0"))
    assert got[paths[0]].free_bytes is None
    free = shutil.disk_usage(tmp_path).free
    assert got[paths[1]].free_bytes is not None and abs(got[paths[1]].free_bytes - free) < 64 * 2**20
    none = answer(ModelCheck(paths))
    assert [none[p].free_bytes for p in paths] == [None, None]


def test_verify_without_systemd_analyze(tmp_path: Path):
    units = {"a": ("[Service]\nExecStart=/bin/true\n", None)}
    (tmp_path / "sh").symlink_to("/bin/sh")           # sh alone on the PATH
    verified = answer(Verify(units), path=str(tmp_path), shell_="/bin/sh")
    assert (dict(verified.problems), verified.available) == ({}, False)


def test_versions_with_no_server_installed():
    reads = [VersionRead("here", sys.executable, "sglang"), VersionRead("gone", "/no/such/python3", "sglang")]
    res = run_here(Versions(reads))
    assert res.stdout.endswith("TOKEN0 END\n")
    assert Versions(reads).parse(Records(res.stdout, "TOKEN0")) == {"here": None, "gone": None}


def test_versions_are_read_from_lib64_and_from_the_system_site_directories_of_rhel_and_fedora(tmp_path: Path):
    """An interpreter's own lib64 (RHEL, Fedora: where a wheel with compiled code goes), and the
    system's site directories as venv.sh's SYSTEM_SITES lists them, /usr/local's of a `pip
    install` as root among them (moved under tmp_path here: this machine's /usr is not the
    test's). Neither was looked at before: the version read unknown."""
    def metadata(site: Path, name: str, version: str) -> None:
        (site / f"{name}-{version}.dist-info").mkdir(parents=True)
        (site / f"{name}-{version}.dist-info" / "METADATA").write_text(
            f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n\nA description\n")

    def python_in(prefix: Path) -> str:      # no pyvenv.cfg: no venv, so it sees the system's sites
        (prefix / "bin").mkdir(parents=True)
        (prefix / "bin" / "python3").symlink_to(sys.executable)
        return str(prefix / "bin" / "python3")

    metadata(tmp_path / "opt" / "lib64" / "python3.11" / "site-packages", "vllm", "0.11.0")
    metadata(tmp_path / "usr" / "local" / "lib64" / "python3.11" / "site-packages", "sglang", "0.5.9")
    metadata(tmp_path / "usr" / "lib64" / "python3.12" / "site-packages", "vllm", "0.10.1")

    class Here(Versions):
        @classmethod
        def text(cls) -> str:
            sites = super().text().split("SYSTEM_SITES='", 1)[1].split("'", 1)[0]
            assert sites.splitlines()[0] == "/usr/local/lib64/python3*/site-packages"
            return super().text().replace(sites, sites.replace("/usr/", f"{tmp_path}/usr/"))

    reads = [VersionRead("own", python_in(tmp_path / "opt"), "vllm"),
             VersionRead("local", python_in(tmp_path / "bare"), "sglang"),
             VersionRead("system", str(tmp_path / "bare" / "bin" / "python3"), "vllm")]
    res = run_here(Here(reads))
    assert Here(reads).parse(Records(res.stdout, "TOKEN0")) == {"own": "0.11.0", "local": "0.5.9", "system": "0.10.1"}


def test_the_preflights_programs_in_one_sh_each_read_by_its_parser(tmp_path: Path):
    """As pre-flight batches them (one sh, each program but the last a subshell): the units on
    stdin still reach verify.sh, each program reads its own parameters, and each parser finds
    its own answer by its token."""
    units = {"a": ("[Service]\nExecStart=/bin/true\n", "[Service]\nEnvironmentFile=/x\n")}
    (tmp_path / "m").mkdir()
    progs: list[HostProgram[object]] = [Verify(units), ModelCheck([str(tmp_path / "m")]),
                                        GpuRead(device_prefix=str(tmp_path / "nvidia")),
                                        Versions([VersionRead("gone", "/no/such/python3", "sglang")])]
    out = run_here(*progs).stdout
    got = [p.parse(Records(out, f"TOKEN{i}")) for i, p in enumerate(progs)]
    assert got[0].problems == {}
    assert got[1][str(tmp_path / "m")].exists
    assert got[2].holders == []
    assert got[3] == {"gone": None}
    cmd, _ = batch(progs, ["a", "b", "c", "d"])
    assert cmd.count("(\n#!/bin/sh") == 3           # the last runs in the sh itself


def test_the_preflights_reads_answer_alike_in_a_lock_sessions_bash_and_in_sh(tmp_path: Path):
    """In a locked run the holder's bash runs an in_session batch itself (shell.ShScript: its
    script, with set -u from holder.sh, in a UTF-8 locale), where a channel of its own runs `sh
    -c`: both answer byte for byte alike, names outside printable ASCII in base64 by both (bash
    reads [:graph:] by its locale, so the programs test the byte range !-~), and the batch costs
    no sh."""
    model = tmp_path / "m 2"
    (model / "sub").mkdir(parents=True)
    (model / "config.json").write_text('{"x": 2}')
    (model / "sub" / "\u00e9.safetensors").write_bytes(b"x" * 10)
    (model / "gone.safetensors").symlink_to(tmp_path / "nowhere")
    (tmp_path / "nvidia0").write_text("")
    progs: list[HostProgram[object]] = [
        ModelCheck([str(model), str(tmp_path / "m*"), str(tmp_path / "none" / "*")], [str(model)]),
        Versions([VersionRead("a", sys.executable, "pytest"), VersionRead("b", "/no/such/python3", "sglang")]),
        GpuRead(device_prefix=str(tmp_path / "nvidia"))]
    assert all(type(p).in_session for p in progs)
    cmd, stdin = batch(progs, ["T0", "T1", "T2"])
    assert isinstance(cmd, shell.ShScript)
    env = {**os.environ, "LC_ALL": "C.UTF-8"}
    in_sh = subprocess.run(["sh", "-c", cmd], input=stdin, capture_output=True, text=True, env=env, timeout=60)
    in_bash = subprocess.run(["bash", "-u", "-c", cmd.script], input=stdin, capture_output=True, text=True,
                             env=env, timeout=60)
    assert (in_bash.returncode, in_bash.stderr) == (0, "")

    def free_space_masked(out: str) -> str:      # df's figure moves as other tests write
        return re.sub(r"^(T0 A) \d+$", r"\1 N", out, flags=re.M)
    assert in_bash.stdout.count("T0 A ") == 1
    assert free_space_masked(in_bash.stdout) == free_space_masked(in_sh.stdout)
    assert "T0 S 10 c3ViL8OpLnNhZmV0ZW5zb3Jz\n" in in_bash.stdout      # sub/é.safetensors, in base64
    got = progs[0].parse(Records(in_bash.stdout, "T0"))
    assert got[str(model)].files == {"sub/\u00e9.safetensors": 10, "gone.safetensors": None}
    assert progs[1].parse(Records(in_bash.stdout, "T1"))["b"] is None


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
    read = GpuRead(health_since=1796288000, device_prefix=str(tmp_path / "nvidia"))
    env = {"FAKE_GPU_FAULTS": str(faults), **({"JOURNALCTL_WITHOUT_GREP": "1"} if without_grep else {})}
    res = run_here(read, tokens=[token := "TOKEN0"], env=env, path=f"{bin_}:/usr/bin:/bin")
    h = read.parse(Records(res.stdout, token, "here")).health
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
        h = answer(GpuRead(health_since=since, device_prefix=str(tmp_path / "nvidia")),
                   env={"FAKE_GPU_FAULTS": env["FAKE_GPU_FAULTS"]}, path=env["PATH"]).health
        assert (h.faults if h is not None else None) == want
        assert h is None or h.read          # nvidia-smi -q exited 15, and said why: that is a reading
