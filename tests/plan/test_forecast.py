"""plan/forecast.py: a host's unavailable seconds before a change, from its own last measured
steps and the drain; a rollout's host-seconds and wall time; the cost measured after."""

from __future__ import annotations

import pytest

from reconciler.plan.drain import StepKind
from reconciler.plan.forecast import (
    BOUND,
    FIXED,
    MEASURED,
    UNMEASURED,
    Part,
    forecast_host,
    forecast_rollout,
)
from reconciler.values import replace
from tests.plan.test_drain_steps import BASE, FULL, HAPROXY

K = StepKind
MEASURED_FULL = {K.LEAVE: 0.1, K.DRAIN: 12.0, K.STOP: 3.0, K.START: 0.2, K.READY: 80.0, K.SMOKE: 1.4,
                 K.REJOIN: 0.1, K.SERVING: 0.6}


def test_a_host_measured_before_is_forecast_step_by_step() -> None:
    f = forecast_host("gpu-1", FULL, MEASURED_FULL)
    assert f.seconds == pytest.approx(97.4)
    assert f.measured
    assert f.describe() == ("gpu-1 qwen: 97s unavailable (leave 0s measured, drain 12s measured, stop 3s measured, "
                            "start 0s measured, ready 80s measured, smoke 1s measured, rejoin 0s measured, "
                            "serving 1s measured)")


def test_never_measured_the_load_is_its_startup_bound_and_the_forecast_says_about() -> None:
    f = forecast_host("gpu-1", BASE, {})
    assert f.parts == (Part(K.STOP, 0.0, UNMEASURED), Part(K.START, 0.0, UNMEASURED), Part(K.READY, 600.0, BOUND))
    assert not f.measured
    assert f.describe() == "gpu-1 qwen: about 600s unavailable (ready 600s bound)"


def test_a_drain_without_an_inflight_read_is_its_timeout() -> None:
    spec = replace(FULL, drain=replace(HAPROXY, inflight=None, timeout=30.0))
    f = forecast_host("gpu-1", spec, {K.READY: 80.0, K.STOP: 2.0})
    drain = next(p for p in f.parts if p.step is K.DRAIN)
    assert drain == Part(K.DRAIN, 30.0, FIXED)
    assert f.seconds == pytest.approx(112.0)


def test_a_first_start_costs_no_stop() -> None:
    f = forecast_host("gpu-1", BASE, {K.STOP: 3.0, K.READY: 50.0, K.START: 0.5}, running=False)
    assert [p.step for p in f.parts] == [K.START, K.READY] and f.seconds == 50.5
    assert [p.basis for p in f.parts] == [MEASURED, MEASURED]


def test_a_rollout_costs_its_hosts_and_its_waves_one_after_another() -> None:
    hosts = {h: forecast_host(h, BASE, {K.STOP: 0.0, K.START: 0.0, K.READY: s})
             for h, s in (("a", 60.0), ("b", 90.0), ("c", 75.0))}
    r = forecast_rollout([["a"], ["b", "c"]], hosts)
    assert (r.host_seconds, r.wall_seconds) == (225.0, 150.0)
    assert r.describe() == "225 host-seconds unavailable over 3 hosts, 150s in all"
    assert forecast_rollout([["a"], ["x"]], hosts).wall_seconds == 60.0      # a host not forecast costs nothing
    guessed = forecast_rollout([["a"], ["y"]], {**hosts, "y": forecast_host("y", BASE, {})})
    assert guessed.describe() == "about 660 host-seconds unavailable over 2 hosts, about 660s in all"

