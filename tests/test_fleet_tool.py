"""tests/fleet.py's `down`: `--prefix` stops the hosts `up --prefix` named so and no other test
host on the machine (the sandbox's h2 and h3, never a test run's rt20 while it runs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests import fleet


@pytest.fixture
def stopped(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> list[str]:
    for name in ("h2", "h3", "h", "hx4", "rt20", "rtw160", "cmp40"):
        (tmp_path / f"{name}.pid").write_text("1\n")
    monkeypatch.setattr(fleet, "RUN_DIR", tmp_path)
    got: list[str] = []
    monkeypatch.setattr(fleet, "stop", got.append)
    return got


def test_down_with_a_prefix_stops_only_the_hosts_up_named_so(stopped: list[str]) -> None:
    fleet.main(["down", "--prefix", "h"])
    assert sorted(stopped) == ["h2", "h3"]


def test_down_without_a_prefix_stops_every_host_this_machine_runs(stopped: list[str]) -> None:
    fleet.main(["down"])
    assert sorted(stopped) == ["cmp40", "h", "h2", "h3", "hx4", "rt20", "rtw160"]
