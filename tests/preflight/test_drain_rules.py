"""The pre-flight's stop rules (preflight/_drain.py): vLLM's default stop aborts what is in flight
when no drain is declared; TimeoutStopSec shorter than the server's own drain on stop; and
systemd's time spans."""

from __future__ import annotations

import math

import pytest

from reconciler import preflight as pf
from reconciler.desired.spec import DrainSpec, ServiceSpec
from reconciler.preflight._drain import stop_timeout, timespan
from reconciler.values import replace
from tests.preflight.test_preflight import DRAINED, RULES, ids, sglang, unit, vllm

STOP_RULES = {"vllm-stop-aborts-requests", "stop-timeout-shorter-than-drain"}


def stop_findings(svc: ServiceSpec) -> list[pf.Finding]:
    return [f for f in pf.check_service(svc, rules=RULES, model_config=None, gpu_count=None)
            if f.rule_id in STOP_RULES]


def bare(svc: ServiceSpec, *, drain: DrainSpec | None = None, stop: str | None = None) -> ServiceSpec:
    """The service without the test helper's drain (or with this one), and a TimeoutStopSec= line."""
    text = svc.unit_text if stop is None else svc.unit_text.replace("[Service]\n", f"[Service]\n{stop}\n")
    return replace(svc, drain=drain, unit_text=text)


@pytest.mark.parametrize(("svc", "want"), [
    # vLLM's default: abort on SIGTERM, and nothing drains it first
    (bare(vllm()), ["vllm-stop-aborts-requests"]),
    (bare(vllm("--shutdown-timeout 0")), ["vllm-stop-aborts-requests"]),
    # a drain declared, or vLLM told to finish its work: no abort
    (vllm(), []),
    (bare(vllm("--shutdown-timeout 30")), []),
    # ... but a wait longer than systemd allows is killed mid-drain
    (bare(vllm("--shutdown-timeout 80")), ["stop-timeout-shorter-than-drain"]),
    (bare(vllm("--shutdown-timeout 80"), stop="TimeoutStopSec=95"), []),
    (bare(vllm("--shutdown-timeout 80"), stop="TimeoutStopSec=infinity"), []),
    (bare(vllm("--shutdown-timeout 80"), stop="TimeoutSec=2min"), []),
    (bare(vllm("--shutdown-timeout 30"), stop="TimeoutStopSec=30s"), ["stop-timeout-shorter-than-drain"]),
    # SGLang drains on SIGTERM without a bound: with a drain of 120 s, what it leaves needs the stop's time
    (sglang(), []),
    (bare(sglang(), drain=replace(DRAINED, timeout=120.0)), ["stop-timeout-shorter-than-drain"]),
    (bare(sglang(), drain=replace(DRAINED, timeout=60.0)), []),
    (bare(sglang(), drain=replace(DRAINED, timeout=120.0), stop="TimeoutStopSec=3min"), []),
])
def test_stop_rules(svc: ServiceSpec, want: list[str]) -> None:
    assert ids(stop_findings(svc)) == want


def test_the_abort_warning_says_why_and_how_to_fix_it() -> None:
    (f,) = stop_findings(bare(vllm()))
    assert (f.severity, f.blocking) == ("warning", False)
    assert f.message == ("every restart aborts the requests in flight: vLLM with no --shutdown-timeout (its default "
                         "is 0) aborts them on SIGTERM, and the service declares no drain")
    assert f.fix.startswith("declare a drain (drain = { haproxy = ... }, or leave and rejoin: docs/drain.md)")
    assert f.source == "https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/engine/core.py"


def test_the_stop_timeout_warning_names_both_numbers() -> None:
    (f,) = stop_findings(bare(sglang(), drain=replace(DRAINED, timeout=120.0), stop="TimeoutStopSec=1min"))
    assert f.message == ("TimeoutStopSec=60s is shorter than the drain timeout (120s): what is still in flight "
                         "then, SGLang finishes during the stop, without a bound of its own, plus the 15s the server "
                         "takes to release its GPUs: systemd kills it mid-drain (SIGKILL), dropping those requests, "
                         "and GPU memory may outlive it")
    assert f.fix == "set TimeoutStopSec=135 or more in the unit's [Service], or shorten the drain"
    (g,) = stop_findings(bare(vllm("--shutdown-timeout 80")))
    assert g.message.startswith("TimeoutStopSec (unset: systemd's default, 90s) is shorter than vLLM's "
                                "--shutdown-timeout 80, plus the 15s")


def test_validate_reports_them_as_warnings_never_problems() -> None:
    from reconciler.desired.spec import DesiredState, HostSpec, SSHSpec
    state = DesiredState("ab" * 20, {"h": HostSpec("h", SSHSpec("127.0.0.5"), {"vllm-qwen": bare(vllm())},
                                                   source="hosts/h.toml")})
    problems, warnings = pf.check_desired(state, RULES)
    assert problems == []
    assert [w for w in warnings if "vllm-stop-aborts-requests" in w] == [
        "hosts/h.toml: services.vllm-qwen: warning: vllm-stop-aborts-requests: every restart aborts the requests in "
        "flight: vLLM with no --shutdown-timeout (its default is 0) aborts them on SIGTERM, and the service declares "
        "no drain. Fix: declare a drain (drain = { haproxy = ... }, or leave and rejoin: docs/drain.md) so that the "
        "host leaves rotation and its work finishes before the stop, or give vLLM --shutdown-timeout S to let them "
        "finish within S seconds (source: https://github.com/vllm-project/vllm/blob/v0.33.0/vllm/v1/engine/core.py)"]


def test_a_repo_can_turn_them_off() -> None:
    from tests.preflight.test_preflight import Snap
    rules = pf.load_rules(Snap({"rules/quiet.toml": 'disable = ["vllm-stop-aborts-requests"]\n'}))
    assert [f for f in pf.check_service(bare(vllm()), rules=rules, model_config=None, gpu_count=None)
            if f.rule_id in STOP_RULES] == []


@pytest.mark.parametrize(("text", "seconds"), [
    ("90", 90.0), ("90s", 90.0), ("5min", 300.0), ("1min 30s", 90.0), ("2h", 7200.0), ("500ms", 0.5),
    ("1m30s", 90.0), ("infinity", math.inf), ("", None), ("soon", None), ("5 parsecs", None), ("-3", None),
])
def test_timespan(text: str, seconds: float | None) -> None:
    assert timespan(text) == seconds


def test_stop_timeout_reads_the_last_setting_and_zero_is_no_timeout() -> None:
    assert stop_timeout(unit("/bin/true")) is None
    assert stop_timeout(unit("/bin/true", "TimeoutSec=30", "TimeoutStopSec=2min")) == 120.0
    assert stop_timeout(unit("/bin/true", "TimeoutStopSec=2min", "TimeoutSec=30")) == 30.0
    assert stop_timeout(unit("/bin/true", "TimeoutStopSec=0")) == math.inf
