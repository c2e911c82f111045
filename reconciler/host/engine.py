"""Ask the engine, the host edge: run the engine's own argument checks on a host (see
preflight/_engine.py for what the answers mean, preflight/_enginebox.py for the box the probe
runs in).

`EngineProbe(run, ...)` is reconciler/sh/engine-probe.sh with its named parameters (one a
line), then the service's environment, allowlisted, as an env file (values never go on a
command line). How the host runs the probe (`python -I` under `systemd-run`, the unit's
identity and sandbox and the probe's own, its limits, no GPU visible by default), when it
refuses to, and what the cache keys and stamps: docs/engine-check.md. Answers are cached on the
controller per host and per request (`VerdictCache`) for at most `MAX_AGE`: a cached answer
costs a `stat` and a hash on the host.
"""

from __future__ import annotations

import base64
import hashlib
import json
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict
from functools import cache
from pathlib import Path
from typing import ClassVar

import msgspec

from .. import engines
from ..errors import ReconcilerError
from ..frames import HostProgram, Param, Records, decode, number
from ..plan.files import render_env_file
from ..plan.layout import CREDSTORE, ENV_DIR
from ..preflight import EngineRun, EngineVerdict, elsewhere, parse_verdict, probe_env, probe_properties
from ..preflight._enginebox import ENV_DENY, ENV_NAMES, ENV_PREFIXES
from ..redact import redact_data
from . import programs
from .cachefile import CacheFile
from .transport import Transport

# The module each engine's argument stage lives in, as a file: where no package directory of the
# interpreter holds it, the host says so without starting python (engine-probe.sh).
STAGE = {"sglang": "sglang/srt/server_args.py", "vllm": "vllm/engine/arg_utils.py"}
MEMORY_MAX = "4G"          # observed 0.95-1.07 GB RSS (review 2026-12-02, §6)
SECONDS = 120              # observed 8-15 s warm, 33 s on vLLM's first run, ~70 s on a loaded box
MAX_AGE = 24 * 3600        # seconds a cached answer stands, however unchanged the host's stamp
SLICE_BYTES = 65536        # of the probe's stderr, the end that comes back (from a line's start)
ENV_FILE_BYTES = 1 << 20   # of each of the unit's env files, what the host program reads


@cache
def probe_text(server: str) -> str:
    """The probe program for a server, one text (package data: reconciler/engines/probe.py and
    the server's adapter; engines.probe_text)."""
    return engines.probe_text(server)


@cache
def probe_digest(server: str) -> str:
    """The sha256 of the probe program (hex): the host's stamp and the request key hold it."""
    return hashlib.sha256(probe_text(server).encode()).hexdigest()


def _model_dir(run: EngineRun) -> str:
    flag = "--model-path" if run.server == "sglang" else "--model"
    args = list(run.args)
    for i, a in enumerate(args):
        if a == flag and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
    if run.server == "vllm" and args and not args[0].startswith("-"):
        return args[0]
    return ""


def _unit_files(run: EngineRun) -> list[str]:
    """The unit's own EnvironmentFile=s, without the reconciler's (the service's environment
    comes on stdin, as it will be after the deploy) and without the secrets' (the check needs
    no secret). The host program keeps only their allowed variables."""
    own = (ENV_DIR + "/", CREDSTORE + "/")
    return [f for f in run.env_files if not f.lstrip("-").startswith(own)]


def request_key(run: EngineRun) -> str:
    """What the controller asked, as a digest: the same request on the same stamp, the same answer."""
    data = json.dumps([run.server, run.interpreter, run.args, sorted(run.env.items()), run.user, run.env_files,
                       run.workdir, run.mode, run.unit, run.user_site,
                       probe_digest(run.server)])
    return hashlib.sha256(data.encode()).hexdigest()[:32]


def refusal(run: EngineRun) -> str | None:
    """Why the check does not run at all (None: it runs): a unit in another root, or a setting
    the host program's one-a-line header cannot carry."""
    if where := elsewhere(run.unit):
        return where
    if any("\n" in v or "\r" in v for v in (run.interpreter, run.user or "", run.env.get("PYTHONPATH", ""),
                                             *run.env_files, *(v for _, v in run.unit), *run.args)):
        return "a unit setting holds a line break"
    return None


