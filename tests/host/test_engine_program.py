"""The engine check's host program (reconciler/sh/engine-probe.sh), run here by sh with a
recording stand-in for systemd-run (it logs its options and runs the command with exactly the
environment its EnvironmentFile= gives, as systemd does), a stand-in nvidia-smi and a stand-in
probe that reports how it was started. The real systemd, the real probes and the real engines
are tests/e2e/test_e2e_engine*.py."""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import os
import stat
import subprocess
import sys
import venv
from pathlib import Path

import pytest

import reconciler.values
from reconciler import shell
from reconciler.desired.spec import ServiceSpec
from reconciler.frames import Records, batch
from reconciler.host import engine
from reconciler.host.transport import LocalTransport
from reconciler.preflight import EngineRun, engine_run_for
from tests.host.programs import run_here

SH = Path(__file__).resolve().parents[2] / "reconciler" / "sh" / "engine-probe.sh"
STAGE = "sglang/srt/server_args.py"

FAKE_PROBE = """import json, os, sys
print("engine log line")
print("RECONCILER-ENGINE " + json.dumps({"engine": "sglang", "version": "0.0-standin", "verdict": "ok",
      "resolved": {"argv": sys.argv[1:], "env": {k: v for k, v in os.environ.items() if k != "LANG"},
                   "isolated": sys.flags.isolated,
                   "no_bytecode": sys.flags.dont_write_bytecode}}))
"""

# systemd-run's stand-in: records its options; the command after the first `--` runs with the
# variables of its EnvironmentFile=s (later wins) and LANG, as systemd gives a service.
FAKE_SYSTEMD_RUN = f"""#!{sys.executable}
import os, re, sys
args = sys.argv[1:]
cut = args.index("--")
with open(os.environ["REC"], "w") as rec:
    rec.write("".join(a + "\\n" for a in args[:cut]))
env = {{"LANG": "C.UTF-8"}}
for a in args[:cut]:
    if a.startswith("EnvironmentFile="):
        for line in open(a.split("=", 1)[1].lstrip("-")).read().splitlines():
            m = re.match(r'^([A-Za-z_][A-Za-z0-9_]*)=(.*)$', line)
            if m:
                v = m.group(2)
                if len(v) >= 2 and v[0] == v[-1] == '"':
                    v = re.sub(r"\\\\(.)", r"\\1", v[1:-1])
                elif len(v) >= 2 and v[0] == v[-1] == "'":
                    v = v[1:-1]
                env[m.group(1)] = v
os.execve(args[cut + 1], args[cut + 1:], env)
"""

FAKE_SMI = """#!/bin/sh
printf 'NVIDIA H200, 9.0, 143771\\nNVIDIA H200, 9.0, 143771\\n'
"""
FACTS = '{"count": 2, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}'


