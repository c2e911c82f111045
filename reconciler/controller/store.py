"""The local state store (SQLite, embedded): every attempt per host and service, the latest
status of each, for `reconcile status` and `reconcile history`, and what each one's last measured
restart cost (issue 42), for the fleet page.

The host's own record (/var/lib/reconciler) stays the source of truth for last-good and
quarantine, so another controller or a fresh checkout knows them; this store is the
controller's memory of what it did and saw.

Every text it stores (messages, journal quotes and tails, events) is redacted on the way in:
no secret value the controller knows, and no token-like pattern, is ever written to it.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import sqlite3
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from .. import dirs
from ..loop.live import record_health
from ..plan.records import Result
from ..redact import redact, redact_data

if TYPE_CHECKING:
    from ..loop.results import FleetResult, HostResult

SCHEMA = """
CREATE TABLE IF NOT EXISTS attempts (
  id INTEGER PRIMARY KEY,
  at REAL NOT NULL,
  host TEXT NOT NULL,
  service TEXT NOT NULL,
  revision TEXT NOT NULL,
  content_hash TEXT,
  action TEXT NOT NULL,          -- deploy | rollback
  result TEXT NOT NULL,          -- Healthy | CrashLoop | StartTimeout | ... | RolledBack
  message TEXT,
  quote TEXT,                    -- the journal line that explains a failure
  journal TEXT,                  -- JSON list: the tail of the journal
  seconds REAL
);
CREATE INDEX IF NOT EXISTS attempts_host ON attempts(host, at);
CREATE TABLE IF NOT EXISTS services (
  host TEXT NOT NULL,
  service TEXT NOT NULL,
  desired_rev TEXT,
  running_rev TEXT,
  health TEXT,
  last_event TEXT,
  quote TEXT,
  updated_at REAL,
  PRIMARY KEY (host, service)
);
CREATE TABLE IF NOT EXISTS costs (
  host TEXT NOT NULL,
  service TEXT NOT NULL,
  revision TEXT NOT NULL,        -- the revision of the run that measured it
  at REAL NOT NULL,
  steps TEXT NOT NULL,           -- JSON object: step (leave, drain, stop, ...) -> seconds
  lost REAL,                     -- requests still in flight when the drain gave up (NULL: none)
  PRIMARY KEY (host, service)
);
CREATE TABLE IF NOT EXISTS controller (
  key TEXT PRIMARY KEY,
  value TEXT
);
"""


DB = "state.db"
# SQLite's own files beside the database: each one ours alone, or the store is not opened.
SIDE_FILES = (DB, f"{DB}-wal", f"{DB}-shm", f"{DB}-journal")
TABLES = frozenset({"attempts", "services", "costs", "controller"})


def _prepare(d: Path) -> None:
    """Make sure SQLite opens only files of ours in `d` (already checked ours alone): each of its
    files that exists is a regular file of ours with one link (a planted link would have SQLite
    create or write its target), and a new database is created 0600 here (O_EXCL|O_NOFOLLOW),
    whatever the umask (the daemon's runs/ logs beside it are shared; the store is not).
    UnsafePath names the file and the fix."""
    try:
        fd = dirs.open_own_dir(d)
    except OSError as e:
        raise dirs.UnsafePath(f"state directory {d}: {e}") from None
    try:
        for name in SIDE_FILES:
            why = dirs.entry_problem(fd, name)
            if why is not None:
                raise dirs.UnsafePath(f"state store {d / name} {why}: the store is not opened through it; "
                                      f"remove it (the store starts empty) or move the real one there")
        with contextlib.suppress(FileExistsError):
            os.close(os.open(DB, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                             dir_fd=fd))
    finally:
        os.close(fd)


def _check_tables(db: sqlite3.Connection, path: Path) -> None:
    """Refuse a database that holds tables other than the store's (another program's state.db in a
    directory the environment chose): the store would add its tables to it and write there."""
    try:
        names = {r[0] for r in db.execute("SELECT name FROM sqlite_master WHERE type = 'table'")}
    except sqlite3.DatabaseError as e:
        db.close()
        raise dirs.UnsafePath(f"state store {path} is not a SQLite database the reconciler wrote ({e}): move it "
                              f"away, or set RECONCILER_STATE_DIR to the reconciler's own directory") from None
    other = sorted(n for n in names - TABLES if not n.startswith("sqlite_"))
    if other:
        db.close()
        raise dirs.UnsafePath(f"state store {path} holds tables that are not the reconciler's ({', '.join(other[:3])}"
                              f"): set RECONCILER_STATE_DIR to the reconciler's own directory")


class Store:
    """A small SQLite database of attempts and per-service status, in a state directory of this
    user's alone (dirs.own_dir: UnsafePath, naming it and the fix, otherwise)."""

    def __init__(self, state_dir: Path | None = None):
        d = dirs.own_dir(state_dir or dirs.default_state_dir())       # ours alone, or UnsafePath
        self.path = d / DB
        _prepare(d)
        self.db = sqlite3.connect(self.path, timeout=10)
        _check_tables(self.db, self.path)
        self.db.row_factory = sqlite3.Row
        # A write-ahead log, synced at checkpoints: a run's commit is an append, not a rollback
        # journal's fsyncs (a commit took 2 ms idle, about 25 ms on a busy 2-core machine, at the
        # end of every run). A power cut may lose the last attempts; the hosts' records, the source of
        # truth, are written on the hosts. SQLite gives the -wal and -shm files the db's mode.
        self.db.execute("PRAGMA journal_mode=WAL")
        self.db.execute("PRAGMA synchronous=NORMAL")
        self.db.executescript(SCHEMA)
        self._batched = False
        self._redact = redact

    def _write(self, sql: str, params: tuple[object, ...]) -> None:
        """One statement in a transaction of its own, or in batch()'s."""
        with contextlib.nullcontext() if self._batched else self.db:
            self.db.execute(sql, params)

    @contextlib.contextmanager
    def batch(self) -> Iterator[None]:
        """Many writes in one transaction (a run's results: one commit, not one per service),
        each text redacted once (most hosts' last events read the same: "in-sync")."""
        self._batched, self._redact = True, functools.cache(redact)
        try:
            with self.db:
                yield
        finally:
            self._batched, self._redact = False, redact

    def add_attempt(self, host: str, service: str, revision: str, content_hash: str | None, action: str,
                    result: str, message: str = "", quote: str | None = None,
                    journal: list[str] | None = None, seconds: float = 0.0) -> None:
        self._write(
            "INSERT INTO attempts(at, host, service, revision, content_hash, action, result, message, quote,"
            " journal, seconds) VALUES (?,?,?,?,?,?,?,?,?,?,?)",
            (time.time(), host, service, revision, content_hash, action, result, redact(message),
             _opt(quote), json.dumps(redact_data(journal or [])), seconds))

    def set_status(self, host: str, service: str, *, desired_rev: str | None, running_rev: str | None,
                   health: str | None, last_event: str, quote: str | None = None) -> None:
        """Upsert one service's status; health None keeps the health recorded before."""
        self._write(
            "INSERT INTO services(host, service, desired_rev, running_rev, health, last_event, quote, updated_at)"
            " VALUES (?,?,?,?,?,?,?,?) ON CONFLICT(host, service) DO UPDATE SET desired_rev=excluded.desired_rev,"
            " running_rev=excluded.running_rev, health=COALESCE(excluded.health, services.health),"
            " last_event=excluded.last_event, quote=excluded.quote, updated_at=excluded.updated_at",
            (host, service, desired_rev, running_rev, health, self._redact(last_event), _opt(quote), time.time()))

    def status(self) -> list[dict]:
        rows = self.db.execute("SELECT * FROM services ORDER BY host, service").fetchall()
        return [dict(r) for r in rows]

    def history(self, host: str, limit: int = 50) -> list[dict]:
        rows = self.db.execute("SELECT * FROM attempts WHERE host = ? ORDER BY at DESC, id DESC LIMIT ?",
                               (host, limit)).fetchall()
        return [{**dict(r), "journal": json.loads(r["journal"] or "[]")} for r in rows]

    def set_cost(self, host: str, service: str, revision: str, steps: dict[str, float],
                 lost: float | None) -> None:
        """What a service's last measured restart cost (issue 42): its step times and the requests
        its drain left in flight. It replaces the one before; a run that restarts nothing keeps it."""
        self._write(
            "INSERT INTO costs(host, service, revision, at, steps, lost) VALUES (?,?,?,?,?,?)"
            " ON CONFLICT(host, service) DO UPDATE SET revision=excluded.revision, at=excluded.at,"
            " steps=excluded.steps, lost=excluded.lost",
            (host, service, revision, time.time(), json.dumps(steps, sort_keys=True), lost or None))

    def costs(self) -> list[dict]:
        """Every service's last measured restart cost (steps decoded), by host and service."""
        rows = self.db.execute("SELECT * FROM costs ORDER BY host, service").fetchall()
        return [{**dict(r), "steps": json.loads(r["steps"])} for r in rows]

    def get_value(self, key: str) -> str | None:
        """A controller-level value (e.g. last_applied_revision)."""
        # Keys may hold the repo's URL (with a password): stored redacted, looked up the same way.
        row = self.db.execute("SELECT value FROM controller WHERE key = ?", (redact(key),)).fetchone()
        return row["value"] if row else None

    def set_value(self, key: str, value: str) -> None:
        self._write("INSERT INTO controller(key, value) VALUES (?, ?) "
                    "ON CONFLICT(key) DO UPDATE SET value = excluded.value", (redact(key), value))

    def in_sync(self) -> dict[str, str]:
        """host -> the revision it was last left in sync with."""
        raw = self.get_value(IN_SYNC)
        try:
            seen = json.loads(raw) if raw else {}
        except ValueError:
            return {}
        return seen if isinstance(seen, dict) else {}

    def close(self) -> None:
        self.db.close()


