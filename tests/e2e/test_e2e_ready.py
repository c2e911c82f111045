"""End-to-end: ready means serving (issue 42 item 2): the watch reads the engine's own readiness,
on real hosts with the stand-in server (tests/standin.py).

* SGLang 0.5.20 and later is judged by `GET /ready`, not by the service's `/health`: with /health
  200 and /ready 503 (STANDIN_READY_STATUS, an SGLang that is up and not ready) the deploy is
  never healthy (StartTimeout naming /ready), while the same revision on SGLang 0.5.12 (no
  /ready: its health.http judges) is healthy beside it. The version is the one the pre-flight
  read from the host's files (a stand-in `sglang` package first on PYTHONPATH).
* vLLM is judged by `/health`, then `/v1/models` listing a model: with no model listed
  (STANDIN_NO_MODELS) it is never healthy; once it lists one it is.
"""

from __future__ import annotations

import pytest

from tests import fleet as fleetlib
from tests.conftest import run_cli, run_json, write_fleet

pytestmark = [pytest.mark.fleet, pytest.mark.timeout(150)]

VLLM_UNIT = (
    "[Unit]\nDescription=stand-in vLLM {service.name}\n\n[Service]\nType=simple\n"
    f"ExecStart={fleetlib.VLLM_STANDIN} --model {{model.path}} --served-model-name m "
    "--host {host.address} --port {vars.port} {vars.args}\nRestart=always\nRestartSec=1\n")


def host_out(out: dict, h: fleetlib.Host) -> dict:
    return next(r for r in out["hosts"] if r["host"] == h.name)


def health_of(fleet, h: fleetlib.Host, path: str) -> str:
    """The status a GET of `path` on the host's server answers, read on the host itself."""
    return fleet.ssh(h, "python3 -c \"import urllib.request as u, urllib.error as e\ntry:\n"
                        f" print(u.urlopen('http://{h.address}:30000{path}', timeout=3).status)\n"
                        "except e.HTTPError as x:\n print(x.code)\"", check=False).strip()


def test_sglang_from_0_5_20_is_judged_by_ready_not_by_health(fleet, repo):
    new, old = fleet.hosts[0], fleet.hosts[1]
    newer = fleet.ssh(new, fleetlib.standin_package("0.5.20")).strip()
    env = {"STANDIN_LOAD_SECONDS": "0.3", "STANDIN_READY_STATUS": "503"}
    write_fleet(repo, [new, old], {"m": {"port": 30000, "env": env, "health": {"startup_timeout": 4}}})
    text = (repo.path / f"hosts/{new.name}.toml").read_text()
    repo.write(f"hosts/{new.name}.toml", text.replace("env = { ", f'env = {{ PYTHONPATH = "{newer}", '))
    repo.commit("up, /health 200, /ready 503: SGLang 0.5.20 on one host, 0.5.12 on the other")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    bad, good = host_out(out, new), host_out(out, old)
    (ev,) = bad["events"]
    assert (ev["outcome"]["reason"], bad["reason"]) == ("StartTimeout", "FirstDeployFailed")
    assert ev["outcome"]["message"] == (f"not healthy within startup_timeout=4s: http://{new.address}:30000/ready "
                                        f"answered 503")
    assert good["status"] == "converged" and good["events"][0]["outcome"]["reason"] == "Healthy"
    # on 0.5.12 the same knob leaves /health 200, and there is no /ready: its health.http judged it
    assert (health_of(fleet, old, "/health"), health_of(fleet, old, "/ready")) == ("200", "404")
    assert not any("version was not read" in n for r in out["hosts"] for n in r["notes"])

    # ready once /ready says so
    env.pop("STANDIN_READY_STATUS")
    write_fleet(repo, [new], {"m": {"port": 30000, "env": env, "health": {"startup_timeout": 4}}})
    text = (repo.path / f"hosts/{new.name}.toml").read_text()
    repo.write(f"hosts/{new.name}.toml", text.replace("env = { ", f'env = {{ PYTHONPATH = "{newer}", '))
    repo.write(f"hosts/{new.name}.toml", (repo.path / f"hosts/{new.name}.toml").read_text()
               + 'smoke = { checks = [{ prompt = "The capital of France is", expect = "Paris" }] }\n')
    repo.commit("/ready 200, and a smoke test")
    dry = run_cli("--repo", str(repo.path), "-H", new.name, "--dry-run", check_codes=(2,))
    assert f"    ready: GET /ready at http://{new.address}:30000, then stable for 1s (at most 4s)\n" in dry.stdout, \
        dry.stdout
    code, out = run_json("--repo", str(repo.path), "-H", new.name, check_codes=(0,))
    assert host_out(out, new)["events"][-1]["outcome"]["reason"] == "Healthy"
    assert (health_of(fleet, new, "/health"), health_of(fleet, new, "/ready")) == ("200", "200")


def test_vllm_is_ready_only_once_its_models_list_a_model(fleet, repo):
    h = fleet.hosts[2]
    env = {"STANDIN_LOAD_SECONDS": "0.3", "STANDIN_NO_MODELS": "1"}
    write_fleet(repo, [h], {"m": {"port": 30000, "env": env, "health": {"startup_timeout": 4}}})
    repo.write("units/standin.service", VLLM_UNIT)
    repo.commit("vLLM up, /health 200, no model listed")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h)
    assert (r["events"][0]["outcome"]["reason"], r["reason"]) == ("StartTimeout", "FirstDeployFailed")
    assert r["events"][0]["outcome"]["message"] == (f"not healthy within startup_timeout=4s: "
                                                    f"http://{h.address}:30000/v1/models lists no model")

    env.pop("STANDIN_NO_MODELS")
    write_fleet(repo, [h], {"m": {"port": 30000, "env": env, "health": {"startup_timeout": 4}}})
    repo.write("units/standin.service", VLLM_UNIT)
    repo.commit("the model listed")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, h)["events"][-1]["outcome"]["reason"] == "Healthy"
    assert health_of(fleet, h, "/health") == "200"
