"""The daemon's deploy status on the commit: git notes on the deploy repo (gitnotes.py) and, when
configured, the forge's commit status (forge.py). Neither ever fails or holds up a deploy: a
note that cannot be written is a warning line in the run's output; forge statuses go out from
a task of the daemon's event loop (forge.py).

Notes are written on a local deploy repo (the bare repo `reconcile init-repo` makes); with a URL
repo the daemon reads a mirror, where notes would reach nobody, so it writes none.

Periodic runs that find a host as the last run left it post nothing new: a forge keeps every
status it is sent (GitHub stops accepting more after 1000 per commit and context), so a host's
status is posted again only when its state (success, failure) changed, or the run acted on it
and says something new; the fleet's "pending" only for the first run of a revision.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from ..desired import source
from . import forge, gitnotes
from .config import ControllerConfig

if TYPE_CHECKING:
    from ..loop.results import FleetResult

REMEMBERED = 10_000       # (commit, context) -> what was posted, for skipping restatements


class CommitStatus:
    """Records each daemon run's outcome on the deployed commit."""

    def __init__(self, cfg: ControllerConfig):
        self.notes = cfg.notes and not source.is_url(cfg.repo)
        self.target_url = cfg.forge_target_url
        self.forge: forge.ForgeStatus | None = None
        self.posted: OrderedDict[tuple[str, str], tuple[str, str]] = OrderedDict()   # -> (state, description)
        if cfg.forge_url and cfg.forge_repo:
            self.forge = forge.ForgeStatus(forge.ForgeSpec(
                url=cfg.forge_url, repo=cfg.forge_repo, token_file=cfg.forge_token_file,
                token_env=cfg.forge_token_env, target_url=cfg.forge_target_url, timeout=cfg.forge_timeout))

    def _post(self, sha: str, status: dict[str, str], *, restates: bool = False) -> None:
        """Queue a status, unless it says what was last posted for its commit and context, or
        `restates` it (a run that acted on nothing) with the same state."""
        if self.forge is None:
            return
        key = (sha, status["context"])
        now = (status["state"], status["description"])
        before = self.posted.get(key)
        if before == now or (restates and before is not None and before[0] == now[0]):
            return
        self.posted.pop(key, None)
        self.posted[key] = now
        while len(self.posted) > REMEMBERED:
            self.posted.popitem(last=False)
        self.forge.send(sha, status)

    def started(self, revision: str, hosts: int) -> None:
        """A run of `revision` over `hosts` hosts begins: the forge says pending (first run only)."""
        if (revision, forge.FLEET_CONTEXT) not in self.posted:
            self._post(revision, forge.started(revision, hosts, self.target_url))

    def failed(self, revision: str, why: str) -> None:
        """A run ended without a result (its pending status must not stay pending)."""
        if len(revision) == 40:
            self._post(revision, forge.failed(revision, why, self.target_url))

    async def close(self) -> None:
        """The daemon stops: statuses still queued are dropped (the next start posts afresh)."""
        if self.forge is not None:
            await self.forge.close()

    def finished(self, repo: Any, result: FleetResult) -> list[str]:
        """A run ended: its notes, its forge statuses. Returns warnings (never raises)."""
        warnings = []
        if self.forge is not None and not result.dry_run:
            statuses = forge.finished(result, self.target_url)
            steady = [gitnotes.steady(r) for r in result.hosts]
            for status, quiet in zip(statuses, [*steady, all(steady)], strict=True):
                self._post(result.revision, status, restates=quiet)
        if self.notes:
            try:
                gitnotes.record_run(repo, result)
            except gitnotes.NotesError as e:
                warnings.append(f"deploy notes not written: {e}")
        return warnings
