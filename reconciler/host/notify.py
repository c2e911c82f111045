"""Webhook notifications of rollout events: start, finish, halt and rollback.

Configured in fleet.toml::

    [notify]
    webhook = "http://127.0.0.1:9000/hooks/deploys"
    format = "json"        # or "slack": {"text": ...}, the shape Slack's incoming webhooks take
    timeout = 5            # seconds per request

A failing, slow or unreachable webhook never blocks or fails a deploy: events go into a bounded
queue that one task of the run's event loop POSTs from, in order, on httpx's async client
(host/outbox.py). The fleet run never waits on a request; at its end it waits at most a few
seconds for the queue to drain and then drops whatever is still pending. Every failure is
logged as a warning and listed in the run's result.

The webhook URL may carry a token (Slack's does): warnings name only its scheme, host and port.
Every event is redacted when it is queued (the values of the secrets the controller decrypted,
and token-like patterns, masked in every field), and so is every warning.

The URL is chosen by whoever can push (fleet.toml), the request comes from the control host: so
it goes only where the controller's own config lets it. A target address that is not public
(loopback, private, link-local, shared, reserved, multicast: anything `ipaddress` says is not
global) is refused unless its network is in the controller's `webhook_allow` (config.toml, or
$RECONCILER_WEBHOOK_ALLOW for the `reconcile` command), checked on the addresses the name
resolves to, and the connection goes to the checked address itself (no second lookup to rebind):
the client's transport does all of it (AllowListTransport). No redirect is followed, no proxy is
used, and of the answer only the status code is shown (a warning never carries text the target
chose).
"""

from __future__ import annotations

import asyncio
import ipaddress
import json
import logging
import os
import socket
import time
from collections.abc import Iterable
from urllib.parse import urlsplit

import httpx

from ..desired.spec import NotifySpec
from ..redact import redact, redact_data
from .outbox import Outbox

log = logging.getLogger("reconciler.host.notify")

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
    if (ip.is_global and not ip.is_multicast) or any(ip in net for net in allowed()):
        return
    kind = next((k for k, yes in (("loopback", ip.is_loopback), ("link-local", ip.is_link_local),
                                  ("multicast", ip.is_multicast), ("private", ip.is_private)) if yes), "not public")
    raise WebhookRefused(f"{ip} is a {kind} address; a webhook reaches it only when the controller's config "
                         f"allows its network (webhook_allow, or ${ALLOW_ENV} for `reconcile`)")


class AllowListTransport(httpx.AsyncBaseTransport):
    """An httpx transport that reaches only addresses check_address lets through: the name is
    resolved once, every address it resolves to is checked (one refused refuses the webhook),
    and the connection goes to a checked address itself (the request's URL rewritten to it; the
    Host header, TLS's server name and its certificate check keep the name), so nothing can
    rebind the name between the check and the connect. A client built on it follows no
    redirect and uses no proxy (webhook_client)."""

    def __init__(self) -> None:
        self._inner = httpx.AsyncHTTPTransport(trust_env=False, retries=0)

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        host, port = request.url.host, request.url.port or (443 if request.url.scheme == "https" else 80)
        infos = await asyncio.get_running_loop().getaddrinfo(host, port, type=socket.SOCK_STREAM)
        addresses = list(dict.fromkeys(str(info[4][0]) for info in infos))
        for address in addresses:
            check_address(address)
        error: Exception = OSError(f"{host}: no address")
        for address in addresses:
            request.url = request.url.copy_with(host=address)
            request.extensions = {**request.extensions, "sni_hostname": host}
            try:
                return await self._inner.handle_async_request(request)
            except httpx.ConnectError as e:       # the next address, as a connect to a name would
                error = e
        raise error

    async def aclose(self) -> None:
        await self._inner.aclose()


def webhook_client(timeout: float, transport: httpx.AsyncBaseTransport | None = None) -> httpx.AsyncClient:
    """The client webhooks go out on: the allow-list transport (or a test's), no redirects, no
    proxy from the environment, `timeout` seconds for each step of a request."""
    return httpx.AsyncClient(transport=transport or AllowListTransport(),
                             timeout=timeout, follow_redirects=False, trust_env=False,
                             headers={"User-Agent": "reconciler"})


def where(url: str) -> str:
    """scheme://host:port of a URL, for messages: the path and query may hold a token."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}" + (f":{u.port}" if u.port else "")
    except ValueError:
        return "(unparsable URL)"


async def post(client: httpx.AsyncClient, url: str, body: bytes) -> None:
    """POST a JSON body; raise WebhookStatus unless the answer is 2xx (a redirect is not
    followed), WebhookRefused for a target not allowed (the transport's)."""
    response = await client.post(url, content=body, headers={"Content-Type": "application/json"})
    if not 200 <= response.status_code < 300:
        raise WebhookStatus(response.status_code)


def failure(e: BaseException, timeout: float) -> str:
    """Why a request failed, in words the controller chose: the status code of an answer, the
    kind of a malformed one, never text the target sent (a reason phrase, a status line)."""
    if isinstance(e, WebhookStatus):
        return str(e)
    if isinstance(e, httpx.TimeoutException):
        return f"{type(e).__name__}: timed out after {timeout:g}s"
    if isinstance(e, httpx.RemoteProtocolError | httpx.DecodingError):
        return f"{type(e).__name__} (the answer is not shown)"
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


MAX_PENDING = 1000          # events queued at most; past it the oldest is dropped (and that is said)


class Notifier(Outbox[dict]):
    """Sends events to one webhook from the run's event loop (host/outbox.py); never raises into
    the caller, never waits. `transport`: a test's (httpx.MockTransport); the allow-list's else."""

    logger = log

    def __init__(self, spec: NotifySpec, transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(lambda: webhook_client(spec.timeout, transport), max_pending=MAX_PENDING)
        self.spec = spec
        self._seq = 0

    def send(self, event: str, **fields: object) -> None:
        """Queue an event; returns at once (call it from the run's event loop)."""
        self._seq += 1
        self.put(self._seq, redact_data({"event": event, "at": round(time.time(), 3), **fields}))

    async def close(self, timeout: float = 5.0) -> None:
        """Wait at most `timeout` seconds for queued events to go out; then drop the rest."""
        if not await self.drain(timeout):
            self.warn(f"webhook {where(self.spec.webhook)} still busy after {timeout:.0f}s; "
                      f"{self.pending} event(s) dropped")
        await super().close()

    def body(self, payload: dict) -> bytes:
        """The request body in the configured format, redacted."""
        payload = redact_data(payload)
        if self.spec.format == "slack":
            return json.dumps({"text": redact(slack_text(payload))}).encode()
        return json.dumps(payload).encode()

    async def _deliver(self, client: httpx.AsyncClient, item: dict) -> None:
        await post(client, self.spec.webhook, self.body(item))

    def _failed(self, item: dict, e: Exception) -> str:
        return f"webhook {where(self.spec.webhook)}: {item['event']} not delivered: {failure(e, self.spec.timeout)}"

    def _dropped(self, item: dict) -> str:
        return f"webhook {where(self.spec.webhook)}: too many events queued; dropped {item['event']}"
