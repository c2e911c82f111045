"""`reconcile pull`: a host reconciles itself from its clone of the desired-state repo (pull
mode: no controller; rollout waves from fleet.toml [pull]), and `--install` makes that a timer.

A run (and an install) says whom it trusts: `--allowed-signers FILE` (only commits signed by a
key in that file deploy) or, on purpose, `--allow-unsigned`; plaintext URLs (http://, git://)
only with `--allow-insecure-transport`."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import click

from ..desired.trust import TrustPolicy
from ..errors import Problem
from .output import console, exits_on_bad_input, fail, print_json, run_async, say
from .run import PATH, check_state_dirs, json_opt, path_opt, repo_opt, rev_opt, state_opt, unusable_settings

if TYPE_CHECKING:
    from ..pull import PullOptions


@click.command()
@repo_opt
@rev_opt
@path_opt
@click.option("--host", "-H", metavar="NAME", help="This host's name in hosts/ (default: its hostname).")
@click.option("--dir", "workdir", type=PATH, envvar="RECONCILER_PULL_DIR", metavar="DIR",
              help="Where a URL repo is mirrored (default /var/lib/reconciler/pull).")
@click.option("--dry-run", "-n", is_flag=True,
              help="Show what this host would deploy, and the diff; change and report nothing.")
@json_opt
@click.option("--retry", is_flag=True, help="Re-apply quarantined (failed) service versions once more.")
@click.option("--allow-rewind", is_flag=True, help="Deploy a revision that does not descend from the one this host "
                                                   "records as applied.")
@click.option("--lock-wait", type=click.FloatRange(min=0), default=30.0, metavar="SECONDS",
              help="How long to wait for another run's lock on this host.")
@click.option("--publish/--no-publish", default=True,
              help="Leave this host's verdicts in the repo as git notes for the later waves "
                   "(refs/notes/reconciler-pull/<host>; only hosts of a wave that is not the last write them).")
@click.option("--age-identity", envvar="RECONCILER_AGE_IDENTITY", metavar="KEYFILE",
              help="An age identity on this host that decrypts the repo's age secrets (without one, a service "
                   "that has some is blocked).")
@state_opt
@click.option("--install", is_flag=True, help="Install and start reconciler-pull.service and .timer (and .path for "
                                              "a repo on this host), which run this command with these options.")
@click.option("--uninstall", is_flag=True, help="Stop and remove those units.")
@click.option("--interval", default="60s", metavar="DURATION",
              help="With --install: how often the timer runs it (30s, 5m, 1h).")
@click.option("--splay", metavar="DURATION", help="With --install: a random extra delay before each run, up to this "
                                                  "(default: a tenth of the interval; spreads a large fleet's "
                                                  "fetches).")
@click.option("--allowed-signers", type=PATH, metavar="FILE",
              help="An ssh allowed_signers file on this host: only commits signed by one of its keys deploy "
                   "(required unless --allow-unsigned).")
@click.option("--allow-unsigned", is_flag=True, help="Deploy unsigned commits: whoever can write the repo is then root "
                                                     "on this host (every run says so).")
@click.option("--allow-insecure-transport", is_flag=True, help="Fetch over http:// or git:// (plaintext: whoever is "
                                                               "on the path chooses what deploys).")
@click.option("--ssh-identity", "ssh_key", type=PATH, metavar="FILE",
              help="This host's deploy key for an ssh:// (or user@host:path) repo: a private key file of root's alone "
                   "(mode 0600). Without it, root's ~/.ssh/id_ed25519 (id_ecdsa, id_rsa).")
@click.option("--known-hosts", type=PATH, metavar="FILE",
              help="The git server's SSH host key, in known_hosts format (root's, not writable by others); the "
                   "fetch refuses any other key. Default: root's ~/.ssh/known_hosts.")
def pull(repo: str, rev: str | None, path: str, host: str | None, workdir: Path | None, dry_run: bool,
         as_json: bool, retry: bool, allow_rewind: bool, lock_wait: float, publish: bool, age_identity: str | None,
         state_dir: Path | None, install: bool, uninstall: bool, interval: str, splay: str | None,
         allowed_signers: Path | None, allow_unsigned: bool, allow_insecure_transport: bool, ssh_key: Path | None,
         known_hosts: Path | None) -> None:
    """Reconcile this host against itself from its clone of the desired-state repo (pull mode: no
    controller; rollout waves from fleet.toml [pull]). Run it on the host, as root."""
    from .. import pull as pull_mode
    if install and uninstall:
        fail("--install and --uninstall: choose one")
    if uninstall:
        try:
            for line in pull_mode.uninstall():
                say(line)
        except OSError as e:
            fail(str(e))
        return
    opts = pull_mode.PullOptions(repo=repo, rev=rev, path=path, host=host, workdir=workdir or pull_mode.DEFAULT_DIR,
                                 age_identity=age_identity, retry=retry, allow_rewind=allow_rewind,
                                 lock_wait=lock_wait, dry_run=dry_run, publish=publish,
                                 trust=_trust(allowed_signers, allow_unsigned, allow_insecure_transport,
                                              as_json=as_json),
                                 ssh_key=str(ssh_key.absolute()) if ssh_key is not None else None,
                                 known_hosts=str(known_hosts.absolute()) if known_hosts is not None else None)
    if install:
        _pull_install(opts, interval, splay, state_dir)
        return
    check_state_dirs(state_dir, as_json)
    _pull_run(opts, as_json, state_dir)


def _trust(allowed_signers: Path | None, allow_unsigned: bool, insecure: bool, *, as_json: bool = False,
           env: Mapping[str, str] | None = None) -> TrustPolicy:
    """The host's trust policy from the flags, or the trust variables of the environment as the
    flags of the same name (RECONCILER_REQUIRE_SIGNED=true with RECONCILER_ALLOWED_SIGNERS=FILE is
    --allowed-signers FILE): a signers file, or unsigned revisions on purpose. A variable that
    contradicts a flag, or would not take effect, exits 1 naming it (controller/trustvars.py)."""
    from ..controller import trustvars
    found, bad = trustvars.read(os.environ if env is None else env)
    if found.require_signed and allow_unsigned:
        bad.append(Problem("environment", trustvars.REQUIRE, "requires signed revisions, but --allow-unsigned accepts "
                                                             "unsigned ones: choose one"))
    flags = trustvars.TrustVars(True if allowed_signers is not None else None,
                                str(allowed_signers) if allowed_signers is not None else None, insecure or None)
    bad += trustvars.problems(found, flags=flags)
    if bad:
        unusable_settings(bad, as_json)
    if allowed_signers is None and found.require_signed and found.allowed_signers:
        allowed_signers = Path(found.allowed_signers)
    if allowed_signers is not None and allow_unsigned:
        fail("--allowed-signers and --allow-unsigned: choose one")
    if allowed_signers is None and not allow_unsigned:
        fail("--allowed-signers FILE is required: an ssh allowed_signers file on this host, so that only commits "
             "signed by one of its keys deploy (whoever can write the repo, or sits on the path to it, is otherwise "
             "root on this host); or pass --allow-unsigned to accept unsigned commits on purpose")
    origin = "--allowed-signers" if allowed_signers is not None else "--allow-unsigned"
    return TrustPolicy.of(require_signed=allowed_signers is not None,
                          allowed_signers=allowed_signers.absolute() if allowed_signers is not None else None,
                          insecure_transport=insecure or bool(found.insecure_transport), origin=origin)


def _pull_run(opts: PullOptions, as_json: bool, state_dir: Path | None) -> None:
    """Run `reconcile pull` until a local repo's branch stops moving under it (at most 3 runs);
    print each run, record it in the state store, exit with the last run's code."""

    from ..loop.report import PhaseView, print_result
    from ..pull import PullOutcome, pull_once
    out = console()

    def chosen(outcome: PullOutcome) -> None:
        if as_json:
            return
        c = outcome.choice
        wave = f" (wave {outcome.wave})" if outcome.wave else ""
        trust = f"signed by {outcome.signer}" if outcome.signer else opts.trust_line()
        if outcome.fallback:
            say(f"pull {outcome.host}: {outcome.fallback}")
        say(f"pull {outcome.host}{wave}: head {outcome.head[:7]} ({trust}), reconciling "
             f"{c.revision[:7] if c.revision else 'nothing'}: {c.why}")
        for skip in c.skipped[:3]:
            say(f"  not {skip.revision[:7]}: {skip.why}")
        if len(c.skipped) > 3:
            say(f"  ... and {len(c.skipped) - 3} older commits")

    outcome = None
    for _ in range(3):
        with (exits_on_bad_input(as_json, f"{opts.repo}@{opts.rev or 'HEAD'}"),    # refused: nothing changed
              PhaseView(console(stderr=True), plans=None if as_json or opts.dry_run else out) as view):
            outcome = run_async(pull_once(opts, on_phase=view, on_choice=chosen))
        if outcome.result is not None and not opts.dry_run:
            from ..controller.store import Store, remember
            with contextlib.closing(Store(state_dir)) as store:
                remember(store, outcome.result)
        if as_json:
            print_json(outcome.to_json())
        else:
            if outcome.result is not None:
                print_result(out, outcome.result, shown=view.shown)
            for line in outcome.reported:
                say(f"reported {line}")
            for w in outcome.warnings:
                say(f"warning: {w}")
        if not outcome.moved:
            break
        say("the branch moved during the run: running again")
    raise SystemExit(outcome.exit_code() if outcome is not None else 1)


