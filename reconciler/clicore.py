"""The typer-free part of the `reconcile` command: its output helpers and the plain run.

`reconcile [options]` (what a user, a git hook and the benchmarks start most) is parsed by
entry.py without typer and runs `converge` here; cli.py's typer app calls the same function.
Everything printed is redacted (see cli.py). Errors exit through SystemExit, which typer passes
through as it does its own Exit.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn, TextIO, TypeVar, cast

from . import redact
from .errors import ConfigError, SourceError

if TYPE_CHECKING:
    import asyncio
    from collections.abc import Callable

    from rich.console import Console

    from .preflight import RuleSet
    from .reconcile import EarlyConnections
    from .source import Snapshot
    from .spec import DesiredState


_T = TypeVar("_T")


def run_async(coro: Coroutine[Any, Any, _T], runner: asyncio.Runner | None = None) -> _T:
    """asyncio.run(coro) (or runner.run: a loop started before, _Early's), with the coroutine's
    result kept out of the main task. asyncio.run's SIGINT handler holds that task, and putting
    the default handler back at the end has the signal module format the handler it replaces,
    task and result included: the repr of a whole fleet's result, twice (about 8 ms at 30 hosts,
    and it grows with the fleet)."""
    import asyncio
    box: list[_T] = []

    async def main() -> None:
        box.append(await coro)
    if runner is not None:
        runner.run(main())
    else:
        asyncio.run(main())
    return box[0]


class _Early:
    """The run's event loop, started while a new commit still loads in its child (after the
    run's own imports), to connect meanwhile to the hosts of the state this repo loaded last
    (reconcile.EarlyConnections): a new commit mostly keeps its hosts. The run then goes on in
    the same loop, its connector taking those connections. Not with --host or --label (which
    hosts they select is known only from the new commit), nor where the last state is not kept."""

    def __init__(self, repo: str, path: str, cache_dir: Path | None, identity: str | None,
                 concurrency: int | None, selecting: bool):
        self.repo, self.path, self.cache_dir, self.identity = repo, path, cache_dir, identity
        self.concurrency, self.selecting = concurrency, selecting
        self.runner: asyncio.Runner | None = None
        self.pool: EarlyConnections | None = None

    def wait(self, pid: int) -> None:
        """Connect until the child `pid` exits (loadcache.load_aside's wait); it is not reaped."""
        from . import loadcache
        last = None if self.selecting else loadcache.last_loaded(self.repo, self.path, self.cache_dir)
        if last is None or not last.hosts:
            return
        try:
            fd = os.pidfd_open(pid)
        except (AttributeError, OSError):
            return
        import asyncio

        from .reconcile import EarlyConnections
        from .rollout import natural_key
        ordered = [h for _, h in sorted(last.hosts.items(), key=lambda kv: natural_key(kv[0]))]
        hosts = ordered[:self.concurrency or last.settings.concurrency]     # what the run opens first
        self.runner, self.pool = asyncio.Runner(), EarlyConnections(self.identity)
        pool = self.pool

        async def meanwhile() -> None:
            loop = asyncio.get_running_loop()
            exited: asyncio.Future[None] = loop.create_future()

            def readable() -> None:          # the child has exited
                if not exited.done():
                    exited.set_result(None)
            loop.add_reader(fd, readable)
            try:
                pool.start(hosts)
                await exited
            finally:
                loop.remove_reader(fd)
        try:
            self.runner.run(meanwhile())
        finally:
            os.close(fd)

    def close(self) -> None:
        """Close the connections the run did not take, and the loop."""
        if self.runner is None:
            return
        try:
            if self.pool is not None:
                self.runner.run(self.pool.close())
        finally:
            self.runner.close()


def escape(text: str) -> str:
    """rich's markup escape (rich is imported when something is printed on a terminal, not before)."""
    from .report import escape_markup
    return escape_markup(text)


def _console(stderr: bool = False) -> Console:
    """Rich on a terminal; plain text at least 160 columns wide in logs, pipes and CI (no
    mid-line wrapping of diffs and journal lines). Everything printed is redacted."""
    # A TextIO as rich types it: Console only writes, flushes and asks isatty/fileno.
    out = cast(TextIO, redact.RedactingWriter(sys.stderr if stderr else sys.stdout))
    from .report import PlainConsole, writes_plain
    if writes_plain(out):
        # What rich would write here is plain text: written as it is, rich never imported.
        return cast("Console", PlainConsole(out, _width()))
    from rich.console import Console
    c = Console(highlight=False, file=out)
    if not c.is_terminal and "COLUMNS" not in os.environ:
        c = Console(highlight=False, file=out, width=160)
    return c


def _width() -> int:
    """A plain console's width (the result table's detail column): $COLUMNS, else 160."""
    try:
        return max(40, int(os.environ.get("COLUMNS", "")))
    except ValueError:
        return 160


def _print_json(data: object) -> None:
    """--json output, redacted (every string before serializing, then the text once more)."""
    import json
    print(redact.redact(json.dumps(redact.redact_data(data), indent=2)))


def _load(repo: str, rev: str | None, path: str, cache_dir: Path | None,
          meanwhile: Callable[[], object] | None = None,
          spare: Callable[[], object] | None = None,
          wait: Callable[[int], object] | None = None) -> tuple[Snapshot, DesiredState]:
    """The snapshot and desired state at a revision. `meanwhile` (the run's own imports) runs
    before this returns: beside the load of a local commit not loaded before (loadcache.load_aside),
    followed there by `spare`, then `wait`, where that load is still going."""
    from . import loadcache, source
    deferred = source.deferred_snapshot(repo, rev, path)
    known = None
    if deferred is not None:
        known = loadcache.load_known(deferred, cache_dir)     # a commit loaded before: no git, no loader
        if known is None and meanwhile is not None:           # runs meanwhile beside its child
            known, meanwhile = loadcache.load_aside(deferred, meanwhile, cache_dir, spare=spare, wait=wait), None
    if meanwhile is not None:
        meanwhile()
    if deferred is not None and known is not None:
        loadcache.remember_last(repo, path, known.revision, cache_dir)
        return deferred, known
    r = source.open_repo(repo, cache_dir)
    snap = source.snapshot(r, rev, path)
    state = loadcache.load(snap, cache_dir)    # a revision loaded before skips TOML and the schema
    if deferred is not None:
        loadcache.remember_last(repo, path, state.revision, cache_dir)
    return snap, state


def _has_age(state: DesiredState) -> bool:
    return any(s.source == "age" for h in state.hosts.values() for svc in h.services.values() for s in svc.secrets)


def _decrypting(state: DesiredState, snap: Snapshot, identity: str | None
                ) -> tuple[DesiredState, Callable[[str], DesiredState | None]]:
    """The state with its age secrets decrypted, and render_at doing the same for the revisions a
    rollback renders. A secret that cannot be decrypted (no identity, another key, a damaged
    file) is no error here: its SecretSpec says why, and that service is blocked."""
    from . import secrets
    from .loadcache import render_at
    dec = secrets.Decryptor(secrets.identity_path(identity))
    return (dec.state(state) if _has_age(state) else state), dec.render_at(render_at(snap))


def _fail_input(err: Exception, as_json: bool, where: str) -> NoReturn:
    if as_json:
        payload: dict = {"error": type(err).__name__, "message": str(err)}
        if isinstance(err, ConfigError):
            payload["problems"] = [p.__dict__ for p in err.problems]
        _print_json(payload)
    elif isinstance(err, ConfigError):
        from .report import print_config_error
        print_config_error(_console(stderr=True), err, where)
    else:
        # one line, never wrapped at the console's width (a log, CI, a hook reads it whole)
        _console(stderr=True).print(f"[bold red]error:[/] {escape(str(err))}", soft_wrap=True)
    raise SystemExit(1)


def _say(text: str) -> None:
    """A plain line on stderr (no markup: `[services.m.secrets]` is text), redacted."""
    _console(stderr=True).print(text, markup=False, soft_wrap=True)


def _fail(message: str) -> NoReturn:
    """One error line on stderr, exit 1."""
    _console(stderr=True).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)
    raise SystemExit(1)


