"""The `reconcile` command: parse arguments, call the library, print, set the exit code.

Exit codes: 0 converged / in sync; 1 bad input or internal error (nothing applied);
2 --dry-run found changes; 3 a host was rolled back (reserved); 4 at least one host failed.

Everything it prints, to the terminal, as --json or in an error (a traceback included), goes
through redact: the values of the secrets it decrypted and token-like patterns are masked.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import typer

from . import coercion, redact
from .clicore import (
    _console,
    _decrypting,
    _fail,
    _fail_input,
    _has_age,
    _load,
    _print_json,
    _say,
    converge,
    escape,
    guarded,
    run_async,
)
from .errors import ConfigError, SourceError

# Everything else is imported where it is used: parsing the arguments (and --help) loads typer
# alone, and a run loads only what it needs (the SSH stack when it connects, the rule pack when
# pre-flight runs). tests/test_cold_start.py keeps it so.
if TYPE_CHECKING:


    from .pull import PullOptions


def _quiet_flag_types() -> None:
    """typer (0.2x) shows a type after every option and argument in --help, `<bool>` after each
    flag (--dry-run, --json, --help) included. A flag takes no value: show none; a value without a
    metavar shows click's classic TEXT / INTEGER / PATH rather than `<str>`."""
    try:
        from typer import core
    except ImportError:
        return
    names = {"<str>": "TEXT", "<int>": "INTEGER", "<float>": "NUMBER", "<path>": "PATH", "<list[str]>": "TEXT"}
    for cls in (getattr(core, "TyperOption", None), getattr(core, "TyperArgument", None)):
        shown = getattr(cls, "display_type_rich", None)
        if cls is None or shown is None or getattr(shown, "_quiet", False):
            continue

        def display(self: object, ctx: object, _shown: Any = shown) -> str | None:
            if getattr(self, "metavar", None) is None and getattr(self, "is_flag", False):
                return None
            label = _shown(self, ctx)
            return names.get(label, label) if isinstance(label, str) else label

        display._quiet = True  # type: ignore[attr-defined]
        cls.display_type_rich = display


_quiet_flag_types()
coercion.install()      # typer's coercion of str/bool/int/Path options without pydantic (0.1 s a run)

app = typer.Typer(add_completion=False, no_args_is_help=False,
                  help="GitOps for bare-metal GPU hosts: converge systemd model servers to a git revision.")

RepoOpt = typer.Option(".", "--repo", envvar="RECONCILER_REPO", metavar="PATH|URL",
                       help="Desired-state repo: a local path (clone or bare) or a URL.")
RevOpt = typer.Option(None, "--rev", metavar="REV", help="Revision to deploy (default: HEAD of the branch).")
PathOpt = typer.Option("", "--path", envvar="RECONCILER_PATH", metavar="DIR",
                       help="Sub-directory of the repo that holds fleet.toml and hosts/.")
JsonOpt = typer.Option(False, "--json", help="Machine-readable output.")
CacheOpt = typer.Option(None, "--cache-dir", envvar="RECONCILER_CACHE_DIR", metavar="DIR",
                        help="Where URL repos are mirrored.")
StateOpt = typer.Option(None, "--state-dir", envvar="RECONCILER_STATE_DIR", metavar="DIR",
                        help="Where the state store lives (default ~/.local/state/reconciler).")
AgeIdentityOpt = typer.Option(None, "--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
                              help="The controller's age identity, to decrypt the repo's age secrets "
                                   "(needed only when the desired state has some).")


