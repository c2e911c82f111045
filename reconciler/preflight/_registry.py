"""The registry of built-in rules: what a check is given (RuleFacts), what it returns (Failed),
and the `@builtin` decorator that files it under its id.

A built-in rule is one decorated function, its docstring saying what it finds::

    @builtin("tp-exceeds-gpus", sources={"sglang": "https://...", "vllm": "https://..."})
    def _gpu_count(cmd: Command, info: ModelInfo, facts: RuleFacts) -> Failed | None:
        \"\"\"The parallel size (tp x pp x dp) exceeds the GPUs the service may use.\"\"\"

`BUILTIN_RULES` is all the rest of the package knows of them: `RuleSet.ids` lists them in the
order they are registered (_builtin, then _shapes, _capacity and _drain), `disable = [...]` turns one
off by id, a repo rule may not take an id, and a finding cites the rule's source for the
service's server. A check returns what is wrong (`Failed`, an error unless it says "warning")
or None.

scope="service" checks one service: (its command, its model, the facts of its host).
scope="host" checks one service against another service of the same host: (its command, the
other's name, the other's command); it is called for both orders of every pair, so that a
conflict is reported on both services.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any, Literal, NamedTuple, overload

import msgspec

from ._command import Command
from ._hardware import Hardware
from ._message import Severity
from ._models import ModelInfo


class Failed(NamedTuple):
    """What a built-in check found wrong: the message, the fix and the severity of its finding."""

    message: str
    fix: str
    severity: Severity = "error"


class RuleFacts(msgspec.Struct, frozen=True):
    """What a service check knows of the host besides the command and the model (pure data).

    gpu_count: the host's GPU count (None: unknown). version: the server's version on the host
    (None: unknown). weights_bytes: the checkpoint's size on the host (the index's total_size,
    else the weight files' sizes; None: unknown). hardware: the GPUs' memory, holders and
    compute capability (None: not read, e.g. validate or a host without nvidia-smi). unit: the
    service's systemd unit, whose GPU memory is freed when it is replaced. drain_timeout: the
    service's declared drain timeout (None: no drain); stop_timeout: its unit's TimeoutStopSec=
    in seconds (None: unset, systemd's default; inf: none).
    """

    gpu_count: int | None = None
    version: str | None = None
    weights_bytes: int | None = None
    hardware: Hardware | None = None
    unit: str | None = None
    drain_timeout: float | None = None
    stop_timeout: float | None = None


ServiceCheck = Callable[[Command, ModelInfo, RuleFacts], Failed | None]
HostCheck = Callable[[Command, str, Command], Failed | None]


class BuiltinRule(msgspec.Struct, frozen=True):
    """A check written in Python (arithmetic, or across services), with its id and sources."""

    id: str
    sources: Mapping[str, str]       # server ("sglang", "vllm", "any") -> URL
    scope: Literal["service", "host"]
    check: Callable[..., Failed | None]   # a ServiceCheck or a HostCheck, as scope says

    def source(self, server: str | None) -> str:
        """The URL that justifies the rule for this server (else the general one)."""
        return self.sources.get(server or "any") or self.sources.get("any") or next(iter(self.sources.values()))


BUILTIN_RULES: dict[str, BuiltinRule] = {}


@overload
def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["service"] = "service") -> Callable[[ServiceCheck], ServiceCheck]: ...


@overload
def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["host"]) -> Callable[[HostCheck], HostCheck]: ...


def builtin(rule_id: str, *, sources: Mapping[str, str],
            scope: Literal["service", "host"] = "service") -> Callable[[Any], Any]:
    """Register the decorated check as built-in rule `rule_id`, justified by `sources`."""

    def register(check: Callable[..., Failed | None]) -> Callable[..., Failed | None]:
        if rule_id in BUILTIN_RULES:
            raise ValueError(f"built-in rule {rule_id!r} is registered twice")
        BUILTIN_RULES[rule_id] = BuiltinRule(rule_id, sources, scope, check)
        return check

    return register


def positive_int(value: object) -> int | None:
    """A config.json value that is a positive integer (not a bool), else None."""
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None
