"""Which server versions a pre-flight reads (host/versions.py `reads_for`): every server's where a
rule is bound to versions, and every SGLang server's in any case, since its release decides what
ready reads (plan/ready.py); none of a server whose release does not matter."""

from __future__ import annotations

from reconciler.desired.spec import ServiceSpec
from reconciler.host.versions import bound, reads_for
from reconciler.preflight import load_rules
from reconciler.values import replace

SGLANG = ServiceSpec("s", "[Service]\nExecStart=/opt/sglang/bin/python3 -m sglang.launch_server --model-path /m\n")
VLLM = ServiceSpec("v", "[Service]\nUser=llm\nExecStart=/opt/vllm/bin/vllm serve /m\n")
PLAIN = ServiceSpec("p", "[Service]\nExecStart=/usr/bin/sleep infinity\n")
SPECS = {"s": SGLANG, "v": VLLM, "p": PLAIN}


def test_without_rules_bound_to_versions_only_sglang_is_read():
    unbound = replace(load_rules(), rules=tuple(r for r in load_rules().rules if not r.versions))
    for rules in (None, unbound):
        assert not bound(rules)
        assert [(r.service, r.executable, r.module) for r in reads_for(SPECS, rules)] == [
            ("s", "/opt/sglang/bin/python3", "sglang")]


def test_with_a_rule_bound_to_versions_every_server_is_read():
    rules = load_rules()
    assert bound(rules)
    assert [(r.service, r.executable, r.module, r.user) for r in reads_for(SPECS, rules)] == [
        ("s", "/opt/sglang/bin/python3", "sglang", ""), ("v", "/opt/vllm/bin/vllm", "vllm", "llm")]