IN_SYNC = "in_sync_revisions"


def expect_changes(seen: dict[str, str], revision: str, hosts: Iterable[str]) -> frozenset[str]:
    """PURE: the hosts last left in sync with another revision. Each records the revision it
    runs, so a new one changes every host (the same revision is the same desired state): a run
    locks them at once instead of looking first; a host never seen, or not left in sync, is
    looked at first."""
    return frozenset(h for h in hosts if h in seen and seen[h] != revision)


def remember_in_sync(store: Store, result: FleetResult) -> None:
    """Note the hosts this run left in sync with its revision (a host it did not leave in sync,
    or could not reach, is forgotten: its next run looks first)."""
    seen = store.in_sync()
    for r in result.hosts:
        if r.status in (Result.IN_SYNC, Result.CONVERGED):
            seen[r.host] = result.revision
        else:
            seen.pop(r.host, None)
    store.set_value(IN_SYNC, json.dumps(seen, sort_keys=True))


def _opt(text: str | None) -> str | None:
    return redact(text) if text is not None else None


# A service's health in the store, by what last happened to it in a run.
_HEALTH_OF_EVENT = {"held": "stopped", "blocked": "blocked", "foreign": "foreign"}


def service_health(r: HostResult, service: str) -> str | None:
    """What a run says about one service's health: its verdict in this run, else what the host's
    own record and systemd said when the run read the host (the same words as `status --live`:
    a service deployed healthy by another controller, or before this store existed, is healthy
    here too); None: not known, keep what the store knew."""
    if r.status == Result.FAILED and not r.plan:
        return "unknown"
    evs = [e for e in r.events if e.service == service]
    last = evs[-1] if evs else None
    if last is None:
        f = r.facts.services.get(service) if r.facts is not None else None
        return record_health(f.record, f) if f is not None and f.record is not None else None
    if last.outcome is not None:
        return "healthy" if last.outcome.healthy else "unhealthy"
    return _HEALTH_OF_EVENT.get(str(last.action))


