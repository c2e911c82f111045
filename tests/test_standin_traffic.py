"""The stand-in's traffic (issue 42), run locally as a subprocess: completions (whole and
streamed, right and wrong), the requests in flight in each engine's metric, SGLang's /ready,
and each engine's stop on SIGTERM: SGLang finishes what is in flight, vLLM aborts it (or waits
up to --shutdown-timeout). Every wait is for what the process does, never a fixed time."""

from __future__ import annotations

import http.client
import json
import signal
import threading
from pathlib import Path

import pytest

from reconciler.plan.drain import inflight_of
from reconciler.plan.smoke import streamed
from tests.test_standin import DENSE, STANDIN, Standin, clean_env, get

pytestmark = pytest.mark.timeout(30)


def post(port: int, path: str, body: dict, timeout: float = 10) -> tuple[int, dict]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout)
    try:
        conn.request("POST", path, json.dumps(body), {"Content-Type": "application/json"})
        resp = conn.getresponse()
        return resp.status, json.loads(resp.read() or b"{}")
    finally:
        conn.close()


def inflight(s: Standin, metric: str) -> float | None:
    status, body = get(s.port, "/metrics")
    assert status == 200
    return inflight_of(body.decode(), metric)


class InFlight:
    """Completions sent from threads, to be in flight while the test does something else."""

    def __init__(self, s: Standin, n: int, **body: object) -> None:
        self.results: list[tuple[int, dict] | BaseException] = []
        self.lock = threading.Lock()
        self.threads = [threading.Thread(target=self._one, args=(s.port, body), daemon=True) for _ in range(n)]
        for t in self.threads:
            t.start()

    def _one(self, port: int, body: dict) -> None:
        try:
            got: tuple[int, dict] | BaseException = post(port, "/v1/completions", {"model": "m", "prompt": "q", **body})
        except BaseException as e:      # a dropped connection is a result here
            got = e
        with self.lock:
            self.results.append(got)

    def done(self) -> list[tuple[int, dict] | BaseException]:
        for t in self.threads:
            t.join(timeout=20)
        return self.results


def until(check, what: str, timeout: float = 10) -> None:
    """Poll `check` (what the process does) until true."""
    import time
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


@pytest.fixture
def start(tmp_path: Path):
    started: list[Standin] = []

    def run(*args: str, **env: str) -> Standin:
        s = Standin(tmp_path, *args, **env)
        started.append(s)
        s.wait_healthy()
        return s

    yield run
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=5)


def vllm(start, *args: str, **env: str) -> Standin:
    return start("--model", str(DENSE), "--served-model-name", "m", *args, STANDIN_ENGINE="vllm", **env)


def test_completions_whole_and_streamed(start) -> None:
    s = start("--model-path", str(DENSE))
    status, body = post(s.port, "/v1/completions", {"model": "x", "prompt": "The capital of France is",
                                                    "max_tokens": 4, "temperature": 0})
    assert status == 200 and body["object"] == "text_completion" and body["choices"][0]["text"] == " Paris."
    status, body = post(s.port, "/v1/chat/completions", {"model": "x", "messages": [{"role": "user", "content": "?"}]})
    assert status == 200 and body["choices"][0]["message"] == {"role": "assistant", "content": "Paris."}
    conn = http.client.HTTPConnection("127.0.0.1", s.port, timeout=5)
    conn.request("POST", "/v1/completions", json.dumps({"model": "x", "prompt": "q", "stream": True}))
    resp = conn.getresponse()
    lines = [(0.0, line) for line in resp.read().decode().splitlines()]
    conn.close()
    assert resp.status == 200 and streamed(200, lines).text == " Paris."


@pytest.mark.parametrize(("env", "completion", "chat"), [
    ({"STANDIN_WRONG_ANSWER": "1"}, " the the the the", " the the the the"),
    ({"STANDIN_BROKEN_CHAT_TEMPLATE": "1"}, " Paris.", "<|im_start|>assistant<|im_start|>assistant"),
    ({"STANDIN_ANSWER": " Berlin."}, " Berlin.", "Berlin."),
])
def test_answers_that_are_wrong_on_purpose(start, env: dict[str, str], completion: str, chat: str) -> None:
    s = start("--model-path", str(DENSE), **env)
    assert post(s.port, "/v1/completions", {"prompt": "q"})[1]["choices"][0]["text"] == completion
    assert post(s.port, "/v1/chat/completions", {"messages": []})[1]["choices"][0]["message"]["content"] == chat


def test_sglang_metrics_need_enable_metrics_and_count_what_is_in_flight(start) -> None:
    plain = start("--model-path", str(DENSE))
    assert get(plain.port, "/metrics")[0] == 404
    s = start("--model-path", str(DENSE), "--enable-metrics", STANDIN_REQUEST_SECONDS="30")
    assert inflight(s, "sglang:num_running_reqs") == 0
    InFlight(s, 3)
    until(lambda: inflight(s, "sglang:num_running_reqs") == 3, "3 requests in flight")


