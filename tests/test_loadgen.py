"""The pure parts of the drain tests' rig: how the load generator classifies a response and sums
up, what the sampler's samples say, and the HAProxy config the balancer writes."""

from __future__ import annotations

import json

import pytest

from tests.balancer import config
from tests.loadgen import Outcome, Report, Samples, classify, summarize

PARIS = json.dumps({"choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}]})
WRONG = json.dumps({"choices": [{"index": 0, "text": " the the the the"}]})


@pytest.mark.parametrize(("status", "body", "error", "expect", "want"), [
    (200, PARIS, None, "Paris", (True, None)),
    (200, PARIS, None, None, (True, None)),
    (200, WRONG, None, "Paris", (False, "wrong answer")),
    (200, "<html>oops</html>", None, "Paris", (False, "not a completion")),
    (500, '{"error": {"message": "aborted"}}', None, "Paris", (False, "HTTP 500")),
    (502, "", None, None, (False, "HTTP 502")),
    (None, "", "RemoteDisconnected", "Paris", (False, "RemoteDisconnected")),
    (None, "", None, "Paris", (False, "no response")),
])
def test_classify(status: int | None, body: str, error: str | None, expect: str | None,
                  want: tuple[bool, str | None]) -> None:
    assert classify(status, body, error, expect) == want


def test_summarize_counts_failures_by_reason() -> None:
    outcomes = [Outcome(1.0, 2.0, True), Outcome(1.5, 3.0, False, "HTTP 500"), Outcome(2.0, 4.5, False, "HTTP 500"),
                Outcome(2.5, 3.5, False, "wrong answer"), Outcome(3.0, 4.0, True)]
    r = summarize(outcomes)
    assert r == Report(5, 2, 3, {"HTTP 500": 2, "wrong answer": 1}, 1.0, 4.5)
    assert r.describe() == "5 requests over 3.5s: 2 ok, 3 failed (2 HTTP 500, 1 wrong answer)"
    assert summarize([]).describe() == "0 requests: 0 ok, 0 failed"


def test_samples_keep_the_fewest_ready_and_the_longest_gap() -> None:
    s = Samples(((0.0, 3), (0.1, 3), (0.2, 2), (0.45, None), (0.55, 3)))
    assert (s.min, s.unread) == (2, 1)
    assert s.longest_gap == pytest.approx(0.25)
    assert s.describe() == "5 samples, fewest ready 2, 1 unread, longest gap 250 ms"
    assert Samples(()).min is None and Samples(()).longest_gap == 0.0


def test_the_balancer_config_fronts_every_server_and_checks_its_health() -> None:
    text = config([("eg122", "127.0.0.122", 30000), ("eg123", "127.0.0.123", 30000)], "127.0.0.132:8080",
                  health="/ready", check_ms=100)
    assert "    stats socket /run/lb/admin.sock mode 600 level admin\n" in text
    assert "frontend models\n    bind 127.0.0.132:8080\n    default_backend models\n" in text
    assert "    http-check send meth GET uri /ready\n    default-server inter 100ms fall 2 rise 1\n" in text
    assert text.endswith("    server eg122 127.0.0.122:30000 check\n    server eg123 127.0.0.123:30000 check\n")
    assert "    retries 3\n    option redispatch\n" in text
