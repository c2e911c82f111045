"""PURE: which reads say that a server is ready to serve, by engine (issue 42): the engine's
own, not a 200 that answers before the model does. Which read for which engine and release:
docs/health.md ("Ready: the engine's own readiness"). (SGLang's `/health` also generates a
token, and answers 503 while it shuts down: its http_server.py.)

The server and its version come from the pre-flight's reading of the unit (preflight's
parse_command, and the version the host reports: loop/preflight.py `ready_probes`); the health
watch (host/health.py) runs the probes from the host, in order, and a server answers only when
every one passed (`failed`). An SGLang whose version could not be read is judged by health.http.
"""

from __future__ import annotations

from collections.abc import Sequence
from urllib.parse import urlsplit

import msgspec

from ..desired.placeholders import origin
from ..desired.spec import HealthSpec
from .lenient import json_or_none

SGLANG_READY_FROM = (0, 5, 20)
MODELS_BODY_MAX = 65536        # characters of a /v1/models body read as JSON; a longer one is "not yet"
QUOTED_MAX = 80                # characters of an answer a message quotes


class Probe(msgspec.Struct, frozen=True):
    """One readiness read: GET url, `status` wanted (health.expect_status for the service's own
    health.http, else 200); `contains`: text the body must hold (health.body_contains);
    `models`: the body must list a model (vLLM's /v1/models)."""

    url: str
    models: bool = False
    status: int = 200
    contains: str | None = None


def _version(text: str | None) -> tuple[int, ...] | None:
    if not text:
        return None
    parts = []
    for word in text.split(".")[:3]:
        digits = "".join(c for c in word if c.isdigit()) if word[:1].isdigit() else ""
        if not digits:
            break
        parts.append(int(digits[:6]))
    return tuple(parts) or None


def readiness_probes(server: str | None, version: str | None, health: HealthSpec) -> tuple[Probe, ...]:
    """The reads that say a server is ready, in order (all must pass); () when there is nothing
    to read (no health URL: systemd's state alone, as today)."""
    base = origin(health.http)
    if base is not None and server == "sglang":
        v = _version(version)
        if v is not None and v >= SGLANG_READY_FROM:
            return (Probe(f"{base}/ready"),)
    if base is not None and server == "vllm":
        return (Probe(f"{base}/health"), Probe(f"{base}/v1/models", models=True))
    return (Probe(health.http, status=health.expect_status, contains=health.body_contains),) if health.http else ()


def lists_a_model(body: str) -> bool:
    """Whether an OpenAI-compatible /v1/models body lists at least one model: a JSON object whose
    `data` is a list holding an object with a non-empty string `id`. Total and bounded: a body
    over MODELS_BODY_MAX, bad JSON or any other shape is False (not yet), never an exception."""
    doc = json_or_none(body, MODELS_BODY_MAX)
    data = doc.get("data") if isinstance(doc, dict) else None
    return isinstance(data, list) and any(isinstance(m, dict) and isinstance(m.get("id"), str) and m["id"]
                                          for m in data)


def failed(probe: Probe, status: int | None, body: str) -> str | None:
    """Why one probe's answer (status, body; status None: the request failed, body says why)
    is not a pass, naming the probe; None when it passed."""
    if status is None:
        return f"{probe.url} did not answer ({body[:QUOTED_MAX]})"
    if status != probe.status:
        return f"{probe.url} answered {status}" + (f", not {probe.status}" if probe.status != 200 else "")
    if probe.contains and probe.contains not in body:
        return f"{probe.url} answered {status} without {probe.contains!r}"
    if probe.models and not lists_a_model(body):
        return f"{probe.url} lists no model"
    return None


def ready_detail(probes: Sequence[Probe], health: HealthSpec) -> str:
    """The ready step's detail for a dry run: 'GET /ready at http://127.0.0.1:30000, then stable
    for 30s'; with no probe, systemd's state."""
    where = f" at {origin(probes[0].url) or probes[0].url}" if probes else ""
    return f"{describe(probes)}{where}, then stable for {health.stable_for:g}s"


def describe(probes: Sequence[Probe]) -> str:
    """What ready reads, for the plan and a dry run: 'GET /health, then GET /v1/models (a model
    listed)'; "systemd's state" without a probe."""
    if not probes:
        return "systemd's state"
    words = []
    for p in probes:
        path = urlsplit(p.url).path or "/"
        extra = " (a model listed)" if p.models else f" ({p.status})" if p.status != 200 else ""
        words.append(f"GET {path}{extra}")
    return ", then ".join(words)
