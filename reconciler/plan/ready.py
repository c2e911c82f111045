"""PURE: which reads say that a server is ready to serve, by engine (issue 42): the engine's
own, not a 200 that answers before the model does.

* SGLang from 0.5.20: `GET /ready`, 200 only when it is up, not paused and not shutting down
  (its http_server.py; `/health` also generates a token, and answers 503 while it shuts down).
  Before 0.5.20 there is no /ready: its `/health` (= /health_generate).
* vLLM: `GET /health` (200 unless the engine is dead), then `GET /v1/models` listing the model.
* Any other server, or an unknown one: the service's own `health.http`.

The server and its version come from the pre-flight's reading of the unit (preflight's
parse_command, and the version the host reports); the probes run from the host like the health
probe (phase 2: host/health.py takes these instead of health.http alone).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..desired.drain import origin
from ..desired.spec import HealthSpec

SGLANG_READY_FROM = (0, 5, 20)


@dataclass(frozen=True)
class Probe:
    """One readiness read: GET url, 200 wanted; `models`: the body must list a model (/v1/models)."""

    url: str
    models: bool = False


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
    return (Probe(health.http),) if health.http else ()
