"""Model presence on the host: one host program reads every model directory, a pure parser judges it.

`ModelCheck(paths)` (reconciler/sh/model-check.sh) reads config.json, the safetensors index and
the size of every weight file in one round trip (POSIX sh, no python on the host);
`parse_model_check` turns its answer into ModelFacts, which name what is missing, empty or
unreadable. (Pre-flight may not import plan/: its one program and parser live here.)
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, ClassVar

import msgspec

from ..errors import ObserveError
from ..frames import Frame, HostProgram, Records, decode, malformed, number

INDEX_FILE = "model.safetensors.index.json"
CONFIG_FILE = "config.json"
SIZE_MAX = 2**60          # bytes: a size in an index beyond an exbibyte is no size we take


class ModelFacts(msgspec.Struct, frozen=True):
    """One model directory on a host, and what is wrong with it."""

    path: str
    exists: bool
    config: dict[str, Any] | None = None
    index: dict[str, Any] | None = None
    files: Mapping[str, int | None] = msgspec.field(default_factory=dict)   # weight file -> size (None: unreadable)
    missing: list[str] = msgspec.field(default_factory=list)
    empty: list[str] = msgspec.field(default_factory=list)
    invalid: list[str] = msgspec.field(default_factory=list)     # files present but unreadable as JSON
    free_bytes: int | None = None                        # free space of the file system

    @property
    def total_size(self) -> int | None:
        """The checkpoint's size according to its index (metadata.total_size), if known."""
        meta = (self.index or {}).get("metadata")
        size = meta.get("total_size") if isinstance(meta, dict) else None
        ok = isinstance(size, int) and not isinstance(size, bool) and 0 <= size <= SIZE_MAX
        return size if ok else None        # bounded: the free-space check divides it as a float

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


_EARLY = "model check output ended early (is there a POSIX shell?)"


def _name(payload: str, host: str) -> str:
    """A name as the program sends it: `@name` (printable ASCII, no spaces), else base64."""
    try:
        return decode(payload)
    except ValueError:
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
        except (ValueError, RecursionError):      # not JSON, a 4,300-digit number, nested too deep
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


_ARITY = {"D": 1, "S": 2}     # fields of each kind after P (F: a line of a file, A: any)


class _ModelReading:
    """parse_model_check's reading of the records: a handler per kind.

    P starts a path (its name, @ or base64), then: D whether it is a directory, F a JSON file
    (config.json line by line, `F NAME L|P TEXT`; the index whole, `F NAME B BASE64`; then
    `F NAME E`), S a weight file's size (or -) and name, A the free KiB of its file system.
    """

    def __init__(self, host: str) -> None:
        self.host = host
        self.out: dict[str, ModelFacts] = {}
        self.current: str | None = None
        self.exists = False
        self.raw: dict[str, str] = {}
        self.lines: dict[str, list[str]] = {}
        self.sizes: dict[str, int | None] = {}
        self.free_kb: int | None = None

    def start(self, path: str) -> None:
        self.flush()
        self.current, self.exists, self.raw, self.lines, self.sizes, self.free_kb = path, False, {}, {}, {}, None

    def flush(self) -> None:
        if self.current is not None:
            self.out[self.current] = _finish(self.current, self.exists, self.raw, self.sizes, self.free_kb)

    def read(self, f: Frame) -> None:
        fields = f.line.split(" ")[2:]
        if f.kind == "P" and len(fields) == 1:
            self.start(_name(fields[0], self.host))
        elif f.kind == "F" and self.current is not None and len(fields) >= 2:
            self.file(f, *f.fields(2))
        elif self.current is None or not (f.kind == "A" or _ARITY.get(f.kind) == len(fields)):
            raise malformed(self.host, "model check", f)
        elif f.kind == "D":
            self.exists = fields[0] == "1"
        elif f.kind == "S":
            size, name = fields
            self.sizes[_name(name, self.host)] = number(size)
        else:
            self.free_kb = number(fields[0]) if len(fields) == 1 else None

    def file(self, f: Frame, name: str, rest: str) -> None:
        """A line of a JSON file: `L TEXT` (a line), `P TEXT` (a last line without its newline),
        `B BASE64` (the whole file), `E` (the file ends)."""
        op, _, text = rest.partition(" ")
        if op in ("L", "P"):
            self.lines.setdefault(name, []).append(text + "\n" if op == "L" else text)
        elif op == "B":
            try:
                self.lines.setdefault(name, []).append(decode(text, plain=False))
            except ValueError:
                raise malformed(self.host, "model check", f) from None
        elif op == "E":
            self.raw[name] = "".join(self.lines.pop(name, []))
        else:
            raise malformed(self.host, "model check", f)


def parse_model_check(stdout: str, token: str, host: str = "?") -> dict[str, ModelFacts]:
    """Parse the answer of model-check.sh (ModelCheck) into {path: ModelFacts} (pure)."""
    reading = _ModelReading(host)
    for f in Records(stdout, token, host).whole(_EARLY):
        reading.read(f)
    reading.flush()
    return reading.out


class ModelCheck(HostProgram[dict[str, ModelFacts]], frozen=True):
    """reconciler/sh/model-check.sh for these model directories: per path (a path with `*` is a
    pattern: its last matching directory is read, as for a Hugging Face cache's snapshots/*)
    whether it is a directory, config.json (line by line, builtins only) and
    model.safetensors.index.json (whole, in base64: it may be megabytes), the size of every
    weight file (*.safetensors, one sub-directory deep, *.bin, *.gguf; symlinks followed, as in a
    Hugging Face cache; one stat for all of them) and, for `spaces`, the free space of its file
    system (one df: only a fetch reads it)."""

    name: ClassVar[str] = "model-check"
    in_session: ClassVar[bool] = True
    constants: ClassVar[Mapping[str, str]] = {"CONFIG_FILE": CONFIG_FILE, "INDEX_FILE": INDEX_FILE}
    paths: Sequence[str]
    spaces: Sequence[str] = ()      # of those, the paths whose free space is read (a fetch may fill them)

    def params(self) -> Mapping[str, Sequence[str]]:
        # a path with a line break (none the desired state lets through) is not read: unchecked
        return {"path": _lines(self.paths), "space": _lines(self.spaces)}

    def parse(self, answer: Records) -> dict[str, ModelFacts]:
        return parse_model_check(answer.stdout, answer.token, answer.host)


def _lines(paths: Sequence[str]) -> list[str]:
    return [p for p in paths if "\n" not in p and "\r" not in p]
