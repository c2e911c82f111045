"""PURE: the smoke test of a new server (issue 42): the requests it sends, how an answer is read
from what the server sent back, and the verdict: healthy, or why not with the answer quoted
(`WrongAnswer`, `SlowAnswer`, `SmokeFailed`: docs/drain.md says what each one does).

No I/O, no clock. The caller (host/smoke.py) sends `request(...)` to the server, reads the
answer (whole, or streamed when the spec has a time-to-first-token limit: `streamed` takes the
lines as they came, with their times), and asks `judge_smoke` for the verdict. The quote is
redacted first, then cut (redact.py: a secret cut in half would no longer be recognized), its
control characters escaped.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import msgspec

from ..desired.spec import SmokeCheck, SmokeSpec
from ..reasons import Reason
from ..redact import escape_controls, redact
from .lenient import json_or_none

WRONG_ANSWER = Reason.WRONG_ANSWER
SLOW_ANSWER = Reason.SLOW_ANSWER
SMOKE_FAILED = Reason.SMOKE_FAILED
QUOTE_CHARS = 200                    # of an answer, in a message or a record
MAX_ANSWER_CHARS = 64_000            # of an answer read at all: the rest is not ours to keep


class Request(msgspec.Struct, frozen=True):
    """One smoke request: where it goes and its JSON body."""

    url: str
    body: dict[str, Any]


def request(spec: SmokeSpec, check: SmokeCheck, model: str) -> Request:
    """The greedy request for one check (temperature 0; streamed when a TTFT limit is set, so
    the first token's time can be read). model: the spec's, else the first /v1/models lists."""
    body: dict[str, Any] = {"model": model, "max_tokens": check.max_tokens, "temperature": 0}
    if check.kind == "chat":
        body["messages"] = [{"role": "user", "content": check.text}]
        url = f"{spec.url}/chat/completions"
    else:
        body["prompt"] = check.text
        url = f"{spec.url}/completions"
    if spec.ttft is not None:
        body["stream"] = True
    return Request(url, body)


def first_model(body: str) -> str | None:
    """The first model id an OpenAI-style /v1/models answer lists (None: none, or not that shape)."""
    data = json_or_none(body)
    items = data.get("data") if isinstance(data, dict) else None
    first = items[0] if isinstance(items, list) and items else None
    model = first.get("id") if isinstance(first, dict) else None
    return model if isinstance(model, str) and model else None


class Answer(msgspec.Struct, frozen=True):
    """What came back for one check: the HTTP status and the text (None: no answer could be
    read; `error` says why), and the seconds to the first token when it was streamed."""

    status: int | None
    text: str | None
    ttft: float | None = None
    error: str | None = None


def _choice_text(data: Any, *, delta: bool) -> str | None:
    """The text of choices[0] of a completion ("text") or a chat completion (message/delta "content")."""
    choices = data.get("choices") if isinstance(data, dict) else None
    first = choices[0] if isinstance(choices, list) and choices else None
    if not isinstance(first, dict):
        return None
    if isinstance(first.get("text"), str):
        return str(first["text"])
    inner = first.get("delta" if delta else "message")
    content = inner.get("content") if isinstance(inner, dict) else None
    return content if isinstance(content, str) else ("" if delta and isinstance(inner, dict) else None)


def whole(status: int, body: str) -> Answer:
    """The answer of a request that was not streamed."""
    data = json_or_none(body)
    text = _choice_text(data, delta=False) if status == 200 else None
    if text is None:
        return Answer(status, None, error=f"HTTP {status}: {_error_of(data, body)}")
    return Answer(status, text[:MAX_ANSWER_CHARS])


def streamed(status: int, lines: Sequence[tuple[float, str]]) -> Answer:
    """The answer of a streamed request from its server-sent-event lines, each with the seconds
    since the request was sent: the text joined, the time to the first chunk that held text."""
    if status != 200:
        body = "\n".join(line for _, line in lines)
        return Answer(status, None, error=f"HTTP {status}: {_error_of(None, body)}")
    parts: list[str] = []
    ttft: float | None = None
    done = False
    for at, line in lines:
        data = line[5:].strip() if line.startswith("data:") else None
        if data is None or not data:
            continue
        if data == "[DONE]":
            done = True
            break
        text = _choice_text(json_or_none(data), delta=True)
        if text is None:
            return Answer(status, None, error=f"an event that is not a completion chunk: {data[:80]!r}")
        if text and ttft is None:
            ttft = at
        parts.append(text)
    if not done:
        return Answer(status, None, ttft=ttft, error="the stream ended without [DONE]")
    return Answer(status, "".join(parts)[:MAX_ANSWER_CHARS], ttft=ttft)


def _error_of(data: Any, body: str) -> str:
    err = data.get("error") if isinstance(data, dict) else None
    message = err.get("message") if isinstance(err, dict) else err if isinstance(err, str) else None
    return str(message) if message else (body.strip()[:QUOTE_CHARS] or "empty body")


# ---- the verdict ----------------------------------------------------------------------------


class SmokeVerdict(msgspec.Struct, frozen=True):
    """The smoke test's verdict: healthy, or the reason, the message and the answer quoted."""

    healthy: bool
    reason: Reason | None = None
    message: str = ""
    quote: str | None = None


def matches(check: SmokeCheck, text: str) -> bool:
    """Whether an answer holds the expected text (`match`: contains, prefix or exact; the
    whitespace around both is ignored, the case is not)."""
    want, got = check.expect.strip(), text.strip()
    if check.match == "exact":
        return got == want
    if check.match == "prefix":
        return got.startswith(want)
    return want in got


def quote(text: str) -> str:
    """An answer as a message or record may show it: redacted, controls escaped, then cut."""
    shown = escape_controls(redact(text))
    return shown if len(shown) <= QUOTE_CHARS else shown[:QUOTE_CHARS - 3] + "..."


def judge_check(spec: SmokeSpec, check: SmokeCheck, number: int, answer: Answer) -> SmokeVerdict:
    """One check's verdict (number: its place in the spec, from 1, for the message)."""
    asked = f"check {number} ({'chat' if check.kind == 'chat' else 'prompt'} {quote(check.text)!r})"
    if answer.text is None:
        why = quote(answer.error or "no answer")
        return SmokeVerdict(False, SMOKE_FAILED, f"{SMOKE_FAILED}: {asked}: no answer: {why}", None)
    if not matches(check, answer.text):
        said = quote(answer.text)
        how = {"contains": "contain", "prefix": "start with", "exact": "be"}.get(check.match, check.match)
        return SmokeVerdict(False, WRONG_ANSWER, f"{WRONG_ANSWER}: {asked}: expected the answer to {how} "
                                                 f"{quote(check.expect)!r}, got {said!r}", said)
    if spec.ttft is not None and (answer.ttft is None or answer.ttft > spec.ttft):
        took = "no token came" if answer.ttft is None else f"the first token came after {answer.ttft:.2f}s"
        return SmokeVerdict(False, SLOW_ANSWER, f"{SLOW_ANSWER}: {asked}: {took}, the limit is {spec.ttft:g}s",
                            quote(answer.text))
    return SmokeVerdict(True)


def judge_smoke(spec: SmokeSpec, answers: Sequence[Answer]) -> SmokeVerdict:
    """The smoke test's verdict: the first check that failed decides; a check with no answer
    (the caller stopped asking after a failure) is not judged."""
    for number, (check, answer) in enumerate(zip(spec.checks, answers, strict=False), 1):
        verdict = judge_check(spec, check, number, answer)
        if not verdict.healthy:
            return verdict
    if len(answers) < len(spec.checks):
        return SmokeVerdict(False, SMOKE_FAILED, f"{SMOKE_FAILED}: {len(answers)} of {len(spec.checks)} checks "
                                                 f"answered")
    n = len(spec.checks)
    return SmokeVerdict(True, message=f"{n} answer{'s' * (n != 1)} as expected")
