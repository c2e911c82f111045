"""The programs that run on hosts are real shell files (reconciler/sh/*.sh): each is clean
under shellcheck (POSIX sh unless its shebang says bash), and each one's constants equal the
Python side's."""

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


def constants(path: Path) -> dict[str, str]:
    """The NAME=value lines at a program's top (its constants), $D expanded."""
    out: dict[str, str] = {}
    for line in path.read_text().splitlines():
        name, sep, value = line.partition("=")
        if sep and name.isupper() and name.isidentifier() and " " not in value:
            out[name] = value.replace("$D", out.get("D", "$D"))
    return out


def test_the_holders_constants_are_the_python_sides():
    from reconciler.host import lock
    from reconciler.plan import confirm, facts
    held = constants(ROOT / "reconciler" / "sh" / "holder.sh")
    assert held == {"D": facts.STATE_DIR, "LOCK": lock.LOCK, "COUNT": lock.COUNT, "OWNER": lock.OWNER,
                    "CONFIRM": confirm.CONFIRM_DIR, "REARM": confirm.REARM_SCRIPT, "IDLE": str(lock.IDLE)}
    rearm = constants(ROOT / "reconciler" / "sh" / "rearm.sh")
    assert rearm == {"D": facts.STATE_DIR, "CONFIRM": confirm.CONFIRM_DIR, "LOCK": lock.LOCK}
