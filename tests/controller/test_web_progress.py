"""A loading engine's progress on the fleet page, per host: the hub keeps it with the phase it
came with (RunIO.on_progress, after the watch's phase), the pure view turns it into a bar, its
stage and the journal line, the templates show it escaped and masked, in the grid's cell and
in the live run. Starlette's TestClient; the real thing is tests/e2e/test_e2e_progress.py."""

from __future__ import annotations

import html
import warnings
from pathlib import Path
from types import SimpleNamespace

import pytest

from reconciler import redact
from reconciler.controller.store import Store
from reconciler.controller.web import view
from reconciler.controller.web.app import create_app
from reconciler.controller.web.hub import Hub, PhaseInfo
from reconciler.plan.facts.progress import GRAPHS, READY, WEIGHTS, LoadProgress

with warnings.catch_warnings():     # starlette 1.x asks for httpx2 in its test client; httpx still works
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

REV = "d" * 40
SHARDS = "Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:03<00:03,  1.51s/it]"


def started_hub(clock: list[float]) -> Hub:
    hub = Hub(clock=lambda: clock[0], wall=lambda: 1_000_000.0)
    hub.run_started(REV, "push", {"gpu-1": SimpleNamespace(ssh=SimpleNamespace(address="127.0.0.51"), labels={},
                                                           services={"sglang": None}),
                                  "gpu-2": SimpleNamespace(ssh=SimpleNamespace(address="127.0.0.52"), labels={},
                                                           services={"sglang": None})}, None)
    return hub


def test_the_hub_keeps_a_progress_with_its_phase_until_the_next_phase():
    clock = [10.0]
    hub = started_hub(clock)
    hub.progress("gpu-1", "sglang", LoadProgress(WEIGHTS, 2, 4, line=SHARDS))      # no phase yet: nothing to add to
    assert hub.snapshot().run.phases == {}
    p = LoadProgress(WEIGHTS, 2, 4, line=SHARDS)
    hub.phase("gpu-1", "sglang", p.text(), 12.0, 1800)
    hub.progress("gpu-1", "sglang", p)
    info = hub.snapshot().run.phases[("gpu-1", "sglang")]
    assert info.phase == "loading weights: 2/4 checkpoint shards (50%)" and info.progress == p.to_json()
    hub.phase("gpu-1", "sglang", "healthy, checking it stays stable for 30s", 40.0, 1800)
    assert hub.snapshot().run.phases[("gpu-1", "sglang")].progress is None


@pytest.mark.parametrize("p,bar", [
    (LoadProgress(WEIGHTS, 2, 4, line=SHARDS), True),
    (LoadProgress(WEIGHTS, 4, 4, True, line="Load weight end. elapsed=6.12 s"), False),    # done: no bar
    (LoadProgress(GRAPHS, None, 8, line="Capture cuda graph bs [1, 2]"), False),          # no count yet
    (LoadProgress(GRAPHS, 3, 8, line="Capturing batches"), True),
    (LoadProgress(READY, line="The server is fired up and ready to roll!"), False),
])
def test_the_view_of_a_progress(p, bar):
    info = PhaseInfo(p.text(), 12.0, 1800, 10.0, progress=p.to_json())
    model = view.phase_model(info, 11.5)
    assert model["text"] == f"watching health: {p.text()}" and model["clock"] == {"elapsed": 13.5, "timeout": 1800}
    assert model["progress"] == {"stage": p.stage, "text": p.text(), "line": p.line, "done": p.done,
                                 "total": p.total, "bar": bar}
    assert view.phase_model(PhaseInfo("loading", 1.0, 1800, 10.0), 10.0)["progress"] is None


def test_the_page_shows_each_hosts_progress_escaped_and_masked(tmp_path: Path):
    clock = [10.0]
    hub = started_hub(clock)
    secret = "S3cr3t-Load-Line-Value"
    redact.register(secret)
    weights = LoadProgress(WEIGHTS, 2, 4, line=SHARDS)
    graphs = LoadProgress(GRAPHS, 3, 8, line=f"Capturing batches <b>x</b> token={secret}")
    for host, p in (("gpu-1", weights), ("gpu-2", graphs)):
        hub.phase(host, "sglang", p.text(), 12.0, 1800)
        hub.progress(host, "sglang", p)
    Store(tmp_path / "s").close()
    app = create_app(hub, tmp_path / "s", commits=lambda r: None)
    with TestClient(app, base_url="http://localhost") as c:
        page = c.get("/").text
        host_page = c.get("/hosts/gpu-2").text
    grid = page.split('id="grid"')[1].split('id="h-commits"')[0]
    one, two = grid.split('data-host="gpu-2"')[0], grid.split('data-host="gpu-2"')[1]
    assert '<progress value="2" max="4">2/4</progress>' in one and f"<code>{html.escape(SHARDS)}</code>" in one
    assert "engine:</span> loading weights: 2/4 checkpoint shards (50%)" in one
    assert '<progress value="3" max="8">3/8</progress>' in two and "capturing CUDA graphs: 3/8 (38%)" in two
    live = page.split('id="live"')[1].split('id="h-grid"')[0]
    assert live.count("<progress ") == 2 and "engine:</span> capturing CUDA graphs: 3/8 (38%)" in live
    for text in (page, host_page):
        assert secret not in text and "<b>x</b>" not in text and "&lt;b&gt;x&lt;/b&gt;" in text
    assert '<progress value="3" max="8">' in host_page
