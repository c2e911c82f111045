"""A service's `drain` and `smoke` tables, exactly as written (what they are for: docs/drain.md).

A call (`leave`, `rejoin`, `serving`) is exactly one of: an HTTP request made from the host (as
the health probe is), a command run on the controller (an argv list, never a shell), or a shell
command run on the host. `haproxy` is the shorthand for HAProxy's runtime API over its socket on
the controller, in place of all three. The checks that need the merged layers (haproxy or the
calls, leave with rejoin, a URL for the in-flight read) are in drain.py.
"""

from __future__ import annotations

import re
from typing import Annotated, Any, Literal

from .fields import AbsPath, HttpStatus, HttpTemplate, PositiveSeconds, SingleLine, _fail, _int_in, _pattern
from .tables import After, Check, Invalid, Table

MAX_CHECKS = 10          # smoke checks per service: each costs a completion before the host rejoins
MAX_ARGV = 64
_METRIC = re.compile(r"^[A-Za-z_:][A-Za-z0-9_:]{0,199}\Z")
# backend/server as HAProxy names them (letters, digits, '-', '_', '.', ':'), placeholders allowed
_HAPROXY_SERVER = re.compile(r"^[A-Za-z0-9_.:{}-]+/[A-Za-z0-9_.:{}-]+\Z")
_CONTROL_BUT_NEWLINE = re.compile(r"[\x00-\x08\x0b-\x1f\x7f]")


def _word(value: Any) -> str:
    # One argv word: a newline or NUL has no place in it, and an empty word is a typo.
    if not isinstance(value, str) or not value or "\x00" in value or "\n" in value:
        raise _fail("a non-empty single-line string (one word of the command, no shell)", value)
    return value


def _argv(value: Any) -> list[str]:
    expected = (f'a command as a list of 1-{MAX_ARGV} words, like ["socat", "-", '
                f'"UNIX-CONNECT:/run/haproxy/admin.sock"]')
    if isinstance(value, list) and not value:
        raise Invalid(f"expected {expected}, got no words")
    if not isinstance(value, list) or len(value) > MAX_ARGV:
        raise _fail(expected, value)
    return [_word(w) for w in value]


def _text(value: Any) -> str:
    # Stdin of a command or a prompt: several lines are fine, other control characters are not.
    if not isinstance(value, str) or _CONTROL_BUT_NEWLINE.search(value):
        raise _fail("text (newlines and tabs allowed, no other control characters)", value)
    return value


def _expect(value: Any) -> str:
    if not isinstance(value, str) or not value.strip() or _CONTROL_BUT_NEWLINE.search(value):
        raise _fail("the text the answer must hold (not empty)", value)
    return value


Argv = Annotated[list[str], Check(_argv)]
Text = Annotated[str, Check(_text)]
MetricName = Annotated[str, _pattern(
    _METRIC, "a Prometheus metric name like 'vllm:num_requests_running' or 'sglang:num_running_reqs'")]
HaproxyServer = Annotated[str, _pattern(
    _HAPROXY_SERVER, "'<backend>/<server>' as haproxy.cfg names them, like 'models/{host.name}'")]
Expect = Annotated[str, Check(_expect)]
MaxTokens = Annotated[int, _int_in(1, 4096, "an integer 1-4096")]
MinAvailable = Annotated[int, _int_in(1, None, "an integer >= 1")]


_ONLY_WITH = {"method": "http", "body": "http", "expect_status": "http", "input": "controller"}


class CallTable(Table, frozen=True):
    """`leave`, `rejoin` or `serving`: exactly one of http (a request made from the host),
    controller (argv run on the controller, stdin `input`) and host (a shell line run on the host)."""

    http: HttpTemplate | None = None
    method: Literal["GET", "POST", "PUT", "DELETE"] | None = None
    body: SingleLine | None = None
    expect_status: HttpStatus | None = None
    controller: Argv | None = None
    input: Text | None = None
    host: SingleLine | None = None
    timeout: PositiveSeconds | None = None

    def check_across(self) -> None:
        ways = [k for k in ("http", "controller", "host") if getattr(self, k) is not None]
        if len(ways) != 1:
            got = f"got {' and '.join(ways)}" if ways else "got none"
            raise Invalid(f"expected exactly one of http, controller and host ({got})")
        for key, only in _ONLY_WITH.items():
            if getattr(self, key) is not None and ways[0] != only:
                raise Invalid(f"{key} goes with {only} only, not with {ways[0]}")


class HaproxyTable(Table, frozen=True):
    """haproxy = { socket, server }: HAProxy's runtime API on the controller. leave: `set server
    <server> state drain`; rejoin: `state ready`; serving: `show stat` says the server is UP."""

    socket: AbsPath
    server: HaproxyServer


class InflightTable(Table, frozen=True):
    """inflight = { metric, url }: the server's in-flight work. `metric`: summed over its label
    sets, from `url` (default: the health URL's origin + /metrics); no metric: `url` answers a number."""

    metric: MetricName | None = None
    url: HttpTemplate | None = None


class DrainTable(Table, frozen=True):
    """[drain] of a service or a definition: leave the balancer, wait for in-flight work, stop
    (plan/drain.py). Keys merge over the layer below, tables whole."""

    haproxy: HaproxyTable | None = None
    leave: CallTable | None = None
    rejoin: CallTable | None = None
    serving: CallTable | None = None
    inflight: InflightTable | None = None
    timeout: PositiveSeconds | None = None
    interval: PositiveSeconds | None = None


class SmokeCheckTable(Table, frozen=True, kw_only=True):
    """One [[smoke.checks]]: `prompt` (POST /v1/completions) or `chat` (one user message, POST
    /v1/chat/completions), and `expect`, the text the greedy answer must hold."""

    prompt: Text | None = None
    chat: Text | None = None
    expect: Expect
    match: Literal["contains", "prefix", "exact"] | None = None
    max_tokens: MaxTokens | None = None

    def check_across(self) -> None:
        if (self.prompt is None) == (self.chat is None):
            raise Invalid("expected exactly one of prompt (a completion) and chat (a chat completion)")


def _checks(value: list[SmokeCheckTable]) -> list[SmokeCheckTable]:
    if not 1 <= len(value) <= MAX_CHECKS:
        raise Invalid(f"expected 1-{MAX_CHECKS} checks, got {len(value)}")
    return value


class SmokeTable(Table, frozen=True):
    """[smoke] of a service or a definition; keys merge over the layer below, `checks` whole."""

    url: HttpTemplate | None = None
    model: SingleLine | None = None
    ttft: PositiveSeconds | None = None
    timeout: PositiveSeconds | None = None
    checks: Annotated[list[SmokeCheckTable], After(_checks)] | None = None
