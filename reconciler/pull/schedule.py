"""PURE: pull mode's wave schedule: which wave a host is in, and which revision it may deploy.

In pull mode every host reconciles itself (`reconcile pull`); no controller runs waves. The
schedule is fleet.toml `[pull] waves` (spec.PullWave), read at the branch head. The rules (a
host's wave, a commit's age, the earlier waves' reports, no report is not a failure):
docs/pull.md, "Rollout waves in pull mode". Of an earlier wave's host, its newest report on a
commit or an ancestor of it decides; an `inconclusive` report and a stale pending one say
nothing, so the report before them decides.

Reports travel in git, as notes: each host writes its own notes ref,
`refs/notes/reconciler-pull/<host>`, one note per revision it reconciled (Report.dumps), so no
two hosts ever write the same ref.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import StrEnum
from typing import Any

import msgspec

from ..desired.spec import PullWave
from ..plan.records import Result

NOTES_PREFIX = "refs/notes/reconciler-pull/"
HISTORY = 500            # first-parent commits read back from the head: candidates and reports
PENDING_MARGIN = 120     # seconds a pending report outlives the deploy's own health window


class Standing(StrEnum):
    """What a host's report says about one revision."""

    OK = "ok"                      # reconciled and healthy there
    BAD = "bad"                    # failed health, rolled back, or a quarantined version held
    PENDING = "pending"            # being deployed there now; the verdict is due by `until`
    INCONCLUSIVE = "inconclusive"  # neither (locked, blocked by pre-flight, ...): says nothing


class Report(msgspec.Struct, frozen=True):
    """One host's report on one revision: the note it writes on that commit."""

    host: str
    revision: str
    standing: Standing
    wave: str = ""
    reason: str = ""               # CamelCase, for bad and inconclusive
    at: int = 0                    # epoch seconds, the host's clock
    until: int = 0                 # pending: its verdict is due by then; after it, the report is stale
    services: Mapping[str, str] = msgspec.field(default_factory=dict)   # service -> its state there

    def to_json(self) -> dict[str, Any]:
        data: dict[str, Any] = {"host": self.host, "revision": self.revision, "standing": str(self.standing),
                                "wave": self.wave, "reason": self.reason, "at": self.at,
                                "services": dict(sorted(self.services.items()))}
        if self.standing is Standing.PENDING:
            data["until"] = self.until
        return data

    def dumps(self) -> str:
        return json.dumps(self.to_json(), sort_keys=True) + "\n"

    @classmethod
    def parse(cls, text: str, *, host: str, revision: str) -> Report | None:
        """Read a note leniently; None when it is not a report. The host and revision are the
        notes ref's and the annotated commit's, whatever the text says."""
        try:
            data = json.loads(text)
        except ValueError:
            return None
        if not isinstance(data, dict):
            return None
        try:
            standing = Standing(_text(data.get("standing")))
        except ValueError:
            return None
        services = data.get("services")
        return cls(host=host, revision=revision, standing=standing, wave=_text(data.get("wave")),
                   reason=_text(data.get("reason")), at=_number(data.get("at")), until=_number(data.get("until")),
                   services={k: v for k, v in services.items() if isinstance(k, str) and isinstance(v, str)}
                   if isinstance(services, dict) else {})

    def same_as(self, other: Report | None) -> bool:
        """Says the same verdict (the time and the services' states aside; a pending report's
        new deadline counts): no need to write it again."""
        if other is None:
            return False
        mine = {k: v for k, v in self.to_json().items() if k not in ("at", "services")}
        return mine == {k: v for k, v in other.to_json().items() if k not in ("at", "services")}


def _text(v: object) -> str:
    return v if isinstance(v, str) else ""


def _number(v: object) -> int:
    return int(v) if isinstance(v, int | float) and not isinstance(v, bool) else 0


class Commit(msgspec.Struct, frozen=True):
    """A commit of the branch's first-parent history."""

    revision: str
    time: int                      # committer time, epoch seconds


class Skip(msgspec.Struct, frozen=True):
    """A newer commit this host does not deploy yet, and why."""

    revision: str
    why: str


class Choice(msgspec.Struct, frozen=True):
    """The revision a pull run reconciles (None: none may deploy yet), why, and the newer ones
    it passed over."""

    revision: str | None
    why: str
    skipped: tuple[Skip, ...] = ()


