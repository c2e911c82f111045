"""L11 of the 2026-12-02 review: pre-receive refuses updates of the deploy status notes
(refs/notes/reconciler*) from every pusher but the controller config's notes_pushers; other
branches and tags pass as they are (nothing deploys from them)."""

from __future__ import annotations

import io
import os
import pwd
from pathlib import Path

import pygit2
import pytest

from reconciler.controller import hooks

ME = pwd.getpwuid(os.geteuid()).pw_name
SHA = "1" * 40


def pre_receive(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
                refs: list[str], config: str = "") -> tuple[int, str]:
    repo = tmp_path / "fleet.git"
    if not repo.exists():
        pygit2.init_repository(str(repo), bare=True, initial_head="main")
    (tmp_path / "config.toml").write_text(config)
    monkeypatch.setenv("RECONCILER_CONFIG", str(tmp_path / "config.toml"))
    monkeypatch.setenv("GIT_DIR", str(repo))
    monkeypatch.setattr("sys.stdin", io.StringIO("".join(f"{'0' * 40} {SHA} {ref}\n" for ref in refs)))
    code = hooks.main(["pre-receive"])
    out = capsys.readouterr()
    return code, out.out + out.err


@pytest.mark.parametrize("ref", ["refs/notes/reconciler", "refs/notes/reconciler-pull/gpu-1"])
def test_a_pushed_deploy_status_note_is_refused(tmp_path, monkeypatch, capsys, ref):
    code, out = pre_receive(tmp_path, monkeypatch, capsys, [ref])
    assert code == 1
    assert (f"reconciler: rejected {ref}: deploy status notes are written by the daemon, and pushed only by the "
            f"users in notes_pushers of the controller's config (pull-mode hosts), not {ME}") in out


def test_a_note_among_other_refs_refuses_the_push(tmp_path, monkeypatch, capsys):
    code, out = pre_receive(tmp_path, monkeypatch, capsys, ["refs/heads/feature", "refs/notes/reconciler"])
    assert code == 1 and "rejected refs/notes/reconciler:" in out and "feature" not in out


def test_a_user_in_notes_pushers_may_push_notes(tmp_path, monkeypatch, capsys):
    code, out = pre_receive(tmp_path, monkeypatch, capsys, ["refs/notes/reconciler-pull/gpu-1"],
                            f'notes_pushers = ["{ME}"]\n')
    assert code == 0 and out == ""


def test_other_branches_and_tags_pass_unvalidated(tmp_path, monkeypatch, capsys):
    code, out = pre_receive(tmp_path, monkeypatch, capsys, ["refs/heads/feature", "refs/tags/v1",
                                                            "refs/notes/commits"])
    assert code == 0 and out == ""
