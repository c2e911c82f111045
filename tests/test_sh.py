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
