"""End-to-end: while the stand-in loads (STANDIN_LOAD_SECONDS), the engine's own progress lines
reach the CLI's progress view, the stream of `git push -o reconcile.wait` and the fleet page,
per host (issue 35, item 4).

Two hosts: the first prints its shard bar with a newline after every redraw (vLLM 0.33.0's
format, STANDIN_BAR_NEWLINE=1: journald stores one line per shard, so the shards are seen one
by one); the second exactly as SGLang 0.5.12 (carriage returns only: journald stores the bar
when it ends, so its shards are never seen one by one; the stand-in logs its CUDA graph capture
right after "Load weight end", so the same read sees both).
"""

from __future__ import annotations

import html
import json
import os
import re
import subprocess
import sys
import threading
import urllib.request

import pytest

from tests import fleet as fleetlib
from tests.conftest import ROOT, run_cli, wait_for, write_fleet
from tests.e2e.test_e2e_push import Deploy, free_port
from tests.e2e.test_e2e_web import page_up

pytestmark = pytest.mark.fleet

LOAD = "8"          # seconds: 70% the 2 shards of Qwen3-8B (2.8 s each), 30% the CUDA graphs


def write(repo, hosts, **env: str) -> None:
    """Both hosts load for LOAD seconds; the first prints newline bars, the second SGLang's own."""
    write_fleet(repo, hosts, {"model-a": {"port": 30000, "model": "Qwen3-8B",
                                          "env": {"STANDIN_LOAD_SECONDS": LOAD, **env},
                                          "health": {"startup_timeout": 60, "stable_for": 1}}})
    first = repo.path / "hosts" / f"{hosts[0].name}.toml"
    first.write_text(first.read_text().replace("env = { ", 'env = { STANDIN_BAR_NEWLINE = "1", ', 1))


def block(page: str, host: str) -> str:
    """The first element of the page about `host`: from its data-host to the next one's."""
    after = page.split(f'data-host="{host}"', 1)[1] if f'data-host="{host}"' in page else ""
    return after.split('data-host="', 1)[0]


def progress_lines(out: str, host: str) -> list[str]:
    """What the progress view said of the host's service, in order, without the clock (nor the
    blanks git pads a "remote:" line with)."""
    return [m.group(1).rstrip() for m in re.finditer(rf"\[ *[\d.]+s\] {re.escape(host)} model-a: ([^\n]*)", out)]


@pytest.mark.timeout(150)
def test_load_progress_in_the_cli_the_push_stream_and_on_the_page(fleet, tmp_path):
    a, b = fleet.hosts[:2]
    deploy = Deploy(tmp_path)
    port = free_port()
    deploy.env["RECONCILER_WEB"] = f"127.0.0.1:{port}"
    try:
        # -- the CLI: `reconcile` on a pipe prints each change as a line (stderr)
        write(deploy.repo, [a, b])
        deploy.commit("qwen3-8b, 8 s to load")
        res = run_cli("--repo", str(deploy.clone), check_codes=(0,))
        cli_a, cli_b = progress_lines(res.stderr, a.name), progress_lines(res.stderr, b.name)
        assert "loading weights: 1/2 checkpoint shards (50%)" in cli_a, res.stderr
        assert "loading weights" in cli_b, res.stderr
        assert not any("/2 checkpoint shards" in p for p in cli_b)   # SGLang's bar reaches the journal as it ends
        for seen in (cli_a, cli_b):
            weights = next(i for i, p in enumerate(seen) if p.startswith("loading weights"))
            graphs = next(i for i, p in enumerate(seen) if "CUDA graphs" in p)
            assert seen[0] == "starting" and seen[-1] == "healthy" and weights < graphs

        # -- the push stream and the page: a change that restarts both, pushed with reconcile.wait
        deploy.start()
        wait_for("the fleet page", lambda: page_up(f"http://127.0.0.1:{port}/"), 15)
        write(deploy.repo, [a, b], LOG_LEVEL="debug")
        rev = deploy.commit("debug logs")
        pages: list[str] = []
        pushed: dict[str, str] = {}

        def push() -> None:
            r = deploy.push("-o", "reconcile.wait")
            pushed["out"] = r.stdout + r.stderr
        t = threading.Thread(target=push)
        t.start()

        def loading_shown() -> bool:
            page = urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=5).read().decode()
            pages.append(page)
            return '<progress value="1" max="2">' in page or not t.is_alive()
        wait_for("the page to show a host's shard progress", loading_shown, timeout=60, every=0.2)
        t.join(100)
        out = pushed["out"]
        assert f"{rev[:7]} finished with exit 0" in out, out
        push_a, push_b = progress_lines(out, a.name), progress_lines(out, b.name)
        assert "loading weights: 1/2 checkpoint shards (50%)" in push_a, out
        assert "loading weights" in push_b and any("CUDA graphs" in p for p in push_b), out

        page = next(p for p in pages if '<progress value="1" max="2">' in block(p, a.name))
        assert "engine:</span> loading weights: 1/2 checkpoint shards (50%)" in block(page, a.name)
        assert html.escape("Loading safetensors checkpoint shards:  50% Completed | 1/2 [") in block(page, a.name)
        assert any("engine:</span> " in block(p, b.name) for p in pages)       # the other host: its own
    finally:
        deploy.stop()


# ---- a line the progress reader cannot take (review N5) ---------------------------------------------

E4 = "Loading safetensors checkpoint shards:  50% Completed | " + "9" * 400 + "/1 ["