@app.callback(invoke_without_command=True)
def main_cmd(
    ctx: typer.Context,
    repo: str = RepoOpt,
    rev: str | None = RevOpt,
    path: str = PathOpt,
    dry_run: bool = typer.Option(False, "--dry-run", "-n", help="Show diffs and actions; change nothing."),
    as_json: bool = JsonOpt,
    identity: str | None = typer.Option(None, "--identity", "-i", envvar="RECONCILER_IDENTITY", metavar="KEYFILE",
                                           help="SSH private key (default: ~/.ssh defaults)."),
    concurrency: int | None = typer.Option(None, "--concurrency", min=1, metavar="N",
                                           help="Hosts at once (default: fleet.toml, 20)."),
    host: list[str] | None = typer.Option(None, "--host", "-H", metavar="NAME", help="Only these hosts (repeatable)."),
    label: list[str] | None = typer.Option(None, "--label", "-l", metavar="KEY=VALUE",
                                              help="Only hosts with this label (repeatable: all must match)."),
    retry: bool = typer.Option(False, "--retry", help="Re-apply quarantined (failed) service versions once more."),
    allow_rewind: bool = typer.Option(False, "--allow-rewind",
                                      help="Deploy a revision that does not descend from the one a host records "
                                           "as applied (an older commit, another repo)."),
    lock_wait: float = typer.Option(30.0, "--lock-wait", min=0, metavar="SECONDS",
                                    help="How long to wait for another run's lock on a host before reporting it "
                                         "Locked (exit 4)."),
    age_identity: str | None = AgeIdentityOpt,
    cache_dir: Path | None = CacheOpt,
    state_dir: Path | None = StateOpt,
    notes: bool = typer.Option(False, "--notes",
                               help="Record the outcome as git notes (refs/notes/reconciler) on the deployed "
                                    "commit in --repo, a local repo, as the daemon does on its deploy repo (not on a "
                                    "dry run)."),
) -> None:
    """Converge every host to the desired state at a revision (or preview it with --dry-run)."""
    if ctx.invoked_subcommand is not None:
        return
    converge(repo=repo, rev=rev, path=path, dry_run=dry_run, as_json=as_json, identity=identity,
             concurrency=concurrency, host=host, label=label, retry=retry, allow_rewind=allow_rewind,
             lock_wait=lock_wait, age_identity=age_identity, cache_dir=cache_dir, state_dir=state_dir, notes=notes)

@app.command()
def validate(repo: str = RepoOpt, rev: str | None = RevOpt, path: str = PathOpt,
             as_json: bool = JsonOpt, cache_dir: Path | None = CacheOpt,
             age_identity: str | None = typer.Option(
                 None, "--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
                 help="Also check that every age secret decrypts with this identity (the controller's).")) -> None:
    """Check the desired state at a revision without contacting any host (exit 0 or 1)."""
    from . import loadcache, secrets
    from .preflight import check_desired, secret_problems
    decrypted = 0
    try:
        snap, state = _load(repo, rev, path, cache_dir)
        problems, warnings = check_desired(state, loadcache.rules(snap), snap.read)
        identity = secrets.identity_path(age_identity)
        if identity and _has_age(state):
            state = secrets.Decryptor(identity).state(state)
            bad = secret_problems(state, snap.read)
            problems.extend(bad)
            decrypted = len({s.path for h in state.hosts.values() for svc in h.services.values()
                             for s in svc.secrets if s.source == "age" and s.problem is None})
        if problems:
            raise ConfigError(problems)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, f"{repo}@{rev or 'HEAD'}")
        return
    for w in warnings:
        _console(stderr=True).print(escape(w), soft_wrap=True)
    n_svc = sum(len(h.services) for h in state.hosts.values())
    if as_json:
        _print_json({"revision": snap.revision, "valid": True, "hosts": len(state.hosts), "services": n_svc,
                     "warnings": warnings})
    else:
        checked = f"; {decrypted} age secret file{'s' * (decrypted != 1)} decrypt" if decrypted else ""
        _console().print(f"{snap.short}: valid ({len(state.hosts)} hosts, {n_svc} services{checked})")


