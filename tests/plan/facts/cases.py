"""The host programs' captured answers (tests/plan/facts/samples/<program>/<case>.json), as
pyinfra keeps tests/facts/<fact>/*.json: each sample names its program and the parameters it
was given, the token, what the host printed (stdout, stderr) and what the parser makes of it.
record.py captures them on a real test host; test_samples.py reads each again.

`build` makes the program of a sample from its parameters; `to_data` is a parse's result as
JSON (dataclasses as objects, tuples and sets as lists, in order)."""

from __future__ import annotations

import dataclasses
import enum
import json
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import msgspec

from reconciler.frames import HostProgram
from reconciler.host.engine import EngineProbe
from reconciler.host.gpu import Signal
from reconciler.host.lock import Install
from reconciler.host.script import ApplyScript
from reconciler.plan.facts.fetch import FetchCommand
from reconciler.plan.facts.gpu import GpuRead
from reconciler.plan.facts.host_record import HostRecordRead
from reconciler.plan.facts.journal import Journal
from reconciler.plan.facts.observe import Observe
from reconciler.plan.facts.progress import JournalTail
from reconciler.plan.facts.show import UnitShow
from reconciler.plan.facts.verify import Verify
from reconciler.plan.facts.versions import VersionRead, Versions
from reconciler.preflight import EngineRun
from reconciler.preflight._hostcheck import ModelCheck

SAMPLES = Path(__file__).resolve().parent / "samples"


def _engine(p: Mapping[str, Any]) -> EngineProbe:
    run = EngineRun(p["service"], p["server"], p["interpreter"], tuple(p["args"]), env=dict(p.get("env", {})),
                    user=p.get("user"), mode=p.get("mode", "hidden"))
    return EngineProbe(run, cached=p.get("cached", ""))


BUILD: dict[str, Callable[[Mapping[str, Any]], HostProgram[Any]]] = {
    "observe": lambda p: Observe(tuple(p["services"]), tuple(p["secret_files"]) if p.get("secret_files") else None),
    "show": lambda p: UnitShow(p["units"], p["props"]),
    "journal": lambda p: Journal(p["unit"], p["since"]),
    "progress": lambda p: JournalTail(tuple((i, c) for i, c in p["reads"])),
    "versions": lambda p: Versions([VersionRead(**r) for r in p["reads"]]),
    "model-check": lambda p: ModelCheck(p["paths"], p.get("spaces", ())),
    "verify": lambda p: Verify({k: (u, e) for k, (u, e) in p["units"].items()}, nonce=p["nonce"]),
    "gpu": lambda p: GpuRead(p.get("health_since"), p.get("device_prefix", "/dev/nvidia")),
    "engine-probe": _engine,
    "signal": lambda p: Signal(p["action"], tuple((pid, comm) for pid, comm in p["holders"])),
    "apply": lambda p: ApplyScript(tuple(p["calls"]), p["steps"]),
    "fetch": lambda p: FetchCommand(p["path"], p["command"]),
    "install": lambda p: Install(tuple(p["texts"])),
    "host-record": lambda p: HostRecordRead(),
}


def build(name: str, params: Mapping[str, Any]) -> HostProgram[Any]:
    return BUILD[name](params)


def to_data(value: Any) -> Any:
    """A parse's result as JSON data (what a sample's `expected` holds)."""
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: to_data(getattr(value, f.name)) for f in dataclasses.fields(value)}
    if isinstance(value, msgspec.Struct):
        return {name: to_data(getattr(value, name)) for name in value.__struct_fields__}
    if isinstance(value, enum.Enum):
        return value.value
    if isinstance(value, Mapping):
        return {str(k): to_data(v) for k, v in value.items()}
    if isinstance(value, (set, frozenset)):
        return sorted(to_data(v) for v in value)
    if isinstance(value, (list, tuple)):
        return [to_data(v) for v in value]
    return value


def samples() -> list[Path]:
    return sorted(SAMPLES.glob("*/*.json"))


def load(path: Path) -> dict[str, Any]:
    data: dict[str, Any] = json.loads(path.read_text())
    return data


def sent(program: HostProgram[Any], token: str) -> str:
    """What a program's stdin says of what it is asked: its parameters (and payload); for a
    program the shell reads from stdin, what follows its text."""
    stdin = program.stdin(token)
    return stdin[len(program.text()):] if program.script_on_stdin else stdin
