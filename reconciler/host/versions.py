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
import json
import os
import re
import secrets
import shlex
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from ..preflight import Command
from ..shell import ShCommand

_PYTHON = re.compile(r"^python[0-9.]*$")

# Runs on the host: the version of the package named in argv[1].
_PROBE_PY = (
    "import sys\n"
    "try:\n"
    "    from importlib.metadata import version\n"
    "    print(version(sys.argv[1]))\n"
    "except Exception:\n"
    "    import importlib\n"
    "    print(getattr(importlib.import_module(sys.argv[1]), '__version__', ''))\n")

_SCRIPT = r"""
T=%(token)s
nl='
'
probe() {  # name executable module pythonpath cached-stamp
  exe=$2
  unknown() { printf '%%s V %%s - -\n' "$T" "$1"; }
  case "$exe" in /*) ;; *) exe=$(command -v "$exe" 2>/dev/null) || { unknown "$1"; return; } ;; esac
  py=$exe
  line=
  { IFS= read -r line < "$exe"; } 2>/dev/null     # the first line: a shebang names the interpreter
  case "$line" in '#!'*)
    line=${line#??}; line=${line#"${line%%%%[![:space:]]*}"}
    case "$line" in *python*) py=$line ;; esac ;;
  esac
  first=${py%%%% *}
  if [ "$first" = /usr/bin/env ]; then
    second=${py#* }; first=$(command -v "${second%%%% *}" 2>/dev/null) || first=/nonexistent
  fi
  case "$first" in */*) bin=${first%%/*} ;; *) bin=. ;; esac
  pp=$4 ppdirs=       # PYTHONPATH with each ':' a space (then split like the rest)
  while :; do case "$pp" in *:*) ppdirs="$ppdirs${pp%%%%:*} "; pp=${pp#*:} ;; *) ppdirs=$ppdirs$pp; break ;; esac; done
  dirs="$first ${bin:-/}/../lib/python3*/site-packages /usr/local/lib/python3*/dist-packages"
  dirs="$dirs /usr/lib/python3/dist-packages $ppdirs"
  stamp=$(stat -L --printf '%%Y.' $dirs 2>/dev/null)
  [ -x "$first" ] || { unknown "$1"; return; }
  if [ "$stamp" = "$5" ]; then printf '%%s V %%s %%s =\n' "$T" "$1" "$stamp"; return; fi
  out=$(cd / && PYTHONPATH="$4" timeout 60 $py -c "$P" "$3" 2>/dev/null; printf x)
  out=${out%%x}; out=${out%%"$nl"}; v=${out##*"$nl"}     # the last line, as tail -n 1 gives it
  case "$v" in
    [0-9]*[!0-9A-Za-z.+!-]*|[!0-9]*|'') v=$(printf '%%s' "$v" | base64 -w0) ;;
    *) v=@$v ;;          # a version as it is (the parser's own pattern): no base64 process
  esac
  printf '%%s V %%s %%s %%s\n' "$T" "$1" "$stamp" "$v"
}
"""


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
    stamp seen last time for its key). Returns (command, token)."""
    token = token or secrets.token_hex(8)
    calls = [" ".join(shlex.quote(x) for x in ("probe", p.service, p.executable, p.module, p.pythonpath,
                                                cached.get(p.key, ""))) for p in probes]
    script = (_SCRIPT % {"token": token}) + f"P={shlex.quote(_PROBE_PY)}\n" + "\n".join(calls) + "\n"
    return ShCommand(script, "reconciler-probe"), token


@dataclass(frozen=True)
class Answer:
    """One probe's answer: the version (None: unknown), and whether it came from the cache."""

    version: str | None
    stamp: str | None
    cached: bool = False


def parse_probe(stdout: str, token: str) -> dict[str, Answer]:
    """Service -> answer (pure). "=" means: unchanged since the cached answer."""
    out: dict[str, Answer] = {}
    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) != 5 or parts[0] != token or parts[1] != "V":
            continue
        _, _, name, stamp, payload = parts
        if stamp == "-":
            out[name] = Answer(None, None)
        elif payload == "=":
            out[name] = Answer(None, stamp, cached=True)
        else:
            if payload.startswith("@"):
                text = payload[1:]        # sent as it is: the host found it matches the pattern below
            else:
                try:
                    text = base64.b64decode(payload).decode(errors="replace").strip()
                except ValueError:
                    text = ""
            out[name] = Answer(text if re.match(r"^[0-9][0-9A-Za-z.+!-]*$", text) else None, stamp)
    return out


class VersionCache:
    """Known server versions per host and probe key, with the stamp they were read at; kept in
    a JSON file in the controller's state directory."""

    def __init__(self, path: Path | None):
        self.path = path
        self.data: dict[str, dict[str, dict[str, str]]] = {}
        if path is not None and path.exists():
            try:
                loaded = json.loads(path.read_text())
                self.data = loaded if isinstance(loaded, dict) else {}
            except (OSError, json.JSONDecodeError):
                self.data = {}

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

    def save(self) -> None:
        if self.path is None:
            return
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            tmp = self.path.with_suffix(".tmp")
            tmp.write_text(json.dumps(self.data, sort_keys=True))
            os.replace(tmp, self.path)
        except OSError:
            pass          # a cache: losing it costs one probe per host next time


_CACHE: VersionCache | None = None


def cache() -> VersionCache:
    """The process's version cache (loaded once from the state directory)."""
    global _CACHE
    if _CACHE is None:
        from ..dirs import default_state_dir
        _CACHE = VersionCache(default_state_dir() / "server-versions.json")
    return _CACHE