@app.command()
def status(
    as_json: bool = JsonOpt,
    state_dir: Path | None = StateOpt,
    live: bool = typer.Option(False, "--live", help="Read the records on the hosts over SSH (read-only, no lock) "
                                                    "instead of the local state store: what runs where, from "
                                                    "any machine. Adds systemd's ActiveState."),
    repo: str = RepoOpt,
    rev: str | None = typer.Option(None, "--rev", metavar="REV",
                                   help="With --live: the revision whose hosts to read (default: HEAD)."),
    path: str = PathOpt,
    host: list[str] | None = typer.Option(None, "--host", "-H", metavar="NAME",
                                          help="With --live: only these hosts (repeatable)."),
    label: list[str] | None = typer.Option(None, "--label", "-l", metavar="KEY=VALUE",
                                           help="With --live: only hosts with this label (repeatable: all must "
                                                "match)."),
    identity: str | None = typer.Option(None, "--identity", "-i", envvar="RECONCILER_IDENTITY", metavar="KEYFILE",
                                        help="With --live: SSH private key (default: ~/.ssh defaults)."),
    concurrency: int | None = typer.Option(None, "--concurrency", min=1, metavar="N",
                                           help="With --live: hosts at once (default: fleet.toml, 20)."),
    age_identity: str | None = AgeIdentityOpt,
    cache_dir: Path | None = CacheOpt,
) -> None:
    """The fleet at a glance: host, service, desired and running revision, health, last event;
    from the local state store, or with --live from the hosts' own records."""
    from .report import print_status
    from .status import Store
    if not live:
        if rev or host or label:
            _fail("--rev, --host and --label choose what `status --live` reads from the hosts; without --live, "
                  "status shows the local state store")
        store = Store(state_dir)
        rows = store.status()
        if as_json:
            _print_json(rows)
        else:
            print_status(_console(), rows)
        return

    from .fleet import select_hosts
    from .live import live_status
    from .reconcile import ssh_connector
    where = f"{repo}@{rev or 'HEAD'}"
    try:
        snap, state = _load(repo, rev, path, cache_dir)
        selected = select_hosts(state, host, label)
    except (ConfigError, SourceError) as e:
        _fail_input(e, as_json, where)
        return
    state, _render = _decrypting(state, snap, age_identity)
    rows = run_async(live_status(state, ssh_connector(identity), hosts=selected, concurrency=concurrency))
    if as_json:
        _print_json(rows)
    else:
        print_status(_console(), rows, live=snap.short)


@app.command()
def history(host: str = typer.Argument(..., help="Host name."), as_json: bool = JsonOpt,
            state_dir: Path | None = StateOpt,
            limit: int = typer.Option(50, "--limit", min=1)) -> None:
    """Every attempt on one host, newest first: revision, result, reason, journal line, duration."""
    from .report import print_history
    from .status import Store
    rows = Store(state_dir).history(host, limit)
    if as_json:
        _print_json(rows)
    else:
        print_history(_console(), host, rows)


@app.command()
def watch(
    config: Path | None = typer.Option(None, "--config", help="Controller config (default /etc/reconciler/config.toml "
                                          "or $RECONCILER_CONFIG); RECONCILER_<KEY> env vars override it."),
    repo: str | None = typer.Option(None, "--repo", help="Override config: the desired-state repo."),
    branch: str | None = typer.Option(None, "--branch", help="Override config: the deploy branch."),
    interval: float | None = typer.Option(None, "--interval", help="Seconds between periodic runs."),
    identity: str | None = typer.Option(None, "--identity", "-i"),
    age_identity: str | None = typer.Option(None, "--age-identity", metavar="KEYFILE",
                                            help="Override config: the age identity that decrypts the repo's secrets."),
    state_dir: Path | None = typer.Option(None, "--state-dir"),
    metrics: str | None = typer.Option(None, "--metrics", help="host:port of the Prometheus endpoint, '' = off."),
    web: str | None = typer.Option(None, "--web", help="host:port of the read-only fleet page, '' = off "
                                                       "(default 127.0.0.1:9188)."),
    label: list[str] | None = typer.Option(None, "--label", "-l", metavar="KEY=VALUE",
                                           help="Override config: only hosts with this label (repeatable: all "
                                                "must match), for several controllers that share a fleet."),
) -> None:
    """Run as a daemon: reconcile on every push (within a second), every interval, and on trigger."""
    import asyncio

    from .config import load_config
    from .daemon import Daemon
    try:
        cfg = load_config(config)
    except ConfigError as e:
        _fail_input(e, False, str(config or "config"))
        return
    overrides = {k: v for k, v in dict(repo=repo, branch=branch, identity=identity, age_identity=age_identity,
                                       state_dir=str(state_dir) if state_dir else None, metrics=metrics,
                                       web=web, labels=label or None).items()
                 if v is not None}
    cfg = cfg.model_copy(update=overrides)
    asyncio.run(Daemon(cfg, interval=interval).serve())


