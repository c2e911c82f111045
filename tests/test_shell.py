"""reconciler.shell and frames.batch: a program's constants in front of its text, its named
parameters on stdin, and several programs in one sh, each as it ran alone."""

from __future__ import annotations

import subprocess
from typing import ClassVar

import pytest

from reconciler import shell
from reconciler.frames import HostProgram, Records, batch


def _run(cmd: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], input=stdin, capture_output=True, text=True, timeout=10)


def test_constants_go_after_the_first_line_quoted_as_sh_reads_them() -> None:
    text = shell.with_constants("#!/bin/sh\nprintf '%s|' \"$A\" \"$B\"\n", {"A": "it's a $x", "B": "/p q"})
    assert text.startswith("#!/bin/sh\nA=") and text.endswith("printf '%s|' \"$A\" \"$B\"\n")
    assert _run(shell.sh_c(text, "me")).stdout == "it's a $x|/p q|"


def test_named_parameters_are_lines_then_an_empty_one() -> None:
    assert shell.param_lines({"a": "1", "b": ["x y", ""], "c": None, "d": 3}) == "a=1\nb=x y\nb=\nd=3\n\n"
    assert shell.param_lines([("s", "a"), ("x", "1"), ("s", "b"), ("x", "2")]) == "s=a\nx=1\ns=b\nx=2\n\n"
    for bad in ({"a": "x\ny"}, {"a": ["ok", "x\ry"]}, {"A": "1"}, {"a-b": "1"}):
        with pytest.raises(ValueError):
            shell.param_lines(bad)          # type: ignore[arg-type]


class Say(HostProgram[list[str]], frozen=True):
    """A program of this test's own: it reads its parameters, then (`lines`) that many lines of
    payload; it says what it read, and ends as asked (an exit status of its own, a trap)."""

    name: ClassVar[str] = "test-say"
    what: str
    body: str = ""
    lines: tuple[str, ...] = ()

    @classmethod
    def text(cls) -> str:
        return ("#!/bin/sh\nwhile IFS= read -r l && [ -n \"$l\" ]; do case $l in token=*) T=${l#token=} ;; "
                "what=*) W=${l#what=} ;; n=*) N=${l#n=} ;; body=*) B=${l#body=} ;; esac; done\n"
                "while [ \"${N:-0}\" -gt 0 ]; do IFS= read -r p; printf '%s S %s\\n' \"$T\" \"$p\"; N=$((N - 1));"
                " done\n"
                "printf '%s S %s %s\\n' \"$T\" \"$W\" \"${X:-unset}\"\nX=set\neval \"$B\"\nprintf '%s END\\n' \"$T\"\n")

    def params(self) -> dict[str, str]:
        return {"what": self.what, "n": str(len(self.lines)), "body": self.body}

    def payload(self) -> str:
        return "".join(x + "\n" for x in self.lines)

    def parse(self, answer: Records) -> list[str]:
        return [f.payload for f in answer]


def test_one_sh_runs_each_with_its_own_parameters_payload_exit_and_trap() -> None:
    progs = [Say("first", "trap 'echo first-trap' EXIT; exit 3", ("p1", "p 2")), Say("second"), Say("third")]
    cmd, stdin = batch(progs, ["T1", "T2", "T3"])
    res = _run(cmd, stdin)
    assert [p.parse(Records(res.stdout, t)) for p, t in zip(progs, ["T1", "T2", "T3"], strict=True)] == [
        ["p1", "p 2", "first unset"], ["second unset"], ["third unset"]]     # no variable crosses over
    assert "first-trap" in res.stdout and res.returncode == 0
    assert cmd.count("(\n#!/bin/sh") == 2 and cmd.endswith(" reconciler-batch")


def test_one_program_alone_is_its_own_sh_and_a_last_one_goes_last() -> None:
    cmd, stdin = batch([Say("only")], ["T"])
    assert cmd == shell.sh_c(Say.text(), "reconciler-test-say") and stdin == "token=T\nwhat=only\nn=0\nbody=\n\n"

    class Last(Say):
        last: ClassVar[bool] = True
    with pytest.raises(ValueError, match="goes last"):
        batch([Last("a"), Say("b")], ["T1", "T2"])
    batch([Say("b"), Last("a")], ["T1", "T2"])
