"""PURE: what the fleet page shows, from the state store's rows and the hub's snapshot.

No I/O, no clock, no web library: the caller passes the rows (status.Store), the snapshot
(hub.Hub), a commit look-up and the time. Every model these functions return is plain data
(dicts, lists, strings, numbers) and has every string value redacted before any template sees
it (`redacted`): the one way text from a run, a commit or the store reaches the page. The
templates escape it (Jinja2 autoescape).

    grid     hosts x services: health, desired vs running revision (short SHA, subject, age),
             last event, and the journal line of a quarantined, rolled-back or failed cell
    live     the current run: each rollout group's waves, which host is in which wave and its
             phase (deploying, watching health with elapsed/timeout, healthy, rolled back ...)
    commits  per revision: where it is live, and where it is desired but not running
    history  one host's attempts: when, what, result, duration, reason and journal line
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from ...plan.rollout import natural_key
from ...redact import redact
from .hub import DEPLOYING, HostInfo, PhaseInfo, RunInfo, Snapshot


@dataclass(frozen=True)
class CommitInfo:
    """What the page says about a revision besides its SHA."""

    subject: str
    time: float                      # commit time, epoch seconds


Commits = Callable[[str], "CommitInfo | None"]
Model = dict[str, Any]

# Health values in the store (status.service_health) that mean "not serving".
_BAD_HEALTH = frozenset({"unhealthy", "unknown", "stopped", "blocked", "foreign"})
_WATCHED = ("deploy", "rollback", "reverify")       # attempts that ended in a health verdict
_EXIT_MEANING = {0: "converged or in sync", 1: "failed before changing any host (see the daemon's log)",
                 2: "changes found", 3: "rolled back, or running the last good version",
                 4: "at least one host failed"}


def redacted(model: Model) -> Model:
    """The model with every string value masked: what templates receive. Keys are left alone:
    they are the model's own field names ("seconds", "quote") and names from git (hosts,
    services, labels), and masking them would blank a field whenever a registered secret value
    happens to be a word in one (a token "second" once hid every attempt's duration). A page
    repeats the same strings many times (subjects, health words), so each distinct one is
    redacted once per model."""
    memo: dict[str, str] = {}

    def walk(x: Any) -> Any:
        if isinstance(x, str):
            if x not in memo:
                memo[x] = redact(x)
            return memo[x]
        if isinstance(x, dict):
            return {k: walk(v) for k, v in x.items()}
        if isinstance(x, list | tuple):
            return [walk(v) for v in x]
        return x

    out: Model = walk(model)
    return out


def age(seconds: float | None) -> str:
    """A short human age: 42s, 5 min, 3 h, 2 d."""
    if seconds is None:
        return ""
    s = max(0, int(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60} min"
    if s < 86400:
        return f"{s // 3600} h"
    return f"{s // 86400} d"


def revision(rev: str | None, commits: Commits, now: float) -> Model | None:
    """A revision as the page shows it: short SHA, commit subject and age (when git knows it)."""
    if not rev:
        return None
    info = commits(rev)
    return {"full": rev, "short": rev[:7], "subject": info.subject if info else "",
            "age": age(now - info.time) if info else ""}


def phase_model(p: PhaseInfo, mono: float) -> Model:
    """One service's phase in a run: its words, its tone, and the health clock while it runs."""
    if p.final:
        tone = ("ok" if p.final == "healthy" else
                "warn" if p.final in ("rolled back", "quarantined", "superseded") else "bad")
        return {"text": p.final, "tone": tone, "clock": None, "quote": p.quote}
    raw = p.phase
    if raw.startswith("failed"):
        return {"text": raw, "tone": "bad", "clock": None, "quote": p.quote}
    if raw == "healthy":
        return {"text": f"healthy again after {p.failure}" if p.failure else "healthy",
                "tone": "warn" if p.failure else "ok", "clock": None, "quote": None}
    if raw == DEPLOYING:
        return {"text": "deploying", "tone": "busy", "clock": None, "quote": None}
    if raw == "superseded":
        return {"text": "superseded by a newer revision", "tone": "warn", "clock": None, "quote": None}
    what = raw if raw.startswith("fetching") else f"watching health: {raw}"
    if p.failure:
        what = f"rolling back after {p.failure}; {what}"
    return {"text": what, "tone": "busy", "quote": None, "progress": load_model(p.progress),
            "clock": {"elapsed": round(p.elapsed + max(0.0, mono - p.at), 1), "timeout": round(p.timeout)}}


def load_model(progress: Mapping[str, Any] | None) -> Model | None:
    """A loading engine's progress as the page shows it: a bar where the engine counts (checkpoint
    shards, CUDA graph batch sizes), its stage in words, and the journal line it was read from."""
    if not progress:
        return None
    return {"stage": progress["stage"], "text": progress["text"], "line": progress["line"] or None,
            "done": progress["done"], "total": progress["total"],
            "bar": progress["done"] is not None and bool(progress["total"]) and not progress["finished"]}


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
            "updated": _updated(row, now), "live": live}


