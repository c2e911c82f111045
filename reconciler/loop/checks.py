"""What the host-side pre-flight reads, in one round trip, and the findings it reads into.

Every fact the pre-flight needs goes to the host as one sh (`_batch`): systemd's own check of
every unit about to be written (`systemd-analyze verify` on a copy in a private directory:
reconciler/sh/verify.sh, parsed by `parse_verify`), the models' files (preflight/_hostcheck.py),
the GPUs and their health (host/gpu.py) and the servers' versions (host/versions.py); `_read`
parses each into a `Preflight`. What the findings mean (the rules, the models, the engine
check, the strays) is judged in loop/preflight.py; the GPU gate's executor is loop/gpu_gate.py.
"""

from __future__ import annotations

import base64
import contextlib
import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field

from .. import shell
from ..desired.spec import HostSpec
from ..frames import Frame, frames
from ..host.gpu import GpuFacts, gpu_command, parse_gpu
from ..host.transport import Transport
from ..host.versions import Probe, probe_command, read_versions
from ..plan.facts import ENV_DROPIN
from ..plan.model import Block, Checks, ModelFetch
from ..preflight import ModelFacts, model_check_command, parse_model_check
from ..reasons import Reason
from ..shell import ShCommand, one_sh

UNIT_SOURCE = "https://www.freedesktop.org/software/systemd/man/systemd-analyze.html (verify)"


@dataclass
class Preflight:
    """What the host-side pre-flight found: blocks per service, fetches to run, notes, GPUs."""

    blocked: dict[str, list[Block]] = field(default_factory=dict)
    fetch: dict[str, ModelFetch] = field(default_factory=dict)
    warnings: list[str] = field(default_factory=list)
    models: dict[str, ModelFacts] = field(default_factory=dict)
    gpu: GpuFacts | None = None
    engine_checks: int = 0          # services with an engine check, run or skipped

    def checks(self) -> Checks:
        return Checks(blocked={n: tuple(b) for n, b in self.blocked.items()}, fetch=dict(self.fetch),
                      gpu_gate=self.gpu is not None and self.gpu.has_nvidia_smi,
                      gpu_health=self.gpu.health if self.gpu is not None else None)

    def block(self, service: str, reason: Reason, message: str) -> None:
        self.blocked.setdefault(service, []).append(Block(reason, message))


# ---- systemd's own check of a unit ----------------------------------------------------------------

def _lines(text: str) -> tuple[int, str]:
    """A text as the verify script's `put` reads it: how many pieces it has between newlines, and
    those pieces each on a line of its own (so a missing final newline stays missing)."""
    pieces = text.split("\n")
    return len(pieces), "".join(p + "\n" for p in pieces)


def verify_command(units: Mapping[str, tuple[str, str | None]], token: str | None = None) -> tuple[ShCommand, str, str]:
    """The command that has systemd check each unit (service -> (unit text, env drop-in or None))
    under a throw-away name, so no live drop-in of the real unit is mixed in: reconciler/sh/verify.sh.

    The unit and drop-in texts come on stdin as plain lines, counted (never on a command line,
    never decoded by another process); they are written byte for byte by the shell itself.
    Returns (command, stdin, token)."""
    token = token or secrets.token_hex(8)
    names = {name: f"reconciler-verify-{secrets.token_hex(4)}-{name}" for name in units}
    head = [secrets.token_hex(8)] + [names[n] for n, (_, env) in sorted(units.items()) if env]
    parts = [" ".join(head) + "\n"]
    for name, (unit, env) in sorted(units.items()):
        nunit, unit_lines = _lines(unit)
        nenv, env_lines = _lines(env) if env else ("-", "")
        parts.append(f"{name} {names[name]} {nunit} {nenv}\n{unit_lines}{env_lines}")
    return ShCommand(shell.program("verify"), "reconciler-verify", [token]), "".join(parts), token


_LINE_REF = re.compile(r"^(?P<file>/\S+?):(?P<line>[0-9]{1,9}): (?P<msg>.*)$")


def _problem(msg: str, unit: str, env: str | None) -> str | None:
    """One line of systemd-analyze's about the unit we would write (None: about another unit on
    the host), with the offending line quoted where it names one."""
    if "reconciler-verify-" not in msg:
        return None
    m = _LINE_REF.match(msg.strip())
    if not m:
        return re.sub(r"reconciler-verify-[0-9a-f]+-", "", msg.strip())
    dropin = m.group("file").endswith(".conf")
    lines = ((env if dropin else unit) or "").splitlines()
    n = int(m.group("line"))
    quoted = f" (`{lines[n - 1].strip()}`)" if 0 < n <= len(lines) else ""
    where = f"{ENV_DROPIN} line {n}" if dropin else f"line {n}"
    return f"{where}: {m.group('msg')}{quoted}"


