"""PURE: the fleet page's hosts, from the state store's rows and the hub's snapshot, in the
words view.py gives a revision, an age and a phase (and redacted by the caller, as all of the
page's models are: view.redacted).

    grid     hosts x services: health, desired vs running revision (short SHA, subject, age),
             last event, the journal line of a quarantined, rolled-back or failed cell, and what
             the service's last measured restart cost (issue 42); filtered by label and
             searched by text
    history  one host's page: its attempts (when, what, result, duration, reason and journal
             line) and its row of the grid now
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import msgspec

from ...plan.drain import StepKind
from ...plan.forecast import unavailable_seconds
from ...plan.rollout import natural_key
from ...redact import redact
from .hub import HostInfo, PageState, PhaseInfo
from .view import Commits, Model, age, phase_model, revision

# Health values in the store (status.service_health) that mean "not serving".
_BAD_HEALTH = frozenset({"unhealthy", "unknown", "stopped", "blocked", "foreign"})
_WATCHED = ("deploy", "rollback", "reverify")       # attempts that ended in a health verdict


# -- what a restart cost -----------------------------------------------------------------------

_STEP_ORDER = {k.value: i for i, k in enumerate(StepKind)}


def with_costs(rows: Iterable[Mapping[str, Any]], costs: Iterable[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """PURE: the store's status rows, each with its service's last measured restart cost under
    "cost" (the store's costs row, or None): how the grid gets the cost of a cell."""
    by_pair = {(c["host"], c["service"]): c for c in costs}
    return [{**r, "cost": by_pair.get((r["host"], r["service"]))} for r in rows]


def cost_model(row: Mapping[str, Any] | None, commits: Commits, now: float) -> Model | None:
    """PURE: what a service's last measured restart cost, as a cell shows it: the seconds it was
    unavailable (the sum of its steps), each step in the order they run (for a title), the
    requests its drain left in flight at the timeout (None when there were none), the run's
    revision and how long ago. None when no restart of it was measured."""
    if row is None:
        return None
    steps: Mapping[str, float] = row["steps"]
    order = sorted(steps, key=lambda k: (_STEP_ORDER.get(k, len(_STEP_ORDER)), k))
    lost = row.get("lost")
    return {"text": f"unavailable {unavailable_seconds(steps):.1f}s",
            "steps": ", ".join(f"{k} {steps[k]:.1f}s" for k in order),
            "lost": f"{lost:g} requests in flight at the drain timeout" if lost else None,
            "revision": revision(row["revision"], commits, now), "when": _updated({"updated_at": row["at"]}, now)}


# -- the grid ---------------------------------------------------------------------------------


def _updated(row: Mapping[str, Any], now: float) -> str:
    """How long ago the store last wrote a row; "" when the row carries no time."""
    return age(now - row["updated_at"]) if row.get("updated_at") else ""


def _host_labels(info: HostInfo | None) -> list[str]:
    """A host's labels as the page shows and filters them: sorted "key=value" strings (none for a
    host the desired state no longer declares)."""
    return sorted(f"{k}={v}" for k, v in (info.labels if info else {}).items())


def _cell(row: Mapping[str, Any], commits: Commits, now: float, live: Model | None) -> Model:
    """One stored (host, service) row as a cell: its state (ok, warn, bad, idle) and the verdict in
    words, both revisions, the last event, and the journal line only where something went wrong."""
    health = row.get("health") or ""
    desired, running = row.get("desired_rev"), row.get("running_rev")
    event = row.get("last_event") or ""
    kind = event.split(":", 1)[0]
    if health in _BAD_HEALTH:
        state, verdict = "bad", health
    elif running and desired and running != desired:
        # the desired version is not what runs: rolled back to, or held at, the last good
        state = "warn"
        verdict = {"rolled-back": "rolled back", "quarantined": "quarantined"}.get(kind, "not at desired")
    elif health == "healthy":
        state, verdict = "ok", "in sync" if running == desired else "healthy"
    else:
        state, verdict = "idle", health or "no health check yet"
    quote = row.get("quote") if state in ("bad", "warn") or kind in ("failed", "rolled-back", "quarantined") else None
    return {"service": row["service"], "health": health or "-", "state": state, "verdict": verdict,
            "desired": revision(desired, commits, now), "running": revision(running, commits, now),
            "same": bool(desired) and desired == running, "event": event, "quote": quote,
            "updated": _updated(row, now), "live": live, "cost": cost_model(row.get("cost"), commits, now)}


class _GridScope(msgspec.Struct, frozen=True):
    """What every host row of one grid shares: the columns, the run's live phases and revision,
    the commit look-up, the clocks and the filters."""

    services: list[str]
    phases: Mapping[tuple[str, str], PhaseInfo]
    this_run: str | None             # the revision of the current (or last) run
    commits: Commits
    mono: float
    wall: float
    label: str
    q: str


def _grid_scope(services: list[str], snap: PageState, commits: Commits, label: str, q: str) -> _GridScope:
    """The grid's shared inputs, taken from the snapshot once for all its rows."""
    # The run's phases while it runs; after it, the store says the same in its own words.
    phases = snap.run.phases if snap.run and snap.run.finished is None else {}
    return _GridScope(services, phases, snap.run.revision if snap.run else None, commits, snap.mono, snap.wall,
                      label, q)


def _rows_by_host(rows: Iterable[Mapping[str, Any]]) -> dict[str, dict[str, Mapping[str, Any]]]:
    """The store's rows as host -> service -> row; service "*" is the host-wide row (a failure
    before any service was reached, such as an unreachable host)."""
    by_host: dict[str, dict[str, Mapping[str, Any]]] = {}
    for r in rows:
        by_host.setdefault(r["host"], {})[r["service"]] = r
    return by_host


def _grid_services(by_host: Mapping[str, Mapping[str, Any]], fleet: Mapping[str, HostInfo]) -> list[str]:
    """The grid's columns: every service the store has a row for (not the host-wide "*") or the
    desired state declares on some host, sorted."""
    return sorted({s for cells in by_host.values() for s in cells if s != "*"}
                  | {s for h in fleet.values() for s in h.services})


def _unreached_cell(svc: str, scope: _GridScope, live: Model | None) -> Model:
    """A service the desired state puts on a host but no run has reconciled there yet: it has no
    row in the store, and what it should run is this run's revision."""
    return {"service": svc, "health": "-", "state": "idle", "verdict": "not reconciled yet",
            "desired": revision(scope.this_run, scope.commits, scope.wall), "running": None, "same": False,
            "event": "", "quote": None, "updated": "", "live": live, "cost": None}


def _grid_cell(host: str, svc: str, info: HostInfo | None, stored: Mapping[str, Mapping[str, Any]],
               scope: _GridScope) -> Model | None:
    """One cell of a host's row: from the store when it has a row, "not reconciled yet" when only
    the desired state declares it, None when the service is not on this host at all. Either
    way it carries the run's live phase for the pair, if any."""
    p = scope.phases.get((host, svc))
    live = phase_model(p, scope.mono) if p is not None else None
    if svc in stored:
        return _cell(stored[svc], scope.commits, scope.wall, live)
    if info is not None and svc in info.services:
        return _unreached_cell(svc, scope, live)
    return None


def _host_problem(stored: Mapping[str, Mapping[str, Any]], now: float) -> Model | None:
    """The host-wide row ("*"), shown under the host's name: what failed before any service was
    reached. None when the store has no such row."""
    if "*" not in stored:
        return None
    row = stored["*"]
    return {"event": row.get("last_event") or "", "quote": row.get("quote"), "updated": _updated(row, now)}


def _cell_words(c: Model) -> list[str]:
    """What the search matches in one cell: its service, health, verdict, event, journal line,
    the short SHA and subject of its desired and running revisions, and its restart's cost."""
    cost = c["cost"] or {}
    return [c["service"], c["health"], c["verdict"], c["event"], c["quote"] or "",
            *(f"{r['short']} {r['subject']}" for r in (c["desired"], c["running"]) if r),
            cost.get("text") or "", cost.get("lost") or ""]


def _search_text(name: str, address: str, labels: list[str], cells: list[Model | None],
                 problem: Model | None) -> str:
    """The text a host row is searched by (here for ?q=, and by the page's script as you type):
    every word the row shows, masked, then lowercased."""
    words: list[str] = [name, address, *labels]
    for c in cells:
        if c is not None:
            words += _cell_words(c)
    if problem:
        words += [problem["event"], problem["quote"] or ""]
    # masked before lowercasing: a secret's value would no longer match once lowered
    return redact(" ".join(w for w in words if w)).lower()


def _hidden(labels: list[str], search: str, label: str, q: str) -> bool:
    """Whether the filters leave a host row out: it lacks the chosen label, or its text lacks the
    search (case-insensitive)."""
    return bool((label and label not in labels) or (q and q.lower() not in search))


def _host_row(name: str, info: HostInfo | None, stored: Mapping[str, Mapping[str, Any]],
              scope: _GridScope) -> Model:
    """One host's row: its address and labels, a cell per column, its host-wide problem, the text
    the search matches and whether the filters hide it."""
    labels = _host_labels(info)
    address = info.address if info else ""
    cells = [_grid_cell(name, svc, info, stored, scope) for svc in scope.services]
    problem = _host_problem(stored, scope.wall)
    search = _search_text(name, address, labels, cells, problem)
    return {"name": name, "address": address, "labels": labels, "cells": cells, "problem": problem,
            "search": search, "hidden": _hidden(labels, search, scope.label, scope.q)}


def grid(rows: Iterable[Mapping[str, Any]], snap: PageState, commits: Commits, *, label: str = "",
         q: str = "") -> Model:
    """Hosts x services from the store, the hosts the desired state declares but no run has
    reached yet, and the run's live phase in each cell. Rows that the filters leave out are
    marked hidden (the page's script filters again as you type)."""
    by_host = _rows_by_host(rows)
    scope = _grid_scope(_grid_services(by_host, snap.fleet), snap, commits, label, q)
    names = sorted(set(by_host) | set(snap.fleet), key=natural_key)
    hosts = [_host_row(name, snap.fleet.get(name), by_host.get(name, {}), scope) for name in names]
    return {"services": scope.services, "hosts": hosts, "shown": sum(not h["hidden"] for h in hosts),
            "labels": sorted({lab for h in hosts for lab in h["labels"]})}


# -- one host ---------------------------------------------------------------------------------


def history(host: str, rows: Iterable[Mapping[str, Any]], status_rows: Iterable[Mapping[str, Any]],
            snap: PageState, lookup: Commits) -> Model:
    """One host's page: its labels, its services now, and every attempt (newest first)."""
    info = snap.fleet.get(host)
    attempts = [{"when": age(snap.wall - r["at"]), "at": r["at"], "service": r["service"], "action": r["action"],
                 "revision": revision(r["revision"], lookup, snap.wall), "result": r["result"],
                 "ok": r["result"] == "Healthy", "seconds": round(r["seconds"] or 0.0, 1),
                 "message": r["message"] or "", "quote": r["quote"]} for r in rows]
    failed = sum(1 for a in attempts if not a["ok"] and a["action"] in _WATCHED)
    took = sorted(a["seconds"] for a in attempts if a["seconds"])
    current = grid([r for r in status_rows if r["host"] == host], PageState(
        {host: info} if info else {}, snap.run, None, snap.repo_path, snap.versions, snap.mono, snap.wall), lookup)
    return {"host": host, "address": info.address if info else "", "labels": _host_labels(info),
            "attempts": attempts, "failed": failed, "median": took[len(took) // 2] if took else None,
            "current": current}
