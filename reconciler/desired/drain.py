"""A service's merged `drain` and `smoke` tables -> DrainSpec and SmokeSpec: placeholders
rendered, and the checks that need every layer (issue 42).

What one table cannot check alone: `haproxy` or the calls, not both; `leave` with `rejoin`
(a host that leaves and never rejoins would be lost to the balancer); a URL for the in-flight
read and the smoke test (theirs, or the health URL's origin); `smoke` with checks. Every problem
names the file and key the value was written in; none ever quotes an env value (these tables
hold none).
"""

from __future__ import annotations

import re
from collections.abc import Callable
from typing import Any

from . import schema_drain
from .health import url_problem
from .merge import At
from .placeholders import PLACEHOLDER, origin
from .spec import CALL_TIMEOUT, DRAIN_INTERVAL, DRAIN_TIMEOUT, CallSpec, DrainSpec, InflightSpec, SmokeCheck, SmokeSpec

# Renders placeholders in a value written at At (the caller reports unknown ones).
Render = Callable[[str, At], str]
# Reports a problem at a value's file and key.
Report = Callable[[At, str], None]

_HAPROXY_SERVER = re.compile(r"^[A-Za-z0-9_.:-]+/[A-Za-z0-9_.:-]+\Z")
_CALLS = ("leave", "rejoin", "serving")


def drain_spec(merged: dict[str, tuple[Any, At]], table_at: At | None, health_url: str | None, render: Render,
               report: Report) -> DrainSpec | None:
    """The service's drain (None: none declared, or a problem reported). table_at: where the top
    layer wrote the table (None: no layer did)."""
    if table_at is None:
        return None
    values = {k: v for k, (v, _) in merged.items()}
    at = {k: a for k, (_, a) in merged.items()}
    haproxy = values.get("haproxy")
    calls = [k for k in _CALLS if k in values]
    if haproxy is not None and calls:
        report(at["haproxy"], f"set either haproxy or {'/'.join(calls)} (the calls it stands for), not both "
                              f"({calls[0]} is set in {at[calls[0]].file})")
        return None
    if haproxy is not None:
        leave, rejoin, serving = _haproxy(haproxy, at["haproxy"], render, report)
    elif "leave" in values and "rejoin" in values:
        leave, rejoin = (_call(values[k], at[k], render, report) for k in ("leave", "rejoin"))
        serving = _call(values["serving"], at["serving"], render, report) if "serving" in values else None
    else:
        missing = "rejoin" if "leave" in values else "leave" if "rejoin" in values else None
        if missing is None:
            report(table_at, "a drain needs haproxy = { socket, server }, or leave and rejoin: how the host "
                             "leaves the balancer's rotation and comes back")
        else:
            have = "leave" if missing == "rejoin" else "rejoin"
            report(at[have], f"{have} needs {missing} too: a host that leaves rotation must have a way back")
        return None
    inflight, ok = _inflight(values.get("inflight"), at.get("inflight", table_at), health_url, render, report)
    if leave is None or rejoin is None or not ok:
        return None
    return DrainSpec(leave=leave, rejoin=rejoin, serving=serving, inflight=inflight,
                     timeout=float(values.get("timeout", DRAIN_TIMEOUT)),
                     interval=float(values.get("interval", DRAIN_INTERVAL)))


def _haproxy(table: schema_drain.HaproxyTable, at: At, render: Render,
             report: Report) -> tuple[CallSpec | None, CallSpec | None, CallSpec | None]:
    """The calls HAProxy's runtime API stands for: drain, ready, and its stats for `serving`."""
    server = render(table.server, At(at.file, f"{at.key}.server"))
    if not _HAPROXY_SERVER.fullmatch(server) and not PLACEHOLDER.search(server):
        report(At(at.file, f"{at.key}.server"), f"renders to {server!r}: not '<backend>/<server>'")
        return None, None, None

    def call(line: str) -> CallSpec:
        return CallSpec(kind="haproxy", target=table.socket, input=line, server=server, timeout=10.0)
    return call(f"set server {server} state drain"), call(f"set server {server} state ready"), call("show stat")