@app.command("init-repo")
def init_repo_cmd(
    path: Path = typer.Argument(..., help="Where to create the bare deploy repo."),
    branch: str = typer.Option("main", "--branch"),
    state_dir: Path | None = typer.Option(None, "--state-dir", envvar="RECONCILER_STATE_DIR",
                                             help="The daemon's state dir, for streaming results to the pusher."),
    stream: bool = typer.Option(False, "--stream", help="Always stream the deploy's outcome to the pusher."),
    shared: str | None = typer.Option(None, "--shared", metavar="GROUP",
                                      help="Share the repo with GROUP (the pushing users and the daemon): "
                                           "group-writable, setgid, core.sharedRepository=group; as root also "
                                           "marked safe.directory in the system git config."),
    owner: str | None = typer.Option(None, "--owner", metavar="USER", help="With --shared, as root: chown to USER."),
) -> None:
    """Create a bare repo with the pre-receive (validate) and post-receive (deploy) hooks installed."""
    from rich.console import Console

    from .hooks import init_repo
    if path.exists() and any(path.iterdir()):
        Console(stderr=True).print(f"[bold red]error:[/] {path} exists and is not empty")
        raise typer.Exit(1)
    try:
        notes = init_repo(path, branch=branch, state_dir=str(state_dir.resolve()) if state_dir else None,
                          stream=stream, group=shared, owner=owner)
    except (KeyError, PermissionError) as e:     # no such group/user, or not root for chown
        Console(stderr=True).print(f"[bold red]error:[/] {path}: cannot share with {shared!r}"
                                   f"{f' owned by {owner!r}' if owner else ''}: {e}")
        raise typer.Exit(1) from None
    out = _console()
    out.print(f"bare deploy repo at {path} (branch {branch}); hooks installed.")
    for n in notes:
        out.print(f"  {n}")
    out.print(f"  git remote add deploy {path.resolve()}\n  git push deploy {branch}")


@app.command()
def pull(
    repo: str = RepoOpt,
    rev: str | None = RevOpt,
    path: str = PathOpt,
    host: str | None = typer.Option(None, "--host", "-H", metavar="NAME",
                                    help="This host's name in hosts/ (default: its hostname)."),
    workdir: Path | None = typer.Option(None, "--dir", envvar="RECONCILER_PULL_DIR", metavar="DIR",
                                        help="Where a URL repo is mirrored (default /var/lib/reconciler/pull)."),
    dry_run: bool = typer.Option(False, "--dry-run", "-n",
                                 help="Show what this host would deploy, and the diff; change and report nothing."),
    as_json: bool = JsonOpt,
    retry: bool = typer.Option(False, "--retry", help="Re-apply quarantined (failed) service versions once more."),
    allow_rewind: bool = typer.Option(False, "--allow-rewind",
                                      help="Deploy a revision that does not descend from the one this host records "
                                           "as applied."),
    lock_wait: float = typer.Option(30.0, "--lock-wait", min=0, metavar="SECONDS",
                                    help="How long to wait for another run's lock on this host."),
    publish: bool = typer.Option(True, "--publish/--no-publish",
                                 help="Leave this host's verdicts in the repo as git notes for the later waves "
                                      "(refs/notes/reconciler-pull/<host>; only hosts of a wave that is not the "
                                      "last write them)."),
    age_identity: str | None = typer.Option(None, "--age-identity", envvar="RECONCILER_AGE_IDENTITY",
                                            metavar="KEYFILE",
                                            help="An age identity on this host that decrypts the repo's age "
                                                 "secrets (without one, a service that has some is blocked)."),
    state_dir: Path | None = StateOpt,
    install: bool = typer.Option(False, "--install",
                                 help="Install and start reconciler-pull.service and .timer (and .path for a "
                                      "repo on this host), which run this command with these options."),
    uninstall: bool = typer.Option(False, "--uninstall", help="Stop and remove those units."),
    interval: str = typer.Option("60s", "--interval", metavar="DURATION",
                                 help="With --install: how often the timer runs it (30s, 5m, 1h)."),
    splay: str | None = typer.Option(None, "--splay", metavar="DURATION",
                                     help="With --install: a random extra delay before each run, up to this "
                                          "(default: a tenth of the interval; spreads a large fleet's fetches)."),
) -> None:
    """Reconcile this host against itself from its clone of the desired-state repo (pull mode: no
    controller; rollout waves from fleet.toml [pull]). Run it on the host, as root."""
    from . import pull as pull_mode
    if install and uninstall:
        _fail("--install and --uninstall: choose one")
    if uninstall:
        try:
            for line in pull_mode.uninstall():
                _say(line)
        except OSError as e:
            _fail(str(e))
        return
    opts = pull_mode.PullOptions(repo=repo, rev=rev, path=path, host=host, workdir=workdir or pull_mode.DEFAULT_DIR,
                                 age_identity=age_identity, retry=retry, allow_rewind=allow_rewind,
                                 lock_wait=lock_wait, dry_run=dry_run, publish=publish)
    if install:
        _pull_install(opts, interval, splay, state_dir)
        return
    _pull_run(opts, as_json, state_dir)


