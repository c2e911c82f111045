"""A revision ready to run: one way for every door to open it.

`open_revision(snapshot, opts)` loads the desired state (`desired.load.load_desired`, or a state
the caller already loaded from the same tree), decrypts its age secrets with the run's
identity, and gives the run what it asks of the repository: the state at another revision for
a rollback (decrypted too), the pre-flight rule pack (parsed on first use: a run that starts
nothing never parses it), and whether one revision descends from another.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from typing import TYPE_CHECKING

from ..desired.spec import DesiredState

if TYPE_CHECKING:
    from ..desired.source import Snapshot
    from ..preflight import RuleSet
    from .options import RunOptions

RenderAt = Callable[[str], DesiredState | None]
# Whether a revision descends from another: True, False, or None (the other is not in the repo).
Descends = Callable[[str, str], "bool | None"]


@dataclass(frozen=True)
class Revision:
    """The desired state at one revision (secrets decrypted), and what a run asks of its repo."""

    state: DesiredState
    render_at: RenderAt | None = None             # the state at another revision (rollbacks)
    rules: Callable[[], RuleSet] | None = None    # the pre-flight rule pack (None: no pre-flight)
    descends: Descends | None = None              # None: no rewind check

    @property
    def revision(self) -> str:
        return self.state.revision


def open_revision(snap: Snapshot, opts: RunOptions, *, state: DesiredState | None = None,
                  rules: RuleSet | None = None) -> Revision:
    """The revision at `snap`, ready for `fleet.run_fleet` (ConfigError, SourceError: bad input).

    `state`, `rules`: what the caller already loaded from this snapshot's tree (the daemon's
    memo of the last tree), so they are not parsed again."""
    from ..desired import secrets
    from ..desired.load import load_desired, render_at  # pydantic and the schema: with a revision to load
    if state is None:
        state = load_desired(snap)
    dec = secrets.Decryptor(secrets.identity_path(opts.age_identity))
    if any(s.source == "age" for h in state.hosts.values() for svc in h.services.values() for s in svc.secrets):
        state = dec.state(state)

    @cache
    def rule_pack() -> RuleSet:
        if rules is not None:
            return rules
        from ..preflight import load_rules
        return load_rules(snap)

    def descends(target: str, applied: str) -> bool | None:
        from ..desired.trust import descends as check
        return check(snap.repo)(target, applied)

    return Revision(state, dec.render_at(render_at(snap)), rule_pack, descends)


def snapshot_of(opts: RunOptions) -> Snapshot:
    """The snapshot of `opts.repo` at `opts.rev`, below `opts.path` (SourceError: no such thing)."""
    from ..desired import source
    return source.snapshot(source.open_repo(opts.repo, opts.cache_dir), opts.rev, opts.path)


def load_revision(opts: RunOptions) -> tuple[Snapshot, Revision]:
    """The revision the options name, opened for a run."""
    snap = snapshot_of(opts)
    return snap, open_revision(snap, opts)
