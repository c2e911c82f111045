"""Deploy status as a forge commit status (the GitHub / Gitea commit-status API), optional.

Configured in the controller's config (never in the desired-state repo, so a push cannot point
the token somewhere else):

    forge_url = "https://gitea.example.internal/api/v1"   # API base (GitHub: https://api.github.com)
    forge_repo = "ops/fleet"                               # owner/name on the forge
    forge_token_file = "/etc/reconciler/forge-token"       # or forge_token_env = "FORGE_TOKEN"
    forge_target_url = "https://fleet.example.internal/hosts/{host}"   # optional link; {sha} {short} {host}

Each daemon run posts `POST {forge_url}/repos/{owner}/{repo}/statuses/{sha}` with
`{"state": "pending"|"success"|"failure"|"error", "context": "reconciler/<host>" or
"reconciler/fleet", "description": ..., "target_url": ...}`: pending for the fleet when the run
starts, then one status per host (success: converged or in sync; failure: rolled back,
quarantined or failed, with the journal line) and one for the fleet.

A failing, slow or unreachable forge never blocks or fails a deploy (as notify.py does for
webhooks): statuses go to a queue that one daemon thread posts from. The queue keeps only the
newest status per commit and context (a forge that is down does not make it grow run after run),
and at most MAX_PENDING of them. Every failure is a warning line on stderr (the journal), naming
the forge by scheme, host and port only. The token is read from its file or variable for each
request (a rotated token is picked up), registered with redact, sent only in the Authorization
header and never printed; every payload is redacted before it is queued.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING
from urllib.parse import quote

from .. import redact
from ..host.notify import where
from ..plan.records import Result
from .gitnotes import host_detail, one_line

if TYPE_CHECKING:
    from ..loop.results import FleetResult

DESCRIPTION_MAX = 140            # GitHub's limit on a status description
MAX_PENDING = 500
FLEET_CONTEXT = "reconciler/fleet"
_STATE = {Result.IN_SYNC: "success", Result.CONVERGED: "success", Result.WOULD_CHANGE: "pending",
          Result.QUARANTINED: "failure", Result.ROLLED_BACK: "failure", Result.FAILED: "failure"}

# (url, body, headers, timeout); raises on failure
Post = Callable[[str, bytes, dict[str, str], float], None]


@dataclass(frozen=True)
class ForgeSpec:
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


def http_post(url: str, body: bytes, headers: dict[str, str], timeout: float) -> None:
    """POST a JSON body; raise unless the answer is 2xx."""
    req = urllib.request.Request(url, data=body, method="POST", headers=headers)
    with urllib.request.urlopen(req, timeout=timeout) as resp:    # http(s) only: the config checks the scheme
        if not 200 <= resp.status < 300:
            raise urllib.error.HTTPError(url, resp.status, resp.reason, resp.headers, None)


class ForgeStatus:
    """Posts commit statuses from a background thread; never raises into the caller, never waits."""

    def __init__(self, spec: ForgeSpec, post: Post = http_post):
        self.spec = spec
        self._post = post
        self._pending: collections.OrderedDict[tuple[str, str], dict[str, str]] = collections.OrderedDict()
        self._cv = threading.Condition()
        self._busy = False
        self._thread: threading.Thread | None = None
        self.failures: collections.deque[str] = collections.deque(maxlen=100)
        self.sent = 0

    def send(self, sha: str, status: dict[str, str]) -> None:
        """Queue one status; returns at once. A newer status for the same commit and context
        replaces one still queued."""
        status = redact.redact_data(status)
        with self._cv:
            key = (sha, status["context"])
            self._pending.pop(key, None)
            self._pending[key] = status
            while len(self._pending) > MAX_PENDING:
                (old_sha, ctx), _ = self._pending.popitem(last=False)
                self._warn(f"forge {where(self.spec.url)}: too many statuses queued; dropped {ctx} on {old_sha[:7]}")
            if self._thread is None:
                self._thread = threading.Thread(target=self._worker, name="reconciler-forge", daemon=True)
                self._thread.start()
            self._cv.notify_all()

    def wait_idle(self, timeout: float) -> bool:
        """Wait until every queued status went out or failed (tests, a clean stop)."""
        with self._cv:
            return self._cv.wait_for(lambda: not self._pending and not self._busy, timeout)

    def _worker(self) -> None:
        while True:
            with self._cv:
                self._cv.wait_for(lambda: bool(self._pending))
                (sha, _context), status = self._pending.popitem(last=False)
                self._busy = True
            try:
                self._deliver(sha, status)
            finally:
                with self._cv:
                    self._busy = False
                    self._cv.notify_all()

    def _deliver(self, sha: str, status: dict[str, str]) -> None:
        what = f"forge {where(self.spec.url)}: status {status['context']} on {sha[:7]} not delivered"
        try:
            token = self.spec.token()
            headers = {"Content-Type": "application/json", "Accept": "application/vnd.github+json",
                       "User-Agent": "reconciler", "Authorization": f"token {token}"}
            self._post(self.spec.status_url(sha), json.dumps(status).encode(), headers, self.spec.timeout)
            self.sent += 1
        except ForgeTokenError as e:
            self._warn(f"{what}: {e}")
        except urllib.error.HTTPError as e:
            self._warn(f"{what}: HTTP {e.code} {e.reason}")
        except Exception as e:      # any failure of the forge is only a warning
            self._warn(f"{what}: {type(e).__name__}: {getattr(e, 'reason', None) or e}")

    def _warn(self, msg: str) -> None:
        msg = redact.redact(msg)
        self.failures.append(msg)
        print(f"reconciler: warning: {msg}", file=sys.stderr, flush=True)
