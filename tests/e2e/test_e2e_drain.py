"""End-to-end: the reconciler's own drain, budget and smoke test (issue 42) on real hosts.

A real HAProxy (Debian's, its runtime API socket on the controller: tests/balancer.py) in front
of three test hosts serving one model through the stand-in playing vLLM (its default stop
aborts what is in flight), a bounded load generator through the balancer for the whole rollout,
and a sampler of the servers HAProxy sends traffic to, every 100 ms (tests/loadgen.py):

* a flag change with a drain and min_available = 2: 0 failed requests, never fewer than 2 ready;
* the same change without a drain: the requests the stops aborted fail (the baseline, > 0);
* a revision that answers wrong: stopped at the canary as WrongAnswer, rolled back with the
  drain, 0 failed requests;
* one host already down when the rollout starts: it goes first, the others wait and the run says
  so, never fewer than 2 ready;
* the dry run's forecast against what the same rollout measured, within 20%.
"""

from __future__ import annotations

import json
import re

import pytest

from tests import balancer
from tests import fleet as fleetlib
from tests.conftest import (
    DesiredRepo,
    Fleet,
    fleet_known_hosts,
    run_cli,
    run_json,
    wait_for,
)
from tests.loadgen import STOP_FALLOUT, Load, Sampler

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(420)]

SERVICE = "model"
PORT = 30000
UNIT = (
    "[Unit]\nDescription=stand-in vLLM {service.name}\n\n[Service]\nType=simple\n"
    f"ExecStart={fleetlib.VLLM_STANDIN} --model {{model.path}} --served-model-name m "
    "--host {host.address} --port {vars.port} {vars.args}\nRestart=always\nRestartSec=1\n")


lb_host, lb = balancer.fixtures(3, PORT)


def write(repo: DesiredRepo, hosts: list[fleetlib.Host], lb: balancer.Balancer, *, args: str = "",
          drain: bool = True, min_available: int | None = 2, wrong: bool = False) -> None:
    """One shared definition of the model on `hosts`, behind `lb`."""
    repo.write("fleet.toml", '[ssh]\nknown_hosts = "known_hosts"\n')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/model.service", UNIT)
    env = {"STANDIN_REQUEST_SECONDS": "0.3", "STANDIN_LOAD_SECONDS": "2", **({"STANDIN_WRONG_ANSWER": "1"}
                                                                          if wrong else {})}
    floor = f", min_available = {min_available}" if min_available is not None else ""
    lines = [
        'unit_file = "units/model.service"',
        'model = { id = "Qwen/Qwen3-8B", path = "/models/Qwen3-8B" }',
        f'vars = {{ port = "{PORT}", args = "{args}" }}',
        "env = { " + ", ".join(f'{k} = "{v}"' for k, v in env.items()) + " }",
        'health = { http = "http://{host.address}:{vars.port}/health", startup_timeout = 30, stable_for = 2, '
        "interval = 0.5 }",
        f"rollout = {{ canary = 1, max_unavailable = 1{floor} }}", ""]
    if drain:
        lines += ["[drain]", f'haproxy = {{ socket = "{lb.socket}", server = "{balancer.BACKEND}/{{host.name}}" }}',
                  'inflight = { metric = "vllm:num_requests_running" }', "timeout = 30", "interval = 0.2", ""]
    lines += ["[smoke]", "[[smoke.checks]]", 'prompt = "The capital of France is"', 'expect = "Paris"', ""]
    repo.write("services/model.toml", "\n".join(lines))
    for h in hosts:
        repo.write(f"hosts/{h.name}.toml", f'address = "{h.address}"\n\n[services.{SERVICE}]\nuse = "model"\n')


