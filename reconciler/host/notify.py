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
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from urllib.parse import urlsplit

from ..desired.spec import NotifySpec
from ..redact import redact, redact_data

log = logging.getLogger("reconciler.host.notify")

EVENTS = ("rollout.start", "rollout.finish", "rollout.halt", "rollback")

Post = Callable[[str, bytes, float], None]     # (url, body, timeout); raises on failure


def where(url: str) -> str:
    """scheme://host:port of a URL, for messages: the path and query may hold a token."""
    try:
        u = urlsplit(url)
        return f"{u.scheme}://{u.hostname}" + (f":{u.port}" if u.port else "")
    except ValueError:
        return "(unparsable URL)"


def http_post(url: str, body: bytes, timeout: float) -> None:
    """POST a JSON body; raise unless the answer is 2xx."""
    req = urllib.request.Request(url, data=body, method="POST",
                                 headers={"Content-Type": "application/json", "User-Agent": "reconciler"})
    with urllib.request.urlopen(req, timeout=timeout) as resp:   # http(s) only: the schema checks the scheme
        if not 200 <= resp.status < 300:
            raise urllib.error.HTTPError(url, resp.status, resp.reason, resp.headers, None)


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
            except urllib.error.HTTPError as e:
                self._warn(f"webhook {where(self.spec.webhook)}: {payload['event']} not delivered: "
                           f"HTTP {e.code} {e.reason}")
            except Exception as e:   # any failure of the webhook is only a warning
                self._warn(f"webhook {where(self.spec.webhook)}: {payload['event']} not delivered: "
                           f"{type(e).__name__}: {getattr(e, 'reason', None) or e}")

    def _warn(self, msg: str) -> None:
        msg = redact(msg)
        self.failures.append(msg)
        log.warning("%s", msg)