def _pull_run(opts: PullOptions, as_json: bool, state_dir: Path | None) -> None:
    """Run `reconcile pull` until a local repo's branch stops moving under it (at most 3 runs);
    print each run, record it in the state store, exit with the last run's code."""

    from .pull import PullOutcome, pull_once
    from .report import PhaseView, print_result
    console = _console()

    def chosen(outcome: PullOutcome) -> None:
        if as_json:
            return
        c = outcome.choice
        wave = f" (wave {outcome.wave})" if outcome.wave else ""
        _say(f"pull {outcome.host}{wave}: head {outcome.head[:7]}, reconciling "
             f"{c.revision[:7] if c.revision else 'nothing'}: {c.why}")
        for skip in c.skipped[:3]:
            _say(f"  not {skip.revision[:7]}: {skip.why}")
        if len(c.skipped) > 3:
            _say(f"  ... and {len(c.skipped) - 3} older commits")

    outcome = None
    for _ in range(3):
        try:
            with PhaseView(_console(stderr=True), plans=None if as_json or opts.dry_run else console) as view:
                outcome = run_async(pull_once(opts, on_phase=view, on_choice=chosen))
        except (ConfigError, SourceError) as e:
            _fail_input(e, as_json, f"{opts.repo}@{opts.rev or 'HEAD'}")
            return
        if outcome.result is not None and not opts.dry_run:
            from .status import Store, remember
            store = Store(state_dir)
            remember(store, outcome.result)
            store.close()
        if as_json:
            _print_json(outcome.to_json())
        else:
            if outcome.result is not None:
                print_result(console, outcome.result, shown=view.shown)
            for line in outcome.reported:
                _say(f"reported {line}")
            for w in outcome.warnings:
                _say(f"warning: {w}")
        if not outcome.moved:
            break
        _say("the branch moved during the run: running again")
    raise typer.Exit(outcome.exit_code() if outcome is not None else 1)


