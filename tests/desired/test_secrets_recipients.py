"""L12 of the 2026-12-02 review: `reconcile secrets encrypt` names every key it encrypted to, with
its comment, so a key a pusher added to secrets/recipients.txt does not go unnoticed."""

from __future__ import annotations

from pathlib import Path

from click.testing import CliRunner

from reconciler import cli
from reconciler.desired import secrets

runner = CliRunner()


def test_encrypt_lists_each_recipient_with_its_comment(tmp_path: Path) -> None:
    repo = tmp_path / "repo"
    (repo / "secrets").mkdir(parents=True)
    ours = secrets.keygen(tmp_path / "age.key")
    added = secrets.keygen(tmp_path / "someone.key")
    bare = secrets.keygen(tmp_path / "anonymous.key")
    (repo / "secrets" / "recipients.txt").write_text(
        f"# the controller\n{ours}  # control-1\n\n# added in a pushed commit\n{added}\n{bare}\n")
    res = runner.invoke(cli.app, ["secrets", "encrypt", "HF_TOKEN", "--repo", str(repo)],
                        input="Zq9-recipients-test-1\n")     # a value no other output holds (it is masked)
    assert res.exit_code == 0, res.stderr
    lines = res.stderr.splitlines()
    start = lines.index("HF_TOKEN is encrypted to 3 keys; whoever holds one of their identities can decrypt it:")
    assert lines[start + 1:start + 4] == [f"  {ours}  (control-1)", f"  {added}  (added in a pushed commit)",
                                          f"  {bare}  (no comment: whose is it?)"]


def test_encrypt_names_a_recipient_given_on_the_command_line(tmp_path: Path) -> None:
    public = secrets.keygen(tmp_path / "age.key")
    res = runner.invoke(cli.app, ["secrets", "encrypt", "API_KEY", "--out", str(tmp_path / "k.age"),
                                  "--recipient", public], input="Zq9-recipients-test-2")
    assert res.exit_code == 0, res.stderr
    assert f"API_KEY is encrypted to 1 key; whoever holds one of their identities can decrypt it:\n" \
           f"  {public}  (--recipient)\n" in res.stderr
