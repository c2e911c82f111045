"""reconciler.shell: several `sh -c` commands run as one sh, each as it ran alone."""

from __future__ import annotations

import subprocess

from reconciler.shell import ShCommand, one_sh


def _run(cmd: str, stdin: str = "") -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", "-c", cmd], input=stdin, capture_output=True, text=True, timeout=10)


def test_a_command_is_its_own_command_line() -> None:
    c = ShCommand('printf "%s|" "$0" "$@"', "me", ["a b", "it's", "$HOME"])
    assert c.startswith("sh -c ")
    assert _run(c).stdout == "me|a b|it's|$HOME|"


def test_one_sh_runs_each_with_its_own_arguments_exit_and_trap() -> None:
    first = ShCommand('trap "echo first-trap" EXIT; echo "first $# $1"; read -r line; echo "read $line"; exit 3',
                      "x", ["one arg"])
    second = ShCommand('echo "second $#"; X=set; exit 0', "y")
    third = ShCommand('echo "third ${X:-unset} $2"', "z", ["a", "b;c"])
    res = _run(one_sh([first, second, third], "all"), stdin="hello\n")
    assert res.stdout.splitlines() == ["first 1 one arg", "read hello", "first-trap", "second 0", "third unset b;c"]
    assert res.returncode == 0


def test_one_command_alone_is_itself() -> None:
    c = ShCommand("echo hi")
    assert one_sh([c]) is c