def _pull_install(opts: PullOptions, interval: str, splay: str | None, state_dir: Path | None) -> None:
    """`reconcile pull --install`: check that the repo and this host resolve, then write and enable
    the units that run the same command, and say what was installed."""
    from . import source
    from .load import load_desired
    from .pull import DEFAULT_DIR, install, render_units, this_host
    from .pull._git import branch_dir, open_clone
    from .schema import parse_duration
    every = parse_duration(interval)
    if every is None or every <= 0:
        _fail(f"--interval {interval!r}: expected a duration > 0 like 60s, 5m or 1h")
    spread = parse_duration(splay) if splay is not None else every / 10
    if spread is None:
        _fail(f"--splay {splay!r}: expected a duration like 5s or 2m")
    repo = opts.repo if source.is_url(opts.repo) else str(Path(opts.repo).resolve())
    from .redact import looks_secret
    if source.is_url(repo) and looks_secret(repo):
        # the URL would be in the unit file and in `systemctl show`, which every local user reads
        _fail("--repo: the URL carries a password or token; it would be readable by every local user in the "
              "unit file. Give the host a read-only deploy key or a git credential helper instead")
    try:
        clone = open_clone(repo, opts.workdir)
        state = load_desired(source.snapshot(clone, opts.rev, opts.path))
        name = this_host(state, opts.host)
    except (ConfigError, SourceError) as e:
        _fail_input(e, False, f"{repo}@{opts.rev or 'HEAD'}")
        return
    argv = [sys.executable, "-m", "reconciler", "pull", "--repo", repo, "--host", name]
    # the unit runs in /: paths as absolute ones
    for flag, value in (("--rev", opts.rev), ("--path", opts.path),
                        ("--age-identity", str(Path(opts.age_identity).resolve()) if opts.age_identity else None),
                        ("--state-dir", str(state_dir.resolve()) if state_dir else None)):
        if value:
            argv += [flag, value]
    if opts.workdir != DEFAULT_DIR:
        argv += ["--dir", str(opts.workdir.resolve())]
    if opts.lock_wait != 30.0:
        argv += ["--lock-wait", f"{opts.lock_wait:g}"]
    if not opts.publish:
        argv.append("--no-publish")
    watch = None if source.is_url(repo) else branch_dir(clone, opts.rev)
    units = render_units(argv, interval=every, splay=spread, watch=watch)
    try:
        lines = install(units)
    except OSError as e:
        _fail(str(e))
    _say(f"pull mode for {name} from {repo}:")
    _say(f"  runs: {' '.join(argv)}")
    _say(f"  every {interval} (plus up to {spread:g}s at random) and soon after boot"
         + (f"; at once when {watch} changes" if watch else ""))
    for line in lines:
        _say(f"  {line}")


secrets_app = typer.Typer(add_completion=False, no_args_is_help=True,
                          help="Secrets encrypted in git with age: make the controller's key, encrypt a value.")
app.add_typer(secrets_app, name="secrets")

DEFAULT_AGE_IDENTITY = Path("/etc/reconciler/age.key")
RECIPIENTS = "secrets/recipients.txt"


@secrets_app.command("keygen")
def secrets_keygen(
    out: Path = typer.Option(DEFAULT_AGE_IDENTITY, "--out", "-o",
                             help="Where to write the new identity (mode 0600; never overwritten)."),
) -> None:
    """Make the controller's age identity (run on the controller); print its public key.

    The public key (age1...) goes on stdout alone, what to do next on stderr."""
    from . import secrets
    try:
        public = secrets.keygen(out)
    except FileExistsError:
        _fail(f"{out} exists: not overwriting an identity (every secret encrypted to it would become "
              f"unreadable). Remove it first, or choose another --out")
    except OSError as e:
        _fail(f"cannot write {out}: {e.strerror}")
    print(public)
    _say(f"wrote the controller's age identity to {out} (mode 0600). Keep it out of git and back it up: "
         f"without it the secrets encrypted to it cannot be decrypted.")
    _say("next:")
    _say(f'  1. controller: set age_identity = "{out.resolve()}" in /etc/reconciler/config.toml '
         f"(reconcile watch), or pass --age-identity / $RECONCILER_AGE_IDENTITY to reconcile")
    if os.geteuid() == 0 and _user_exists("reconciler"):
        _say(f"     the daemon runs as user reconciler: chown reconciler:reconciler {out}")
    _say(f"  2. desired-state repo: add the public key to {RECIPIENTS} and commit it:")
    _say(f"       mkdir -p secrets && echo {public} >> {RECIPIENTS} && git add {RECIPIENTS} && "
         f"git commit -m 'secrets: the controller key'")
    _say('  3. encrypt a secret: printf %s "$HF_TOKEN" | reconcile secrets encrypt HF_TOKEN')


