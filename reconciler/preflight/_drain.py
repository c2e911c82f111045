"""Built-in rules about what a stop does to the requests in flight (issue 42): see
docs/preflight.md, "What a stop does to the requests in flight". Read from the engines' wheels
(../shared/reviews/2026-12-03-anchors.md §1.3-1.4): vLLM's v1/engine/core.py `_handle_shutdown`
(mode "abort"; --shutdown-timeout S > 0 lets them finish for up to S seconds) and SGLang's
tokenizer_manager.py `sigterm_watchdog` (it drains them on SIGTERM without a bound).

`RuleFacts.drain_timeout` (None: no drain) and `stop_timeout` (None: systemd's default) come
from the service (_check.py); `stop_timeout` parses systemd's time spans here.
"""

from __future__ import annotations

import math
import re

from ._command import Command, unit_entries
from ._registry import Failed, RuleFacts, builtin

DEFAULT_STOP = 90.0                  # systemd's DefaultTimeoutStopSec
RELEASE = 15.0                       # SGLang's _SCHEDULER_EXIT_TIMEOUT_SECS: schedulers release the GPUs
_VLLM_ARGS = "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/engine/arg_utils.py"
_VLLM_CORE = "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/engine/core.py"
_SGLANG_DRAIN = ("https://github.com/sgl-project/sglang/blob/v0.5.23/python/sglang/srt/managers/"
                 "tokenizer_manager.py")
_SYSTEMD = "https://www.freedesktop.org/software/systemd/man/latest/systemd.service.html#TimeoutStopSec="
_SPAN = re.compile(r"(\d+(?:\.\d+)?)\s*([a-zA-Z]*)")
_UNITS = {"": 1.0, "s": 1.0, "sec": 1.0, "second": 1.0, "seconds": 1.0, "ms": 1e-3, "msec": 1e-3, "us": 1e-6,
          "usec": 1e-6, "m": 60.0, "min": 60.0, "minute": 60.0, "minutes": 60.0, "h": 3600.0, "hr": 3600.0,
          "hour": 3600.0, "hours": 3600.0, "d": 86400.0, "day": 86400.0, "days": 86400.0, "w": 604800.0,
          "week": 604800.0, "weeks": 604800.0}


def timespan(text: str) -> float | None:
    """Seconds in a systemd time span ("90", "90s", "5min", "1min 30s", "infinity"); None when
    it is not one (systemd would refuse the unit; its own check says so)."""
    text = text.strip()
    if text == "infinity":
        return math.inf
    if not text or _SPAN.sub("", text).strip():
        return None
    total = 0.0
    for number, unit in _SPAN.findall(text):
        if unit not in _UNITS:
            return None
        total += float(number) * _UNITS[unit]
    return total


def stop_timeout(unit_text: str) -> float | None:
    """The unit's stop timeout: the last TimeoutStopSec= or TimeoutSec= of [Service] (None: unset,
    systemd's default; 0 means no timeout, as infinity)."""
    value: float | None = None
    for key, raw in unit_entries(unit_text):
        if key in ("TimeoutStopSec", "TimeoutSec") and raw:
            seconds = timespan(raw)
            value = math.inf if seconds == 0 else seconds if seconds is not None else value
    return value


def _shutdown_timeout(cmd: Command) -> int | None:
    return cmd.int_value("--shutdown-timeout", 0)


@builtin("vllm-stop-aborts-requests", sources={"vllm": _VLLM_CORE, "any": _VLLM_ARGS})
def _vllm_aborts(cmd: Command, _info: object, facts: RuleFacts) -> Failed | None:
    """vLLM with --shutdown-timeout 0 (its default) aborts every request in flight on stop, and no drain is declared."""
    if cmd.server != "vllm" or facts.drain_timeout is not None or _shutdown_timeout(cmd) != 0:
        return None
    given = "--shutdown-timeout 0" if cmd.has("--shutdown-timeout") else "no --shutdown-timeout (its default is 0)"
    return Failed(f"every restart aborts the requests in flight: vLLM with {given} aborts them on SIGTERM, and the "
                  f"service declares no drain",
                  "declare a drain (drain = { haproxy = ... }, or leave and rejoin: docs/drain.md) so that the host "
                  "leaves rotation and its work finishes before the stop, or give vLLM --shutdown-timeout S to let "
                  "them finish within S seconds", "warning")


@builtin("stop-timeout-shorter-than-drain", sources={"vllm": _VLLM_ARGS, "sglang": _SGLANG_DRAIN, "any": _SYSTEMD})
def _stop_cut_short(cmd: Command, _info: object, facts: RuleFacts) -> Failed | None:
    """TimeoutStopSec= is shorter than the server's own drain on stop: systemd kills it mid-drain."""
    stop = facts.stop_timeout if facts.stop_timeout is not None else DEFAULT_STOP
    if cmd.server == "vllm":
        drain = float(_shutdown_timeout(cmd) or 0)
        what = f"vLLM's --shutdown-timeout {drain:g}"
    elif cmd.server == "sglang" and facts.drain_timeout is not None:
        drain = facts.drain_timeout
        what = (f"the drain timeout ({drain:g}s): what is still in flight then, SGLang finishes during the stop, "
                f"without a bound of its own")
    else:
        return None
    if drain <= 0 or stop >= drain + RELEASE:
        return None
    set_as = "TimeoutStopSec (unset: systemd's default, 90s)" if facts.stop_timeout is None else \
        f"TimeoutStopSec={stop:g}s"
    return Failed(f"{set_as} is shorter than {what}, plus the {RELEASE:g}s the server takes to release its GPUs: "
                  f"systemd kills it mid-drain (SIGKILL), dropping those requests, and GPU memory may outlive it",
                  f"set TimeoutStopSec={math.ceil(drain + RELEASE)} or more in the unit's [Service], or "
                  f"shorten the drain", "warning")
