"""Ask the engine: the installed SGLang or vLLM checks a unit's command line itself (pure half).

The rule pack trails the engines (they change weekly); the engine installed on the host does
not. Before anything is stopped, a small probe (reconciler/engines/<server>_probe.py, copied to
the host) runs the launcher's own checks, before any GPU or weight work, on the unit's server
arguments with the unit's interpreter, user and environment; its last stdout line is
`RECONCILER-ENGINE {json}`. What it calls, and the review behind this design: docs/engine-check.md.

Here: which services have an engine check (`engine_run_for`), what the probe's answer means
(`parse_verdict`, `EngineVerdict`), and how it reads to an operator (`EngineVerdict.block`,
`.note`). The host edge (the command, systemd-run with guards, the cache) is host/engine.py.

Verdicts (`ok`, `rejected`, `inconclusive`) and what each does: docs/engine-check.md,
"Verdicts". Any verdict may carry the engine's `warnings` (in its own words) and the probe's
`notes` (what it left out of the command line): the dry run shows both with the verdict.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal

import msgspec

from ..desired.spec import ServiceSpec
from ..redact import redact
from ._command import _PYTHON, Command, Server, parse_command
from ._enginebox import unit_settings
from ._unitfile import unit_entries

MARKER = "RECONCILER-ENGINE "
Verdict = Literal["ok", "rejected", "inconclusive"]
# What the engine resolved that an operator wants to see, in this order, with a short label.
_RESOLVED_LABELS: tuple[tuple[str, str], ...] = (
    ("mamba_scheduler_strategy", "mamba strategy"),
    ("mamba_radix_cache_strategy", "mamba strategy"),
    ("speculative_algorithm", "speculative"),
    ("speculative_method", "speculative"),
    ("attention_backend", "attention"),
    ("page_size", "page size"),
    ("context_length", "context"),
    ("max_model_len", "context"),
    ("tp_size", "tp"),
    ("tensor_parallel_size", "tp"),
    ("disable_overlap_schedule", "overlap off"),
    ("mamba_cache_mode", "mamba cache"),
)
_MESSAGE_LIMIT = 600
_SAID_MAX = 20          # the engine's warnings and the probe's notes kept per verdict


class EngineRun(msgspec.Struct, frozen=True):
    """One service's engine check: the interpreter its ExecStart runs, the server's own
    arguments, the environment the service gets, the unit's User= and EnvironmentFile=s, its
    identity and sandbox settings (`unit`: _enginebox.UNIT_KEYS, in the unit's order), and
    whether its interpreter reads the user's site directory (not with `-s`, `-I` or
    PYTHONNOUSERSITE)."""

    service: str
    server: Server
    interpreter: str
    args: tuple[str, ...]
    env: Mapping[str, str] = msgspec.field(default_factory=dict)
    user: str | None = None
    env_files: tuple[str, ...] = ()
    workdir: str | None = None
    mode: str = "hidden"             # "hidden": no GPU visible to the check, facts passed in; "visible"
    unit: tuple[tuple[str, str], ...] = ()
    user_site: bool = True


def _interpreter(argv: tuple[str, ...]) -> tuple[str | None, tuple[str, ...]]:
    """The python that runs the server: `.../python3 -m sglang.launch_server`, or the
    interpreter of a console script (`/opt/vllm/bin/vllm serve`: its bin/python beside it);
    and the interpreter's own options (before `-m`)."""
    for i, tok in enumerate(argv):
        base = tok.rsplit("/", 1)[-1]
        if _PYTHON.match(base):
            rest = argv[i + 1:]
            return tok, tuple(rest[:rest.index("-m")] if "-m" in rest else ())
        if base in ("sglang", "vllm") and "/" in tok:
            return tok.rsplit("/", 1)[0] + "/python3", ()
    return None, ()