class _Verdicts:
    """parse_verify's reading of the records: O a line of systemd-analyze's output, B all of it
    in base64, V its exit status for a service (`V - -`: there is no systemd-analyze)."""

    def __init__(self, units: Mapping[str, tuple[str, str | None]]) -> None:
        self.units = units
        self.out: dict[str, list[str]] = {}
        self.available = True
        self.said: dict[str, list[str]] = {}        # service -> systemd-analyze's output lines so far

    def read(self, f: Frame) -> None:
        fields = f.fields(2)
        if len(fields) != 2:
            return
        name, rest = fields
        if f.kind == "O":
            self.said.setdefault(name, []).append(rest)
        elif f.kind == "B":
            with contextlib.suppress(ValueError):     # not base64 (binascii.Error is one): said nothing
                self.said.setdefault(name, []).append(base64.b64decode(rest, validate=True).decode(errors="replace"))
        elif f.kind == "V":
            self.verdict(name, rest)

    def verdict(self, name: str, rc: str) -> None:
        if name == "-":
            self.available = False
            return
        unit, env = self.units.get(name, ("", None))
        said = "\n".join(self.said.pop(name, []))
        problems = [p for msg in said.splitlines() if (p := _problem(msg, unit, env)) is not None]
        if rc != "0" and not problems:
            problems.append(f"systemd-analyze verify exited {rc}")
        if problems:
            self.out[name] = problems


def parse_verify(stdout: str, token: str,
                 units: Mapping[str, tuple[str, str | None]]) -> tuple[dict[str, list[str]], bool]:
    """Pure: service -> what systemd objects to in its unit (each with the offending line quoted);
    and whether systemd-analyze was there at all."""
    verdicts = _Verdicts(units)
    for f in frames(stdout, token):
        verdicts.read(f)
    return verdicts.out, verdicts.available


# ---- the one round trip -------------------------------------------------------------------------


def _batch(units: Mapping[str, tuple[str, str | None]], paths: list[str], gpu: int | None,
           probes: list[Probe]) -> tuple[ShCommand, str | None, dict[str, str]]:
    """Every fact the pre-flight reads, as one sh (one round trip, one process: one_sh): the
    command, its stdin (the units to verify), and the token each fact's parser reads by."""
    facts: dict[str, tuple[ShCommand, str]] = {}
    stdin = None
    if units:
        cmd, stdin, token = verify_command(units)
        facts["verify"] = (cmd, token)
    if paths:
        facts["model"] = model_check_command(paths)
    if gpu is not None:      # the GPUs, and their health with the kernel log since `gpu` (gpuhealth)
        facts["gpu"] = gpu_command(health_since=gpu)
    if probes:
        facts["versions"] = probe_command(probes)
    tokens = {fact: token for fact, (_, token) in facts.items()}
    return one_sh([cmd for cmd, _ in facts.values()], "reconciler-preflight"), stdin, tokens


def _read_versions(out: Preflight, probes: list[Probe], stdout: str, token: str) -> dict[str, str | None]:
    """The server version of each probed service (None: unknown), as the host's files say."""
    versions, warnings = read_versions(probes, stdout, token)
    out.warnings.extend(warnings)
    return versions


def _read_units(out: Preflight, units: Mapping[str, tuple[str, str | None]], stdout: str, token: str) -> None:
    """systemd's verdict on each unit: a unit it rejects blocks its service (UnitInvalid)."""
    problems, available = parse_verify(stdout, token, units)
    if not available:
        out.warnings.append("systemd-analyze not found: units not verified before writing")
    for name, lines in problems.items():
        out.block(name, Reason.UNIT_INVALID, f"{name}: systemd rejects the unit: " + "; ".join(lines)
                  + f" (source: {UNIT_SOURCE})")


async def _read(t: Transport, out: Preflight, host: HostSpec, units: Mapping[str, tuple[str, str | None]],
                paths: list[str], gpu: int | None, probes: list[Probe]) -> dict[str, str | None]:
    """Read every fact in one round trip and parse each into `out`; the probed server versions."""
    cmd, stdin, tokens = _batch(units, paths, gpu, probes)
    res = await t.run(cmd, input=stdin, check=True, timeout=120, what="pre-flight")
    versions = _read_versions(out, probes, res.stdout, tokens["versions"]) if probes else {}
    if units:
        _read_units(out, units, res.stdout, tokens["verify"])
    if gpu is not None:
        out.gpu = parse_gpu(res.stdout, tokens["gpu"], host.name)
    out.models = parse_model_check(res.stdout, tokens["model"], host.name) if paths else {}
    return versions