@dataclass(frozen=True)
class _GridScope:
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


def _grid_scope(services: list[str], snap: Snapshot, commits: Commits, label: str, q: str) -> _GridScope:
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
            "event": "", "quote": None, "updated": "", "live": live}


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
    """What the search matches in one cell: its service, health, verdict, event, journal line and
    the short SHA and subject of its desired and running revisions."""
    return [c["service"], c["health"], c["verdict"], c["event"], c["quote"] or "",
            *(f"{r['short']} {r['subject']}" for r in (c["desired"], c["running"]) if r)]


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


def grid(rows: Iterable[Mapping[str, Any]], snap: Snapshot, commits: Commits, *, label: str = "",
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


# -- the live rollout -------------------------------------------------------------------------


def _policy(ro: Mapping[str, Any]) -> str:
    return (f"canary = {ro['canary']}, max_unavailable = {json.dumps(ro['max_unavailable'])} "
            f"(at most {ro['bound']} at once)")


def _wave_state(ro: Mapping[str, Any], number: int) -> str:
    halted = ro.get("halted")
    if halted is not None:
        if number == halted["wave"]:
            return "halted"
        if number > halted["wave"]:
            return "not started"
    if number <= ro["waves_done"]:
        return "done"
    if ro.get("current_wave") == number:
        return "running"
    if ro["status"] == "superseded":
        return "not started"
    return "waiting"


_HOST_IN_WAVE = {"running": ("deploying", "busy"), "waiting": ("waiting", "idle"),
                 "done": ("done", "ok"), "not started": ("not started", "idle"), "halted": ("halted", "bad")}


def rollout(ro: Mapping[str, Any], run: RunInfo, mono: float) -> Model:
    """One rollout group: its policy, its waves with each host's phase, and where it halted."""
    svc = ro["service"]
    untouched = set(ro.get("untouched") or ())
    waves = []
    for w in ro["waves"]:
        state = _wave_state(ro, w["number"])
        hosts = []
        for h in w["hosts"]:
            p = run.phases.get((h, svc))
            if h in untouched:
                ph: Model = {"text": "not restarted (rollout halted)", "tone": "warn", "clock": None, "quote": None}
            elif p is not None:
                ph = phase_model(p, mono)
            else:
                text, tone = _HOST_IN_WAVE[state]
                ph = {"text": text, "tone": tone, "clock": None, "quote": None}
            hosts.append({"name": h, "phase": ph})
        waves.append({"number": w["number"], "canary": w["canary"], "state": state, "hosts": hosts})
    return {"service": svc, "definition": ro["definition"], "policy": _policy(ro), "status": ro["status"],
            "pending": len(ro["pending"]), "members": len(ro["members"]), "waves": waves,
            "halted": ro.get("halted"), "untouched": sorted(untouched, key=natural_key),
            "skipped": list(ro.get("skipped") or ()), "seconds": ro.get("seconds") or 0}


def _run(run: RunInfo, commits: Commits, snap: Snapshot) -> Model:
    rev = revision(run.revision, commits, snap.wall)
    waved = {(h, ro["service"]) for ro in run.rollouts.values() for w in ro["waves"] for h in w["hosts"]}
    others = [{"host": h, "service": s, "phase": phase_model(p, snap.mono)}
              for (h, s), p in sorted(run.phases.items(), key=lambda kv: (natural_key(kv[0][0]), kv[0][1]))
              if (h, s) not in waved]
    counts: dict[str, int] = {}
    for r in run.hosts.values():
        counts[r["status"] or "?"] = counts.get(r["status"] or "?", 0) + 1
    problems = [{"host": h, **r} for h, r in sorted(run.hosts.items(), key=lambda kv: natural_key(kv[0]))
                if r.get("reason")]
    running = run.finished is None
    return {"revision": rev, "why": run.why, "running": running, "started": age(snap.wall - run.started),
            "clock": {"elapsed": round(snap.mono - run.started_mono, 1), "timeout": None} if running else None,
            "seconds": round(run.seconds, 1), "code": run.code,
            "meaning": _EXIT_MEANING.get(run.code, "") if run.code is not None else "",
            "rollouts": [rollout(ro, run, snap.mono) for _, ro in sorted(run.rollouts.items())],
            "others": others, "counts": sorted(counts.items()), "problems": problems,
            "finished": age(snap.wall - run.finished) if run.finished else ""}


def live(snap: Snapshot, commits: Commits) -> Model:
    """The current (or last) run, and the last rollout when this run has none."""
    run = _run(snap.run, commits, snap) if snap.run else None
    last = None
    if snap.last_rollout_run is not None and (snap.run is None or not snap.run.rollouts):
        last = _run(snap.last_rollout_run, commits, snap)
    return {"run": run, "last": last}


# -- commits and history -----------------------------------------------------------------------


def commits(rows: Iterable[Mapping[str, Any]], lookup: Commits, now: float) -> Model:
    """Per revision in the store: where it is live, and where it is desired but not running."""
    revs: dict[str, Model] = {}

    def entry(rev: str) -> Model:
        if rev not in revs:
            info = lookup(rev)
            revs[rev] = {"revision": revision(rev, lookup, now), "time": info.time if info else 0.0,
                         "live": [], "not_live": []}
        return revs[rev]

    for r in rows:
        if r["service"] == "*":
            continue
        if r.get("running_rev"):
            entry(r["running_rev"])["live"].append((r["service"], r["host"]))
        if r.get("desired_rev") and r.get("desired_rev") != r.get("running_rev"):
            why = (r.get("last_event") or "").split(":", 1)[0] or "not running"
            entry(r["desired_rev"])["not_live"].append((why, r.get("quote") or "", r["service"], r["host"]))
    out = sorted(revs.values(), key=lambda c: (-c["time"], c["revision"]["full"]))
    for c in out:
        by_service: dict[str, list[str]] = {}
        for svc, host in c["live"]:
            by_service.setdefault(svc, []).append(host)
        c["live"] = [{"service": svc, "hosts": sorted(hs, key=natural_key)} for svc, hs in sorted(by_service.items())]
        # one line per reason and journal line: a halted rollout says it once for the whole group
        reasons: dict[tuple[str, str], list[str]] = {}
        for reason, quote, svc, host in c["not_live"]:
            reasons.setdefault((reason, quote), []).append(f"{host}/{svc}")
        c["not_live"] = [{"why": reason, "quote": quote or None, "where": sorted(where, key=natural_key)}
                         for (reason, quote), where in sorted(reasons.items())]
    return {"commits": out}


def history(host: str, rows: Iterable[Mapping[str, Any]], status_rows: Iterable[Mapping[str, Any]],
            snap: Snapshot, lookup: Commits) -> Model:
    """One host's page: its labels, its services now, and every attempt (newest first)."""
    info = snap.fleet.get(host)
    attempts = []
    for r in rows:
        attempts.append({"when": age(snap.wall - r["at"]), "at": r["at"], "service": r["service"],
                         "action": r["action"], "revision": revision(r["revision"], lookup, snap.wall),
                         "result": r["result"], "ok": r["result"] == "Healthy",
                         "seconds": round(r["seconds"] or 0.0, 1),
                         "message": r["message"] or "", "quote": r["quote"]})
    failed = sum(1 for a in attempts if not a["ok"] and a["action"] in _WATCHED)
    took = sorted(a["seconds"] for a in attempts if a["seconds"])
    current = grid([r for r in status_rows if r["host"] == host], Snapshot(
        {host: info} if info else {}, snap.run, None, snap.repo_path, snap.versions, snap.mono, snap.wall), lookup)
    return {"host": host, "address": info.address if info else "", "labels": _host_labels(info),
            "attempts": attempts, "failed": failed, "median": took[len(took) // 2] if took else None,
            "current": current}
