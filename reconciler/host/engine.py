"""Ask the engine, the host edge: run the engine's own argument checks on a host (see
preflight/_engine.py for what the answers mean).

`engine_command(run, ...)` is reconciler/sh/engine-probe.sh with its arguments and stdin (the
service's environment as an env file: values never go on a command line). On the host it runs
the probe under `systemd-run` as the unit's user with the unit's EnvironmentFile=s and the
service's environment, `MemoryMax=`, `RuntimeMaxSec=`, `Nice=19`, idle I/O, no hub downloads
(`HF_HUB_OFFLINE=1`) and, by default, no GPU visible (`CUDA_VISIBLE_DEVICES=`) with the host's
GPU facts from nvidia-smi passed in instead: the old server keeps its GPUs untouched while the
new command line is checked (bench/results/engine_probe_h200.txt has the measurements).

A probe costs a python start-up that imports the engine (8-15 s), so answers are cached on the
controller per host and per request (interpreter, arguments, environment, user, probe) with the
host's stamp (the interpreter's and its packages' modification times, the model's config.json,
the GPU facts): a cached answer costs one `stat`, as the version probe's does.
"""

from __future__ import annotations

import asyncio
import base64
import hashlib
import json
import secrets
from dataclasses import asdict, dataclass
from functools import cache

from .. import engines, shell
from ..errors import ReconcilerError
from ..frames import frames
from ..plan.facts import CREDSTORE, ENV_DIR
from ..plan.files import render_env_file
from ..preflight import EngineRun, EngineVerdict, parse_verdict
from ..redact import redact_data
from ..shell import ShCommand
from .cachefile import CacheFile
from .transport import Transport

# The module each engine's argument stage lives in, as a file: where no package directory of the
# interpreter holds it, the host says so without starting python (engine-probe.sh).
STAGE = {"sglang": "sglang/srt/server_args.py", "vllm": "vllm/engine/arg_utils.py"}
MEMORY_MAX = "4G"          # observed 0.95-1.07 GB RSS (review 2026-12-02, §6)
SECONDS = 120              # observed 8-15 s warm, 33 s on vLLM's first run, ~70 s on a loaded box


@cache
def probe_text(server: str) -> str:
    """The probe program for a server, one text (package data: reconciler/engines/probe.py and
    the server's adapter; engines.probe_text)."""
    return engines.probe_text(server)


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
    no secret)."""
    own = (ENV_DIR + "/", CREDSTORE + "/")
    return [f for f in run.env_files if not f.lstrip("-").startswith(own) and " " not in f]


def request_key(run: EngineRun) -> str:
    """What the controller asked, as a digest: the same request on the same stamp, the same answer."""
    data = json.dumps([run.server, run.interpreter, run.args, sorted(run.env.items()), run.user, run.env_files,
                       run.workdir, run.mode, hashlib.sha256(probe_text(run.server).encode()).hexdigest()])
    return hashlib.sha256(data.encode()).hexdigest()[:32]


def engine_command(run: EngineRun, *, cached: str = "", memory_max: str = MEMORY_MAX,
                   seconds: int = SECONDS, token: str | None = None) -> tuple[ShCommand, str, str]:
    """The command that runs one service's engine check, its stdin (the environment) and token."""
    token = token or secrets.token_hex(8)
    files = _unit_files(run)
    args = [token, run.interpreter, base64.b64encode(probe_text(run.server).encode()).decode(),
            run.user or "", run.workdir or "", memory_max, str(seconds), run.mode, _model_dir(run), cached,
            STAGE[run.server], run.env.get("PYTHONPATH", ""), str(len(files)), *files, *run.args]
    return ShCommand(shell.program("engine-probe"), "reconciler-engine", args), render_env_file(run.env), token


@dataclass(frozen=True)
class Answer:
    """The host's answer: its stamp, and a verdict (None: the cached one stands)."""

    stamp: str
    verdict: EngineVerdict | None