def _unit_argv(opts: PullOptions, repo: str, name: str, state_dir: Path | None) -> list[str]:
    """The command the service runs: this very one, with these options (paths absolute: the unit
    runs in /), its trust policy included."""
    from ..pull import DEFAULT_DIR
    argv = [sys.executable, "-m", "reconciler", "pull", "--repo", repo, "--host", name]
    for flag, value in (("--rev", opts.rev), ("--path", opts.path),
                        ("--age-identity", str(Path(opts.age_identity).resolve()) if opts.age_identity else None),
                        ("--state-dir", str(state_dir.resolve()) if state_dir else None),
                        ("--allowed-signers", opts.trust.allowed_signers[0] if opts.trust.require_signed else None),
                        ("--ssh-identity", opts.ssh_key), ("--known-hosts", opts.known_hosts)):
        if value:
            argv += [flag, value]
    if not opts.trust.require_signed:
        argv.append("--allow-unsigned")
    if opts.trust.insecure_transport:
        argv.append("--allow-insecure-transport")
    if opts.workdir != DEFAULT_DIR:
        argv += ["--dir", str(opts.workdir.resolve())]
    if opts.lock_wait != 30.0:
        argv += ["--lock-wait", f"{opts.lock_wait:g}"]
    if not opts.publish:
        argv.append("--no-publish")
    return argv