def _call(table: schema_drain.CallTable, at: At, render: Render, report: Report) -> CallSpec | None:
    timeout = float(table.timeout) if table.timeout is not None else CALL_TIMEOUT
    if table.http is not None:
        url_at = At(at.file, f"{at.key}.http")
        url = render(table.http, url_at)
        if problem := url_problem(url):
            report(url_at, problem)
            return None
        body = render(table.body, At(at.file, f"{at.key}.body")) if table.body is not None else None
        return CallSpec(kind="http", target=url, method=table.method or "POST", body=body,
                        expect_status=table.expect_status, timeout=timeout)
    if table.controller is not None:
        argv = tuple(render(w, At(at.file, f"{at.key}.controller")) for w in table.controller)
        stdin = render(table.input, At(at.file, f"{at.key}.input")) if table.input is not None else None
        return CallSpec(kind="controller", argv=argv, input=stdin, timeout=timeout)
    assert table.host is not None        # the schema lets exactly one of the three through
    return CallSpec(kind="host", target=render(table.host, At(at.file, f"{at.key}.host")), timeout=timeout)


def _inflight(table: schema_drain.InflightTable | None, at: At, health_url: str | None, render: Render,
              report: Report) -> tuple[InflightSpec | None, bool]:
    """The in-flight read (None when none is declared), and False when it has a problem (reported)."""
    if table is None:
        return None, True
    if table.url is not None:
        url_at = At(at.file, f"{at.key}.url")
        url = render(table.url, url_at)
        if problem := url_problem(url):
            report(url_at, problem)
            return None, False
    elif table.metric is not None and origin(health_url) is not None:
        url = f"{origin(health_url)}/metrics"
    else:
        report(at, "needs url (where the metric is read), or metric with health.http set (then it is read at "
                   "the health URL's host and port, /metrics)" if table.metric is not None else
               "needs metric (a metric of the server's /metrics), or url (which answers a number)")
        return None, False
    return InflightSpec(url=url, metric=table.metric), True


def smoke_spec(merged: dict[str, tuple[Any, At]], table_at: At | None, health_url: str | None, render: Render,
               report: Report) -> SmokeSpec | None:
    """The service's smoke test (None: none declared, or a problem reported). table_at: where the
    top layer wrote the table (None: no layer did)."""
    if table_at is None:
        return None
    values = {k: v for k, (v, _) in merged.items()}
    at = {k: a for k, (_, a) in merged.items()}
    checks: list[schema_drain.SmokeCheckTable] | None = values.get("checks")
    if not checks:
        report(table_at, "a smoke test needs checks: [[smoke.checks]] with prompt (or chat) and expect")
        return None
    if "url" in values:
        url = render(values["url"], at["url"]).rstrip("/")
        if problem := url_problem(url, "expected the server's OpenAI API base URL, like "
                                       "http://{host.address}:30000/v1"):
            report(at["url"], problem)
            return None
    elif origin(health_url) is not None:
        url = f"{origin(health_url)}/v1"
    else:
        report(table_at, "needs url (the server's OpenAI API base, like http://{host.address}:30000/v1), or "
                         "health.http set (then it is the health URL's host and port, /v1)")
        return None
    ttft, timeout = values.get("ttft"), float(values.get("timeout", 60.0))
    if ttft is not None and ttft >= timeout:
        report(at["ttft"], f"{ttft:g}s is not shorter than the smoke timeout ({timeout:g}s): the limit could "
                           f"never be reached before the answer times out")
        return None
    model = render(values["model"], at["model"]) if "model" in values else None
    return SmokeSpec(url=url, model=model, ttft=float(ttft) if ttft is not None else None, timeout=timeout,
                     checks=tuple(_check(c) for c in checks))


def _check(c: schema_drain.SmokeCheckTable) -> SmokeCheck:
    kind, text = ("completion", c.prompt) if c.prompt is not None else ("chat", c.chat)
    assert text is not None              # the schema lets exactly one of the two through
    return SmokeCheck(kind=kind, text=text, expect=c.expect, match=c.match or "contains",
                      max_tokens=c.max_tokens or 16)
