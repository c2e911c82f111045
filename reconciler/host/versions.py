"""The model server's version on a host: which interpreter a unit runs, a probe, and a cache.

Pre-flight rules can be true for some server releases only (`versions = ">=0.5.10,<0.5.14"`),
so the host is asked which sglang or vllm the service's own interpreter has. The interpreter is
the python of ExecStart (`/opt/sglang/bin/python3 -m sglang.launch_server`), or the one named in
the shebang of a console script (`/opt/vllm/bin/vllm serve`). The probe reads the installed
package's metadata (importlib.metadata: nothing is imported), and imports the package only when
it has no metadata. It runs with the unit's PYTHONPATH and nothing else of its environment
(env values may be secrets).

Asking costs a python start-up on the host, so answers are cached on the controller per host,
interpreter, PYTHONPATH and the modification times of the interpreter and its package
directories (a pip install or upgrade changes them): a cached answer costs one `stat`.

Like facts.py: `probe_command(...)` builds the shell, `parse_probe(...)` reads it (pure).
"""

from __future__ import annotations

import base64
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass

from .. import shell
from ..frames import frames
from ..preflight import Command
from ..shell import ShCommand
from .cachefile import CacheFile

_PYTHON = re.compile(r"^python[0-9.]*\Z")


@dataclass(frozen=True)
class Probe:
    """What to ask one host about one service: its executable, the server's package, PYTHONPATH."""

    service: str
    executable: str
    module: str                      # "sglang" | "vllm"
    pythonpath: str = ""

    @property
    def key(self) -> str:
        return f"{self.executable}|{self.module}|{self.pythonpath}"


def probe_for(service: str, cmd: Command) -> Probe | None:
    """The probe for a parsed server command, or None when it runs no server we know."""
    if cmd.server is None or not cmd.argv:
        return None
    exe = next((tok for tok in cmd.argv if _PYTHON.match(tok.rsplit("/", 1)[-1])), None)
    if exe is None:
        # a console script (`vllm serve`, `sglang serve`): its shebang names the interpreter
        exe = next((tok for tok in cmd.argv if tok.rsplit("/", 1)[-1] in ("sglang", "vllm")), None)
    if exe is None:
        return None
    return Probe(service, exe, cmd.server, cmd.env.get("PYTHONPATH", ""))


def probe_command(probes: list[Probe], cached: Mapping[str, str], token: str | None = None) -> tuple[ShCommand, str]:
    """The shell that reads every probe's version (or only its stamp, when `cached` has the
    stamp seen last time for its key): reconciler/sh/versions.sh. Returns (command, token)."""
    token = token or secrets.token_hex(8)
    args = [token, *(x for p in probes for x in (p.service, p.executable, p.module, p.pythonpath,
                                                 cached.get(p.key, "")))]
    return ShCommand(shell.program("versions"), "reconciler-probe", args), token


@dataclass(frozen=True)
class Answer:
    """One probe's answer: the version (None: unknown), and whether it came from the cache."""

    version: str | None
    stamp: str | None
    cached: bool = False


_VERSION = re.compile(r"^[0-9][0-9A-Za-z.+!-]*\Z")


def _answer(stamp: str, payload: str) -> Answer:
    """A V record's answer: its stamp (- unknown), and "=" (unchanged since the cached answer),
    the version as it is (@, the host found it matches _VERSION) or in base64."""
    if stamp == "-":
        return Answer(None, None)
    if payload == "=":
        return Answer(None, stamp, cached=True)
    if payload.startswith("@"):
        text = payload[1:]
    else:
        try:
            text = base64.b64decode(payload).decode(errors="replace").strip()
        except ValueError:
            text = ""
    return Answer(text if _VERSION.match(text) else None, stamp)


def parse_probe(stdout: str, token: str) -> dict[str, Answer]:
    """Service -> answer (pure): each "V SERVICE STAMP PAYLOAD" record (an answer cut short
    lacks the services it did not reach: their versions are unknown)."""
    out: dict[str, Answer] = {}
    for f in frames(stdout, token):
        fields = f.fields()
        if f.kind == "V" and len(fields) == 3:
            out[fields[0]] = _answer(fields[1], fields[2])
    return out


class VersionCache(CacheFile):
    """Known server versions per host and probe key, with the stamp they were read at; kept in
    a JSON file in the controller's state directory."""

    def stamps(self, host: str) -> dict[str, str]:
        return {k: v.get("stamp", "") for k, v in self.data.get(host, {}).items()}

    def resolve(self, host: str, probes: list[Probe], answers: Mapping[str, Answer]) -> dict[str, str | None]:
        """Service -> version, from fresh answers or the cache; remembers the fresh ones."""
        out: dict[str, str | None] = {}
        known = self.data.setdefault(host, {})
        for p in probes:
            a = answers.get(p.service)
            if a is None or a.stamp is None:
                out[p.service] = None
            elif a.cached:
                out[p.service] = known.get(p.key, {}).get("version") or None
            else:
                out[p.service] = a.version
                if a.version:
                    known[p.key] = {"stamp": a.stamp, "version": a.version}
        return out


_CACHE: VersionCache | None = None


def cache() -> VersionCache:
    """The process's version cache (loaded once from the state directory)."""
    global _CACHE
    if _CACHE is None:
        from ..dirs import default_state_dir
        _CACHE = VersionCache(default_state_dir() / "server-versions.json")
    return _CACHE