def wave_of(labels: Mapping[str, str], waves: Sequence[PullWave]) -> int | None:
    """The index of a host's wave: the first whose labels it carries, else the last. None when
    there is no schedule."""
    if not waves:
        return None
    return next((i for i, w in enumerate(waves) if all(labels.get(k) == v for k, v in w.labels.items())),
                len(waves) - 1)


def earlier_hosts(labels: Mapping[str, Mapping[str, str]], waves: Sequence[PullWave], wave: int) -> dict[str, int]:
    """The hosts of the waves before `wave` (host -> its wave index): those whose reports count."""
    return {host: w for host, lab in labels.items() if (w := wave_of(lab, waves)) is not None and w < wave}


def publishes(wave: int | None, waves: Sequence[PullWave]) -> bool:
    """Whether a host of this wave reports its verdicts: only a later wave reads them."""
    return wave is not None and wave < len(waves) - 1


def standing_of(result: Result, *, failed_health: bool) -> Standing:
    """A run's outcome on a host, as its report says it."""
    if failed_health or result in (Result.ROLLED_BACK, Result.QUARANTINED):
        return Standing.BAD
    if result in (Result.IN_SYNC, Result.CONVERGED):
        return Standing.OK
    return Standing.INCONCLUSIVE


def blocker(chain: Sequence[Commit], index: int, reports: Mapping[str, Mapping[str, Report]],
            now: int) -> str | None:
    """Why an earlier wave stands against chain[index] (None: nobody does). reports: host ->
    revision -> its report, for the hosts of the earlier waves only."""
    for host in sorted(reports):
        by_rev = reports[host]
        for c in chain[index:]:
            r = by_rev.get(c.revision)
            if r is None or r.standing is Standing.INCONCLUSIVE:
                continue
            if r.standing is Standing.OK:
                break
            where = f"{host}{f' ({r.wave})' if r.wave else ''}"
            at = "" if c.revision == chain[index].revision else f" at {c.revision[:7]}, an ancestor"
            if r.standing is Standing.BAD:
                return f"{where} failed it{at}: {r.reason or 'Failed'}"
            if now < r.until:
                return f"{where} is deploying it{at}; its verdict is due within {span(r.until - now)}"
            # a pending report past its deadline: the host never came back with a verdict
    return None


def choose(chain: Sequence[Commit], applied: str | None, *, wave: int, waves: Sequence[PullWave], now: int,
           reports: Mapping[str, Mapping[str, Report]], unusable: Mapping[str, str] | None = None) -> Choice:
    """The revision a host of `wave` reconciles now: the newest commit of `chain` (newest first)
    that is old enough for its wave and that no earlier wave stands against, never older than
    `applied` (stay there when nothing newer passes). `unusable`: revisions the caller found it
    cannot deploy (invalid there, or this host not in it), with why."""
    w = waves[wave]
    stop = next((i for i, c in enumerate(chain) if c.revision == applied), len(chain))
    skipped: list[Skip] = []
    for i, c in enumerate(chain[:stop]):
        why = (unusable or {}).get(c.revision)
        age = now - c.time
        if why is None and age < w.after:
            why = f"{span(age)} old; wave {w.name} deploys a commit once it is {span(w.after)} old"
        if why is None:
            why = blocker(chain, i, reports, now)
        if why is not None:
            skipped.append(Skip(c.revision, why))
            continue
        said = f"{c.revision[:7]} is {span(age)} old (wave {w.name}: {span(w.after)})"
        if wave:
            said += "; no earlier wave stands against it"
        return Choice(c.revision, said, tuple(skipped))
    if applied is not None:
        newer = " (nothing newer may deploy yet)" if skipped else ""
        return Choice(applied, f"staying at the applied revision {applied[:7]}{newer}", tuple(skipped))
    return Choice(None, f"no revision may deploy yet in wave {w.name}", tuple(skipped))


def span(seconds: float) -> str:
    """A duration in words a reader takes in at once: 45s, 12m, 2h30m, 3d4h."""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m" + (f"{s % 60}s" if s % 60 and s < 600 else "")
    if s < 86400:
        return f"{s // 3600}h" + (f"{s % 3600 // 60}m" if s % 3600 // 60 else "")
    return f"{s // 86400}d" + (f"{s % 86400 // 3600}h" if s % 86400 // 3600 else "")
