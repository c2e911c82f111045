"""End-to-end: the rig of the drain tests (issue 42) on real hosts, before the reconciler drains
anything itself: a real HAProxy (Debian's, with its runtime API on a Unix socket) in front of
three test hosts serving one model through the stand-in, a bounded load through it, and a
sampler of the backends HAProxy counts as ready.

* A host drained by hand through the runtime API finishes its work in flight (the engine's own
  metric reaches 0), gets no new request while drained, and gets traffic again once ready; the
  clients see no failure, and HAProxy never had fewer than the two other hosts ready.
* A plain `systemctl restart` of a host under load, without a drain, with the stand-in playing
  vLLM (its default --shutdown-timeout 0 aborts what is in flight): the requests it aborted
  fail at the clients, each as the HTTP 500 the abort answers. This is the baseline a drain
  must bring to 0.

The reconciler's own drain, budget and smoke test are phase 2's (docs/drain.md).
"""

from __future__ import annotations

import http.client
import re

import pytest

from reconciler.plan.drain import inflight_of
from tests import balancer
from tests import fleet as fleetlib
from tests.conftest import (
    DesiredRepo,
    Fleet,
    fleet_known_hosts,
    run_cli,
    wait_for,
)
from tests.loadgen import STOP_FALLOUT, Load, Sampler

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(300)]

SERVICE = "model"
PORT = 30000
SGLANG_UNIT = (
    "[Unit]\nDescription=stand-in SGLang {service.name}\n\n[Service]\nType=simple\n"
    "ExecStart=/usr/bin/python3 -m sglang.launch_server --model-path {model.path} --served-model-name m "
    "--host {host.address} --port {vars.port} --enable-metrics\nRestart=always\nRestartSec=1\n")
VLLM_UNIT = (
    "[Unit]\nDescription=stand-in vLLM {service.name}\n\n[Service]\nType=simple\n"
    f"ExecStart={fleetlib.VLLM_STANDIN} --model {{model.path}} --served-model-name m "
    "--host {host.address} --port {vars.port}\nRestart=always\nRestartSec=1\n")
METRIC = {"sglang": "sglang:num_running_reqs", "vllm": "vllm:num_requests_running"}


lb_host, lb = balancer.fixtures(3, PORT)


def deploy(repo: DesiredRepo, hosts: list[fleetlib.Host], unit: str, env: dict[str, str]) -> None:
    """One model on `hosts`, deployed by the reconciler (no drain declared: the rig's own test)."""
    repo.write("fleet.toml", '[ssh]\nknown_hosts = "known_hosts"\n')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/model.service", unit)
    envs = ", ".join(f'{k} = "{v}"' for k, v in env.items())
    for h in hosts:
        repo.write(f"hosts/{h.name}.toml", "\n".join([
            f'address = "{h.address}"', "", f"[services.{SERVICE}]", 'unit_file = "units/model.service"',
            'model = { id = "Qwen/Qwen3-8B", path = "/models/Qwen3-8B" }', f'vars = {{ port = "{PORT}" }}',
            f"env = {{ {envs} }}",
            'health = { http = "http://{host.address}:{vars.port}/health", startup_timeout = 20, stable_for = 1, '
            "interval = 0.5 }", ""]))
    repo.commit("one model on three hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))


def inflight(h: fleetlib.Host, engine: str) -> float | None:
    """The host's requests in flight, in its engine's own metric (read from this machine: the
    test hosts share its network namespace)."""
    conn = http.client.HTTPConnection(h.address, PORT, timeout=5)
    try:
        conn.request("GET", "/metrics")
        return inflight_of(conn.getresponse().read().decode(), METRIC[engine])
    except OSError:
        return None
    finally:
        conn.close()


def test_a_host_drained_by_hand_finishes_its_work_and_gets_no_new_requests(fleet: Fleet, repo: DesiredRepo,
                                                                           lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    deploy(repo, trio, SGLANG_UNIT, {"STANDIN_REQUEST_SECONDS": "0.5"})
    wait_for("HAProxy to see three servers up", lambda: lb.ready() == 3, timeout=30)
    first, others = trio[0], trio[1:]
    sampler = Sampler(lb.ready).start()
    load = Load(lb.url, clients=6).start()
    try:
        before = lb.served()
        wait_for("every server to get requests", lambda: all(lb.served()[h.name] > before[h.name] for h in trio),
                 timeout=30)
        wait_for("work in flight on the first host", lambda: (inflight(first, "sglang") or 0) >= 1, timeout=30)

        lb.state(first.name, "drain")
        wait_for("its work in flight to reach 0", lambda: inflight(first, "sglang") == 0, timeout=30)
        drained = lb.served()[first.name]
        others_then = {h.name: lb.served()[h.name] for h in others}
        wait_for("the others to serve 30 more requests",
                 lambda: sum(lb.served()[h.name] - others_then[h.name] for h in others) >= 30, timeout=60)
        assert lb.served()[first.name] == drained           # not one new request while drained
        assert inflight(first, "sglang") == 0
        assert lb.stats()[f"{balancer.BACKEND}/{first.name}"].status == "DRAIN"

        lb.state(first.name, "ready")
        wait_for("traffic to the first host again", lambda: lb.served()[first.name] > drained, timeout=30)
    finally:
        report, samples = load.stop(), sampler.stop()
    print(f"\ndrain by hand: {report.describe()}; sampler: {samples.describe()}")
    assert (report.failed, report.reasons) == (0, {})
    assert report.ok >= 30
    assert samples.min == 2 and samples.unread == 0


def test_a_plain_restart_under_load_fails_the_requests_it_aborted(fleet: Fleet, repo: DesiredRepo,
                                                                 lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    deploy(repo, trio, VLLM_UNIT, {"STANDIN_REQUEST_SECONDS": "1"})
    wait_for("HAProxy to see three servers up", lambda: lb.ready() == 3, timeout=30)
    first = trio[0]
    load = Load(lb.url, clients=6).start()
    try:
        wait_for("work in flight on the first host", lambda: (inflight(first, "vllm") or 0) >= 1, timeout=30)
        since = fleet.ssh(first, "date +%s").strip()     # the journal keeps earlier tests' stops on this host
        fleet.ssh(first, f"systemctl restart {SERVICE}")
        wait_for("the restarted server to serve again", lambda: inflight(first, "vllm") is not None, timeout=30)
        served = lb.served()[first.name]
        wait_for("it to get requests again", lambda: lb.served()[first.name] > served, timeout=30)
    finally:
        report = load.stop()
    journal = fleet.ssh(first, f"journalctl -u {SERVICE} --since @{since} -o cat --no-pager")
    aborted = [int(n) for n in re.findall(r"aborting in-flight requests count=(\d+)", journal)]
    print(f"\nplain restart, vLLM's default stop: {report.describe()}; the engine aborted {aborted}")
    assert len(aborted) == 1 and aborted[0] >= 1
    # every request the engine aborted failed at a client, as the 500 the abort answers; any other
    # failure reached the server as it stopped (loadgen.STOP_FALLOUT)
    assert report.reasons.get("HTTP 500") == aborted[0]
    assert set(report.reasons) <= STOP_FALLOUT
    assert report.failed == sum(report.reasons.values()) and report.ok >= 1