def _user_exists(name: str) -> bool:
    import pwd
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _recipients(path: Path) -> list[str]:
    """The age public keys in a recipients file: one a line, # comments and blank lines allowed."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        _fail(f"no recipients: {path} does not exist. On the controller, `reconcile secrets keygen` prints its "
              f"public key (age1...): put it in {RECIPIENTS} and commit it, or pass --recipient age1...")
    except OSError as e:
        _fail(f"cannot read {path}: {e.strerror}")
    keys = []
    for n, raw in enumerate(text.splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if not _is_recipient(line):
            _fail(f"{path}: line {n}: expected an age public key (age1...), one a line")
        keys.append(line)
    if not keys:
        _fail(f"no recipients: {path} holds no age public key (age1...)")
    return keys


def _is_recipient(key: str) -> bool:
    from pyrage import x25519
    try:
        x25519.Recipient.from_str(key)
    except Exception:             # pyrage.RecipientError
        return False
    return True


def _read_value(name: str) -> bytes:
    """The secret from stdin (one trailing newline removed), or asked for without echo on a terminal."""
    if sys.stdin.isatty():
        import getpass
        text = getpass.getpass(f"{name} (not echoed): ")
        return text.encode()
    data = sys.stdin.buffer.read()
    if data.endswith(b"\n"):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    return data


@secrets_app.command("encrypt")
def secrets_encrypt(
    name: str = typer.Argument(..., help="The secret's name: the variable or credential name the server sees, "
                                         "e.g. HF_TOKEN."),
    repo: Path = typer.Option(Path("."), "--repo", help="The desired-state repo (its working tree)."),
    out: Path | None = typer.Option(None, "--out", "-o",
                                    help="Where to write it (default: <repo>/secrets/<name>.age, e.g. hf-token.age)."),
    recipient: list[str] | None = typer.Option(None, "--recipient", "-r", metavar="AGE1...",
                                               help="Encrypt to this age public key (repeatable; default: the keys "
                                                    f"in <repo>/{RECIPIENTS})."),
) -> None:
    """Encrypt a secret read from stdin to the controller's key, as a file to commit.

    printf %s "$HF_TOKEN" | reconcile secrets encrypt HF_TOKEN"""
    import re

    from . import secrets
    from .preflight import secret_file
    from .schema import ENV_KEY
    if not re.match(ENV_KEY, name):
        _fail(f"{name!r} is not a valid name: letters, digits and '_', not starting with a digit (the server "
              f"sees it as an environment variable or a credential of that name)")
    if recipient:
        keys = [r.strip() for r in recipient]
        for k in keys:
            if not _is_recipient(k):
                _fail(f"--recipient {k!r}: not an age public key (age1...)")
    else:
        keys = _recipients(repo / RECIPIENTS)
    value = _read_value(name)
    if not value.strip():
        _fail(f"{name}: the value is empty (nothing on stdin, or only whitespace); pipe it in: "
              f"printf %s \"$VALUE\" | reconcile secrets encrypt {name}")
    redact.register(value)
    armored = secrets.encrypt(value, keys)
    target = out if out is not None else repo / secret_file(name)
    replaced = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(armored)
        tmp.replace(target)
    except OSError as e:
        _fail(f"cannot write {target}: {e.strerror}")
    try:
        rel = target.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        rel = str(target)
    keys_text = f"{len(keys)} key{'s' * (len(keys) != 1)}"
    if replaced:
        _say(f"replaced {target}: {name}, encrypted to {keys_text}. Commit and push it: the services that use "
             f"{name} restart with the new value.")
    else:
        _say(f"wrote {target}: {name}, encrypted to {keys_text}. Add this line to the service's secrets table "
             f"([services.<service>.secrets] in hosts/<host>.toml, or [secrets] in services/<definition>.toml; "
             f"add env = true for a server that reads it from its environment), then commit both:")
    print(f'{name} = {{ age = "{rel}" }}')
    _say(f"  git add {rel} && git commit")


def main() -> None:
    """The typer app, for everything entry.py does not parse itself. An unexpected error prints
    its traceback, redacted (clicore.guarded)."""
    guarded(app)