def test_ready_exists_from_sglang_0_5_20_and_says_503_while_it_drains(start) -> None:
    old = start("--model-path", str(DENSE), STANDIN_VERSION="0.5.12")
    assert get(old.port, "/ready")[0] == 404
    s = start("--model-path", str(DENSE), "--enable-metrics", STANDIN_VERSION="0.5.23", STANDIN_REQUEST_SECONDS="2")
    assert get(s.port, "/ready")[0] == 200
    first = InFlight(s, 1)
    until(lambda: inflight(s, "sglang:num_running_reqs") == 1, "a request in flight")
    s.proc.send_signal(signal.SIGTERM)
    s.said("Draining requests and shutting down")
    assert get(s.port, "/ready")[0] == 503 and get(s.port, "/health")[0] == 503
    # SGLang still takes requests while it drains (only its readiness says it is going), and
    # waits for them too: it exits only once this late one has its answer
    late = InFlight(s, 1)
    assert [r[0] for r in late.done() if isinstance(r, tuple)] == [200]
    assert [r[0] for r in first.done() if isinstance(r, tuple)] == [200]
    assert s.proc.wait(timeout=10) == 0


def test_sglang_finishes_every_request_in_flight_before_it_exits(start) -> None:
    s = start("--model-path", str(DENSE), "--enable-metrics", STANDIN_REQUEST_SECONDS="1.5")
    load = InFlight(s, 4)
    until(lambda: inflight(s, "sglang:num_running_reqs") == 4, "4 requests in flight")
    s.proc.send_signal(signal.SIGTERM)
    s.said("Gracefully exiting... Remaining number of requests 4.")
    assert s.proc.wait(timeout=15) == 0
    results = load.done()
    assert [r[0] for r in results if isinstance(r, tuple)] == [200] * 4
    assert "Gracefully exiting... Remaining number of requests 0." in s.stderr


def test_sglang_force_shutdown_drops_them(start) -> None:
    s = start("--model-path", str(DENSE), "--enable-metrics", STANDIN_REQUEST_SECONDS="30", SGL_FORCE_SHUTDOWN="1")
    load = InFlight(s, 2)
    until(lambda: inflight(s, "sglang:num_running_reqs") == 2, "2 requests in flight")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=10) == 0
    results = load.done()
    assert len(results) == 2 and all(isinstance(r, BaseException) for r in results)


def test_vllm_serves_its_own_names_and_refuses_a_model_it_does_not_serve(start) -> None:
    s = vllm(start, STANDIN_REQUEST_SECONDS="30")
    assert get(s.port, "/ready")[0] == 404
    assert inflight(s, "vllm:num_requests_running") == 0
    status, body = post(s.port, "/v1/completions", {"model": "other", "prompt": "q"})
    assert (status, body["error"]["message"]) == (404, "The model `other` does not exist.")
    InFlight(s, 2)
    until(lambda: inflight(s, "vllm:num_requests_running") == 2, "2 requests in flight")


def test_vllm_with_its_default_shutdown_timeout_aborts_what_is_in_flight(start) -> None:
    s = vllm(start, STANDIN_REQUEST_SECONDS="30")
    load = InFlight(s, 3)
    until(lambda: inflight(s, "vllm:num_requests_running") == 3, "3 requests in flight")
    s.proc.send_signal(signal.SIGTERM)
    assert s.proc.wait(timeout=10) == 0
    results = load.done()
    assert sorted(r[0] for r in results if isinstance(r, tuple)) == [500, 500, 500]
    assert "[shutdown] EngineCore: aborting in-flight requests count=3" in s.stderr


def test_vllm_with_a_shutdown_timeout_finishes_them_and_refuses_new_ones(start) -> None:
    s = vllm(start, "--shutdown-timeout", "20", STANDIN_REQUEST_SECONDS="1.5")
    load = InFlight(s, 2)
    until(lambda: inflight(s, "vllm:num_requests_running") == 2, "2 requests in flight")
    s.proc.send_signal(signal.SIGTERM)
    s.said("draining in-flight requests count=2 timeout=20s")
    status, body = post(s.port, "/v1/completions", {"model": "m", "prompt": "q"})
    assert (status, body["error"]["type"]) == (503, "ServiceUnavailable")
    assert s.proc.wait(timeout=15) == 0
    assert sorted(r[0] for r in load.done() if isinstance(r, tuple)) == [200, 200]
    assert "aborting" not in s.stderr


def test_vllm_flags_are_vllms(tmp_path: Path) -> None:
    import subprocess
    import sys
    res = subprocess.run([sys.executable, str(STANDIN), "--model-path", str(DENSE)], capture_output=True, text=True,
                         env=clean_env(STANDIN_ENGINE="vllm"), timeout=10)
    assert res.returncode == 2 and "unrecognized arguments: --model-path" in res.stderr


def test_the_readiness_knobs_keep_health_200_while_ready_and_models_say_not_yet(start) -> None:
    s = start("--model-path", str(DENSE), STANDIN_VERSION="0.5.20", STANDIN_READY_STATUS="503")
    assert (get(s.port, "/health")[0], get(s.port, "/ready")[0]) == (200, 503)
    v = vllm(start, STANDIN_NO_MODELS="1")
    status, body = get(v.port, "/v1/models")
    assert (get(v.port, "/health")[0], status, json.loads(body)["data"]) == (200, 200, [])
