"""The smoke test's requests (issue 42): greedy completions sent to a new server from the host,
through the SSH channel as the health probe is. plan/smoke.py builds the requests, reads the
answers and gives the verdict; this module only sends them."""

from __future__ import annotations

import json

from ..clock import REAL, Clock
from ..desired.spec import SmokeSpec
from ..plan.smoke import Answer, SmokeVerdict, first_model, judge_check, judge_smoke, request, streamed, whole
from .probe import http_request
from .transport import Transport


async def ask(t: Transport, spec: SmokeSpec, *, clock: Clock = REAL) -> tuple[SmokeVerdict, float]:
    """Send the smoke test's checks, one after another, stopping at the first that fails; the
    verdict, and the seconds it all took."""
    t0 = clock.now()
    model = spec.model
    if model is None:
        status, body = await http_request(t, f"{spec.url}/models", timeout=spec.timeout)
        model = first_model(body) if status == 200 else None
        if model is None:
            why = f"HTTP {status}" if status is not None else body
            answer = Answer(status, None, error=f"no model listed at {spec.url}/models ({why})")
            return judge_smoke(spec, [answer]), clock.now() - t0
    answers: list[Answer] = []
    for number, check in enumerate(spec.checks, 1):
        req = request(spec, check, model)
        body = json.dumps(req.body)
        lines: list[tuple[float, str]] | None = [] if spec.ttft is not None else None
        status, said = await http_request(t, req.url, method="POST", body=body, timeout=spec.timeout, lines=lines)
        if status is None:
            answer = Answer(None, None, error=said)
        else:
            answer = streamed(status, lines) if lines is not None else whole(status, said)
        answers.append(answer)
        if not judge_check(spec, check, number, answer).healthy:
            break
    return judge_smoke(spec, answers), clock.now() - t0
