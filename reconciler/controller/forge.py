"""Deploy status as a forge commit status (the GitHub / Gitea commit-status API), optional: what
is posted and when, where it is configured (the forge_* keys of the controller's config, never
the repo), and how a slow or failing forge is kept from a deploy: docs/status.md, "Forge commit
status".

Statuses go to a queue that one task of the daemon's event loop posts from (host/outbox.py, as
notify.py does for webhooks): at most MAX_PENDING, the newest per commit and context, so a
forge that is down does not make it grow run after run. A failure's warning names the forge by
scheme, host and port only. The token is read for each request (a rotated one is picked up) and
registered with redact; every payload is redacted before it is queued.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

import msgspec

from .. import redact
from ..host.notify import where
from ..host.outbox import Outbox
from ..plan.records import Result
from .gitnotes import host_detail, one_line

if TYPE_CHECKING:
    import httpx

    from ..loop.results import FleetResult

DESCRIPTION_MAX = 140            # GitHub's limit on a status description
MAX_PENDING = 500
FLEET_CONTEXT = "reconciler/fleet"
_STATE = {Result.IN_SYNC: "success", Result.CONVERGED: "success", Result.WOULD_CHANGE: "pending",
          Result.QUARANTINED: "failure", Result.ROLLED_BACK: "failure", Result.FAILED: "failure"}


class ForgeSpec(msgspec.Struct, frozen=True):
    url: str                          # API base, e.g. https://api.github.com
    repo: str                         # owner/name
    token_file: str | None = None
    token_env: str | None = None
    target_url: str | None = None     # may hold {sha}, {short}, {host}
    timeout: float = 5.0

    def status_url(self, sha: str) -> str:
        owner, _, name = self.repo.partition("/")
        return f"{self.url.rstrip('/')}/repos/{quote(owner)}/{quote(name)}/statuses/{sha}"

    def token(self) -> str:
        """The token, from its file or environment variable (read now: a rotated one is used)."""
        if self.token_file:
            try:
                value = Path(self.token_file).read_text().strip()
            except OSError as e:
                raise ForgeTokenError(f"cannot read forge_token_file {self.token_file}: "
                                      f"{e.strerror or type(e).__name__}") from None
        else:
            value = os.environ.get(self.token_env or "", "").strip()
            if not value:
                raise ForgeTokenError(f"forge_token_env names {self.token_env}, which is not set")
        if not value:
            raise ForgeTokenError(f"forge_token_file {self.token_file} is empty")
        redact.register(value)
        return value


class ForgeTokenError(Exception):
    """The forge token could not be read (the message never holds a token)."""


def payload(state: str, context: str, description: str, target_url: str | None = None) -> dict[str, str]:
    """PURE: one commit status in the GitHub/Gitea API shape."""
    body = {"state": state, "context": context, "description": one_line(redact.redact(description),
                                                                         DESCRIPTION_MAX)}
    if target_url:
        body["target_url"] = target_url
    return body


def _target(spec_target: str | None, sha: str, host: str) -> str | None:
    if not spec_target:
        return None
    return spec_target.replace("{sha}", sha).replace("{short}", sha[:7]).replace("{host}", host)


def started(revision: str, hosts: int, target_url: str | None = None) -> dict[str, str]:
    """PURE: the fleet's pending status when a run starts."""
    return payload("pending", FLEET_CONTEXT, f"deploying {revision[:7]} to {hosts} host{'s' * (hosts != 1)}",
                   _target(target_url, revision, "fleet"))


def finished(result: FleetResult, target_url: str | None = None) -> list[dict[str, str]]:
    """PURE: the statuses of a finished run: one per host, then the fleet's."""
    out = []
    counts: dict[str, int] = {}
    for r in result.hosts:
        status = Result(r.status)
        counts[str(status)] = counts.get(str(status), 0) + 1
        detail = host_detail(r)
        out.append(payload(_STATE[status], f"reconciler/{r.host}", f"{status}: {detail}" if detail else str(status),
                           _target(target_url, result.revision, r.host)))
    worst = max((Result(r.status) for r in result.hosts), key=lambda s: s.rank, default=Result.IN_SYNC)
    summary = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    out.append(payload(_STATE[worst], FLEET_CONTEXT, f"{summary} (exit {result.exit_code()})",
                       _target(target_url, result.revision, "fleet")))
    return out


def failed(revision: str, why: str, target_url: str | None = None) -> dict[str, str]:
    """PURE: the fleet's status when a run ended without a result (git unreadable, an error)."""
    return payload("error", FLEET_CONTEXT, f"run failed: {why}", _target(target_url, revision, "fleet"))


class ForgeStatus(Outbox[tuple[str, dict[str, str]]]):
    """Posts commit statuses from the daemon's event loop (host/outbox.py); never raises into the
    caller, never waits. `transport`: a test's (httpx.MockTransport); httpx's own else."""

    def __init__(self, spec: ForgeSpec, transport: httpx.AsyncBaseTransport | None = None):
        super().__init__(lambda: _client(spec.timeout, transport), max_pending=MAX_PENDING)
        self.spec = spec

    def send(self, sha: str, status: dict[str, str]) -> None:
        """Queue one status; returns at once (call it from the daemon's loop). A newer status for
        the same commit and context replaces one still queued."""
        status = redact.redact_data(status)
        self.put((sha, status["context"]), (sha, status))

    async def _deliver(self, client: httpx.AsyncClient, item: tuple[str, dict[str, str]]) -> None:
        sha, status = item
        headers = {"Accept": "application/vnd.github+json", "Authorization": f"token {self.spec.token()}"}
        response = await client.post(self.spec.status_url(sha), json=status, headers=headers)
        if not 200 <= response.status_code < 300:
            raise ForgeAnswer(response.status_code, response.reason_phrase)

    def _failed(self, item: tuple[str, dict[str, str]], e: Exception) -> str:
        import httpx
        sha, status = item
        what = f"forge {where(self.spec.url)}: status {status['context']} on {sha[:7]} not delivered"
        if isinstance(e, ForgeTokenError | ForgeAnswer):
            return f"{what}: {e}"
        if isinstance(e, httpx.TimeoutException):
            return f"{what}: {type(e).__name__}: timed out after {self.spec.timeout:g}s"
        return f"{what}: {type(e).__name__}: {e}"

    def _dropped(self, item: tuple[str, dict[str, str]]) -> str:
        return f"forge {where(self.spec.url)}: too many statuses queued; dropped {item[1]['context']} on {item[0][:7]}"

    def _say(self, msg: str) -> None:
        print(f"reconciler: warning: {msg}", file=sys.stderr, flush=True)


class ForgeAnswer(Exception):
    """The forge answered with a status other than 2xx (a redirect included: never followed)."""

    def __init__(self, code: int, reason: str):
        super().__init__(f"HTTP {code} {reason}".rstrip())


def _client(timeout: float, transport: httpx.AsyncBaseTransport | None) -> httpx.AsyncClient:
    """The forge's client: its API base is the controller's own config (not the pushed repo's),
    so httpx's defaults stand (the environment's proxy, certificate checks), redirects aside."""
    import httpx
    return httpx.AsyncClient(transport=transport, timeout=timeout, follow_redirects=False,
                             headers={"User-Agent": "reconciler"})
