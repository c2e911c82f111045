"""Model presence on the host: one shell command reads every model directory, a pure parser judges it.

`model_check_command(paths)` reads config.json, the safetensors index and the size of every
weight file in one round trip (POSIX sh, no python on the host); `parse_model_check` turns its
framed output into ModelFacts, which name what is missing, empty or unreadable.
"""

from __future__ import annotations

import base64
import binascii
import json
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ObserveError
from ..shell import ShCommand

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_MODEL_SCRIPT = r"""
T=%(token)s
nl='
'
# One file's size: stat, else wc (only when the one stat in weights() does not line up).
size() { stat -L -c %%s -- "$1" 2>/dev/null || wc -c < "$1" 2>/dev/null | tr -d ' '; }
name() {  # a name as an S line carries it: @ and the name when printable ASCII without spaces, else base64
  case "$1" in ''|*[![:graph:]]*) n=$(printf '%%s' "$1" | base64 -w0) ;; *) n=@$1 ;; esac
}
weights() {  # dir: one S line per weight file (its size, or - when unreadable), in glob order
  d=$1; set --; ex=
  for w in "$d"/*.safetensors "$d"/*/*.safetensors "$d"/*.bin "$d"/*.gguf; do
    if [ -e "$w" ]; then ex=${ex}1; elif [ -L "$w" ]; then ex=${ex}0; else continue; fi
    set -- "$@" "$w"
  done
  [ $# -gt 0 ] || return 0
  # One stat for every file that exists ("SIZE NAME" lines, a dangling link gives none). Each
  # line must be "SIZE $w" for the next existing file; when not (a name with a newline, a file
  # that went or came meanwhile) every file is sized on its own, as size() does.
  all=; case "$ex" in *1*) all=$(stat -L -c '%%s %%n' -- "$@" 2>/dev/null) ;; esac
  rest=$all; e=$ex; ok=1
  for w in "$@"; do
    case "$e" in 1*)
      case "$rest" in *"$nl"*) l=${rest%%%%"$nl"*}; rest=${rest#*"$nl"} ;; *) l=$rest; rest= ;; esac
      s=${l%%%% *}
      case "$s" in ''|*[!0-9]*) ok= ;; esac
      [ "$l" = "$s $w" ] || ok= ;;
    esac
    e=${e#?}
  done
  [ -z "$rest" ] || ok=
  rest=$all
  for w in "$@"; do
    if [ -z "$ok" ]; then
      s=$(size "$w") || s=-
      [ -n "$s" ] || s=-
    else
      case "$ex" in
        1*) case "$rest" in *"$nl"*) l=${rest%%%%"$nl"*}; rest=${rest#*"$nl"} ;; *) l=$rest; rest= ;; esac
            s=${l%%%% *} ;;
        *) s=- ;;
      esac
    fi
    ex=${ex#?}
    name "${w#"$d"/}"
    printf '%%s S %%s %%s\n' "$T" "$s" "$n"
  done
}
free() {  # path: the free KiB of its file system (df's "Available"), or nothing
  a=$(df -Pk -- "$1" 2>/dev/null)
  case "$a" in
    *"$nl"*) a=${a#*"$nl"}; a=${a%%%%"$nl"*}; set -f; set -- $a; set +f; a=$4 ;;
    *) a= ;;
  esac
}
while [ $# -gt 1 ]; do        # pairs: the path in base64 (for the P line), the path
  enc=$1; p=$2; shift 2
  printf '%%s P %%s\n' "$T" "$enc"
  d=$p
  case "$p" in *"*"*)   # a pattern (a Hugging Face cache's snapshots/*): its last directory
    for g in $p; do [ -d "$g" ] && d=$g; done ;;
  esac
  if [ -d "$d" ]; then
    printf '%%s D 1\n' "$T"
    for f in config.json model.safetensors.index.json; do
      if [ -f "$d/$f" ]; then
        printf '%%s F %%s %%s\n' "$T" "$f" "$(base64 -w0 < "$d/$f")-"
      fi
    done
    weights "$d"
  else
    printf '%%s D 0\n' "$T"
  fi
  q=$d        # the nearest existing directory (dirname's steps, by parameter expansion)
  while [ ! -d "$q" ] && [ "$q" != / ] && [ "$q" != . ]; do
    case "$q" in */*) q=${q%%/*}; [ -n "$q" ] || q=/ ;; *) q=. ;; esac
  done
  free "$q"
  printf '%%s A %%s\n' "$T" "$a"
done
printf '%%s END\n' "$T"
"""


def model_check_command(paths: list[str], token: str | None = None) -> tuple[ShCommand, str]:
    """The POSIX sh command that reads what a completeness check needs, for each model dir.

    Per path (a path with `*` is a pattern: its last matching directory is read, as for a
    Hugging Face cache's snapshots/*): whether it is a directory, config.json and model.safetensors.index.json
    (base64, one base64 process each), the size of every weight file (*.safetensors, one
    sub-directory deep, *.bin, *.gguf; symlinks followed, as in a Hugging Face cache; one stat
    for all of them) and the free space of its file system (one df). No python on the host, and
    no process per file name: a name of printable ASCII without spaces comes as it is (`@name`),
    any other name in base64. Each path is passed with its base64 form, for its P line. Returns
    (command, token); the token frames the output.
    """
    token = token or secrets.token_hex(8)
    script = _MODEL_SCRIPT % {"token": token}
    args = [x for p in paths for x in (base64.b64encode(p.encode()).decode(), p)]
    return ShCommand(script, "reconciler-model-check", args), token


