"""PURE: what the fleet page shows, from the state store's rows and the hub's snapshot.

No I/O, no clock, no web library: the caller passes the rows (status.Store), the snapshot
(hub.Hub), a commit look-up and the time. Every model these functions return is plain data
(dicts, lists, strings, numbers) and has every string value redacted before any template sees
it (`redacted`): the one way text from a run, a commit or the store reaches the page. The
templates escape it (Jinja2 autoescape).

Here: the words every section shares (a revision, an age, a service's phase in a run) and

    live     the current run: each rollout group's waves, which host is in which wave and its
             phase (deploying, watching health with elapsed/timeout, healthy, rolled back ...)
    commits  per revision: where it is live, and where it is desired but not running

and in hosts.py, from the same words: the grid (hosts x services) and one host's history.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from typing import Any

import msgspec

from ...plan.rollout import natural_key
from ...redact import redact
from .hub import DEPLOYING, PageState, PhaseInfo, RunInfo


class CommitInfo(msgspec.Struct, frozen=True):
    """What the page says about a revision besides its SHA."""

    subject: str
    time: float                      # commit time, epoch seconds


Commits = Callable[[str], "CommitInfo | None"]
Model = dict[str, Any]

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


# -- the live rollout -------------------------------------------------------------------------


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
    policy = (f"canary = {ro['canary']}, max_unavailable = {json.dumps(ro['max_unavailable'])} "
              f"(at most {ro['bound']} at once)")
    return {"service": svc, "definition": ro["definition"], "policy": policy, "status": ro["status"],
            "pending": len(ro["pending"]), "members": len(ro["members"]), "waves": waves,
            "halted": ro.get("halted"), "blocked": ro.get("blocked"), "untouched": sorted(untouched, key=natural_key),
            "skipped": list(ro.get("skipped") or ()), "seconds": ro.get("seconds") or 0}


def _run(run: RunInfo, commits: Commits, snap: PageState) -> Model:
    rev = revision(run.revision, commits, snap.wall)
    waved = {(h, ro["service"]) for ro in run.rollouts.values() for w in ro["waves"] for h in w["hosts"]}
    others = [{"host": h, "service": s, "phase": phase_model(p, snap.mono)}
              for (h, s), p in sorted(run.phases.items(), key=lambda kv: (natural_key(kv[0][0]), kv[0][1]))
              if (h, s) not in waved]
    counts = Counter(r["status"] or "?" for r in run.hosts.values())
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


def live(snap: PageState, commits: Commits) -> Model:
    """The current (or last) run, and the last rollout when this run has none."""
    run = _run(snap.run, commits, snap) if snap.run else None
    last = None
    if snap.last_rollout_run is not None and (snap.run is None or not snap.run.rollouts):
        last = _run(snap.last_rollout_run, commits, snap)
    return {"run": run, "last": last}


# -- commits ----------------------------------------------------------------------------------


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
