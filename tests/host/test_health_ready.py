"""The health watch with the engine's own readiness reads (plan/ready.py): every probe in order,
the first miss ending the round, its message naming the probe; timed on a FakeClock over the
scripted host of test_health.py (the real thing: tests/e2e/test_e2e_ready.py)."""

from __future__ import annotations

import asyncio
import json

from reconciler.desired.spec import HealthSpec
from reconciler.host.health import SystemdWatch, watch_service
from reconciler.plan.ready import Probe
from tests.host.test_health import POLL, RTT, RUNNING, ScriptedHost

BASE = "http://127.0.0.1:8000"
VLLM = (Probe(f"{BASE}/health"), Probe(f"{BASE}/v1/models", models=True))
READY = (Probe(f"{BASE}/ready"),)
LISTED = (200, json.dumps({"object": "list", "data": [{"id": "m", "object": "model"}]}))
EMPTY = (200, json.dumps({"object": "list", "data": []}))


class Answers:
    """GET from the host, scripted per URL: the n-th GET of a URL gets answer n (the last one
    repeats); each takes RTT on the host's clock. `calls`: (virtual time, url) of each GET."""

    def __init__(self, host: ScriptedHost, script: dict[str, list[tuple[int | None, str]]]):
        self.host, self.script = host, script
        self.calls: list[tuple[float, str]] = []

    async def get(self, url: str) -> tuple[int | None, str]:
        await self.host.clock.sleep(RTT)
        self.calls.append((self.host.clock.elapsed(), url))
        answers = self.script[url]
        n = sum(1 for _, u in self.calls if u == url) - 1
        return answers[min(n, len(answers) - 1)]

    def urls(self) -> list[str]:
        return [u.removeprefix(BASE) for _, u in self.calls]


def watch(script: dict[str, list[tuple[int | None, str]]], probes: tuple[Probe, ...], health: HealthSpec):
    t = ScriptedHost({"a": [RUNNING]})
    answers = Answers(t, script)

    async def main():
        return await watch_service(t, "a", health, baseline_restarts=0, since_epoch=0, baseline_invocation="old",
                                   systemd=SystemdWatch(t, POLL, t.clock), probes=probes, http=answers.get)
    return asyncio.run(main()), answers, t


def test_vllm_is_ready_only_once_its_models_list_a_model():
    health = HealthSpec(http=f"{BASE}/health", interval=POLL, stable_for=0, startup_timeout=5)
    out, answers, t = watch({f"{BASE}/health": [(200, "")], f"{BASE}/v1/models": [EMPTY, EMPTY, LISTED]},
                            VLLM, health)
    assert (out.healthy, out.reason) == (True, "Healthy")
    # each round reads /health, then /v1/models; the third round's models list one
    assert answers.urls() == ["/health", "/v1/models"] * 3
    assert out.seconds == answers.calls[-1][0] - 2 * RTT    # healthy as of the start of the round that passed


def test_the_first_probe_that_misses_ends_the_round():
    health = HealthSpec(http=f"{BASE}/health", interval=POLL, stable_for=0, startup_timeout=5)
    out, answers, _ = watch({f"{BASE}/health": [(503, "unhealthy\n"), (None, "connect: refused"), (200, "")],
                             f"{BASE}/v1/models": [LISTED]}, VLLM, health)
    assert out.reason == "Healthy"
    assert answers.urls() == ["/health", "/health", "/health", "/v1/models"]


def test_sglang_ready_says_503_while_health_says_200_so_it_never_becomes_healthy():
    health = HealthSpec(http=f"{BASE}/health", interval=0.5, stable_for=0, startup_timeout=3)
    out, answers, _ = watch({f"{BASE}/ready": [(503, "")], f"{BASE}/health": [(200, "")]}, READY, health)
    assert (out.healthy, out.reason) == (False, "StartTimeout")
    assert out.message == f"not healthy within startup_timeout=3s: {BASE}/ready answered 503"
    assert set(answers.urls()) == {"/ready"}          # /health is not what judges it
    assert len(answers.calls) == 7                    # one GET per interval until the timeout


def test_a_models_list_that_empties_after_the_first_success_is_unstable():
    health = HealthSpec(http=f"{BASE}/health", interval=0.25, stable_for=2, startup_timeout=5)
    out, answers, _ = watch({f"{BASE}/health": [(200, "")], f"{BASE}/v1/models": [LISTED, LISTED, EMPTY]},
                            VLLM, health)
    assert (out.healthy, out.reason) == (False, "Unstable")
    first_ok = answers.calls[1][0] - 2 * RTT          # the round's start: its first GET's start
    went = answers.calls[5][0] - 2 * RTT
    assert out.message == f"{BASE}/v1/models lists no model, {went - first_ok:.1f}s after becoming healthy"
    assert out.quote == "boom: needs --flag x"


def test_a_body_that_is_not_json_is_not_yet_never_an_exception():
    health = HealthSpec(http=f"{BASE}/health", interval=1, stable_for=0, startup_timeout=2)
    out, _, _ = watch({f"{BASE}/health": [(200, "")], f"{BASE}/v1/models": [(200, "{\"data\": [" + "[" * 5000)]},
                      VLLM, health)
    assert out.reason == "StartTimeout"
    assert out.message == f"not healthy within startup_timeout=2s: {BASE}/v1/models lists no model"


def test_without_probes_given_the_service_health_http_judges_as_before():
    health = HealthSpec(http=f"{BASE}/h", interval=1, stable_for=0, startup_timeout=2, expect_status=204,
                        body_contains="ok")
    t = ScriptedHost({"a": [RUNNING]})
    answers = Answers(t, {f"{BASE}/h": [(204, "not yet"), (204, "ok")]})

    async def main():
        return await watch_service(t, "a", health, baseline_restarts=0, since_epoch=0, baseline_invocation="old",
                                   systemd=SystemdWatch(t, POLL, t.clock), http=answers.get)
    out = asyncio.run(main())
    assert out.reason == "Healthy" and answers.urls() == ["/h", "/h"]


def test_no_probe_at_all_is_systemd_state_alone():
    out, answers, _ = watch({}, (), HealthSpec(http=f"{BASE}/health", stable_for=0, startup_timeout=2))
    assert out.reason == "Healthy" and answers.calls == []