class EngineAnswer(msgspec.Struct, frozen=True):
    """The host's answer: its stamp, and a verdict (None: the cached one stands)."""

    stamp: str
    verdict: EngineVerdict | None


class EngineProbe(HostProgram[EngineAnswer], frozen=True):
    """reconciler/sh/engine-probe.sh for one service: its named parameters, then the allowlisted
    environment as an env file, then the probe program, which the host reads only where it runs
    the probe (so in a batch it goes last). `cached`: the host's stamp of a cached answer (the
    host then only says whether it still stands)."""

    name: ClassVar[str] = "engine-probe"
    last: ClassVar[bool] = True
    fragments: ClassVar[tuple[str, ...]] = ("params", "venv")
    constants: ClassVar[Mapping[str, str]] = {
        "SLICE_BYTES": str(SLICE_BYTES), "ENV_FILE_BYTES": str(ENV_FILE_BYTES),
        "ENV_ALLOW": " ".join([*(p + "*" for p in ENV_PREFIXES), *ENV_NAMES]), "ENV_DENY": " ".join(ENV_DENY)}
    run: EngineRun
    cached: str = ""
    seconds: int = SECONDS

    def timeout(self) -> float:
        """How long its round trip may take: the probe's own bound, and its start and answer."""
        return self.seconds + 30

    def params(self) -> Mapping[str, Param]:
        run = self.run
        return {"arg": list(run.args), "env": str(self._env().count("\n")), "interp": run.interpreter,
                "probe": str(len(probe_text(run.server).encode())), "probesum": probe_digest(run.server),
                "user": run.user or "",
                "mem": MEMORY_MAX, "secs": str(self.seconds), "mode": run.mode, "model": _model_dir(run),
                "cached": self.cached, "stage": STAGE[run.server], "usersite": str(int(run.user_site)),
                "pythonpath": [p for p in run.env.get("PYTHONPATH", "").split(":") if p],
                "envfile": _unit_files(run), "prop": list(probe_properties(run.unit, run.mode))}

    def _env(self) -> str:
        return render_env_file(probe_env(self.run.env))

    def payload(self) -> str:
        return self._env() + probe_text(self.run.server)

    def parse(self, answer: Records) -> EngineAnswer:
        return read_answer(self.run, answer.stdout, answer.token)


def read_answer(run: EngineRun, stdout: str, token: str) -> EngineAnswer:
    """The framed output of engine-probe.sh (pure)."""
    stamp, status, out, err, cached = "", None, "", "", False
    for f in Records(stdout, token):
        fields = f.fields()
        if f.kind == "N":
            return EngineAnswer("", _inconclusive(run, f"{run.server} is not installed for {run.interpreter} "
                                                       f"(no {STAGE[run.server]} in its package directories)"))
        if f.kind == "U" and len(fields) == 4:
            return EngineAnswer("", _inconclusive(run, _untrusted(run, *fields)))
        if f.kind == "S" and fields:
            stamp = fields[0]
        elif f.kind == "C":
            cached = True
        elif f.kind == "R" and fields and (n := number(fields[0], 3)) is not None:
            status = n
        elif f.kind in ("O", "E"):
            try:
                text = decode(fields[0], plain=False) if fields else ""
            except ValueError:
                text = ""                # not base64: no output we can read
            out, err = (text, err) if f.kind == "O" else (out, text)
    if cached:
        return EngineAnswer(stamp, None)
    return EngineAnswer(stamp, parse_verdict(run.service, run.server, out, exit_status=status, tail=err))


def _inconclusive(run: EngineRun, message: str) -> EngineVerdict:
    """No verdict on `run`'s command line, and why."""
    return EngineVerdict(run.service, run.server, "inconclusive", message=message)


def _untrusted(run: EngineRun, uid: str, gid: str, mode: str, path: str) -> str:
    """The refusal's message: which path may be changed by someone the unit does not run as."""
    try:
        name = base64.b64decode(path).decode(errors="replace")
    except ValueError:
        name = "?"
    own = f"root or the unit's user {run.user}" if run.user and run.user not in ("root", "0") else "root"
    return (f"the engine check did not run: {name} (owner uid {uid}, gid {gid}, mode {mode}) may be changed by "
            f"someone other than {own}, and the probe would run what it holds. Fix: make it {own}'s alone "
            f"(chown, chmod go-w)")