def service_quote(r: HostResult, service: str) -> str | None:
    """The journal line that explains a service's latest failure in a run (or its quarantine)."""
    evs = [e for e in r.events if e.service == service]
    failed = [e.outcome for e in evs if e.outcome is not None and not e.outcome.healthy]
    if failed:
        return failed[-1].quote
    return evs[-1].quote if evs else None


def remember(store: Store, result: FleetResult) -> None:
    """Write every attempt and the latest per-service status to the state store (one commit)."""
    with store.batch():
        for r in result.hosts:
            for e in r.events:
                o = e.outcome
                store.add_attempt(r.host, e.service, e.revision, e.content_hash, str(e.action),
                                  o.reason if o else str(e.action).capitalize(), (o.message if o else e.note) or "",
                                  o.quote if o else e.quote, o.journal if o else None, o.seconds if o else 0.0)
            for svc, steps in sorted(r.costs.items()):
                store.set_cost(r.host, svc, result.revision, steps, r.lost.get(svc))
            event = f"{r.status}: {r.message}" if r.message else str(r.status)
            for svc in sorted(r.plan.states if r.plan else ()):
                store.set_status(r.host, svc, desired_rev=result.revision, running_rev=r.running.get(svc),
                                 health=service_health(r, svc), last_event=event, quote=service_quote(r, svc))
            if r.status == Result.FAILED and not r.plan:
                store.set_status(r.host, "*", desired_rev=result.revision, running_rev=None, health="unknown",
                                 last_event=f"failed: {r.reason}: {r.message}")
