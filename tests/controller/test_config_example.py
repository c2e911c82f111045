"""systemd/config.toml.example is what an operator copies: it loads as it is, every setting it
shows commented out is a real key that loads when uncommented, and every key of the controller's
config appears in it."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reconciler.controller.config import ControllerConfig, load_config
from tests.conftest import ROOT

EXAMPLE = ROOT / "systemd" / "config.toml.example"
SETTING = re.compile(r"^#?\s*([a-z_]+)\s*=", re.M)


@pytest.fixture(autouse=True)
def no_env_overrides(monkeypatch):
    for key in ControllerConfig.model_fields:
        monkeypatch.delenv(f"RECONCILER_{key.upper()}", raising=False)


def test_the_example_loads_as_shipped() -> None:
    cfg = load_config(EXAMPLE)
    assert (cfg.repo, cfg.web, cfg.web_public, cfg.allow_insecure_transport) == (
        "/srv/git/fleet.git", "127.0.0.1:9188", False, False)


def test_every_key_is_shown_and_every_shown_key_is_real() -> None:
    shown = set(SETTING.findall(EXAMPLE.read_text()))
    assert shown == set(ControllerConfig.model_fields)


def test_the_commented_settings_load_when_uncommented(tmp_path: Path) -> None:
    # one of forge_token_file / forge_token_env: the example shows both, as alternatives
    lines = [re.sub(r"^# (?=[a-z_]+\s*=)", "", line) for line in EXAMPLE.read_text().splitlines()
             if not line.startswith("# forge_token_env")]
    path = tmp_path / "config.toml"
    path.write_text("\n".join(lines) + "\n")
    cfg = load_config(path)
    assert cfg.webhook_allow == ["127.0.0.0/8"] and cfg.forge_repo == "ops/fleet" and cfg.forge_timeout == 5
    assert cfg.drain_programs == ["socat"]
