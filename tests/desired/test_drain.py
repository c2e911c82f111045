"""The `drain` and `smoke` tables and `rollout.min_available` (issue 42): loaded into the spec,
merged over their layers, and every bad input a problem naming file and key."""

from __future__ import annotations

import pytest

from reconciler.desired import cache
from reconciler.desired.spec import CallSpec, InflightSpec, RolloutPolicy, SmokeCheck
from reconciler.errors import Problem
from reconciler.values import replace
from tests.desired.test_load import base_files, load, problems

DEFINITION = """\
unit_file = "units/server.service"
model = { id = "org/model", path = "/models/m" }
vars = { port = "30000" }
health = { http = "http://{host.address}:{vars.port}/health" }
"""
ALL = " (in service web on hosts a, b, c)"     # a problem found in the definition, for each host
HOSTS = {f"hosts/{n}.toml": f'address = "127.0.0.{i}"\n[services.web]\nuse = "server"\n'
         for n, i in (("a", 5), ("b", 6), ("c", 7))}
HAPROXY = """
[drain]
haproxy = { socket = "/run/haproxy/admin.sock", server = "models/{host.name}" }
inflight = { metric = "sglang:num_running_reqs" }
"""
SMOKE = """
[smoke]
[[smoke.checks]]
prompt = "The capital of France is"
expect = "Paris"
"""


def repo(definition_extra: str = "", **hosts: str) -> dict[str, str]:
    """Three hosts using services/server.toml; a host's file gets `hosts[name]` appended."""
    files = {**base_files({"services/server.toml": DEFINITION + definition_extra}), **HOSTS}
    for name, extra in hosts.items():
        files[f"hosts/{name}.toml"] += extra
    return files


def only(found: list[Problem]) -> Problem:
    assert len(found) == 1, "\n".join(map(str, found))
    return found[0]


# ---- good input -----------------------------------------------------------------------------


def test_haproxy_shorthand_stands_for_the_three_calls_on_each_host() -> None:
    state = load(repo(HAPROXY + SMOKE))
    a, c = state.hosts["a"].services["web"].drain, state.hosts["c"].services["web"].drain
    assert a is not None and c is not None
    assert a.leave == CallSpec(kind="haproxy", target="/run/haproxy/admin.sock", server="models/a",
                               input="set server models/a state drain", timeout=10.0)
    assert a.rejoin.input == "set server models/a state ready"
    assert a.serving is not None and (a.serving.input, a.serving.server) == ("show stat", "models/a")
    assert c.leave.input == "set server models/c state drain"
    # the metric is read where the health URL points, /metrics; the defaults
    assert a.inflight == InflightSpec(url="http://127.0.0.5:30000/metrics", metric="sglang:num_running_reqs")
    assert (a.timeout, a.interval) == (120.0, 1.0)
    smoke = state.hosts["b"].services["web"].smoke
    assert smoke is not None and smoke.url == "http://127.0.0.6:30000/v1"
    assert smoke.checks == (SmokeCheck(kind="completion", text="The capital of France is", expect="Paris"),)
    assert (smoke.model, smoke.ttft, smoke.timeout) == (None, None, 60.0)


def test_the_three_ways_of_a_call_render_their_placeholders() -> None:
    drain = """
[drain]
timeout = 45
interval = 0.5
leave = { controller = ["socat", "-", "UNIX-CONNECT:/run/lb.sock"], input = "disable server be/{host.name}\\n" }
serving = { host = "curl -sf http://{host.address}:{vars.port}/ready" }
inflight = { url = "http://{host.address}:{vars.port}/inflight" }
[drain.rejoin]
http = "http://127.0.0.1:9000/workers/{host.address}"
method = "PUT"
body = '{"port": {vars.port}}'
expect_status = 204
timeout = 5
"""
    d = load(repo(drain)).hosts["b"].services["web"].drain
    assert d is not None
    assert d.leave == CallSpec(kind="controller", argv=("socat", "-", "UNIX-CONNECT:/run/lb.sock"),
                               input="disable server be/b\n")
    assert d.rejoin == CallSpec(kind="http", target="http://127.0.0.1:9000/workers/127.0.0.6", method="PUT",
                                body='{"port": 30000}', expect_status=204, timeout=5.0)
    assert d.serving == CallSpec(kind="host", target="curl -sf http://127.0.0.6:30000/ready")
    assert d.inflight == InflightSpec(url="http://127.0.0.6:30000/inflight", metric=None)
    assert (d.timeout, d.interval) == (45.0, 0.5)
    assert d.leave.describe() == "run on the controller: socat - UNIX-CONNECT:/run/lb.sock <<< 'disable server be/b'"
    assert d.rejoin.describe() == "PUT http://127.0.0.1:9000/workers/127.0.0.6 (from the host)"


