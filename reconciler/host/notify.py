"""Webhook notifications of rollout events: start, finish, halt and rollback.

Configured in fleet.toml::

    [notify]
    webhook = "http://127.0.0.1:9000/hooks/deploys"
    format = "json"        # or "slack": {"text": ...}, the shape Slack's incoming webhooks take
    timeout = 5            # seconds per request

A failing, slow or unreachable webhook never blocks or fails a deploy: events go into a queue
that one daemon thread POSTs from, in order (stdlib urllib; no extra dependency). The fleet run
never waits on a request; at its end it waits at most a few seconds for the queue to drain and
then leaves whatever is still pending behind (the thread is a daemon, so the process can exit).
Every failure is logged as a warning and listed in the run's result.

The webhook URL may carry a token (Slack's does): warnings name only its scheme, host and port.
Every event is redacted when it is queued (the values of the secrets the controller decrypted,
and token-like patterns, masked in every field), and so is every warning.

The URL is chosen by whoever can push (fleet.toml), the request comes from the control host: so
it goes only where the controller's own config lets it. A target address that is not public
(loopback, private, link-local, shared, reserved, multicast: anything `ipaddress` says is not
global) is refused unless its network is in the controller's `webhook_allow` (config.toml, or
$RECONCILER_WEBHOOK_ALLOW for the `reconcile` command), checked on the addresses the name
resolves to, and the connection goes to the checked address itself (no second lookup to rebind).
No redirect is followed, no proxy is used, and of the answer only the status code is shown (a
warning never carries text the target chose).
"""

from __future__ import annotations

import base64
import http.client
import ipaddress
import json
import logging
import os
import queue
import socket
import ssl
import threading
import time
from collections.abc import Callable, Iterable
from urllib.parse import unquote, urlsplit

from ..desired.spec import NotifySpec
from ..redact import redact, redact_data

log = logging.getLogger("reconciler.host.notify")

EVENTS = ("rollout.start", "rollout.finish", "rollout.halt", "rollback")

Post = Callable[[str, bytes, float], None]     # (url, body, timeout); raises on failure
ALLOW_ENV = "RECONCILER_WEBHOOK_ALLOW"           # the `reconcile` command's webhook_allow
Network = ipaddress.IPv4Network | ipaddress.IPv6Network
_allowed: tuple[Network, ...] | None = None      # set by the daemon from its config (allow())


class WebhookRefused(OSError):
    """The webhook's address is not public and not allowed by the controller's config."""


class WebhookStatus(Exception):
    """The webhook answered with a status other than 2xx (a redirect included: never followed)."""

    def __init__(self, code: int):
        super().__init__(f"HTTP {code}")
        self.code = code


def networks(items: Iterable[str]) -> tuple[Network, ...]:
    """Networks from CIDR strings ("127.0.0.0/8", "127.0.0.1", "::1/128"); ValueError names a bad one."""
    out = []
    for item in items:
        try:
            out.append(ipaddress.ip_network(item.strip(), strict=False))
        except ValueError:
            raise ValueError(f"{item!r} is not a network (an address or CIDR, like 127.0.0.0/8)") from None
    return tuple(out)


def allow(items: Iterable[str] | None) -> None:
    """The non-public networks webhooks may reach: the controller's config (`webhook_allow`).
    None: back to $RECONCILER_WEBHOOK_ALLOW (the `reconcile` command's)."""
    global _allowed
    _allowed = None if items is None else networks(items)


def allowed() -> tuple[Network, ...]:
    """The networks allow() set, else those of $RECONCILER_WEBHOOK_ALLOW (comma or space separated)."""
    if _allowed is not None:
        return _allowed
    return networks(os.environ.get(ALLOW_ENV, "").replace(",", " ").split())


def check_address(address: str) -> None:
    """Raise WebhookRefused unless the address is public or in an allowed network."""
    ip = ipaddress.ip_address(address.split("%", 1)[0])
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_global and not ip.is_multicast:
        return
    if any(ip in net for net in allowed()):
        return
    kind = next((k for k, yes in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                                  ("multicast", ip.is_multicast), ("private", ip.is_private)) if yes), "not public")
    raise WebhookRefused(f"{ip} is a {kind} address; a webhook reaches it only when the controller's config "
                         f"allows its network (webhook_allow, or ${ALLOW_ENV} for `reconcile`)")


def _connect_checked(address: tuple[str, int], timeout: float | None = None,
                     source_address: tuple[str, int] | None = None, **_kw: object) -> socket.socket:
    """socket.create_connection, to an address check_address passed: every address the name
    resolves to is checked (one refused refuses the webhook), then one of them is connected."""
    host, port = address
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)
    for info in infos:
        check_address(str(info[4][0]))
    error: OSError = OSError(f"{host}: no address")
    for family, kind, proto, _name, sockaddr in infos:
        sock = socket.socket(family, kind, proto)
        try:
            sock.settimeout(timeout)
            if source_address:
                sock.bind(source_address)
            sock.connect(sockaddr)
            return sock
        except OSError as e:
            sock.close()
            error = e
    raise error