def _check_interpreter() -> None:
    """Exit 1 when the interpreter, its venv or this package could be changed by a user other
    than root: the unit would run that code as root."""
    from ..pull._units import untrusted_paths
    code = (sys.executable, sys.prefix, str(Path(__file__).resolve().parents[1]))    # the interpreter, its venv, us
    bad = untrusted_paths(code)
    if bad is not None:
        fail(f"the unit would run {sys.executable} as root, but {bad} can be changed by someone other than root: "
             f"install the reconciler where only root can write (a venv under /opt made by root) and run --install "
             f"with its python")


def _pull_install(opts: PullOptions, interval: str, splay: str | None, state_dir: Path | None) -> None:
    """`reconcile pull --install`: check that the repo and this host resolve, then write and enable
    the units that run the same command, and say what was installed."""
    from ..desired import source
    from ..desired.cache import load_desired
    from ..desired.fields import parse_duration
    from ..pull import install, render_units, this_host
    from ..pull._git import branch_dir, open_clone
    every = parse_duration(interval)
    if every is None or every <= 0:
        fail(f"--interval {interval!r}: expected a duration > 0 like 60s, 5m or 1h")
    spread = parse_duration(splay) if splay is not None else every / 10
    if spread is None:
        fail(f"--splay {splay!r}: expected a duration like 5s or 2m")
    repo = opts.repo if source.is_url(opts.repo) else str(Path(opts.repo).resolve())
    with exits_on_bad_input(False, repo):
        opts.check_source()          # a plaintext URL, or one with a token, is refused before anything else
    _check_interpreter()
    with exits_on_bad_input(False, f"{repo}@{opts.rev or 'HEAD'}"):
        clone = open_clone(repo, opts.workdir, opts.auth)
        head = source.snapshot(clone, opts.rev, opts.path)
        signer = opts.trust.verify(clone, head.revision)
        state = load_desired(head)
        name = this_host(state, opts.host)
    argv = _unit_argv(opts, repo, name, state_dir)
    watch = None if source.is_url(repo) else branch_dir(clone, opts.rev)
    units = render_units(argv, interval=every, splay=spread, watch=watch)
    try:
        lines = install(units)
    except OSError as e:
        fail(str(e))
    say(f"pull mode for {name} from {repo}:")
    say(f"  runs: {' '.join(argv)}")
    say(f"  trusts: {opts.trust_line()}" + (f" (the head {head.short} is signed by {signer})" if signer else ""))
    say(f"  every {interval} (plus up to {spread:g}s at random) and soon after boot"
         + (f"; at once when {watch} changes" if watch else ""))
    for line in lines:
        say(f"  {line}")
