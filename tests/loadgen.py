"""A bounded load generator and a readiness sampler for the drain tests (issue 42).

`Load`: N clients, each in a thread of its own, send greedy completions through the balancer
one after another (a new connection each) until stopped, or until `limit` requests in all; each
request's outcome is kept: ok, or failed with the reason ("HTTP 502", "wrong answer",
"connection reset" ...). An answer without the expected text is a failure too: a server that is
up and wrong must not be serving.

`Sampler`: every 100 ms (by default) reads how many backends are ready (HAProxy's `show stat`,
or anything else that counts) and keeps every sample; `min` is the fewest ever seen.

What is pure (how a response is classified, the summaries) is unit-tested in
tests/test_loadgen.py; the threads and sockets are exercised by tests/e2e/test_e2e_drain_rig.py.
"""

from __future__ import annotations

import collections
import http.client
import itertools
import json
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from urllib.parse import urlsplit

from reconciler.plan.smoke import whole

# How a request fails when the server behind the balancer stops under it without a drain: the
# engine's abort (500), refused while it stops (503), cut when it closed (HAProxy's 502), or the
# balancer closing the client's connection with no answer at all (RemoteDisconnected: seen in CI
# runs of both no-drain baselines, a few in a hundred of their failures; its cause in HAProxy is
# not pinned down). Anything else (a wrong answer, a timeout) is not a stop's fallout.
STOP_FALLOUT = frozenset({"HTTP 500", "HTTP 502", "HTTP 503", "RemoteDisconnected"})


@dataclass(frozen=True)
class Outcome:
    """One request: when it was sent and came back (monotonic seconds), ok or why not."""

    started: float
    ended: float
    ok: bool
    reason: str | None = None


def classify(status: int | None, body: str, error: str | None, expect: str | None) -> tuple[bool, str | None]:
    """A response's outcome: (ok, reason). No response: the error's kind; not 200: the status;
    200 without the expected text (or not a completion at all): "wrong answer"."""
    if status is None:
        return False, error or "no response"
    if status != 200:
        return False, f"HTTP {status}"
    answer = whole(status, body)
    if answer.text is None:
        return False, "not a completion"
    if expect is not None and expect not in answer.text:
        return False, "wrong answer"
    return True, None


@dataclass
class Report:
    """What the clients saw: counts, and the failures by reason."""

    sent: int
    ok: int
    failed: int
    reasons: dict[str, int] = field(default_factory=dict)
    first: float | None = None       # monotonic time of the first request sent
    last: float | None = None        # ... and of the last answer

    def describe(self) -> str:
        why = ", ".join(f"{n} {r}" for r, n in sorted(self.reasons.items(), key=lambda kv: (-kv[1], kv[0])))
        span = f" over {self.last - self.first:.1f}s" if self.first is not None and self.last is not None else ""
        return f"{self.sent} requests{span}: {self.ok} ok, {self.failed} failed" + (f" ({why})" if why else "")


def summarize(outcomes: list[Outcome]) -> Report:
    """The report of a list of outcomes."""
    reasons = collections.Counter(o.reason or "?" for o in outcomes if not o.ok)
    ok = sum(1 for o in outcomes if o.ok)
    return Report(len(outcomes), ok, len(outcomes) - ok, dict(reasons),
                  min((o.started for o in outcomes), default=None), max((o.ended for o in outcomes), default=None))


class Load:
    """N clients sending completions to `url` (the balancer's frontend) until stopped."""

    def __init__(self, url: str, clients: int = 6, *, model: str = "m", prompt: str = "The capital of France is",
                 expect: str | None = "Paris", timeout: float = 60.0, limit: int = 100_000) -> None:
        parts = urlsplit(url)
        self.host, self.port = parts.hostname or "127.0.0.1", parts.port or 80
        self.body = json.dumps({"model": model, "prompt": prompt, "max_tokens": 8, "temperature": 0})
        self.expect, self.timeout, self.limit = expect, timeout, limit
        self.outcomes: list[Outcome] = []
        self.lock = threading.Lock()
        self.halt = threading.Event()
        self.threads = [threading.Thread(target=self._client, daemon=True, name=f"loadgen-{i}")
                        for i in range(clients)]

    def start(self) -> Load:
        for t in self.threads:
            t.start()
        return self

    def _client(self) -> None:
        while not self.halt.is_set():
            with self.lock:
                if len(self.outcomes) >= self.limit:
                    return
            started = time.monotonic()
            status, body, error = self._send()
            ok, reason = classify(status, body, error, self.expect)
            with self.lock:
                self.outcomes.append(Outcome(started, time.monotonic(), ok, reason))

    def _send(self) -> tuple[int | None, str, str | None]:
        conn = http.client.HTTPConnection(self.host, self.port, timeout=self.timeout)
        try:
            conn.request("POST", "/v1/completions", self.body, {"Content-Type": "application/json"})
            resp = conn.getresponse()
            return resp.status, resp.read(1 << 20).decode(errors="replace"), None
        except (OSError, http.client.HTTPException) as e:
            return None, "", type(e).__name__
        finally:
            conn.close()

    def count(self) -> int:
        with self.lock:
            return len(self.outcomes)

    def report(self) -> Report:
        with self.lock:
            return summarize(list(self.outcomes))

    def stop(self) -> Report:
        """Let every client finish the request it is in, then report (bounded by the timeout)."""
        self.halt.set()
        for t in self.threads:
            t.join(timeout=self.timeout + 5)
        return self.report()


@dataclass(frozen=True)
class Samples:
    """What a sampler saw: (monotonic time, ready count or None where the read failed)."""

    points: tuple[tuple[float, int | None], ...]

    @property
    def min(self) -> int | None:
        read = [n for _, n in self.points if n is not None]
        return min(read) if read else None

    @property
    def unread(self) -> int:
        return sum(1 for _, n in self.points if n is None)

    @property
    def longest_gap(self) -> float:
        """The longest time between two samples: what "every 100 ms" really was."""
        times = [t for t, _ in self.points]
        return max((b - a for a, b in itertools.pairwise(times)), default=0.0)

    def describe(self) -> str:
        return (f"{len(self.points)} samples, fewest ready {self.min}, {self.unread} unread, "
                f"longest gap {self.longest_gap * 1000:.0f} ms")


class Sampler:
    """Reads `count()` every `every` seconds in a thread of its own until stopped."""

    def __init__(self, count: Callable[[], int], every: float = 0.1) -> None:
        self.read, self.every = count, every
        self.points: list[tuple[float, int | None]] = []
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="sampler")

    def start(self) -> Sampler:
        self.thread.start()
        return self

    def _run(self) -> None:
        tick = time.monotonic()
        while not self.halt.is_set():
            try:
                n: int | None = self.read()
            except (OSError, ValueError, IndexError):
                n = None
            self.points.append((time.monotonic(), n))
            tick += self.every
            self.halt.wait(max(0.0, tick - time.monotonic()))

    def stop(self) -> Samples:
        self.halt.set()
        self.thread.join(timeout=5)
        return Samples(tuple(self.points))
