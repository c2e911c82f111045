"""`reconcile watch`: the long-running reconciler. What it does for the operator (asks, back-off,
waiting for the first push, the watchdog): docs/push.md, "The daemon"; its kept connections and
a newer push superseding a run: docs/concurrency.md, "A warm daemon" and "Superseded".

Level-based, like controller-runtime: the timer (apscheduler), the file watcher on the branch ref
and the trigger file (watchfiles) and the post-receive hook all only *ask* for a reconcile. One
runner task does the work, so there are never two reconciles at once. One push asks twice (the
branch ref changes, then the hook touches the trigger): an ask for the revision a run has
already reconciled is dropped.

SIGTERM: stop asking, cancel the run in flight, close SSH connections. Files on hosts are
written atomically and the record last, so a killed run leaves every host runnable and the
next run (after a restart) converges, re-watching services applied but not yet seen healthy.

Each run's output goes to the journal (stdout) and to <state_dir>/runs/<sha>.log, redacted, and
<sha>.exit holds the exit code when it ends, for the post-receive hook to stream to the pusher
(runlog.py, which also says who may read them). Who may read what is set there and here, never
left to the process umask (the unit runs with UMask=0077): the trigger file is group-writable
(0660) so the post-receive hook can touch it; the state store stays the daemon's alone (0600).

A crashed run is counted as reconciler_runs_total{result="crash"}. The last applied revision it
remembers (a cache: the hosts' own records are the truth, and every run checks them) is kept per
repo and branch, so a new or re-initialised deploy repo is never refused because of another
one's history.
"""

from __future__ import annotations

import asyncio
import signal
import time
import traceback
from pathlib import Path
from typing import TYPE_CHECKING

from rich.console import Console

from .. import faults, redact
from ..clock import REAL, Clock
from ..desired import cache, source
from ..desired.spec import DesiredState
from ..desired.trust import RevisionRefused, check_descends
from ..dirs import default_state_dir, own_dir
from ..errors import ConfigError, ReconcilerError, SourceError
from ..host import notify
from ..host.pool import Pool
from ..host.programs import Seen
from ..loop.fleet import run_fleet, selected
from ..loop.host_run import ssh_connector
from ..loop.options import RunIO, RunOptions, confirm_margin_from
from ..loop.report import PhaseView, print_config_error, print_result
from ..loop.revision import open_revision
from ..preflight import RuleSet, load_rules, secret_warnings
from ..values import replace
from . import notify_systemd as sd
from .commitstatus import CommitStatus
from .config import ControllerConfig
from .metrics import Metrics, on_the_page
from .runlog import WIDTH, RunLog, runs_dir, write_exit
from .store import Store, remember
from .watch import watch, watch_paths
from .web.hub import Hub

if TYPE_CHECKING:
    import pygit2

    from ..loop.revision import Planned

BACKOFF_START = 2.0
# Asks that only say "the branch moved": dropped when a run already reconciled the branch head.
PUSH_ASKS = frozenset({"push", "trigger"})