@dataclass(frozen=True)
class ModelFacts:
    """One model directory on a host, and what is wrong with it."""

    path: str
    exists: bool
    config: dict[str, Any] | None = None
    index: dict[str, Any] | None = None
    files: Mapping[str, int | None] = field(default_factory=dict)   # weight file -> size (None: unreadable)
    missing: list[str] = field(default_factory=list)
    empty: list[str] = field(default_factory=list)
    invalid: list[str] = field(default_factory=list)     # files present but unreadable as JSON
    free_bytes: int | None = None                        # free space of the file system

    @property
    def total_size(self) -> int | None:
        """The checkpoint's size according to its index (metadata.total_size), if known."""
        meta = (self.index or {}).get("metadata")
        size = meta.get("total_size") if isinstance(meta, dict) else None
        return size if isinstance(size, int) and not isinstance(size, bool) else None

    def problems(self) -> list[str]:
        """What makes the model unusable, one short phrase per file; [] when complete."""
        if not self.exists:
            return [f"model directory {self.path} missing"]
        out = [f"{name} missing" for name in self.missing]
        out += [f"{name} is invalid JSON" for name in self.invalid]
        out += [f"{name} is empty (0 bytes)" for name in self.empty]
        return out

    @property
    def complete(self) -> bool:
        """Whether the model is usable: nothing missing, empty or invalid."""
        return not self.problems()


def _b64text(payload: str, host: str) -> str:
    if payload.startswith("@"):
        return payload[1:]          # a name sent as it is (printable ASCII, no spaces)
    try:
        return base64.b64decode(payload, validate=True).decode("utf-8", errors="replace")
    except (binascii.Error, ValueError):
        raise ObserveError(host, "malformed model check output (bad base64)") from None


def _finish(path: str, exists: bool, raw: dict[str, str], sizes: dict[str, int | None],
            free_kb: int | None) -> ModelFacts:
    missing: list[str] = []
    invalid: list[str] = []
    empty: list[str] = []

    def load(name: str) -> dict[str, Any] | None:
        text = raw.get(name)
        if text is None:
            return None
        try:
            data = json.loads(text)
        except json.JSONDecodeError:
            invalid.append(name)
            return None
        if not isinstance(data, dict):
            invalid.append(name)
            return None
        return data

    config = load(CONFIG_FILE)
    index = load(INDEX_FILE)
    if exists and CONFIG_FILE not in raw:
        missing.append(CONFIG_FILE)
    if index is not None:
        weight_map = index.get("weight_map")
        shards = sorted({v for v in weight_map.values() if isinstance(v, str)}) if isinstance(weight_map, dict) else []
        if not shards and INDEX_FILE not in invalid:
            invalid.append(INDEX_FILE)   # an index that names no shard cannot be loaded either
        for shard in shards:
            if shard not in sizes or sizes[shard] is None:
                missing.append(shard)
            elif sizes[shard] == 0:
                empty.append(shard)
    elif exists and INDEX_FILE not in raw:
        # No index: a single-file checkpoint. It needs at least one weight file, none empty.
        if not sizes:
            missing.append("model weights (no model.safetensors.index.json, no *.safetensors)")
        for name, size in sorted(sizes.items()):
            if size == 0:
                empty.append(name)
            elif size is None:
                missing.append(name)
    return ModelFacts(path=path, exists=exists, config=config, index=index, files=dict(sizes),
                      missing=missing, empty=empty, invalid=invalid,
                      free_bytes=free_kb * 1024 if free_kb is not None else None)


def parse_model_check(stdout: str, token: str, host: str = "?") -> dict[str, ModelFacts]:
    """Parse the output of `model_check_command` into {path: ModelFacts} (pure)."""
    out: dict[str, ModelFacts] = {}
    current: str | None = None
    exists = False
    raw: dict[str, str] = {}
    sizes: dict[str, int | None] = {}
    free_kb: int | None = None
    ended = False

    def flush() -> None:
        if current is not None:
            out[current] = _finish(current, exists, raw, sizes, free_kb)

    for line in stdout.splitlines():
        parts = line.split(" ")
        if len(parts) < 2 or parts[0] != token:
            continue
        kind = parts[1]
        if kind == "END":
            ended = True
            break
        if kind == "P" and len(parts) == 3:
            flush()
            current, exists, raw, sizes, free_kb = _b64text(parts[2], host), False, {}, {}, None
        elif current is None:
            raise ObserveError(host, f"malformed model check line: {line[:80]!r}")
        elif kind == "D" and len(parts) == 3:
            exists = parts[2] == "1"
        elif kind == "F" and len(parts) == 4:
            # The payload ends with '-' so that an empty file still gives a field.
            raw[parts[2]] = _b64text(parts[3][:-1], host) if parts[3] != "-" else ""
        elif kind == "S" and len(parts) == 4:
            sizes[_b64text(parts[3], host)] = int(parts[2]) if parts[2].isdigit() else None
        elif kind == "A":
            free_kb = int(parts[2]) if len(parts) == 3 and parts[2].isdigit() else None
        else:
            raise ObserveError(host, f"malformed model check line: {line[:80]!r}")
    if not ended:
        raise ObserveError(host, "model check output ended early (is there a POSIX shell?)")
    flush()
    return out