def reads_user_site(cmd: Command) -> bool:
    """Whether the server's interpreter puts the user's site directory on its path: not with
    `-s` or `-I` among its options, nor with PYTHONNOUSERSITE set (unless `-E`)."""
    _, options = _interpreter(cmd.argv)
    flags = "".join(o[1:] for o in options if o.startswith("-") and not o.startswith("--"))
    return not ("s" in flags or "I" in flags or ("E" not in flags and cmd.env.get("PYTHONNOUSERSITE")))


def engine_run_for(name: str, svc: ServiceSpec) -> EngineRun | None:
    """The engine check of a service, or None when it has none: its unit runs no server we can
    ask (no sglang/vllm entry point, or an interpreter that cannot be named, as `sglang serve`
    on PATH), or the service says `engine_check = "off"`."""
    cmd = parse_command(svc)
    if cmd.server is None or svc.engine_check == "off":
        return None
    interpreter, _ = _interpreter(cmd.argv)
    if interpreter is None or not interpreter.startswith("/"):
        return None
    args = list(cmd.server_args)
    if cmd.server == "sglang" and cmd.positionals and not cmd.has("--model-path"):
        # `sglang serve MODEL`: the launcher's own parser takes it as --model-path
        args.remove(cmd.positionals[0])
        args = ["--model-path", cmd.positionals[0], *args]
    entries = unit_entries(svc.unit_text)
    user = next((v for k, v in reversed(entries) if k == "User" and v), None)
    workdir = next((v for k, v in reversed(entries) if k == "WorkingDirectory" and v), None)
    env_files = tuple(v for k, v in entries if k == "EnvironmentFile" and v)
    return EngineRun(name, cmd.server, interpreter, tuple(args), dict(cmd.env), user, env_files,
                     workdir.lstrip("-") if workdir else None, svc.engine_check, unit_settings(entries),
                     reads_user_site(cmd))


@dataclass(frozen=True)
class EngineVerdict:
    """The engine's answer about one service's command line."""

    service: str
    server: str
    verdict: Verdict
    version: str | None = None
    stage: str | None = None
    error: str | None = None
    message: str = ""
    where: str | None = None
    resolved: Mapping[str, Any] = field(default_factory=dict)
    seconds: float | None = None
    cached: bool = False
    warnings: tuple[str, ...] = ()
    notes: tuple[str, ...] = ()
    # False: the probe printed no answer (a timeout, a crash): no answer to keep (the cache)
    answered: bool = True

    def __post_init__(self) -> None:
        # a verdict read back from the cache's JSON has lists here
        object.__setattr__(self, "warnings", tuple(self.warnings))
        object.__setattr__(self, "notes", tuple(self.notes))

    @property
    def engine(self) -> str:
        return f"{self.server} {self.version}" if self.version else self.server

    def block(self) -> str:
        """The blocking reason's text: the engine, its message, where it was raised."""
        where = f" ({self.where})" if self.where else ""
        error = "" if self.error in (None, "usage") else f"{self.error}: "
        return (f"{self.service}: the installed {self.engine} refuses this command line: {error}{self.message}{where}. "
                f"Nothing was stopped. Fix: change the flags as the engine says, or pin the engine version "
                f"the unit was written for{self._said()}")

    def _said(self) -> str:
        """The engine's warnings and the probe's notes, as a tail for the verdict's line."""
        parts = ([f"; {self.engine} warns: " + "; ".join(self.warnings)] if self.warnings else []) + \
            [f" ({n})" for n in self.notes]
        return "".join(parts)

    def note(self) -> str:
        """A line for the dry run and the run's notes."""
        took = f", {self.seconds:.1f} s" if self.seconds and self.seconds >= 0.05 and not self.cached else ""
        if self.verdict == "ok":
            shown = describe_resolved(self.resolved)
            return (f"{self.service}: {self.engine} accepts the command line{took}" + (f": {shown}" if shown else "")
                    + self._said())
        if self.verdict == "inconclusive":
            return (f"{self.service}: engine check inconclusive ({self.engine}{took}): {self.message}; "
                    f"the static rules decide{self._said()}")
        return self.block()


