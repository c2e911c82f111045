"""plan/smoke.py and plan/ready.py: the smoke test's requests, how answers are read (whole and
streamed), the verdict with the answer quoted (redacted, then cut), and each engine's readiness."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler import redact
from reconciler.desired.spec import HealthSpec, SmokeCheck, SmokeSpec
from reconciler.plan.ready import Probe, readiness_probes
from reconciler.plan.smoke import (
    SLOW_ANSWER,
    SMOKE_FAILED,
    WRONG_ANSWER,
    Answer,
    Request,
    SmokeVerdict,
    first_model,
    judge_smoke,
    request,
    streamed,
    whole,
)

PROMPT = SmokeCheck("completion", "The capital of France is", "Paris", max_tokens=4)
CHAT = SmokeCheck("chat", "What is the capital of France? One word.", "Paris")
SPEC = SmokeSpec("http://127.0.0.21:30000/v1", (PROMPT, CHAT), timeout=30.0)
TIMED = SmokeSpec("http://127.0.0.21:30000/v1", (PROMPT,), ttft=2.0)


def test_requests_are_greedy_and_stream_only_to_time_the_first_token() -> None:
    assert request(SPEC, PROMPT, "Qwen/Qwen3-8B") == Request(
        "http://127.0.0.21:30000/v1/completions",
        {"model": "Qwen/Qwen3-8B", "max_tokens": 4, "temperature": 0, "prompt": "The capital of France is"})
    assert request(SPEC, CHAT, "m") == Request(
        "http://127.0.0.21:30000/v1/chat/completions",
        {"model": "m", "max_tokens": 16, "temperature": 0,
         "messages": [{"role": "user", "content": "What is the capital of France? One word."}]})
    assert request(TIMED, PROMPT, "m").body["stream"] is True


def test_first_model() -> None:
    assert first_model('{"object": "list", "data": [{"id": "Qwen/Qwen3-8B", "object": "model"}]}') == "Qwen/Qwen3-8B"
    for body in ('{"data": []}', "[]", "not json", '{"data": [{"id": 3}]}'):
        assert first_model(body) is None


def test_whole_answers_of_both_apis_and_errors() -> None:
    completion = {"choices": [{"index": 0, "text": " Paris.", "finish_reason": "length"}]}
    chat = {"choices": [{"index": 0, "message": {"role": "assistant", "content": "Paris"}}]}
    assert whole(200, json.dumps(completion)) == Answer(200, " Paris.")
    assert whole(200, json.dumps(chat)) == Answer(200, "Paris")
    assert whole(404, '{"error": {"message": "The model `x` does not exist."}}') == \
        Answer(404, None, error="HTTP 404: The model `x` does not exist.")
    assert whole(200, "<html>") == Answer(200, None, error="HTTP 200: <html>")


def test_a_streamed_answer_is_joined_and_timed_at_its_first_token() -> None:
    def event(text: str) -> str:
        return "data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": text}}]})
    lines = [(0.2, "data: " + json.dumps({"choices": [{"delta": {"role": "assistant"}}]})), (0.3, ""),
             (1.5, event(" Par")), (1.6, event("is.")), (1.7, "data: [DONE]")]
    assert streamed(200, lines) == Answer(200, " Paris.", ttft=1.5)
    completion = [(0.4, 'data: {"choices": [{"text": " Paris"}]}'), (0.5, "data: [DONE]")]
    assert streamed(200, completion) == Answer(200, " Paris", ttft=0.4)
    assert streamed(200, lines[:-1]) == Answer(200, None, ttft=1.5, error="the stream ended without [DONE]")
    assert streamed(200, [(0.1, "data: {}")]).error == "an event that is not a completion chunk: '{}'"
    assert streamed(503, [(0.1, "busy")]) == Answer(503, None, error="HTTP 503: busy")


@pytest.mark.parametrize(("spec", "answers", "want"), [
    (SPEC, [Answer(200, " Paris."), Answer(200, "Paris")], SmokeVerdict(True, message="2 answers as expected")),
    # the incident's class: up, 200, garbage (a broken chat template)
    (SPEC, [Answer(200, " Paris."), Answer(200, "<|im_start|>assistant<|im_start|>")],
     SmokeVerdict(False, WRONG_ANSWER, "WrongAnswer: check 2 (chat 'What is the capital of France? One word.'): "
                                       "expected the answer to contain 'Paris', got "
                                       "'<|im_start|>assistant<|im_start|>'", "<|im_start|>assistant<|im_start|>")),
    # the first failing check decides
    (SPEC, [Answer(200, " the the the"), Answer(200, "nope")],
     SmokeVerdict(False, WRONG_ANSWER, "WrongAnswer: check 1 (prompt 'The capital of France is'): expected the answer "
                                       "to contain 'Paris', got ' the the the'", " the the the")),
    (SPEC, [Answer(500, None, error="HTTP 500: CUDA error")],
     SmokeVerdict(False, SMOKE_FAILED, "SmokeFailed: check 1 (prompt 'The capital of France is'): no answer: "
                                       "HTTP 500: CUDA error")),
    (SPEC, [Answer(200, "Paris")],
     SmokeVerdict(False, SMOKE_FAILED, "SmokeFailed: 1 of 2 checks answered")),
    (TIMED, [Answer(200, " Paris", ttft=1.99)], SmokeVerdict(True, message="1 answer as expected")),
    (TIMED, [Answer(200, " Paris", ttft=2.5)],
     SmokeVerdict(False, SLOW_ANSWER, "SlowAnswer: check 1 (prompt 'The capital of France is'): the first token "
                                      "came after 2.50s, the limit is 2s", " Paris")),
    (TIMED, [Answer(200, "", ttft=None)],
     SmokeVerdict(False, WRONG_ANSWER, "WrongAnswer: check 1 (prompt 'The capital of France is'): expected the "
                                       "answer to contain 'Paris', got ''", "")),
])
def test_judge_smoke(spec: SmokeSpec, answers: list[Answer], want: SmokeVerdict) -> None:
    assert judge_smoke(spec, answers) == want


@pytest.mark.parametrize(("match", "text", "ok"), [
    ("contains", "The capital is Paris.", True), ("contains", "paris", False),
    ("prefix", "  Paris, of course", True), ("prefix", "It is Paris", False),
    ("exact", " Paris \n", True), ("exact", "Paris.", False),
])
def test_match_modes(match: str, text: str, ok: bool) -> None:
    check = SmokeCheck("completion", "q", "Paris", match=match)
    assert judge_smoke(SmokeSpec("http://x:1/v1", (check,)), [Answer(200, text)]).healthy is ok


def test_the_quote_is_redacted_before_it_is_cut_and_controls_are_escaped() -> None:
    secret = "s3cr3t-" + "x" * 20
    redact.register(secret)
    try:
        answer = "a" * 190 + secret + "\x1b[31m"
        v = judge_smoke(SmokeSpec("http://x:1/v1", (PROMPT,)), [Answer(200, answer)])
    finally:
        redact._values.discard(secret)
    assert v.quote == "a" * 190 + "***" + "\\x1b..."          # masked whole, then cut to 200
    assert secret[:8] not in v.message and len(v.quote or "") == 200


@settings(max_examples=200, deadline=None)
@given(status=st.integers(100, 599), body=st.text(max_size=300),
       lines=st.lists(st.tuples(st.floats(0, 100), st.text(max_size=80)), max_size=8))
def test_answer_readers_are_total(status: int, body: str, lines: list[tuple[float, str]]) -> None:
    for answer in (whole(status, body), streamed(status, lines)):
        assert (answer.text is None) != (answer.error is None)       # an answer, or why there is none
        if answer.text is None:
            assert judge_smoke(SPEC, [answer]).reason == SMOKE_FAILED


# ---- readiness ------------------------------------------------------------------------------

HEALTH = HealthSpec(http="http://127.0.0.21:30000/health")


@pytest.mark.parametrize(("server", "version", "want"), [
    ("sglang", "0.5.23", (Probe("http://127.0.0.21:30000/ready"),)),
    ("sglang", "0.5.20", (Probe("http://127.0.0.21:30000/ready"),)),
    ("sglang", "0.5.20.post1", (Probe("http://127.0.0.21:30000/ready"),)),
    ("sglang", "0.5.12", (Probe("http://127.0.0.21:30000/health"),)),       # no /ready before 0.5.20
    ("sglang", None, (Probe("http://127.0.0.21:30000/health"),)),           # unknown: the service's own
    ("vllm", "0.33.0", (Probe("http://127.0.0.21:30000/health"), Probe("http://127.0.0.21:30000/v1/models", True))),
    (None, None, (Probe("http://127.0.0.21:30000/health"),)),
])
def test_readiness_is_the_engines_own(server: str | None, version: str | None, want: tuple[Probe, ...]) -> None:
    assert readiness_probes(server, version, HEALTH) == want


def test_without_a_health_url_systemd_alone_says_ready() -> None:
    assert readiness_probes("vllm", "0.33.0", HealthSpec()) == ()
