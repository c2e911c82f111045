"""The unit hands the keys to the daemon as systemd credentials (LoadCredential=): a credential in
$CREDENTIALS_DIRECTORY stands in for the key's path in config.toml."""

from __future__ import annotations

from reconciler.controller.config import load_config


def test_a_credential_stands_in_for_the_keys_path(tmp_path, monkeypatch):
    cfg = tmp_path / "config.toml"
    cfg.write_text('identity = "/etc/reconciler/id_ed25519"\nage_identity = "/etc/reconciler/age.key"\n')
    creds = tmp_path / "credentials"
    creds.mkdir()
    (creds / "id_ed25519").write_text("key\n")
    monkeypatch.setenv("CREDENTIALS_DIRECTORY", str(creds))
    loaded = load_config(cfg)
    assert loaded.identity == str(creds / "id_ed25519")
    assert loaded.age_identity == "/etc/reconciler/age.key"        # no age.key credential: the path
    (creds / "age.key").write_text("AGE-SECRET-KEY-1\n")
    assert load_config(cfg).age_identity == str(creds / "age.key")


def test_without_credentials_the_paths_are_used(tmp_path, monkeypatch):
    monkeypatch.delenv("CREDENTIALS_DIRECTORY", raising=False)
    cfg = tmp_path / "config.toml"
    cfg.write_text('identity = "/etc/reconciler/id_ed25519"\n')
    assert load_config(cfg).identity == "/etc/reconciler/id_ed25519"
