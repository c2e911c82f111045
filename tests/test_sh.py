"""The programs that run on hosts are real shell files (reconciler/sh/*.sh): each is clean
under shellcheck (POSIX sh unless its shebang says bash), and so is each as it is sent, its
constants in front (their values are the Python side's, generated: tests/test_host_programs.py)."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROGRAMS = sorted((ROOT / "reconciler" / "sh").glob("*.sh"))


def test_there_are_programs_and_shellcheck_is_here():
    assert PROGRAMS, "no reconciler/sh/*.sh"
    assert shutil.which("shellcheck"), "shellcheck is missing: .ci/setup installs it (Debian package shellcheck)"


@pytest.mark.parametrize("path", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_each_program_is_shellcheck_clean(path: Path):
    res = subprocess.run(["shellcheck", "--external-sources", str(path)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def sent() -> dict[str, str]:
    """Every program as a host gets it: its text with its constants in front (and for a script
    the shell reads whole, an example of its parameters and calls; a dead-man's switch as it is
    written), from its file as it is (the comment lines, shellcheck's directives among them,
    are dropped only as it is sent)."""
    import functools
    from unittest import mock

    # Imported before the patch: a module that binds `program` by name as it is imported
    # (tests/host/test_apply.py) must get the real one, not this test's.
    import tests.host.test_apply  # noqa: F401
    from reconciler import frames, shell
    # the texts made once per program (frames): made afresh from the files here, the cache kept
    with mock.patch.object(shell, "program", lambda name: (ROOT / "reconciler" / "sh" / f"{name}.sh").read_text()), \
            mock.patch.object(frames, "_text", functools.cache(frames._text.__wrapped__)):
        return _sent()


def _sent() -> dict[str, str]:
    from reconciler.frames import HostProgram
    from reconciler.host import engine, gpu, lock
    from reconciler.host.script import ApplyScript
    from reconciler.plan import confirm
    from reconciler.plan.facts import fetch, host_record, journal, observe, progress, show, verify, versions
    from reconciler.plan.facts import gpu as gpu_facts
    from reconciler.plan.records import ServiceRecord
    from reconciler.preflight import _hostcheck
    from tests.host.test_apply import _plan
    programs: list[type[HostProgram[object]]] = [
        observe.Observe, verify.Verify, gpu_facts.GpuRead, versions.Versions, _hostcheck.ModelCheck,
        progress.JournalTail,
        show.UnitShow, journal.Journal, engine.EngineProbe, gpu.Signal, fetch.FetchCommand, lock.Install,
        host_record.HostRecordRead]
    out = {p.name: p.text() for p in programs}
    plan = _plan()
    out["apply"] = ApplyScript.of(plan, plan.actions, 0).stdin("0123456789abcdef")
    out["holder"], out["session"] = lock.installed_texts()[:2]
    out["launch"], out["rearm"] = lock.launch_text(), confirm.rearm_text()
    out["confirm"] = confirm.arm("m", revision="f" * 40, new_hash="h", window=60, record=ServiceRecord(),
                                 previous=confirm.Previous("r", "[Service]\n", None)).script
    return out


SENT = sent()


@pytest.mark.parametrize("name", sorted(SENT))
def test_each_program_as_it_is_sent_is_shellcheck_clean(name: str):
    shebang = SENT[name].split("\n", 1)[0]
    args = ["--shell=bash"] if "bash" in shebang else ["--shell=sh"]
    if name == "apply":         # its calls' arguments are texts (a unit, the re-arm script) quoted as data
        args.append("--exclude=SC2016")
    if name == "holder":        # it sources session.sh, checked on its own (from stdin, shellcheck cannot follow)
        args.append("--exclude=SC1091")
    res = subprocess.run(["shellcheck", *args, "-"], input=SENT[name], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stdout + res.stderr


def _layout_values() -> list[str]:
    """The host's layout as plan/layout.py writes it once: every path and name it defines."""
    from reconciler.plan import layout
    return sorted({v for k, v in vars(layout).items() if k.isupper() and isinstance(v, str) and len(v) > 4})


@pytest.mark.parametrize("path", PROGRAMS, ids=[p.name for p in PROGRAMS])
def test_no_program_writes_a_value_of_the_layout_itself(path: Path):
    """A path or name the Python side holds (plan/layout.py) reaches a program as a constant in
    front of its text, never written in the file as well, where the two could drift apart."""
    from reconciler import shell
    text = shell.program(path.stem)          # as it is sent: comment lines dropped
    assert [v for v in _layout_values() if v in text] == []