def test_a_host_overrides_drain_keys_and_replaces_a_call_whole() -> None:
    files = repo(HAPROXY + "timeout = 30\n", a='[services.web.drain]\ntimeout = 300\n',
                 b='[services.web.smoke]\nttft = 2\nmodel = "{model.id}"\n')
    files["services/server.toml"] += SMOKE
    state = load(files)
    a, b = state.hosts["a"].services["web"], state.hosts["b"].services["web"]
    assert a.drain is not None and a.drain.timeout == 300.0 and a.drain.leave.kind == "haproxy"
    assert b.drain is not None and b.drain.timeout == 30.0
    assert b.smoke is not None and (b.smoke.ttft, b.smoke.model) == (2.0, "org/model")
    assert len(b.smoke.checks) == 1            # the definition's checks, the host's own keys over them


def test_drain_and_smoke_restart_nothing_and_survive_the_cache() -> None:
    plain, declared = load(repo()), load(repo("rollout = { min_available = 2 }\n" + HAPROXY + SMOKE))
    for h in ("a", "b", "c"):
        assert plain.hosts[h].services["web"].content_hash() == declared.hosts[h].services["web"].content_hash()
    entry = cache.decode(cache.encode(cache.CacheEntry(cache.FORMAT, "t", "f", declared)))
    assert entry is not None
    again = entry.state
    assert again == declared
    assert again.hosts["a"].services["web"].rollout == RolloutPolicy(canary=1, max_unavailable="25%", min_available=2)


def test_min_available_joins_the_policy_and_its_description() -> None:
    state = load(repo('rollout = { canary = 1, max_unavailable = 1, min_available = 2 }\n'))
    policy = state.hosts["a"].services["web"].rollout
    assert policy.min_available == 2
    assert policy.describe() == "canary = 1, max_unavailable = 1, min_available = 2"
    assert replace(policy, min_available=None).describe() == "canary = 1, max_unavailable = 1"


# ---- bad input: one problem each, at its file and key -----------------------------------------


@pytest.mark.parametrize(("extra", "key", "message"), [
    ('rollout = { min_available = 3 }\n', "rollout.min_available",
     "min_available = 3 can never be met: web (services/server.toml) runs on 3 hosts (a, b, c), and a restart "
     "takes one of them out of service, so a rollout could never restart any; at most 2 (or add hosts)"),
    ('rollout = { min_available = 0 }\n', "rollout.min_available", "expected an integer >= 1, got 0"),
    ('[drain]\ntimeout = 10\n', "drain",
     "a drain needs haproxy = { socket, server }, or leave and rejoin: how the host leaves the balancer's "
     "rotation and comes back" + ALL),
    ('[drain]\nleave = { host = "true" }\n', "drain.leave",
     "leave needs rejoin too: a host that leaves rotation must have a way back" + ALL),
    ('[drain]\nrejoin = { host = "true" }\nleave = { host = "true", http = "http://x:1/" }\n', "drain.leave",
     "expected exactly one of http, controller and host (got http and host)"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { timeout = 3 }\n', "drain.leave",
     "expected exactly one of http, controller and host (got none)"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { http = "http://x:1/", input = "x" }\n', "drain.leave",
     "input goes with controller only, not with http"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { host = "true", method = "GET" }\n', "drain.leave",
     "method goes with http only, not with host"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { controller = [] }\n', "drain.leave.controller",
     'expected a command as a list of 1-64 words, like ["socat", "-", "UNIX-CONNECT:/run/haproxy/admin.sock"], '
     "got no words"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { controller = ["a\\nb"] }\n', "drain.leave.controller",
     "expected a non-empty single-line string (one word of the command, no shell), got 'a\\nb'"),
    ('[drain]\nrejoin = { host = "true" }\nleave = { http = "http://127.0.0.1/drain" }\n',
     "drain.leave.http", "expected an http(s) URL with a host and port, got 'http://127.0.0.1/drain': it needs "
                         "an explicit port, like http://{host.address}:30000/health" + ALL),
    ('[drain]\nhaproxy = { socket = "run/admin.sock", server = "a/b" }\n', "drain.haproxy.socket",
     "expected an absolute path without whitespace, like '/etc/credstore/hf_token', got 'run/admin.sock'"),
    ('[drain]\nhaproxy = { socket = "/run/a.sock", server = "models" }\n', "drain.haproxy.server",
     "expected '<backend>/<server>' as haproxy.cfg names them, like 'models/{host.name}', got 'models'"),
    ('[drain]\nhaproxy = { socket = "/run/a.sock", server = "m/{vars.nope}" }\n', "drain.haproxy.server",
     "unknown placeholder {vars.nope}: no such var (vars set: port)" + ALL),
    ('[drain]\nhaproxy = { socket = "/run/a.sock", server = "m/s" }\ninflight = { metric = "num running" }\n',
     "drain.inflight.metric",
     "expected a Prometheus metric name like 'vllm:num_requests_running' or 'sglang:num_running_reqs', "
     "got 'num running'"),
    ('[drain]\nhaproxy = { socket = "/run/a.sock", server = "m/s" }\ninflight = {}\n', "drain.inflight",
     "needs metric (a metric of the server's /metrics), or url (which answers a number)" + ALL),
    ('[drain]\nhaproxy = { socket = "/run/a.sock", server = "m/s" }\ntimeuot = 3\n', "drain.timeuot",
     "unknown key (did you mean 'timeout'? allowed: haproxy, leave, rejoin, serving, inflight, timeout, interval)"),
    ('[smoke]\nttft = 1\n', "smoke",
     "a smoke test needs checks: [[smoke.checks]] with prompt (or chat) and expect" + ALL),
    ('[smoke]\nchecks = []\n', "smoke.checks", "expected 1-10 checks, got 0"),
    ('[[smoke.checks]]\nprompt = "a"\nchat = "b"\nexpect = "c"\n', "smoke.checks[#1]",
     "expected exactly one of prompt (a completion) and chat (a chat completion)"),
    ('[[smoke.checks]]\nprompt = "a"\nexpect = " "\n', "smoke.checks[#1].expect",
     "expected the text the answer must hold (not empty), got ' '"),
    ('[[smoke.checks]]\nprompt = "a"\nexpect = "b"\nmax_tokens = 0\n', "smoke.checks[#1].max_tokens",
     "expected an integer 1-4096, got 0"),
    ('[smoke]\nttft = 60\n[[smoke.checks]]\nprompt = "a"\nexpect = "b"\n', "smoke.ttft",
     "60s is not shorter than the smoke timeout (60s): the limit could never be reached before the answer "
     "times out" + ALL),
])
def test_bad_drain_smoke_and_budget_name_file_and_key(extra: str, key: str, message: str) -> None:
    p = only(problems(repo(extra)))
    assert (p.file, p.key, p.message) == ("services/server.toml", key, message)