class Daemon:
    """Reconciles the fleet whenever asked (timer, push, trigger file), one run at a time.

    `clock`: what the retry back-off waits on (the machine's; a test's virtual one)."""

    def __init__(self, cfg: ControllerConfig, *, interval: float | None = None, clock: Clock = REAL):
        self.cfg = cfg
        # This user's alone, checked before anything is made in it (dirs.UnsafePath: one line, exit 1).
        self.state_dir = own_dir(Path(cfg.state_dir) if cfg.state_dir else default_state_dir())
        self.runs_dir = runs_dir(self.state_dir)     # run logs and exit files (runlog.py)
        self.ran: str | None = None          # the branch head the last run reconciled
        self.waiting = False                 # the branch does not exist yet (no push so far)
        self.running = False
        self.supersede = asyncio.Event()     # set when a newer revision arrives during a run
        self.cache_dir = Path(cfg.cache_dir) if cfg.cache_dir else None
        self.interval = interval or cfg.interval or 60.0
        self.wake = asyncio.Event()
        self.stopping = asyncio.Event()
        self.reasons: list[str] = []
        self.backoff = BACKOFF_START
        self.clock = clock
        self._retries: set[asyncio.Task[None]] = set()    # back-offs under way (held: the loop keeps weak refs)
        self.metrics = Metrics()
        self.console = Console(highlight=False, force_terminal=False, width=WIDTH)
        self.store = Store(self.state_dir)
        # The fleet page's live feed (web/hub.py: plain data; the web server is imported in serve()).
        self.hub: Hub | None = Hub() if cfg.web else None
        self.commit_status = CommitStatus(cfg)   # deploy status on the commit: git notes, forge status
        # One SSH connection per host kept open between runs (pool.py): a warm no-change round
        # costs one observation per host, not a handshake, through the connection's standing
        # session (session.py), not an sshd session and a login shell of its own.
        self.pool = Pool(ssh_connector(cfg.identity), standing=True)
        # Each host's last observation and what it was read as: a host that answers the same
        # text as in the last round is not parsed again (host/programs.Seen)
        self.seen = Seen()
        # the last tree loaded: its state, rule pack and secret warnings (all of them the tree's alone)
        self._loaded: tuple[str | None, DesiredState, RuleSet, list[str]] | None = None
        # The plans the last run made (Revision.planned), by its revision: a run at the same
        # revision plans a host again only where its facts or context moved (plan_host is pure).
        self._planned: tuple[str, Planned] = ("", {})
        self._git = asyncio.Lock()                 # one open or fetch of the repo at a time (_head)
        if cfg.webhook_allow:                      # where fleet.toml's webhook may go: this config says
            notify.allow(cfg.webhook_allow)        # (none: $RECONCILER_WEBHOOK_ALLOW, already in cfg)
        self._checks: set[asyncio.Task[None]] = set()   # ask()'s supersede checks in flight

    # -- asking ---------------------------------------------------------------------------
    def ask(self, why: str) -> None:
        """Ask for a reconcile; asks during a run coalesce into one more run. A push of a newer
        revision during a run supersedes it (its health waits end now)."""
        self.reasons.append(why)
        self.wake.set()
        if why in PUSH_ASKS and self.running and self.ran is not None:
            # Reading the head of a URL repo is a fetch: a task of its own, off the event loop.
            check = asyncio.get_running_loop().create_task(self._supersede_if_newer(self.ran))
            self._checks.add(check)
            check.add_done_callback(self._checks.discard)

    async def _supersede_if_newer(self, ran: str) -> None:
        """Supersede the run of `ran` when the branch head is newer (and that run still runs)."""
        try:
            head = await self._head()
        except (SourceError, OSError):
            return
        if head not in (None, ran) and self.running and self.ran == ran and not self.supersede.is_set():
            print(f"reconciler: a newer revision arrived; superseding the run of {ran[:7]}", flush=True)
            self.supersede.set()

    def _watch_paths(self) -> tuple[list[Path], set[str]]:
        """What to watch for a push (watch.py): read once, as the watcher starts."""
        return watch_paths(self.cfg)

    async def _watch(self) -> None:
        paths, names = self._watch_paths()
        await watch(paths, names, self.stopping, self.ask)

    # -- running --------------------------------------------------------------------------
    def _applied_key(self) -> str:
        repo = self.cfg.repo if source.is_url(self.cfg.repo) else str(Path(self.cfg.repo).resolve())
        return f"last_applied_revision:{repo}:{self.cfg.branch}"

    def head(self) -> str | None:
        """The deploy branch's head, or None when the branch does not exist (yet). Blocking (a URL
        repo is fetched): the loop calls it through _head."""
        repo = source.open_repo(self.cfg.repo, self.cache_dir)
        ref = repo.references.get(f"refs/heads/{self.cfg.branch}")
        return str(ref.resolve().target) if ref is not None else None

    async def _head(self) -> str | None:
        """head() in a thread, one git access at a time: a stalled remote never freezes the loop
        (the watchdog, the hosts' lock heartbeats, the page), and two fetches never race for
        the mirror's lock files."""
        async with self._git:
            return await asyncio.to_thread(self.head)

    async def _open_repo(self) -> pygit2.Repository:
        """source.open_repo (a fetch for a URL repo) in a thread, like _head."""
        async with self._git:
            return await asyncio.to_thread(source.open_repo, self.cfg.repo, self.cache_dir)

    async def _already_done(self) -> bool:
        """True when every pending ask only says "the branch moved" and the last run already
        reconciled the branch head (a push's ref change and its hook's trigger, one run)."""
        if not self.reasons or not set(self.reasons) <= PUSH_ASKS or self.ran is None:
            return False
        try:
            return await self._head() == self.ran
        except (SourceError, OSError):
            return False

    async def run_once(self) -> int:
        """One reconcile of the whole fleet at the branch head. Returns its exit code."""
        started = time.monotonic()
        why = ", ".join(sorted(set(self.reasons))) or "start"
        self.reasons.clear()
        rev_name = "unknown"
        # The run's log stays open through the except clauses (they write to it too).
        with RunLog(self.runs_dir, self.console) as out:
            try:
                opts = self.run_options()
                opts.trust.check_url(self.cfg.repo)      # before anything is fetched
                repo = await self._open_repo()
                if repo.references.get(f"refs/heads/{self.cfg.branch}") is None:
                    if not self.waiting:
                        print(f"reconciler: waiting for the first push to {self.cfg.branch} of {self.cfg.repo}",
                              flush=True)
                    self.waiting = True
                    self.metrics.waiting.set(1)
                    return 0
                self.waiting = False
                self.metrics.waiting.set(0)
                snap = source.snapshot(repo, f"refs/heads/{self.cfg.branch}", self.cfg.path)
                rev_name = snap.revision
                self.ran = snap.revision
                console = out.start(snap.revision)
                console.print(f"reconcile {snap.short} ({why})")
                if not self.cfg.allow_rewind:
                    check_descends(repo, self.store.get_value(self._applied_key()), snap.revision)
                who = opts.trust.verify(repo, snap.revision)     # before its tree is read (open_revision: again)
                if who is not None:
                    console.print(f"{snap.short}: signed by {who}")
                state, rules, warnings = self._load(snap)
                # Age secrets decrypted with the controller's identity, at this revision and at any
                # a rollback renders; one that cannot be decrypted blocks its service (the core).
                rev = open_revision(snap, opts, state=state, rules=rules)
                if self._planned[0] == snap.revision:
                    rev = replace(rev, planned=self._planned[1])
                self._planned = (snap.revision, rev.planned)
                for w in warnings:
                    console.print(w, soft_wrap=True, markup=False)
                view = PhaseView(console, plans=console)    # each host's diff before its health progress
                # A controller of one shard (config labels): only the hosts carrying its labels.
                mine = selected(rev.state, opts)
                self.commit_status.started(snap.revision, len(mine))
                if self.hub is not None:     # the fleet page
                    self.hub.run_started(snap.revision, why, mine, repo.path)
                run_io = RunIO(connect=self.pool.connector(), on_phase=self.hub.tee(view) if self.hub else view,
                               on_progress=self.hub.progress if self.hub else None,
                               on_planned=view.planned, on_rollout=self.hub.rollout if self.hub else None,
                               supersede=self.supersede, seen=self.seen)
                result = await run_fleet(rev, opts, run_io)
                print_result(console, result, shown=view.shown, in_sync_rows=False)
                for r, why in rev.refused.items():       # rollback targets the signing policy refused
                    console.print(f"refused to roll back to {r[:7]}: {why}", soft_wrap=True, markup=False)
                await self.pool.retain(mine)             # hosts that left the fleet (or shard), idle ones
                self.seen.retain(mine)
                remember(self.store, result)
                if self.hub is not None:     # the fleet page: the store has the results now
                    self.hub.run_finished(result)
                for w in self.commit_status.finished(repo, result):
                    console.print(f"warning: {w}", soft_wrap=True, markup=False)
                self.store.set_value(self._applied_key(), snap.revision)
                code = result.exit_code()
                # The pool first: a scrape that sees this run counted sees its connections too.
                self._observe_pool()
                self.metrics.observe_run(result, time.monotonic() - started)
            except RevisionRefused as e:
                code = 1
                out.say(f"refused: {e.reason}: {e}")
                self.metrics.count_run("refused", time.monotonic() - started)
            except ConfigError as e:
                code = 1
                print_config_error(out.console(), e, rev_name[:7])
                self.metrics.count_run("invalid", time.monotonic() - started)
            except (SourceError, ReconcilerError, OSError) as e:
                code = 1
                out.say(f"run failed: {type(e).__name__}: {e}")
                self.commit_status.failed(rev_name, f"{type(e).__name__}: {e}")
                self.metrics.count_run("error", time.monotonic() - started)
        if rev_name != "unknown":
            write_exit(self.runs_dir, rev_name, code)
        return code

    def run_options(self) -> RunOptions:
        """What the daemon's runs do: its config's shard, waits and keys (RunOptions)."""
        return RunOptions(repo=self.cfg.repo, cache_dir=self.cache_dir, labels=tuple(self.cfg.labels or ()),
                          lock_wait=self.cfg.lock_wait, allow_rewind=self.cfg.allow_rewind,
                          identity=self.cfg.identity, age_identity=self.cfg.age_identity,
                          confirm_margin=confirm_margin_from(), trust=self.cfg.trust_policy(),
                          drain_programs=tuple(self.cfg.drain_programs))

    def _load(self, snap: source.Snapshot) -> tuple[DesiredState, RuleSet, list[str]]:
        """The desired state, rule pack and secret warnings at a snapshot (the warnings read env
        values, unit texts and secret names: the tree's, whatever decryption fills in); the same
        tree as the last run's (every interval run until the next push) is not read again."""
        key = snap.tree_id
        if key is not None and self._loaded is not None and self._loaded[0] == key:
            return replace(self._loaded[1], revision=snap.revision), self._loaded[2], self._loaded[3]
        state = cache.load_desired(snap, self.cache_dir)
        rules = load_rules(snap)
        warnings = secret_warnings(state, snap.read)
        self._loaded = (key, state, rules, warnings)
        return state, rules, warnings

    def _observe_pool(self) -> None:
        self.metrics.observe_pool(self.pool.opened, self.pool.reused, len(self.pool))

    async def _runner(self) -> None:
        while not self.stopping.is_set():
            await self.wake.wait()
            self.wake.clear()
            if self.stopping.is_set():
                break
            if await self._already_done():
                self.reasons.clear()
                continue
            self.supersede.clear()
            self.running = True
            started = time.monotonic()
            try:
                code = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:            # a bug: say it, count it, retry; never end the loop
                print(redact.redact("reconciler: run crashed:\n" + traceback.format_exc()), flush=True)
                self.metrics.count_run("crash", time.monotonic() - started)
                code = 1
            finally:
                self.running = False
                self._observe_pool()
            if self.hub is not None:         # the fleet page: the run is over, however it ended
                self.hub.run_ended(code)
            if code in (1, 4):
                # git down, a host unreachable, a refused revision: retry, backing off
                delay = min(self.backoff, self.interval)
                self.backoff = min(self.backoff * 2, self.interval)
                retry = asyncio.create_task(self._retry_after(delay))
                self._retries.add(retry)
                retry.add_done_callback(self._retries.discard)
            else:
                self.backoff = BACKOFF_START

    async def _retry_after(self, delay: float) -> None:
        """Ask for a run again `delay` seconds after a failed one (on the daemon's clock, so a
        test sees the back-off without waiting it out)."""
        await self.clock.sleep(delay)
        self.ask("retry")

    async def serve(self) -> None:
        """Run until SIGTERM/SIGINT."""
        from apscheduler.schedulers.asyncio import AsyncIOScheduler
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, self.stopping.set)
        # /metrics: on the page when both share an address, else on a server of its own; a port
        # it cannot listen on is said, and the daemon goes on.
        shared = bool(self.hub is not None and self.cfg.metrics and on_the_page(self.cfg.metrics, self.cfg.web))
        metrics = await self.metrics.serve(self.cfg.metrics) if self.cfg.metrics and not shared else None
        sched = AsyncIOScheduler(event_loop=loop)
        sched.add_job(self.ask, "interval", seconds=self.interval, args=["interval"], coalesce=True,
                      max_instances=1, id="interval")
        sched.start()
        print(f"reconciler watching {self.cfg.repo} branch {self.cfg.branch} every {self.interval:.0f}s", flush=True)
        self.ask("start")
        runner = asyncio.create_task(self._runner())
        watcher = asyncio.create_task(self._watch())
        pinger = asyncio.create_task(self._watchdog())
        page = None
        if self.hub is not None:
            from .web.server import serve_page  # starlette, uvicorn, Jinja2: only when the page is on
            page = await serve_page(self.cfg.web, self.hub, self.state_dir, repo=self.cfg.repo,
                                    branch=self.cfg.branch, metrics=self.metrics.app() if shared else None)
        sd.notify("READY=1\nSTATUS=watching " + self.cfg.repo)
        await self.stopping.wait()
        print("reconciler: stopping", flush=True)
        sd.notify("STOPPING=1")
        sched.shutdown(wait=False)
        for task in (runner, watcher, pinger):
            task.cancel()
        await asyncio.gather(runner, watcher, pinger, return_exceptions=True)
        if page is not None and self.hub is not None:
            await page.stop(self.hub)
        if metrics is not None:
            await metrics.stop()
        await self.pool.close()
        await self.commit_status.close()
        self.store.close()

    async def _watchdog(self) -> None:
        """Ping systemd's watchdog from the event loop itself: if the loop wedges, pings stop."""
        every = sd.watchdog_interval()
        if every is None:
            return
        while True:
            faults.block_loop_if_asked()
            sd.notify("WATCHDOG=1")
            await asyncio.sleep(every)