def _rules(snap: Snapshot) -> Callable[[], RuleSet]:
    """The pre-flight rule pack of a revision, loaded (once) on first use."""
    from functools import cache

    @cache
    def rules() -> RuleSet:
        from . import loadcache
        return loadcache.rules(snap)
    return rules



def guarded(run: Callable[[], object]) -> None:
    """Run a command: Ctrl-C exits 130; an unexpected error prints its traceback redacted and
    exits 1 (typer's own handler would print local variables' text unmasked)."""
    try:
        run()
    except KeyboardInterrupt:
        sys.exit(130)
    except Exception:
        import traceback
        sys.stderr.write(redact.redact(traceback.format_exc()))
        sys.exit(1)


def _descends(snap: Snapshot, cache_dir: Path | None = None) -> Callable[[str, str], bool | None]:
    """trust.descends on the snapshot's repository, opened (with pygit2) when first asked: where
    the load cache's note of the commit's ancestors does not already list the applied revision."""
    def check(target: str, applied: str) -> bool | None:
        from .loadcache import descends_known
        if target == applied or descends_known(target, applied, cache_dir):
            return True
        from .trust import descends
        return descends(snap.repo)(target, applied)
    return check


def _run_imports() -> None:
    """What a run imports before it reaches a host: its own modules and the SSH stack (done
    beside a new commit's load, which then overlaps them)."""
    from . import fleet, preflight, reconcile, report, status  # noqa: F401
    from .libcache import import_asyncssh
    import_asyncssh()