class VerdictCache(CacheFile):
    """Engine answers per host and request, with the host's stamp they were read at and when
    (`wall`: the time they are measured by); a JSON file in the controller's state directory.
    An answer older than MAX_AGE is not offered. It holds no environment value (a request is a
    digest) and its messages are redacted."""

    KEEP = 64       # requests per host

    def __init__(self, path: Path | None, wall: Callable[[], float] = time.time):
        super().__init__(path)
        self.wall = wall

    def _entry(self, host: str, key: str) -> dict[str, object] | None:
        entry = self.data.get(host, {}).get(key)
        if not isinstance(entry, dict):
            return None
        taken = entry.get("taken")
        if not isinstance(taken, (int, float)) or not 0 <= self.wall() - taken <= MAX_AGE:
            return None                # expired (or from a cache that kept no time): asked again
        return entry

    def stamp(self, host: str, key: str) -> str:
        entry = self._entry(host, key)
        return str(entry.get("stamp", "")) if entry is not None else ""

    def verdict(self, host: str, key: str, service: str) -> EngineVerdict | None:
        entry = self._entry(host, key)
        raw = entry.get("verdict") if entry is not None else None
        if not isinstance(raw, dict):
            return None
        try:
            return EngineVerdict(**{**raw, "service": service, "cached": True})
        except TypeError:
            return None

    def remember(self, host: str, key: str, stamp: str, verdict: EngineVerdict) -> None:
        if not stamp or not verdict.answered:
            return            # a timeout or a crash of the probe is not an answer to keep
        known = self.data.setdefault(host, {})
        known.pop(key, None)
        # Redacted as the store is: an engine's message may quote its argv (a token given there).
        known[key] = {"stamp": stamp, "taken": self.wall(),
                      "verdict": redact_data({**asdict(verdict), "resolved": dict(verdict.resolved)})}
        for old in list(known)[:-self.KEEP]:
            del known[old]


@cache
def verdict_cache() -> VerdictCache:
    """The process's engine-answer cache (loaded once from the state directory)."""
    from ..dirs import default_state_dir
    return VerdictCache(default_state_dir() / "engine-verdicts.json")


class Ask(msgspec.Struct, frozen=True):
    """One service's engine check as it is asked (`ask`): its probe, with the stamp of a cached
    answer the host may confirm (`cached`); or its answer, given without the host (`early`)."""

    run: EngineRun
    probe: EngineProbe | None = None
    key: str = ""
    cached: EngineVerdict | None = None
    early: EngineVerdict | None = None


def ask(host: str, run: EngineRun, store: VerdictCache, seconds: int = SECONDS) -> Ask:
    """What to ask `host` for `run`: a probe (with the stamp of the answer cached for the same
    request, if any), or the answer where none may run."""
    why = refusal(run)
    if why is not None:
        return Ask(run, early=_inconclusive(run, f"the engine check did not run: {why}"))
    try:
        key = request_key(run)
    except OSError as e:
        return Ask(run, early=_inconclusive(run, f"no probe for {run.server}: {e}"))
    cached = store.verdict(host, key, run.service)
    taken = store.stamp(host, key) if cached else ""
    return Ask(run, EngineProbe(run, cached=taken, seconds=seconds), key, cached)


def answered(host: str, asked: Ask, answer: EngineAnswer, store: VerdictCache) -> EngineVerdict:
    """The verdict the host's answer to `asked` gives (kept in the store where it is a new one)."""
    run = asked.run
    assert asked.probe is not None
    if answer.verdict is None:
        taken = asked.probe.cached
        if asked.cached is not None and taken and answer.stamp == taken:
            return asked.cached          # taken on the host's stamp of now: it stands
        return _inconclusive(run, "the host kept no answer for its stamp (nothing cached was used)")
    store.remember(host, asked.key, answer.stamp, answer.verdict)
    return answer.verdict


async def probe(t: Transport, host: str, asked: Ask, store: VerdictCache) -> EngineVerdict:
    """An asked engine check in a round trip of its own (its answer given without the host
    where it has one)."""
    if asked.probe is None:
        assert asked.early is not None
        return asked.early
    try:
        answer = await programs.run(t, asked.probe, timeout=asked.probe.timeout(),
                                    what=f"engine check of {asked.run.service}", check=False)
    except ReconcilerError as e:      # the connection, a timeout: the probe could not run
        return _inconclusive(asked.run, f"the check could not run: {e}")
    return answered(host, asked, answer, store)