@pytest.fixture
def host_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("systemd-run", FAKE_SYSTEMD_RUN), ("nvidia-smi", FAKE_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setattr(engine, "probe_text", lambda server: FAKE_PROBE)
    monkeypatch.setenv("PATH", f"{bin_dir}:{os.environ['PATH']}")
    monkeypatch.setenv("REC", str(tmp_path / "rec"))
    stage = tmp_path / "site" / STAGE        # the engine's argument stage, here on PYTHONPATH
    stage.parent.mkdir(parents=True)
    stage.write_text("")
    return bin_dir


def spec(unit: str, env: dict[str, str] | None = None) -> ServiceSpec:
    return ServiceSpec(name="m", unit_text=unit, env=env or {})


def unit(*lines: str, python: str = sys.executable, args: str = "--tp-size 1") -> str:
    return "[Service]\n" + "".join(f"{x}\n" for x in lines) + f"ExecStart={python} -m sglang.launch_server {args}\n"


def site(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(tmp_path / "site")}


def run_of(text: str, env: dict[str, str] | None = None) -> EngineRun:
    run = engine_run_for("m", spec(text, env))
    assert run is not None
    return run


def ask(run: EngineRun, cached: str = "") -> tuple[engine.EngineAnswer, str]:
    """The host program run by sh as a host runs it: its answer, and its raw output."""
    probe = engine.EngineProbe(run, cached=cached, seconds=30)
    res = run_here(probe, tokens=["T0"])
    return probe.parse(Records(res.stdout, "T0")), res.stdout


def seen(a: engine.EngineAnswer) -> dict:
    """What the stand-in probe reported about how it was started."""
    assert a.verdict is not None and a.verdict.verdict == "ok", a
    return dict(a.verdict.resolved)


def test_the_probe_runs_isolated_with_facts_an_allowlisted_env_and_the_guards_last(host_bin: Path, tmp_path: Path):
    envfile = tmp_path / "unit env.env"                   # a path with a space survives
    envfile.write_text("SGLANG_FROM_FILE=1\nCUDA_VISIBLE_DEVICES=0,1\nLD_PRELOAD=/tmp/x.so\nPYTHONPATH=/tmp/p\n"
                       "HF_TOKEN=hf_secret\nBROWSER=/bin/sh\n")
    text = unit("User=nobody", f"EnvironmentFile={envfile}", "EnvironmentFile=-/etc/reconciler/env/m.env",
                args="--model-path /nonexistent --tp-size 2")
    run = run_of(text, {"SGLANG_FROM_GIT": "from-git", "PYTHONWARNINGS": "all:0:antigravity.x:0:0",
                        "BROWSER": "/bin/sh -c 'touch /tmp/x' %s", "PYTHONSTARTUP": "/tmp/s.py", "PYTHONINSPECT": "1",
                        "VLLM_API_KEY": "k", **site(tmp_path)})
    cmd, stdin = batch([engine.EngineProbe(run, seconds=30)], ["T0"])
    assert "from-git" not in cmd and 'SGLANG_FROM_GIT="from-git"' in stdin      # values only on stdin
    assert not any(n in stdin.split("\n\n", 1)[1] for n in ("PYTHON", "BROWSER", "VLLM_API_KEY"))
    a, _ = ask(run)
    got = seen(a)
    assert (got["isolated"], got["no_bytecode"]) == (1, 1)
    assert got["argv"] == ["--path", str(tmp_path / "site"), "--facts", FACTS, "--", "--model-path", "/nonexistent",
                           "--tp-size", "2"]
    assert got["env"] == {"SGLANG_FROM_FILE": "1", "SGLANG_FROM_GIT": "from-git", "CUDA_VISIBLE_DEVICES": "",
                          "HOME": "/tmp", "HF_HOME": "/nonexistent/.cache/huggingface", "HF_HUB_OFFLINE": "1",
                          "TRANSFORMERS_OFFLINE": "1"}
    options = (tmp_path / "rec").read_text().splitlines()
    assert options[:9] == ["--quiet", "--wait", "--pipe", "--collect", "--service-type=exec", "-p", "MemoryMax=4G",
                           "-p", "RuntimeMaxSec=30"]
    props = [options[i + 1] for i, o in enumerate(options) if o == "-p"]
    assert props[5:] == [*engine.probe_properties(run.unit, "hidden"), props[-1]]
    assert props[5] == "User=nobody" and props[-1].startswith("EnvironmentFile=/run/reconciler-engine.")
    assert [p for p in props if p.startswith("EnvironmentFile=")] == [props[-1]]    # the unit's are not loaded
    assert not Path(props[-1].removeprefix("EnvironmentFile=")).parent.exists()     # nothing left behind


@pytest.mark.parametrize(("line", "kept"), [
    ("SGLANG_A=1", True),
    ("  SGLANG_A=1  ", True),
    ('SGLANG_A="a b"', True),
    ('SGLANG_A="a \\" b"', True),
    ("SGLANG_A='a b'", True),
    ('SGLANG_A="unterminated', False),
    ('SGLANG_A="a" "b"', False),
    ('SGLANG_A="ends in an escaped quote\\"', False),
    ("SGLANG_A='a'b'", False),
    ("SGLANG_A=bare\\ escape", False),
    ("SGLANG_A=continued\\", False),
    ("sglang_a=1", False),
    ("SGLANG_A =1", False),
    ("# SGLANG_A=1", False),
    ("SGLANG_API_KEY=1", False),
    ("VLLM_LOGGING_CONFIG_PATH=/x.json", False),
    ("NCCL_NET_PLUGIN=evil", False),
    ("HF_MODULES_CACHE=/tmp/m", False),
    ("OMP_NUM_THREADS=4", True),
    ("LD_PRELOAD=/x.so", False),
])
def test_a_unit_env_file_keeps_only_whole_lines_that_set_an_allowed_variable(host_bin: Path, tmp_path: Path,
                                                                           line: str, kept: bool):
    envfile = tmp_path / "unit.env"
    envfile.write_text(f"{line}\nSGLANG_AFTER=2\n")
    a, _ = ask(run_of(unit(f"EnvironmentFile={envfile}"), site(tmp_path)))
    names = set(seen(a)["env"]) - {"HOME", "HF_HOME", "HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE", "CUDA_VISIBLE_DEVICES"}
    after = set() if line.endswith("\\") else {"SGLANG_AFTER"}      # a continued line takes the next with it
    assert names == ({line.split("=")[0].strip()} | after if kept else after)


def test_a_continued_line_takes_the_lines_that_continue_it_with_it(host_bin: Path, tmp_path: Path):
    """A trailing backslash continues a line in systemd: `FOO=\\` then `SGLANG_X=1` is one value of
    FOO's; `SGLANG_Y=1\\` then `LD_PRELOAD=...` is one of SGLANG_Y's. Neither reaches the probe."""
    envfile = tmp_path / "unit.env"
    envfile.write_text("FOO=a\\\nSGLANG_X=1\nSGLANG_Y=1\\\nLD_PRELOAD=/x.so\\\nSGLANG_Z=1\nSGLANG_OK=1\n")
    a, _ = ask(run_of(unit(f"EnvironmentFile={envfile}"), site(tmp_path)))
    assert "SGLANG_OK" in seen(a)["env"]
    assert not {"SGLANG_X", "SGLANG_Y", "SGLANG_Z", "LD_PRELOAD", "FOO"} & set(seen(a)["env"])


def test_visible_mode_passes_no_facts_and_hides_no_gpu(host_bin: Path, tmp_path: Path):
    run = reconciler.values.replace(run_of(unit(), {"CUDA_VISIBLE_DEVICES": "3", **site(tmp_path)}), mode="visible")
    a, _ = ask(run)
    assert seen(a)["argv"] == ["--path", str(tmp_path / "site"), "--", "--tp-size", "1"]
    assert seen(a)["env"]["CUDA_VISIBLE_DEVICES"] == "3"
    assert "PrivateDevices=yes" not in (tmp_path / "rec").read_text()


def test_an_unchanged_stamp_answers_from_the_cache_without_running_the_probe(host_bin: Path, tmp_path: Path):
    run = run_of(unit(), site(tmp_path))
    first, _ = ask(run)
    (tmp_path / "rec").unlink()
    again, _ = ask(run, cached=first.stamp)
    assert again == engine.EngineAnswer(first.stamp, None) and not (tmp_path / "rec").exists()


def make_venv(at: Path, system_site: bool = False) -> Path:
    """A venv of this python (no pip), its site-packages returned."""
    venv.EnvBuilder(with_pip=False, symlinks=True, system_site_packages=system_site).create(at)
    return next((at / "lib").glob("python3*/site-packages"))


def test_no_python_is_started_where_the_engines_argument_stage_is_not_installed(host_bin: Path, tmp_path: Path):
    run = run_of(unit(), {"PYTHONPATH": str(tmp_path / "elsewhere")})
    a, _ = ask(run)
    assert a.stamp == "" and a.verdict is not None and a.verdict.verdict == "inconclusive"
    assert a.verdict.message == (f"sglang is not installed for {sys.executable} "
                                 "(no sglang/srt/server_args.py in its package directories)")
    assert not (tmp_path / "rec").exists()                    # systemd-run never ran


def test_a_pth_of_a_site_directory_is_followed_and_an_editable_finder_counts_as_installed(host_bin: Path,
                                                                                         tmp_path: Path):
    """Python reads the .pth files of its site directories (not of PYTHONPATH's): a line naming a
    directory puts it on the path, relative to the site directory or absolute; an `import` line
    (setuptools' editable finder) naming the engine means it is installed somewhere."""
    sp = make_venv(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    src = tmp_path / "src"
    (src / STAGE).parent.mkdir(parents=True)
    (src / STAGE).write_text("")
    for pth, found in ((f"# a comment\n{src}", True), ("../../../../src", True), ("import os\n/src/vllm", False),
                       ("import __editable___sglang_0_5_23_finder; __editable___sglang_0_5_23_finder.install()", True),
                       (f"{src}/missing", False)):
        (sp / "a.pth").write_text(pth)
        rec = tmp_path / "rec"
        rec.unlink(missing_ok=True)
        a, _ = ask(run_of(unit(python=python)))
        assert (a.verdict is not None and a.verdict.verdict == "ok") is found, (pth, a)
        assert rec.exists() is found
    # The same .pth in a PYTHONPATH directory is not read (python does not), so not installed.
    (sp / "a.pth").unlink()
    (tmp_path / "pp").mkdir()
    (tmp_path / "pp" / "a.pth").write_text(str(src))
    a, _ = ask(run_of(unit(python=python), {"PYTHONPATH": str(tmp_path / "pp")}))
    assert a.verdict is not None and a.verdict.verdict == "inconclusive" and "not installed" in a.verdict.message


def test_the_engine_in_an_interpreters_lib64_counts_as_installed(host_bin: Path, tmp_path: Path):
    """RHEL and Fedora put a wheel with compiled code (vLLM's, SGLang's kernels) under lib64,
    beside lib: python imports from there, so the check runs. Before, only lib was looked at
    and the check said the engine was not installed."""
    prefix = tmp_path / "opt"
    (prefix / "bin").mkdir(parents=True)
    (prefix / "bin" / "python3").symlink_to(sys.executable)       # no pyvenv.cfg: no venv
    python = str(prefix / "bin" / "python3")
    a, _ = ask(run_of(unit(python=python)))
    assert a.verdict is not None and "not installed" in a.verdict.message
    stage = prefix / "lib64" / "python3.11" / "site-packages" / STAGE
    stage.parent.mkdir(parents=True)
    stage.write_text("")
    a, _ = ask(run_of(unit(python=python)))
    assert a.verdict is not None and a.verdict.verdict == "ok" and (tmp_path / "rec").exists()


def test_every_pythonpath_entry_is_searched_and_passed_in_order_relative_ones_left_out(host_bin: Path,
                                                                                      tmp_path: Path):
    (tmp_path / "first").mkdir()
    run = run_of(unit(), {"PYTHONPATH": f"{tmp_path / 'first'}:relative/dir:{tmp_path / 'site'}:{tmp_path / 'none'}"})
    a, _ = ask(run)
    assert seen(a)["argv"][:4] == ["--path", str(tmp_path / "first"), "--path", str(tmp_path / "site")]


def test_the_user_site_is_searched_for_the_units_user_and_given_to_the_probe(host_bin: Path, tmp_path: Path):
    """A unit with User= whose home holds the engine in ~/.local, run by a python that reads the
    user's site directory (the system's, not a venv): found there, and given to the probe as a
    --path (python -I does not read it); with `-s` it is not looked at. The program reads the
    user's home from /etc/passwd: here from a copy (this machine's is not the test's to change)."""
    home = tmp_path / "home"
    us = home / ".local" / "lib" / f"python3.{sys.version_info.minor}" / "site-packages"
    (us / STAGE).parent.mkdir(parents=True)
    (us / STAGE).write_text("")
    (tmp_path / "passwd").write_text(f"daemon:x:1:1:daemon:{home}:/usr/sbin/nologin\n")
    class Here(engine.EngineProbe):
        @classmethod
        def text(cls) -> str:
            script = super().text().replace("< /etc/passwd", f"< {tmp_path / 'passwd'}")
            assert script != super().text()
            return script

    def answer(run: EngineRun) -> engine.EngineAnswer:
        probe = Here(run, seconds=30)
        return probe.parse(Records(run_here(probe, tokens=["T0"]).stdout, "T0"))
    assert seen(answer(run_of(unit("User=daemon", python="/usr/bin/python3"))))["argv"][:2] == ["--path", str(us)]
    a = answer(run_of(unit("User=daemon", python="/usr/bin/python3 -s")))
    assert a.verdict is not None and "not installed" in a.verdict.message


@pytest.mark.parametrize(("change", "where"), [
    (["chmod o+w"], "site"),
    (["chgrp 4242", "chmod g+w"], "site"),
    (["chown 4242"], "site"),
    (["chown 4242"], "stage"),
    (["chmod o+w"], "above"),
])
def test_a_path_anyone_else_may_write_makes_the_check_refuse_naming_it(host_bin: Path, tmp_path: Path,
                                                                      change: list[str], where: str):
    """The interpreter, a directory on its path, the stage file or a directory above one of
    them, owned by someone else or writable by another group or by others: no probe, an
    inconclusive verdict naming the path."""
    target = {"site": tmp_path / "site", "stage": tmp_path / "site" / STAGE, "above": tmp_path}[where]
    if os.geteuid() != 0:
        pytest.fail("run as root (.ci/test does): the test changes owners")
    for c in change:
        subprocess.run([*c.split(), str(target)], check=True)
    try:
        a, out = ask(run_of(unit(), site(tmp_path)))
    finally:
        subprocess.run(["chown", "0:0", str(target)], check=True)
        subprocess.run(["chmod", "go-w", str(target)], check=True)
    assert a.verdict is not None and a.verdict.verdict == "inconclusive", a
    assert a.verdict.message.startswith(f"the engine check did not run: {target} (owner uid "), a.verdict.message
    assert "may be changed by someone other than root, and the probe would run what it holds" in a.verdict.message
    assert not (tmp_path / "rec").exists()


def test_the_units_own_user_may_own_its_packages_and_root_sticky_directories_above_are_fine(host_bin: Path,
                                                                                           tmp_path: Path):
    """/tmp (root's, sticky) is above every path here; a site directory owned by the unit's
    own user is the unit's to change anyway."""
    subprocess.run(["chown", "nobody", str(tmp_path / "site")], check=True)
    try:
        a, _ = ask(run_of(unit("User=nobody"), site(tmp_path)))
        assert a.verdict is not None and a.verdict.verdict == "ok", a
        b, _ = ask(run_of(unit(), site(tmp_path)))        # the same, for a unit of root's
        assert b.verdict is not None and "owner uid 65534" in b.verdict.message
    finally:
        subprocess.run(["chown", "0", str(tmp_path / "site")], check=True)


def stamp_of(run: EngineRun) -> str:
    a, _ = ask(run, cached="-")
    assert a.stamp
    return a.stamp


def test_the_stamp_moves_with_everything_the_answer_depends_on(host_bin: Path, tmp_path: Path):
    """Review 2026-12-03 N3: each change below is a package upgrade (or a new env file) the old
    stamp did not see. Each one moves the stamp, so a cached answer is asked again."""
    sp = make_venv(tmp_path / "venv")
    python = str(tmp_path / "venv" / "bin" / "python")
    src = tmp_path / "src"
    (src / STAGE).parent.mkdir(parents=True)
    (src / STAGE).write_text("v1")
    (sp / "__editable__.sglang.pth").write_text(str(src))
    (sp / "sglang-0.5.12.dist-info").mkdir()
    (sp / "sglang-0.5.12.dist-info" / "METADATA").write_text("Version: 0.5.12\n")
    envfile = tmp_path / "unit.env"
    envfile.write_text("SGLANG_X=1\n")
    (tmp_path / "pp").mkdir()
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    run = run_of(unit(f"EnvironmentFile=-{envfile}", python=python, args=f"--model-path {model}"),
                 {"PYTHONPATH": str(tmp_path / "pp")})
    changes = [
        ("the stage file, edited in place (same size)", lambda: (src / STAGE).write_text("v2")),
        ("a PYTHONPATH directory gets a package", lambda: (tmp_path / "pp" / "sglang").mkdir()),
        ("the site directory: a new dist-info", lambda: (sp / "sglang-0.5.12.dist-info").rename(
            sp / "sglang-0.5.23.dist-info")),
        ("the dist-info's METADATA", lambda: (sp / "sglang-0.5.23.dist-info" / "METADATA").write_text(
            "Version: 0.5.23\n")),
        ("a .pth file", lambda: (sp / "__editable__.sglang.pth").write_text(f"{src}\n")),
        ("the .pth target directory", lambda: (src / "new.py").write_text("")),
        ("the unit's env file", lambda: envfile.write_text("SGLANG_X=2\n")),
        ("the model's config.json", lambda: (model / "config.json").write_text('{"a": 1}')),
    ]
    before = stamp_of(run)
    assert stamp_of(run) == before                          # nothing changed, nothing moved
    for what, change in changes:
        change()
        after = stamp_of(run)
        assert after != before, what
        before = after


def test_the_check_asked_alone_and_a_cached_ok_is_asked_again_once_stale(host_bin: Path, tmp_path: Path):
    """An engine check asked in a round trip of its own (engine.probe), over a local transport:
    the first answer is kept, the same stamp answers from the cache (no probe), a package
    upgrade asks the probe again."""
    run = run_of(unit(), site(tmp_path))
    store = engine.VerdictCache(None, wall=lambda: 1000.0)
    t = LocalTransport()

    def check() -> engine.EngineVerdict:
        return asyncio.run(engine.probe(t, "h", engine.ask("h", run, store, engine.SECONDS), store))
    first = check()
    assert first.verdict == "ok" and not first.cached and (tmp_path / "rec").exists()
    (tmp_path / "rec").unlink()
    second = check()
    assert second.cached and not (tmp_path / "rec").exists()
    (tmp_path / "site" / STAGE).write_text("# upgraded\n")
    third = check()
    assert not third.cached and (tmp_path / "rec").exists()


def test_the_command_line_holds_the_program_only_and_its_parameters_are_named_on_stdin(host_bin: Path,
                                                                                        tmp_path: Path):
    run = run_of(unit("User=llm", args="--tp-size 2 ''"), site(tmp_path))
    cmd, stdin = batch([engine.EngineProbe(run)], ["T0"])
    assert cmd == shell.sh_c(engine.EngineProbe.text(), "reconciler-engine-probe")
    head = [line.split("=", 1) for line in stdin.split("\n\n", 1)[0].splitlines() if not line.startswith("prop=")]
    assert [v for k, v in head if k == "arg"] == ["--tp-size", "2", ""]        # in order, the empty one too
    named = {k: v for k, v in head if k != "arg"}
    # the probe program: its length and digest named, its bytes the end of stdin, after the environment
    assert (named.pop("probe"), named.pop("probesum")) == (str(len(FAKE_PROBE.encode())),
                                                          hashlib.sha256(FAKE_PROBE.encode()).hexdigest())
    assert stdin.endswith("\n" + FAKE_PROBE)
    env = stdin.split("\n\n", 1)[1].removesuffix(FAKE_PROBE)
    assert named == {"token": "T0", "interp": sys.executable, "user": "llm", "mem": "4G", "secs": "120",
                     "mode": "hidden", "model": "", "cached": "", "stage": STAGE, "usersite": "1",
                     "pythonpath": str(tmp_path / "site"), "env": str(env.count("\n"))}
    assert seen(ask(run)[0])["argv"][-3:] == ["--tp-size", "2", ""]


def test_the_output_tail_starts_at_a_line(host_bin: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    """What the probe printed on stderr comes back as its last 64 KiB from the start of a line:
    no word of it is cut in two before the controller redacts it."""
    chatty = "import sys\nfor i in range(20000):\n    print(f'line {i} ' + 'x' * 10, file=sys.stderr)\n"
    monkeypatch.setattr(engine, "probe_text", lambda server: chatty + FAKE_PROBE)
    _, out = ask(run_of(unit(), site(tmp_path)))
    err = next(base64.b64decode(ln.split()[2]).decode() for ln in out.splitlines() if ln.split()[1:2] == ["E"])
    assert len(err) <= engine.SLICE_BYTES and err.startswith("line ") and err.endswith("line 19999 xxxxxxxxxx\n")
    json.dumps(err)
