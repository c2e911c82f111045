"""A revision ready to run: one way for every door to open it.

`open_revision(snapshot, opts)` verifies the revision under the run's trust policy
(`opts.trust`: signed by an allowed key, when the door requires it), loads the desired state
(`desired.cache.load_desired`, or a state the caller already loaded from the same tree),
decrypts its age secrets with the run's identity, and gives the run what it asks of the
repository: the state at another revision for a rollback (verified under the same policy, then
decrypted: a revision a host's record names is no more trusted than a tip), the pre-flight rule
pack (parsed on first use: a run that starts nothing never parses it), and whether one revision
descends from another.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cache
from typing import TYPE_CHECKING

import msgspec

from ..desired.spec import DesiredState, HostSpec, ServiceSpec

if TYPE_CHECKING:
    from ..desired.source import Snapshot
    from ..plan.facts import HostFacts
    from ..plan.model import Context, HostPlan
    from ..preflight import RuleSet
    from .options import RunOptions

    # the plans a run made, by host name: (desired, facts, context, plan), the last two (host_run)
    Planned = dict[str, list[tuple[HostSpec, HostFacts, Context, HostPlan]]]

RenderAt = Callable[[str], DesiredState | None]
# Whether a revision descends from another: True, False, or None (the other is not in the repo).
Descends = Callable[[str, str], "bool | None"]
Rules = Callable[[], "RuleSet | None"]


def nowhere(revision: str) -> DesiredState | None:
    """No repository: no other revision to render (nothing to roll back to)."""
    return None


def no_rules() -> RuleSet | None:
    """No repository: no rule pack (the host-side pre-flight runs without its rules)."""
    return None


def no_history(target: str, applied: str) -> bool | None:
    """No repository: no history to rewind, so no rewind check (every revision may follow)."""
    return True


class Revision(msgspec.Struct, frozen=True):
    """The desired state at one revision (secrets decrypted), and what a run asks of its repo.
    `Revision(state)` alone is a revision without a repository (a benchmark's, a test's)."""

    state: DesiredState
    render_at: RenderAt = nowhere                 # the state at another revision (rollbacks)
    rules: Rules = no_rules                       # the pre-flight rule pack
    descends: Descends = no_history               # whether one revision descends from another
    signer: str | None = None                     # who signed it (None: the policy asks no signature)
    # rollback targets the trust policy refused (revision -> why), filled as the run renders them
    refused: dict[str, str] = msgspec.field(default_factory=dict)
    planned: Planned = msgspec.field(default_factory=dict)      # the plans this run made (host_run)

    @property
    def revision(self) -> str:
        return self.state.revision

    def spec_at(self, revision: str, host: str, service: str) -> ServiceSpec | None:
        """A host's service as `revision` declares it (None: not there, or not rendered)."""
        state = self.render_at(revision)
        h = state.hosts.get(host) if state is not None else None
        return h.services.get(service) if h is not None else None


def open_revision(snap: Snapshot, opts: RunOptions, *, state: DesiredState | None = None,
                  rules: RuleSet | None = None) -> Revision:
    """The revision at `snap`, ready for `fleet.run_fleet` (ConfigError, SourceError: bad input;
    RevisionRefused: the trust policy does not let it deploy).

    `state`, `rules`: what the caller already loaded from this snapshot's tree (the daemon's
    memo of the last tree), so they are not parsed again."""
    from ..desired import secrets
    from ..desired.cache import load_desired, render_at  # the loader only on a cache miss
    signer = opts.trust.verify(snap.repo, snap.revision) if opts.trust.require_signed else None
    if state is None:
        state = load_desired(snap, opts.cache_dir)
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

    refused: dict[str, str] = {}
    rollback = render_at(snap, opts.cache_dir)
    if opts.trust.require_signed:
        rollback = opts.trust.render_at(snap.repo, rollback, refused)
    return Revision(state, dec.render_at(rollback), rule_pack, descends, signer, refused)


def snapshot_of(opts: RunOptions) -> Snapshot:
    """The snapshot of `opts.repo` at `opts.rev`, below `opts.path` (SourceError: no such thing)."""
    from ..desired import source
    return source.snapshot(source.open_repo(opts.repo, opts.cache_dir), opts.rev, opts.path)


def load_revision(opts: RunOptions) -> tuple[Snapshot, Revision]:
    """The revision the options name, opened for a run."""
    snap = snapshot_of(opts)
    return snap, open_revision(snap, opts)