def describe_resolved(resolved: Mapping[str, Any]) -> str:
    """What the engine resolved, short: `mamba strategy auto -> extra_buffer, attention fa3`.
    A value the unit left to the engine shows as `requested -> resolved` when the probe reports
    both (a [requested, resolved] pair)."""
    parts: list[str] = []
    seen: set[str] = set()
    for key, label in _RESOLVED_LABELS:
        if key not in resolved or label in seen:
            continue
        value = resolved[key]
        if value is None or value is False:
            continue
        seen.add(label)
        if isinstance(value, list) and len(value) == 2:     # [requested, resolved]
            shown = _short(value[1]) if value[0] == value[1] else f"{_short(value[0])} -> {_short(value[1])}"
            parts.append(f"{label} {shown}")
        elif value is True:
            parts.append(label)
        else:
            parts.append(f"{label} {_short(value)}")
    return ", ".join(parts)


def _short(value: Any) -> str:
    text = str(value)
    return text if len(text) <= 40 else text[:37] + "..."


def _clean(text: Any) -> str:
    """One line, printable, bounded: the engine's message as it can be quoted. Redacted whole
    before it is cut, so that no part of a secret survives the cut (a secret cut in two is no
    longer recognised by its value or its pattern)."""
    s = redact(" ".join(str(text or "").split()))
    s = "".join(ch if ch.isprintable() else "?" for ch in s)
    return s if len(s) <= _MESSAGE_LIMIT else s[:_MESSAGE_LIMIT - 3] + "..."


def parse_verdict(service: str, server: str, stdout: str, *, exit_status: int | None = None,
                  tail: str = "") -> EngineVerdict:
    """The probe's answer (its last `RECONCILER-ENGINE {json}` line), or an inconclusive verdict
    saying why there is none (a timeout, a crash, an interpreter that is not there)."""
    line = next((ln for ln in reversed(stdout.splitlines()) if ln.startswith(MARKER)), None)
    if line is None:
        why = _clean(tail.strip().splitlines()[-1]) if tail.strip() else ""
        status = "killed at its time limit" if exit_status in (124, 137) else f"exit status {exit_status}"
        return EngineVerdict(service, server, "inconclusive", answered=False,
                             message=f"the probe gave no answer ({status}){': ' + why if why else ''}")
    try:
        data = json.loads(line[len(MARKER):])
    except (ValueError, RecursionError):     # not JSON, a number past int()'s limit, nested too deep
        data = None
    if not isinstance(data, dict) or data.get("verdict") not in ("ok", "rejected", "inconclusive"):
        return EngineVerdict(service, server, "inconclusive", message="the probe's answer could not be read")
    seconds = data.get("seconds")
    total = sum(v for v in seconds.values() if _seconds(v)) if isinstance(seconds, dict) else None
    resolved = data.get("resolved")
    version = data.get("version")
    return EngineVerdict(
        service, str(data.get("engine") or server), data["verdict"],
        version=str(version) if isinstance(version, str) and version else None,
        stage=data.get("stage") if isinstance(data.get("stage"), str) else None,
        error=_clean(data.get("error")) or None,
        message=_clean(data.get("message")),
        where=_clean(data.get("where")) or None,
        resolved=resolved if isinstance(resolved, dict) else {},
        seconds=total, warnings=_texts(data.get("warnings")), notes=_texts(data.get("notes")))


def _seconds(value: Any) -> bool:
    """A stage's time as the probe reports it: a number of seconds a probe can take (a day at
    most), so the sum is a plain float (a 400-digit int beside a float would overflow it)."""
    return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 86400


def _texts(value: Any) -> tuple[str, ...]:
    """A list of texts from the probe's answer (warnings, notes), each cleaned, at most _SAID_MAX."""
    if not isinstance(value, list):
        return ()
    return tuple(_clean(x) for x in value if isinstance(x, str))[:_SAID_MAX]