def test_more_than_ten_checks_is_refused() -> None:
    checks = "".join('[[smoke.checks]]\nprompt = "a"\nexpect = "b"\n' for _ in range(11))
    p = only(problems(repo(checks)))
    assert (p.key, p.message) == ("smoke.checks", "expected 1-10 checks, got 11")


def test_haproxy_in_the_definition_and_leave_on_a_host_conflict_where_the_haproxy_was_set() -> None:
    p = only(problems(repo(HAPROXY, b='[services.web.drain]\nleave = { host = "true" }\n'
                                      'rejoin = { host = "true" }\n')))
    assert (p.file, p.key) == ("services/server.toml", "drain.haproxy")
    assert p.message == ("set either haproxy or leave/rejoin (the calls it stands for), not both (leave is set in "
                         "hosts/b.toml) (in service web on host b)")


def test_without_a_health_url_the_metric_and_the_smoke_need_their_own_url() -> None:
    no_health = DEFINITION.replace('health = { http = "http://{host.address}:{vars.port}/health" }\n', "")
    assert no_health != DEFINITION
    files = {**repo(), "services/server.toml": no_health + HAPROXY + SMOKE}
    found = problems(files)
    assert [(p.file, p.key, p.message.split(" (in service")[0]) for p in found] == [
        ("services/server.toml", "drain.inflight",
         "needs url (where the metric is read), or metric with health.http set (then it is read at the health "
         "URL's host and port, /metrics)"),
        ("services/server.toml", "smoke",
         "needs url (the server's OpenAI API base, like http://{host.address}:30000/v1), or health.http set (then "
         "it is the health URL's host and port, /v1)"),
    ]


def test_the_budget_counts_a_host_whose_service_has_problems_of_its_own() -> None:
    files = repo('rollout = { min_available = 2 }\n')
    files.pop("hosts/c.toml")
    files["hosts/b.toml"] += '[services.web.drain]\nbogus = 1\n'
    found = problems(files)
    assert [(p.file, p.key) for p in found] == [("hosts/b.toml", "services.web.drain.bogus"),
                                                ("services/server.toml", "rollout.min_available")]
    assert "runs on 2 hosts (a, b)" in found[1].message


def test_min_available_on_a_service_without_a_definition_has_no_effect() -> None:
    host = ('address = "127.0.0.5"\n[services.web]\nunit_file = "units/server.service"\n'
            'model = { id = "org/model", path = "/models/m" }\nvars = { port = "30000" }\n'
            'rollout = { min_available = 1 }\n')
    p = only(problems(base_files({"hosts/a.toml": host})))
    assert (p.file, p.key) == ("hosts/a.toml", "services.web.rollout")
    assert p.message.startswith("has no effect here: only a service that uses a shared definition")
