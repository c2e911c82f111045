"""What a run is asked to do (RunOptions), and how it reaches hosts and tells its door (RunIO).

Every door builds one RunOptions and calls the one fleet run (`fleet.run_fleet`): the CLI
(`reconcile`, `reconcile status --live`), the daemon (`reconcile watch`), and pull mode
(`reconcile pull`). A new option is a field here, the door that sets it, and its one use.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Awaitable, Callable, Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import msgspec

from ..clock import REAL, Clock
from ..desired.trust import TrustPolicy

if TYPE_CHECKING:
    from ..desired.spec import HostSpec
    from ..host.notify import Notifier
    from ..host.programs import Seen
    from ..host.progress import LoadProgress
    from ..host.transport import Transport
    from ..plan.rollout import RolloutResult
    from .results import HostResult

# Opens a connection to a host (an SSH connection, the daemon's pool, a local transport).
Connector = Callable[["HostSpec"], Awaitable["Transport"]]
HostPhase = Callable[[str, str, str, float, float], None]   # host, service, phase, elapsed, timeout
HostProgress = Callable[[str, str, "LoadProgress"], None]   # host, service, its engine's load progress
# Told of each rollout's progress (the daemon's fleet page): "start", "wave" (its hosts restart
# now: waves_done + 1), "done", "halted", "superseded", with the rollout as it stands.
RolloutWatch = Callable[[str, "RolloutResult"], None]

CONFIRM_MARGIN = 60.0


class RunOptions(msgspec.Struct, frozen=True):
    """What to run: which revision, which hosts, whether to change them, how to wait, which keys."""

    repo: str = "."                   # the desired-state repo: a local path or a URL
    rev: str | None = None            # the revision (None: HEAD)
    path: str = ""                    # the repo's sub-directory holding fleet.toml and hosts/
    cache_dir: Path | None = None     # where a URL repo is mirrored (None: dirs.default_cache_dir)
    hosts: tuple[str, ...] = ()       # --host: only these (empty: every host of the revision)
    labels: tuple[str, ...] = ()      # --label KEY=VALUE: only hosts carrying every one of them
    dry_run: bool = False             # plan and show; change nothing
    look: bool = False                # read every host's records (status --live): no plan, no lock, no writes
    retry: bool = False               # try quarantined versions once more
    allow_rewind: bool = False        # deploy a revision that does not descend from a host's applied one
    lock_wait: float = 30.0           # seconds to wait for another run's host lock (host.lock.WAIT)
    concurrency: int | None = None    # hosts at once (None: fleet.toml's)
    identity: str | None = None       # the SSH private key (None: ~/.ssh defaults)
    age_identity: str | None = None   # the age identity that decrypts the revision's secrets
    # seconds the dead-man's switch adds to start-up timeout + stable_for (None: no switch)
    confirm_margin: float | None = CONFIRM_MARGIN
    # what may deploy: signed revisions only (and by whom), plaintext URLs or not; the revision a
    # run opens and every revision a rollback renders are verified under it (revision.py)
    trust: TrustPolicy = msgspec.field(default_factory=TrustPolicy)
    engine_check: bool = False        # --engine-check: a dry run runs the engine check of an unsigned revision
    # programs a drain's `controller` call may run on this machine (issue 42): the repo alone
    # never names a program the controller runs
    drain_programs: tuple[str, ...] = ()


def confirm_margin_from(environ: Mapping[str, str] = os.environ) -> float | None:
    """$RECONCILER_CONFIRM_MARGIN: seconds (default 60), or "off" for no dead-man's switch."""
    raw = environ.get("RECONCILER_CONFIRM_MARGIN", "").strip().lower()
    if raw == "off":
        return None
    try:
        return max(0.0, float(raw)) if raw else CONFIRM_MARGIN
    except ValueError:
        return CONFIRM_MARGIN


class RunIO(msgspec.Struct, frozen=True):
    """How this door's run reaches its hosts and whom it tells (none of it changes what is done)."""

    connect: Connector | None = None              # None: a new SSH connection per host (RunOptions.identity)
    on_phase: HostPhase | None = None             # each service's health phase (the progress view)
    on_progress: HostProgress | None = None       # each change of a loading engine's progress (the fleet page)
    on_rollout: RolloutWatch | None = None        # each rollout's start, waves and end (the fleet page)
    notifier: Notifier | None = None              # webhooks (None: fleet.toml [notify], never on a dry run)
    supersede: asyncio.Event | None = None        # set when a newer revision arrives (the daemon)
    expect_changes: frozenset[str] = frozenset()  # hosts locked at once, without a first look (the store's hint)
    on_planned: Callable[[HostResult], None] | None = None   # a host's plan, before it is applied (the report)
    clock: Clock = REAL                           # what the run's waits are measured on (the GPU gate, a fetch's ticks)
    seen: Seen | None = None                      # the hosts' last readings (the daemon: host/programs.Seen)