def reconcile(repo, *args: str, fault: str | None = None) -> tuple[int, dict, str]:
    """`reconcile --json` as a user runs it; `fault`: RECONCILER_FAULT (reconciler/faults.py)."""
    env = {**os.environ, "RECONCILER_IDENTITY": str(fleetlib.client_key_path()), "COLUMNS": "200", "NO_COLOR": "1"}
    env.pop("RECONCILER_FAULT", None)
    if fault is not None:
        env["RECONCILER_FAULT"] = fault
    res = subprocess.run([sys.executable, "-m", "reconciler", "--repo", str(repo.path), "--json", *args],
                         capture_output=True, text=True, env=env, timeout=150, cwd=ROOT)
    assert "Traceback" not in res.stderr, res.stderr
    return res.returncode, json.loads(res.stdout), res.stderr


def host_of(out: dict, host) -> dict:
    return next(r for r in out["hosts"] if r["host"] == host.name)


def model_record(fleet, h) -> dict:
    return json.loads(fleet.ssh(h, "cat /var/lib/reconciler/services/model-a.json"))


@pytest.mark.timeout(300)
def test_a_line_the_progress_reader_cannot_take_is_that_services_no_verdict_and_the_run_goes_on(fleet, repo):
    """E4 on real hosts: while b's stand-in loads, it prints a shard bar with a 400-digit count.
    That count is no count the reader takes now, so to reach the containment of an exception the
    run arms RECONCILER_FAULT=progress-raises, which makes reading such a line raise OverflowError
    as it did before (the run then ended, every host's transport closed mid-deploy, and again on
    every retry). Now: a's deploy, at the same time, is judged and recorded as usual; b's service
    comes to no verdict (Inconclusive, three watches), is neither rolled back nor quarantined, and
    keeps running; a second run does not crash either; and without the fault the line is harmless."""
    a, b = fleet.hosts[:2]
    svc = {"port": 30000, "model": "Qwen3-8B", "health": {"startup_timeout": 60, "stable_for": 1}}
    write_fleet(repo, [a, b], {"model-a": {**svc, "env": {"STANDIN_LOAD_SECONDS": "1", "V": "1"}}})
    v1 = repo.commit("v1")
    assert reconcile(repo)[0] == 0
    # 4 s to load: the watch reads the journal at most every second, and only until the first
    # healthy answer, so it reads the line (printed as the load begins) at its second read at the latest
    write_fleet(repo, [a, b], {"model-a": {**svc, "env": {"STANDIN_LOAD_SECONDS": "4", "V": "2"}}})
    host_b = repo.path / "hosts" / f"{b.name}.toml"
    host_b.write_text(host_b.read_text().replace("env = { ", f"env = {{ STANDIN_PROGRESS_LINE = {json.dumps(E4)}, ", 1))
    v2 = repo.commit("v2: b's engine prints E4's line as it loads")

    code, out, _ = reconcile(repo, fault="progress-raises")
    assert code == 4
    ra, rb = host_of(out, a), host_of(out, b)
    assert ra["status"] == "converged" and [(e["action"], e["outcome"]["reason"]) for e in ra["events"]] == \
        [("deploy", "Healthy")]
    rec_a = model_record(fleet, a)
    assert rec_a["last_good_revision"] == v2 and rec_a["pending"] is None and rec_a["quarantine"] is None
    assert (rb["status"], rb["reason"]) == ("failed", "Inconclusive"), rb
    assert [(e["action"], e["outcome"]["reason"]) for e in rb["events"]] == \
        [("deploy", "Inconclusive"), ("reverify", "Inconclusive"), ("reverify", "Inconclusive")], rb["events"]
    assert all(e["outcome"]["message"].startswith("no verdict: the health watch failed (OverflowError at progress.py:")
               for e in rb["events"])
    rec_b = model_record(fleet, b)
    assert rec_b["quarantine"] is None and rec_b["last_good_revision"] == v1, rec_b
    assert rec_b["pending"]["revision"] == v2 and rec_b["pending"]["attempts"] == 3
    assert rec_b["pending"]["unjudged"].startswith("Inconclusive: no verdict: the health watch failed (OverflowError")
    running = fleet.show(b, "model-a", "ActiveState", "InvocationID")
    assert running["ActiveState"] == "active"
    assert "STANDIN_PROGRESS_LINE" in fleet.ssh(b, "cat /etc/reconciler/env/model-a.env")    # v2 runs on

    # The same revision again, the fault still armed: b is left as it is (no watch, no start).
    code, out, _ = reconcile(repo, fault="progress-raises")
    assert code == 4 and host_of(out, a)["status"] == "in-sync"
    assert (host_of(out, b)["status"], host_of(out, b)["reason"]) == ("failed", "Inconclusive")
    assert model_record(fleet, b) == rec_b
    assert fleet.show(b, "model-a", "InvocationID") == {"InvocationID": running["InvocationID"]}

    # Without the fault, E4's line is no count and nothing else: --retry watches b again, healthy.
    code, out, _ = reconcile(repo, "--retry")
    assert code == 0 and [(e["action"], e["outcome"]["reason"]) for e in host_of(out, b)["events"]] == \
        [("reverify", "Healthy")]
    rec_b = model_record(fleet, b)
    assert rec_b["last_good_revision"] == v2 and rec_b["pending"] is None and rec_b["quarantine"] is None
    assert fleet.show(b, "model-a", "InvocationID") == {"InvocationID": running["InvocationID"]}