def read_answer(run: EngineRun, stdout: str, token: str) -> Answer:
    """The framed output of engine-probe.sh (pure)."""
    stamp, status, out, err, cached = "", None, "", "", False
    for f in frames(stdout, token):
        fields = f.fields()
        if f.kind == "N":
            return Answer("", EngineVerdict(run.service, run.server, "inconclusive",
                                            message=f"{run.server} is not installed for {run.interpreter} "
                                                    f"(no {STAGE[run.server]} in its package directories)"))
        if f.kind == "S" and fields:
            stamp = fields[0]
        elif f.kind == "C":
            cached = True
        elif f.kind == "R" and fields and fields[0].isdigit():
            status = int(fields[0])
        elif f.kind in ("O", "E"):
            text = base64.b64decode(fields[0]).decode(errors="replace") if fields else ""
            out, err = (text, err) if f.kind == "O" else (out, text)
    if cached:
        return Answer(stamp, None)
    return Answer(stamp, parse_verdict(run.service, run.server, out, exit_status=status, tail=err))


class VerdictCache(CacheFile):
    """Engine answers per host and request, with the host's stamp they were read at; a JSON file
    in the controller's state directory. It holds no environment value (a request is a digest)
    and its messages are redacted."""

    KEEP = 64       # requests per host

    def stamp(self, host: str, key: str) -> str:
        entry = self.data.get(host, {}).get(key)
        return str(entry.get("stamp", "")) if isinstance(entry, dict) else ""

    def verdict(self, host: str, key: str, service: str) -> EngineVerdict | None:
        entry = self.data.get(host, {}).get(key)
        raw = entry.get("verdict") if isinstance(entry, dict) else None
        if not isinstance(raw, dict):
            return None
        try:
            v = EngineVerdict(**{**raw, "service": service, "cached": True})
        except TypeError:
            return None
        return v

    def remember(self, host: str, key: str, stamp: str, verdict: EngineVerdict) -> None:
        if not stamp or (verdict.verdict == "inconclusive" and "gave no answer" in verdict.message):
            return            # a timeout or a crash of the probe is not an answer to keep
        known = self.data.setdefault(host, {})
        known.pop(key, None)
        # Redacted as the store is: an engine's message may quote its argv (a token given there).
        known[key] = {"stamp": stamp,
                      "verdict": redact_data({**asdict(verdict), "resolved": dict(verdict.resolved)})}
        for old in list(known)[:-self.KEEP]:
            del known[old]


@cache
def verdict_cache() -> VerdictCache:
    """The process's engine-answer cache (loaded once from the state directory)."""
    from ..dirs import default_state_dir
    return VerdictCache(default_state_dir() / "engine-verdicts.json")


async def check_engine(t: Transport, host: str, run: EngineRun, *, store: VerdictCache | None = None,
                       seconds: int = SECONDS) -> EngineVerdict:
    """One service's engine check on a host (cached per request and host stamp)."""
    store = store if store is not None else verdict_cache()
    try:
        key = request_key(run)
    except OSError as e:
        return EngineVerdict(run.service, run.server, "inconclusive", message=f"no probe for {run.server}: {e}")
    cached = store.verdict(host, key, run.service)
    cmd, stdin, token = engine_command(run, cached=store.stamp(host, key) if cached else "", seconds=seconds)
    try:
        res = await t.run(cmd, input=stdin, timeout=seconds + 30, what=f"engine check of {run.service}")
    except ReconcilerError as e:
        return EngineVerdict(run.service, run.server, "inconclusive", message=f"the check could not run: {e}")
    answer = read_answer(run, res.stdout, token)
    if answer.verdict is None and cached is not None:
        return cached                    # the host's stamp is the cached answer's: it stands
    verdict = answer.verdict or EngineVerdict(run.service, run.server, "inconclusive", message="no answer")
    store.remember(host, key, answer.stamp, verdict)
    return verdict


async def check_engines(t: Transport, host: str, runs: list[EngineRun], *, store: VerdictCache | None = None,
                        seconds: int = SECONDS) -> dict[str, EngineVerdict]:
    """Every service's engine check on one host, at once; the cache saved once after."""
    store = store if store is not None else verdict_cache()
    verdicts = await asyncio.gather(*(check_engine(t, host, r, store=store, seconds=seconds)
                                      for r in runs))
    store.save()
    return {v.service: v for v in verdicts}
