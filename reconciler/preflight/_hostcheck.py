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
import shlex
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ObserveError

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"

_MODEL_SCRIPT = r"""
T=%(token)s
b64() { base64 | tr -d '\n'; }
size() { stat -L -c %%s -- "$1" 2>/dev/null || wc -c < "$1" 2>/dev/null | tr -d ' '; }
for p in "$@"; do
  printf '%%s P %%s\n' "$T" "$(printf '%%s' "$p" | b64)"
  d=$p
  case "$p" in *"*"*)   # a pattern (a Hugging Face cache's snapshots/*): its last directory
    for g in $p; do [ -d "$g" ] && d=$g; done ;;
  esac
  if [ -d "$d" ]; then
    printf '%%s D 1\n' "$T"
    for f in config.json model.safetensors.index.json; do
      if [ -f "$d/$f" ]; then
        printf '%%s F %%s %%s\n' "$T" "$f" "$(b64 < "$d/$f")-"
      fi
    done
    for w in "$d"/*.safetensors "$d"/*/*.safetensors "$d"/*.bin "$d"/*.gguf; do
      [ -e "$w" ] || [ -L "$w" ] || continue
      s=$(size "$w") || s=-
      [ -n "$s" ] || s=-
      printf '%%s S %%s %%s\n' "$T" "$s" "$(printf '%%s' "${w#"$d"/}" | b64)"
    done
  else
    printf '%%s D 0\n' "$T"
  fi
  q=$d
  while [ ! -d "$q" ] && [ "$q" != / ] && [ "$q" != . ]; do q=$(dirname -- "$q"); done
  printf '%%s A %%s\n' "$T" "$(df -Pk -- "$q" 2>/dev/null | awk 'NR==2 {print $4}')"
done
printf '%%s END\n' "$T"
"""


def model_check_command(paths: list[str], token: str | None = None) -> tuple[str, str]:
    """The POSIX sh command that reads what a completeness check needs, for each model dir.

    Per path (a path with `*` is a pattern: its last matching directory is read, as for a
    Hugging Face cache's snapshots/*): whether it is a directory, config.json and model.safetensors.index.json
    (base64), the size of every weight file (*.safetensors, one sub-directory deep, *.bin,
    *.gguf; symlinks followed, as in a Hugging Face cache) and the free space of its file
    system. No python on the host. Returns (command, token); the token frames the output.
    """
    token = token or secrets.token_hex(8)
    script = _MODEL_SCRIPT % {"token": token}
    args = " ".join(shlex.quote(p) for p in paths)
    return f"sh -c {shlex.quote(script)} reconciler-model-check {args}", token


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