class _HTTP(http.client.HTTPConnection):
    """http.client's connection, connecting only where check_address lets it."""

    def __init__(self, host: str, port: int | None, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._create_connection = _connect_checked


class _HTTPS(http.client.HTTPSConnection):
    """The same over TLS (the default context: the certificate and the host name are checked)."""

    def __init__(self, host: str, port: int | None, timeout: float):
        super().__init__(host, port, timeout=timeout)
        self._create_connection = _connect_checked


def where(url: str) -> str:
    """scheme://host:port of a URL, for messages: the path and query may hold a token."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}" + (f":{u.port}" if u.port else "")
    except ValueError:
        return "(unparsable URL)"


def http_post(url: str, body: bytes, timeout: float) -> None:
    """POST a JSON body to a checked address (_connect_checked); raise WebhookStatus unless the
    answer is 2xx (a redirect is not followed), WebhookRefused for a target not allowed."""
    u = urlsplit(url)                     # http(s) only: the schema checks the scheme
    conn = (_HTTPS if u.scheme == "https" else _HTTP)(u.hostname or "", u.port, timeout=timeout)
    headers = {"Content-Type": "application/json", "User-Agent": "reconciler"}
    if u.username is not None:
        pair = f"{unquote(u.username)}:{unquote(u.password or '')}".encode()
        headers["Authorization"] = "Basic " + base64.b64encode(pair).decode()
    try:
        conn.request("POST", (u.path or "/") + (f"?{u.query}" if u.query else ""), body=body, headers=headers)
        status = conn.getresponse().status
    finally:
        conn.close()
    if not 200 <= status < 300:
        raise WebhookStatus(status)


def failure(e: BaseException) -> str:
    """Why a request failed, in words the controller chose: the status code of an answer, the
    kind of a malformed one, never text the target sent (a reason phrase, a status line)."""
    if isinstance(e, WebhookStatus):
        return str(e)
    if isinstance(e, http.client.HTTPException):
        return f"{type(e).__name__} (the answer is not shown)"
    if isinstance(e, ssl.SSLError):
        return f"{type(e).__name__}: {e.reason or 'TLS failed'}"
    return f"{type(e).__name__}: {e}"


def slack_text(p: dict) -> str:
    """One Slack message for an event (mrkdwn); the journal line as a quote."""
    svc, short = p.get("service", "?"), p.get("short", "?")
    ev = p.get("event")
    if ev == "rollout.start":
        waves = p.get("waves") or []
        canary = ", ".join(waves[0]["hosts"]) if waves and waves[0].get("canary") else "none"
        return (f":arrow_forward: Rollout of *{svc}* at `{short}` started: {len(p.get('hosts') or [])} hosts "
                f"in {len(waves)} waves (canary: {canary}, at most {(p.get('policy') or {}).get('bound')} at once)")
    if ev == "rollout.finish":
        return (f":white_check_mark: Rollout of *{svc}* at `{short}` finished: {len(p.get('hosts') or [])} hosts "
                f"in {p.get('seconds', 0):.0f}s")
    if ev == "rollout.halt":
        text = (f":octagonal_sign: Rollout of *{svc}* at `{short}` halted at *{p.get('host')}* "
                f"(wave {p.get('wave')}): {p.get('reason')}; {len(p.get('untouched') or [])} hosts left "
                f"on their current version")
    else:
        to = p.get("rolled_back_to")
        done = f"rolled back to `{to[:7]}`" if to and p.get("result") == "rolled-back" else "not rolled back"
        text = f":leftwards_arrow_with_hook: *{p.get('host')}* {svc} at `{short}`: {p.get('reason')}; {done}"
    if p.get("journal_line"):
        text += f"\n> {p['journal_line']}"
    return text


class Notifier:
    """Sends events to one webhook from a background thread; never raises into the caller."""

    def __init__(self, spec: NotifySpec, post: Post = http_post):
        self.spec = spec
        self._post = post
        self._queue: queue.Queue[dict | None] = queue.Queue()
        self._thread: threading.Thread | None = None
        self.failures: list[str] = []
        self.sent = 0

    def send(self, event: str, **fields: object) -> None:
        """Queue an event; returns at once."""
        payload = redact_data({"event": event, "at": round(time.time(), 3), **fields})
        if self._thread is None:
            self._thread = threading.Thread(target=self._worker, name="reconciler-notify", daemon=True)
            self._thread.start()
        self._queue.put(payload)

    def close(self, timeout: float = 5.0) -> None:
        """Wait at most `timeout` seconds for queued events to go out; then give up on the rest."""
        if self._thread is None:
            return
        self._queue.put(None)
        self._thread.join(timeout)
        if self._thread.is_alive():     # the end marker just queued is no event
            self._warn(f"webhook {where(self.spec.webhook)} still busy after {timeout:.0f}s; "
                       f"{self._queue.qsize() - 1} event(s) dropped")

    def body(self, payload: dict) -> bytes:
        """The request body in the configured format, redacted."""
        payload = redact_data(payload)
        if self.spec.format == "slack":
            return json.dumps({"text": redact(slack_text(payload))}).encode()
        return json.dumps(payload).encode()

    def _worker(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            try:
                self._post(self.spec.webhook, self.body(payload), self.spec.timeout)
                self.sent += 1
            except Exception as e:   # any failure of the webhook is only a warning
                self._warn(f"webhook {where(self.spec.webhook)}: {payload['event']} not delivered: {failure(e)}")

    def _warn(self, msg: str) -> None:
        msg = redact(msg)
        self.failures.append(msg)
        log.warning("%s", msg)