def first_deploy(repo: DesiredRepo, trio: list[fleetlib.Host], lb: balancer.Balancer, **kw: object) -> None:
    write(repo, trio, lb, **kw)  # type: ignore[arg-type]
    repo.commit("the model on three hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    wait_for("HAProxy to see three servers up", lambda: lb.ready() == 3, timeout=30)


def under_load(lb: balancer.Balancer, *args: str, codes: tuple[int, ...]) -> tuple[dict, object, object]:
    """Run the reconciler (--json) with the load and the sampler going for the whole run."""
    sampler = Sampler(lb.ready).start()
    load = Load(lb.url, clients=6).start()
    try:
        wait_for("the load to get answers", lambda: load.count() >= 6, timeout=30)
        _, out = run_json(*args, check_codes=codes)
    finally:
        report, samples = load.stop(), sampler.stop()
    print(f"\n{report.describe()}; sampler: {samples.describe()}")
    return out, report, samples


def test_a_flag_change_with_drain_and_min_available_fails_no_request(fleet: Fleet, repo: DesiredRepo,
                                                                    lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    first_deploy(repo, trio, lb)
    write(repo, trio, lb, args="--max-model-len 4096")
    repo.commit("a flag change")
    out, report, samples = under_load(lb, "--repo", str(repo.path), codes=(0,))
    assert (report.failed, report.reasons) == (0, {})  # type: ignore[attr-defined]
    assert report.ok >= 30  # type: ignore[attr-defined]
    assert samples.min == 2 and samples.unread == 0  # type: ignore[attr-defined]
    assert samples.longest_gap < 1.0  # type: ignore[attr-defined]
    ro = out["rollouts"][0]
    assert ro["status"] == "done" and [w["hosts"] for w in ro["waves"]] == [[h.name] for h in trio]
    for h in out["hosts"]:
        steps = h["costs"][SERVICE]["steps"]
        assert set(steps) == {"leave", "drain", "stop", "start", "ready", "smoke", "rejoin", "serving"}, h
        assert any("left rotation; no work in flight" in n for n in h["notes"]), h["notes"]


def test_the_same_change_without_a_drain_fails_requests(fleet: Fleet, repo: DesiredRepo,
                                                        lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    first_deploy(repo, trio, lb, drain=False, min_available=None)
    write(repo, trio, lb, args="--max-model-len 4096", drain=False, min_available=None)
    repo.commit("a flag change, no drain")
    _, report, _ = under_load(lb, "--repo", str(repo.path), codes=(0,))
    assert report.failed > 0  # type: ignore[attr-defined]          the baseline a drain brings to 0
    assert set(report.reasons) <= STOP_FALLOUT  # type: ignore[attr-defined]


def test_a_wrong_answer_stops_at_the_canary_and_rolls_back_with_drain(fleet: Fleet, repo: DesiredRepo,
                                                                     lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    first_deploy(repo, trio, lb)
    write(repo, trio, lb, args="--max-model-len 4096", wrong=True)
    repo.commit("a build that answers wrong")
    out, report, samples = under_load(lb, "--repo", str(repo.path), codes=(3,))
    assert (report.failed, report.reasons) == (0, {})  # type: ignore[attr-defined]
    assert samples.min == 2  # type: ignore[attr-defined]
    ro = out["rollouts"][0]
    assert (ro["status"], ro["halted"]["host"], ro["halted"]["reason"]) == ("halted", trio[0].name, "WrongAnswer")
    assert ro["halted"]["wave"] == 1 and ro["untouched"] == [h.name for h in trio[1:]]
    canary = next(h for h in out["hosts"] if h["host"] == trio[0].name)
    assert canary["status"] == "rolled-back"
    kinds = [(e["action"], e["outcome"]["reason"]) for e in canary["events"] if e["outcome"]]
    assert kinds == [("deploy", "WrongAnswer"), ("rollback", "Healthy")]
    assert "got ' the the the the'" in canary["events"][0]["outcome"]["message"]
    assert set(canary["costs"][SERVICE]["steps"]) >= {"leave", "drain", "rejoin"}
    wait_for("the canary back in rotation", lambda: lb.ready() == 3, timeout=10)


def test_a_host_already_down_goes_first_and_the_budget_holds(fleet: Fleet, repo: DesiredRepo,
                                                             lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    first_deploy(repo, trio, lb)
    fleet.ssh(trio[2], f"systemctl stop {SERVICE}")
    wait_for("HAProxy to count the stopped host out", lambda: lb.ready() == 2, timeout=30)
    write(repo, trio, lb, args="--max-model-len 4096")
    repo.commit("a flag change with one host down")
    out, report, samples = under_load(lb, "--repo", str(repo.path), codes=(0,))
    assert (report.failed, report.reasons) == (0, {})  # type: ignore[attr-defined]
    assert samples.min == 2  # type: ignore[attr-defined]
    ro = out["rollouts"][0]
    assert [w["hosts"] for w in ro["waves"]] == [[trio[2].name], [trio[0].name], [trio[1].name]]
    assert ro["budget"][0].startswith(f"canary: {trio[2].name} (2 of 3 ready, min_available = 2)")
    assert f"{trio[0].name} waits: min_available = 2: 2 of 3 hosts ready ({trio[2].name} unhealthy" in ro["budget"][0]
    waiting = next(h for h in out["hosts"] if h["host"] == trio[0].name)
    assert any(n.startswith(f"{SERVICE}: waits: min_available = 2") for n in waiting["notes"])


def test_the_forecast_comes_within_20_percent_of_the_measured_cost(fleet: Fleet, repo: DesiredRepo,
                                                                   lb: balancer.Balancer) -> None:
    trio = fleet.hosts[:3]
    first_deploy(repo, trio, lb)
    write(repo, trio, lb, args="--max-model-len 4096")
    repo.commit("a first flag change: every step measured")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    write(repo, trio, lb, args="--max-model-len 2048")
    repo.commit("a second flag change")
    dry = run_cli("--repo", str(repo.path), "--dry-run", check_codes=(2,)).stdout
    print(dry)
    m = re.search(r"forecast: (\d+) host-seconds unavailable over 3 hosts, (\d+)s in all", dry)
    assert m is not None, dry
    assert "leave: HAProxy" in dry and "drain: wait for vllm:num_requests_running" in dry
    forecast = float(m.group(1))
    out, _, _ = under_load(lb, "--repo", str(repo.path), codes=(0,))
    measured = sum(h["costs"][SERVICE]["unavailable"] for h in out["hosts"])
    costs = json.dumps([h["costs"] for h in out["hosts"]])
    print(f"forecast {forecast:.0f} host-seconds, measured {measured:.1f}: {costs}")
    assert abs(forecast - measured) <= 0.2 * measured