def _deploy_imports() -> None:
    """What a run imports once it deploys: the pre-flight stack (a new commit mostly deploys)."""
    from . import gate  # noqa: F401


def converge(*, repo: str = ".", rev: str | None = None, path: str = "", dry_run: bool = False,
             as_json: bool = False, identity: str | None = None, concurrency: int | None = None,
             host: list[str] | None = None, label: list[str] | None = None, retry: bool = False,
             allow_rewind: bool = False, lock_wait: float = 30.0, age_identity: str | None = None,
             cache_dir: Path | None = None, state_dir: Path | None = None, notes: bool = False) -> NoReturn:
    """Converge every host to the desired state at a revision (or preview it with --dry-run);
    exits with the run's code."""

    from . import source
    if notes and source.is_url(repo):
        _fail(f"--notes writes to a local repo; {redact.redact(repo)} is a URL (its local mirror is a cache that "
              f"nobody reads). Run it on a clone and push refs/notes/reconciler")
    where = f"{repo}@{rev or 'HEAD'}"
    # a new commit's run connects to the hosts while the commit loads (_Early)
    early = _Early(repo, path, cache_dir, identity, concurrency, bool(host or label))
    try:
        try:
            snap, state = _load(repo, rev, path, cache_dir, meanwhile=_run_imports, spare=_deploy_imports,
                                wait=early.wait)
        except (ConfigError, SourceError) as e:
            _fail_input(e, as_json, where)
        from .fleet import reconcile_fleet, select_hosts
        from .preflight import secret_warnings
        from .reconcile import ssh_connector
        from .report import PhaseView, print_result
        from .status import Store, expect_changes, remember, remember_in_sync
        rules = _rules(snap)      # parsed when pre-flight first runs (a change to start); never for a no-change run
        try:
            selected = select_hosts(state, host, label)
        except SourceError as e:
            _fail_input(e, as_json, where)
        # Which hosts this run is expected to change (status.expect_changes): they are locked at once.
        store = None if dry_run else Store(state_dir)
        expect = (expect_changes(store.in_sync(), state.revision, selected if selected is not None else state.hosts)
                  if store is not None else frozenset())
        state, render = _decrypting(state, snap, age_identity)
        console = _console()
        for w in secret_warnings(state, snap.read):
            _console(stderr=True).print(f"[yellow]{escape(w)}[/]", soft_wrap=True)
        with PhaseView(_console(stderr=True), plans=None if as_json or dry_run else console) as view:
            result = run_async(reconcile_fleet(state, ssh_connector(identity, early=early.pool), dry_run=dry_run,
                                                 concurrency=concurrency, hosts=selected,
                                                 render_at=render, retry=retry, on_phase=view,
                                                 rules=rules, lock_wait=lock_wait, descends=_descends(snap, cache_dir),
                                                 allow_rewind=allow_rewind, expect_changes=expect),
                                 runner=early.runner)
    finally:
        early.close()
    if store is not None:
        remember(store, result)
        remember_in_sync(store, result)
        store.close()
        if notes:
            from .gitnotes import NotesError, record_run
            try:
                record_run(snap.repo, result)
            except NotesError as e:
                _say(f"warning: deploy notes not written: {e}")
    if as_json:
        _print_json(result.to_json())
    else:
        print_result(console, result, shown=view.shown)
    raise SystemExit(result.exit_code())
