"""The on-host programs (reconciler/sh/*.sh) run on this machine by the unit tests: the same
texts, with the host's state directory moved under a temp dir (and the holder's idle time
shortened where a test asks), installed there by the same install step as on a host.

The programs' constants are generated from the Python side (frames.HostProgram.constants,
shell.with_constants): a test moves every one under /var/lib/reconciler at that one place."""

from __future__ import annotations

import functools
import os
import subprocess
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, ClassVar

import pytest

from reconciler import frames, shell
from reconciler.frames import HostProgram, Records, batch
from reconciler.host import lock

STATE_DIR = "/var/lib/reconciler"


def local_programs(monkeypatch: pytest.MonkeyPatch, root: Path, *, idle: int | None = None) -> None:
    """Every program's /var/lib/reconciler is `root` from now on in this test (IDLE=`idle`)."""
    real = shell.with_constants

    def with_constants(text: str, constants: Mapping[str, str]) -> str:
        moved = {k: str(root) + v[len(STATE_DIR):] if v == STATE_DIR or v.startswith(STATE_DIR + "/") else v
                 for k, v in constants.items()}
        return real(text, moved)
    monkeypatch.setattr(shell, "with_constants", with_constants)
    # the texts made once per program: made afresh in this test, the cache of the rest kept
    monkeypatch.setattr(frames, "_text", functools.cache(frames._text.__wrapped__))
    monkeypatch.setattr(frames, "_command", functools.cache(frames._command.__wrapped__))
    monkeypatch.setattr(lock, "BIN", str(root / "progs"))
    if idle is not None:
        monkeypatch.setattr(lock, "IDLE", idle)


def run_here(*programs: HostProgram[Any], tokens: Sequence[str] | None = None, env: Mapping[str, str] | None = None,
             path: str | None = None, check: bool = True, shell_: str = "sh") -> subprocess.CompletedProcess[str]:
    """The programs run on this machine as a host runs them (frames.batch: one sh, each its
    parameters on stdin), each with its token (`tokens`, else TOKEN0, TOKEN1, ...). `path`: PATH
    (a stand-in tool first); `shell_`: the shell that runs the command line (the login shell's
    part: bash on a host, over SSH)."""
    toks = list(tokens) if tokens is not None else [f"TOKEN{i}" for i in range(len(programs))]
    cmd, stdin = batch(programs, toks)
    full = {**os.environ, **(env or {}), **({"PATH": path} if path is not None else {})}
    raw = subprocess.run([shell_, "-c", cmd], input=stdin.encode(), capture_output=True, timeout=60, env=full)
    # decoded as the transport decodes (no newline translation: a \r stays a \r)
    res = subprocess.CompletedProcess(raw.args, raw.returncode, raw.stdout.decode(errors="replace"),
                                      raw.stderr.decode(errors="replace"))
    if check:
        assert res.returncode == 0, res.stderr
    return res


def answer(program: HostProgram[Any], **kw: Any) -> Any:
    """One program run here (run_here), its answer parsed."""
    res = run_here(program, tokens=["TOKEN0"], **kw)
    return program.parse(Records(res.stdout, "TOKEN0", "here"))


def headers(stdin: str) -> list[dict[str, list[str]]]:
    """The named parameters of each program of a round trip, as they read them from stdin (for
    programs without a payload): {name: [values]} per program, in order."""
    out: list[dict[str, list[str]]] = []
    for block in stdin.split("\n\n"):
        if not block.strip():
            continue
        params: dict[str, list[str]] = {}
        for line in block.strip("\n").split("\n"):
            name, _, value = line.partition("=")
            params.setdefault(name, []).append(value)
        out.append(params)
    return out


def moved(constants: Mapping[str, str], root: Path) -> dict[str, str]:
    """A program's constants with every absolute path under `root` (a scratch host's /)."""
    return {k: " ".join(str(root) + w if w.startswith("/") else w for w in v.split(" ")) for k, v in constants.items()}


def apply_here(calls: Sequence[str], *, root: Path | None = None, steps: int = 100, path: str | None = None,
               env: Mapping[str, str] | None = None) -> tuple[Any, subprocess.CompletedProcess[str]]:
    """apply.sh with these calls, run by sh on this machine as a host runs it (`sh -s`), its
    constants' paths under `root` where given: its answer (plan/facts/apply.py) for a plan of
    `steps` actions, and how the script ended."""
    from reconciler.host.script import ApplyScript

    class Here(ApplyScript):
        constants: ClassVar[Mapping[str, str]] = (moved(ApplyScript.constants, root) if root is not None
                                                  else ApplyScript.constants)

    program = Here(tuple(calls), steps)
    res = run_here(program, tokens=["T0"], env=env, path=path, check=False)
    return program.parse(Records(res.stdout, "T0", "here", res.stderr)), res


def token_of(stdin: str) -> str:
    """The token an apply script was given (its `T=` assignment)."""
    import re
    m = re.search(r"^T='?([0-9a-f]+)'?$", stdin, re.M)
    assert m is not None, stdin[-500:]
    return m.group(1)
