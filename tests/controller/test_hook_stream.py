"""What the post-receive hook prints to the pusher: the daemon's run log, redacted, with control
characters shown as escapes (git's sideband puts them on the pusher's terminal)."""

from __future__ import annotations

from pathlib import Path

from reconciler.controller.hooks import _stream

REV = "0123456789abcdef0123456789abcdef01234567"


def test_the_log_reaches_the_pusher_redacted_and_without_control_characters(tmp_path: Path, capsys) -> None:
    runs = tmp_path / "runs"
    runs.mkdir()
    token = "hf_" + "Zq7x" * 8
    (runs / f"{REV}.log").write_text(f"gpu-1: model-a: journal: \x1b]0;owned\x07bad token {token}\n"
                                     "gpu-1: done\x1b[2K")                  # the last line has no newline
    (runs / f"{REV}.exit").write_text("0\n")
    assert _stream(runs, REV, timeout=5) == 0
    out = capsys.readouterr().out
    assert out == ("gpu-1: model-a: journal: \\x1b]0;owned\\x07bad token ***\n"
                   "gpu-1: done\\x1b[2K\n"
                   "reconciler: 0123456 finished with exit 0\n")
