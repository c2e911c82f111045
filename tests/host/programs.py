"""The on-host programs (reconciler/sh/*.sh) run on this machine by the unit tests: the same
texts, with the host's state directory moved under a temp dir (and the holder's idle time
shortened where a test asks), installed there by the same install step as on a host."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler import shell
from reconciler.host import lock

STATE_DIR = "/var/lib/reconciler"


def local_programs(monkeypatch: pytest.MonkeyPatch, root: Path, *, idle: int | None = None) -> None:
    """Every program's /var/lib/reconciler is `root` from now on in this test (IDLE=`idle`)."""
    real = shell.program

    def program(name: str) -> str:
        text = real(name).replace(f"D={STATE_DIR}\n", f"D={root}\n")
        return text.replace("IDLE=30\n", f"IDLE={idle}\n") if idle is not None else text
    monkeypatch.setattr(shell, "program", program)
    monkeypatch.setattr(lock, "BIN", str(root / "progs"))
