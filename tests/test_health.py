"""Pure health judges: systemd states (../shared/SYSTEMD.md) and the journal line picker."""

from __future__ import annotations

import json

import pytest

from reconciler.health import explain, judge_systemd, parse_journal


@pytest.mark.parametrize("props,baseline,state,reason", [
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "0"}, 0, "running", ""),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
      "NRestarts": "3"}, 3, "crashed", "CrashLoop"),          # the incident's state
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart-queued"}, 0, "crashed",
     "CrashLoop"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "3"}, 2, "crashed",
     "CrashLoop"),
    ({"LoadState": "loaded", "ActiveState": "active", "SubState": "running", "NRestarts": "2"}, 2, "running", ""),
    ({"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "exit-code",
      "NRestarts": "5"}, 0, "crashed", "CrashLoop"),            # start limit hit, Result still exit-code
    ({"LoadState": "bad-setting", "ActiveState": "inactive"}, 0, "not-loaded", "UnitNotLoaded"),
    ({"LoadState": "loaded", "ActiveState": "inactive", "SubState": "dead", "Result": "success"}, 0, "exited",
     "Exited"),
    ({"LoadState": "loaded", "ActiveState": "activating", "SubState": "start"}, 0, "starting", ""),
    ({}, 0, "starting", ""),                                    # missing keys are tolerated
])
def test_judge_systemd(props, baseline, state, reason):
    v = judge_systemd(props, baseline)
    assert (v.state, v.reason) == (state, reason)


# Captured on a test host (systemd 252): ExecStartPre= failing under Restart=always, and a
# Type=notify unit whose start timed out. Neither ever entered `active`.
PRE_FAILS = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "auto-restart", "Result": "exit-code",
             "NRestarts": "0", "ActiveEnterTimestampMonotonic": "0", "InvocationID": "4b6e"}
NOTIFY_TIMEOUT = {"LoadState": "loaded", "ActiveState": "failed", "SubState": "failed", "Result": "timeout",
                  "NRestarts": "0", "ActiveEnterTimestampMonotonic": "0", "InvocationID": "0522"}


@pytest.mark.parametrize("props,kw,state,reason", [
    (PRE_FAILS, {}, "crashed", "StartFailed"),
    (NOTIFY_TIMEOUT, {}, "crashed", "StartFailed"),
    # a restart of a unit that was active: it never became active again since our restart
    ({**PRE_FAILS, "ActiveEnterTimestampMonotonic": "1230"}, {"baseline_active_enter": "1230"}, "crashed",
     "StartFailed"),
    # it did become active again, then crashed: a crash loop
    ({**PRE_FAILS, "ActiveEnterTimestampMonotonic": "1240"}, {"baseline_active_enter": "1230"}, "crashed",
     "CrashLoop"),
    # our queued (--no-block) start has not begun: the old process's state says nothing yet
    ({**PRE_FAILS, "InvocationID": "old"}, {"baseline_invocation": "old"}, "starting", ""),
    ({"LoadState": "loaded", "ActiveState": "deactivating", "SubState": "stop-sigterm", "InvocationID": "old"},
     {"baseline_invocation": "old"}, "starting", ""),
    # a start that timed out, caught while systemd stops what never came up
    ({**NOTIFY_TIMEOUT, "ActiveState": "deactivating", "SubState": "stop-sigterm"}, {}, "crashed", "StartFailed"),
    # a bad unit is reported even before the start begins
    ({"LoadState": "bad-setting", "InvocationID": "old"}, {"baseline_invocation": "old"}, "not-loaded",
     "UnitNotLoaded"),
])
def test_judge_systemd_start_failures(props, kw, state, reason):
    v = judge_systemd(props, 0, **kw)
    assert (v.state, v.reason) == (state, reason)


INCIDENT = "MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1"


def test_explain_prefers_the_service_line_that_says_what_is_needed():
    lines = [("[standin] server_args=ServerArgs(model_path='/models/x')", True),
             ("Load weight begin. avail mem=79.1 GB", True),
             (INCIDENT, True),
             ("sglang-qwen.service: Main process exited, code=exited, status=1/FAILURE", False),
             ("sglang-qwen.service: Failed with result 'exit-code'.", False)]
    assert explain(lines) == INCIDENT


@pytest.mark.parametrize("line", [
    "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB",
    "RuntimeError: NCCL error in: ../torch/csrc/distributed/c10d/ProcessGroupNCCL.cpp:1970, unhandled system error",
    "OSError: [Errno 98] Address already in use",
])
def test_explain_picks_common_failures_over_noise(line):
    lines = [("Traceback (most recent call last):", True), ('  File "x.py", line 3, in <module>', True),
             (line, True), ("INFO: shutting down", True)]
    assert explain(lines) == line


def test_explain_falls_back_to_systemd_when_the_service_said_nothing():
    lines = [("m.service: Failed to locate executable /usr/bin/nope: No such file or directory", False),
             ("m.service: Failed with result 'exit-code'.", False)]
    assert "Failed to locate executable" in explain(lines)


def test_parse_journal_marks_systemd_lines_and_decodes_bytes():
    out = "\n".join(json.dumps(e) for e in [
        {"MESSAGE": "hello", "_PID": "42"},
        {"MESSAGE": "Started m.service.", "_PID": "1", "SYSLOG_IDENTIFIER": "systemd"},
        {"MESSAGE": list(b"caf\xc3\xa9 \xff"), "_PID": "42"},
    ])
    got = parse_journal(out)
    assert got[0] == ("hello", True) and got[1] == ("Started m.service.", False)
    assert got[2][0].startswith("café")
