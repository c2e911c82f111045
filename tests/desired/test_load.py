"""load.load_desired: TOML files in memory -> DesiredState, or ConfigError naming file and key."""

from __future__ import annotations

from pathlib import Path

import pytest

from reconciler.desired.load import HEADER, MemorySnapshot, dotted, load_desired
from reconciler.desired.spec import DesiredState
from reconciler.errors import ConfigError, Problem

EXAMPLE = Path(__file__).resolve().parents[2] / "desired-state"
KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAICAdCaxAZ4iUdq6+pd5a/yu2sIc3kEhzg+RQQqCtivEF"

UNIT = """\
[Unit]
Description=demo {service.name} on {host.name}

[Service]
ExecStart=/usr/bin/server --model {model.path} --name {model.id} --host {host.address} --port {vars.port}
Environment=KEEP=${HOME} %i {not.a.placeholder} {vars}
"""

DEFINITION = """\
unit_file = "units/server.service"
model = { id = "org/model", path = "/models/m" }
env = { LOG = "info", SHARED = "yes" }
vars = { port = "30000" }
[health]
http = "http://{host.address}:{vars.port}/health"
interval = 3
"""


def base_files(overrides: dict[str, str | None] | None = None) -> dict[str, str]:
    """A small valid repo; overrides replace files by path (None removes one)."""
    files: dict[str, str | None] = {
        "fleet.toml": '[ssh]\nuser = "deploy"\nknown_hosts = "known_hosts"\n[health]\nstable_for = 7\n',
        "known_hosts": f"# comment\n127.0.0.5 {KEY}\n",
        "services/server.toml": DEFINITION,
        "units/server.service": UNIT,
        "hosts/a.toml": 'address = "127.0.0.5"\n[services.web]\nuse = "server"\n',
    }
    files.update(overrides or {})
    return {k: v for k, v in files.items() if v is not None}


def load(files: dict[str, str]) -> DesiredState:
    return load_desired(MemorySnapshot(files, revision="ab" * 20))


def problems(files: dict[str, str]) -> list[Problem]:
    with pytest.raises(ConfigError) as info:
        load(files)
    return info.value.problems


def find(problems: list[Problem], file: str, key: str) -> Problem:
    """The one problem at file/key (failing with the whole list when there is none)."""
    matches = [p for p in problems if p.file == file and p.key == key]
    assert matches, f"no problem at {file} {key}; got:\n" + "\n".join(map(str, problems))
    return matches[0]


# ---- good input -----------------------------------------------------------------------------


def test_good_fleet_loads_and_renders_placeholders() -> None:
    state = load(base_files())
    assert state.revision == "ab" * 20 and state.short == "abababa"
    host = state.hosts["a"]
    assert host.source == "hosts/a.toml"
    assert (host.ssh.address, host.ssh.port, host.ssh.user) == ("127.0.0.5", 22, "deploy")
    assert host.ssh.known_hosts_file == "known_hosts" and KEY in (host.ssh.known_hosts or "")
    web = host.services["web"]
    assert web.definition == "server"
    assert web.source == "hosts/a.toml + services/server.toml"
    assert web.unit_text.startswith(HEADER.format(source="units/server.service"))
    assert "Description=demo web on a\n" in web.unit_text
    assert "ExecStart=/usr/bin/server --model /models/m --name org/model --host 127.0.0.5 --port 30000\n" in (
        web.unit_text
    )
    # systemd's own syntax and other braces pass through untouched.
    assert "Environment=KEEP=${HOME} %i {not.a.placeholder} {vars}\n" in web.unit_text
    assert web.unit_text.endswith("{vars}\n") and not web.unit_text.endswith("\n\n")
    assert web.health.http == "http://127.0.0.5:30000/health"
    assert (web.health.interval, web.health.stable_for, web.health.startup_timeout) == (3.0, 7.0, 1200.0)
    assert web.model is not None and (web.model.id, web.model.path) == ("org/model", "/models/m")
    assert web.env == {"LOG": "info", "SHARED": "yes"}
    assert state.settings.concurrency == 20


def test_minimal_repo_without_fleet_toml_uses_defaults() -> None:
    files = {
        "hosts/h.toml":
            'address = "gpu-01.example.org"\n[services.s]\nunit = """\n[Service]\nExecStart=/bin/true\n"""\n'
    }
    state = load(files)
    host = state.hosts["h"]
    assert (host.ssh.user, host.ssh.port, host.ssh.known_hosts, host.ssh.known_hosts_file) == ("root", 22, None, None)
    service = host.services["s"]
    assert service.unit_text == HEADER.format(source="hosts/h.toml") + "[Service]\nExecStart=/bin/true\n"
    assert service.definition is None and service.source == "hosts/h.toml"
    assert service.model is None and service.health.http is None and service.health.expect_status == 200


def test_host_with_no_services_is_valid() -> None:
    state = load({"hosts/empty.toml": 'address = "127.0.0.9"\n'})
    assert state.hosts["empty"].services == {}


def test_host_overrides_merge_key_by_key() -> None:
    host = """\
address = "127.0.0.5"
labels = { rack = "r1", gpu = "h200" }
[ssh]
port = 2222
user = "ops"
host_key = "%s"
[services.web]
use = "server"
env = { LOG = "debug", EXTRA = "1" }
vars = { port = "31000" }
model = { path = "/data/m" }
[services.web.health]
expect_status = 204
body_contains = "ok"
""" % KEY  # noqa: UP031 -- %-formatting leaves the TOML's inline-table braces as they are
    fleet = 'concurrency = 3\n[health]\ninterval = 9\nstable_for = 0\n'
    state = load(base_files({"hosts/a.toml": host, "fleet.toml": fleet}))
    h = state.hosts["a"]
    assert (h.ssh.port, h.ssh.user, h.ssh.host_key) == (2222, "ops", KEY)
    assert h.labels == {"rack": "r1", "gpu": "h200"}
    web = h.services["web"]
    assert web.env == {"LOG": "debug", "SHARED": "yes", "EXTRA": "1"}
    assert web.model is not None and (web.model.id, web.model.path) == ("org/model", "/data/m")
    assert "--model /data/m " in web.unit_text and "--port 31000\n" in web.unit_text
    # health: fleet (stable_for) < definition (interval, http) < host (expect_status, body)
    assert web.health.http == "http://127.0.0.5:31000/health"
    assert (web.health.interval, web.health.stable_for) == (3.0, 0.0)
    assert (web.health.expect_status, web.health.body_contains) == (204, "ok")
    assert state.settings.concurrency == 3


def test_host_inline_unit_replaces_definitions_unit_file() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nunit = "[Service]\\nExecStart=/bin/x {vars.port}"\n'
    web = load(base_files({"hosts/a.toml": host})).hosts["a"].services["web"]
    assert web.unit_text == HEADER.format(source="hosts/a.toml") + "[Service]\nExecStart=/bin/x 30000\n"


def test_placeholders_in_env_and_vars() -> None:
    host = """\
address = "127.0.0.5"
[services.web]
use = "server"
vars = { url = "http://{host.address}:8000/{service.name}" }
env = { URL = "{vars.url}", MODEL = "{model.id}", LITERAL = "${HOME} {x.y}" }
"""
    web = load(base_files({"hosts/a.toml": host})).hosts["a"].services["web"]
    assert web.env["URL"] == "http://127.0.0.5:8000/web"
    assert web.env["MODEL"] == "org/model"
    assert web.env["LITERAL"] == "${HOME} {x.y}"


def test_float_and_int_accepted_for_seconds() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nhealth = { startup_timeout = 1.5, interval = 1 }\n'
    web = load(base_files({"hosts/a.toml": host})).hosts["a"].services["web"]
    assert (web.health.startup_timeout, web.health.interval) == (1.5, 1.0)


def test_unit_text_ends_with_exactly_one_newline() -> None:
    files = base_files({"units/server.service": "[Service]\nExecStart=/bin/true\n\n\n"})
    web = load(files).hosts["a"].services["web"]
    assert web.unit_text.endswith("ExecStart=/bin/true\n")


def test_readme_and_dotfiles_in_hosts_are_ignored() -> None:
    state = load(base_files({"hosts/README.md": "# hosts", "hosts/.gitkeep": ""}))
    assert list(state.hosts) == ["a"]


def test_memory_snapshot_lists_files_directly_inside() -> None:
    snap = MemorySnapshot({"a/b.toml": "x", "a/c/d.toml": "y", "/e": b"z"})
    assert snap.list("a") == ["b.toml"] and snap.list("") == ["e"] and snap.list("nope") == []
    assert snap.read("a/b.toml") == b"x" and snap.read("a/zz") is None and snap.read("e") == b"z"


def test_dotted_quotes_keys_that_are_not_bare() -> None:
    assert dotted("services", "x.service", "env", "A") == 'services."x.service".env.A'


# ---- the example repository users copy ------------------------------------------------------


def example_snapshot() -> MemorySnapshot:
    files = {str(p.relative_to(EXAMPLE)): p.read_bytes() for p in EXAMPLE.rglob("*") if p.is_file()}
    return MemorySnapshot(files)


def test_example_desired_state_renders_two_hosts() -> None:
    state = load_desired(example_snapshot())
    assert sorted(state.hosts) == ["h2", "h3"]
    for name, address in (("h2", "127.0.0.2"), ("h3", "127.0.0.3")):
        host = state.hosts[name]
        assert (host.ssh.address, host.ssh.port, host.ssh.user) == (address, 22, "root")
        assert host.ssh.known_hosts_file == "known_hosts"
        service = host.services["sglang-qwen"]
        assert (
            "ExecStart=/opt/sglang/bin/python3 -m sglang.launch_server \\\n"
            "    --model-path /models/Qwen3.5-122B-A10B --served-model-name Qwen/Qwen3.5-122B-A10B \\\n"
            f"    --host {address} --port 30000 \\\n    --tp-size 4 "
        ) in service.unit_text
        assert "{" not in service.unit_text
        assert service.health.http == f"http://{address}:30000/health"
        assert service.health.startup_timeout == 1800.0 and service.definition == "sglang-qwen"
        assert service.env["CUDA_VISIBLE_DEVICES"] == "0,1,2,3" and service.model is not None
        vllm = host.services["vllm-qwen3-8b"]
        assert "ExecStart=/opt/vllm/bin/vllm serve /models/Qwen3-8B --served-model-name Qwen/Qwen3-8B" \
            in vllm.unit_text and vllm.health.http == f"http://{address}:8000/health"
    assert state.hosts["h2"].services["sglang-qwen"].env["SGLANG_LOG_LEVEL"] == "info"
    assert state.hosts["h3"].services["sglang-qwen"].env["SGLANG_LOG_LEVEL"] == "debug"
    h2, h3 = (state.hosts[h].services["sglang-qwen"] for h in ("h2", "h3"))
    assert h2.content_hash() != h3.content_hash()


def test_example_uses_only_loopback_addresses() -> None:
    import re

    for path in EXAMPLE.rglob("*"):
        if path.is_file():
            text = path.read_text()
            assert not re.search(r"\b(10\.\d+|172\.(1[6-9]|2\d|3[01])|192\.168)\.\d+\.\d+", text), path


# ---- bad input: each names the file and the key ---------------------------------------------


def test_missing_address() -> None:
    p = find(problems(base_files({"hosts/a.toml": '[services.web]\nuse = "server"\n'})), "hosts/a.toml", "address")
    assert p.message == "required key missing"


def test_unknown_top_level_key_lists_allowed_keys() -> None:
    p = find(problems(base_files({"hosts/a.toml": 'address = "127.0.0.5"\nadress = "x"\n'})), "hosts/a.toml", "adress")
    assert "unknown key" in p.message and "address, labels, ssh, services" in p.message
    assert "did you mean 'address'" in p.message


def test_unknown_nested_key() -> None:
    host = 'address = "127.0.0.5"\n[services.x]\nuse = "server"\n[services.x.helth]\nhttp = "http://a:1/"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.x.helth")
    assert "unknown key" in p.message and "'health'" in p.message


def test_known_hosts_is_not_allowed_per_host() -> None:
    host = 'address = "127.0.0.5"\n[ssh]\nknown_hosts = "kh"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "ssh.known_hosts")
    assert "fleet.toml" in p.message


def test_port_as_string_is_rejected() -> None:
    host = 'address = "127.0.0.5"\n[ssh]\nport = "22"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "ssh.port")
    assert p.message == "expected an integer 1-65535, got '22'"


@pytest.mark.parametrize("port", ["0", "70000", "true", "22.0"])
def test_port_out_of_range_or_wrong_type(port: str) -> None:
    p = find(problems(base_files({"fleet.toml": f"[ssh]\nport = {port}\n"})), "fleet.toml", "ssh.port")
    assert p.message.startswith("expected an integer 1-65535, got ")


def test_newline_in_env_value_never_shows_the_value() -> None:
    secret = "hf_SeCrEt"
    host = f'address = "127.0.0.5"\n[services.web]\nuse = "server"\nenv = {{ HF_TOKEN = "{secret}\\nX" }}\n'
    with pytest.raises(ConfigError) as raised:
        load(base_files({"hosts/a.toml": host}))
    error = raised.value
    p = find(error.problems, "hosts/a.toml", "services.web.env.HF_TOKEN")
    assert "newline" in p.message
    assert secret not in str(error) and secret not in repr(error.problems)


def test_env_value_of_wrong_type_never_shows_the_value() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nenv = { PIN = 987654 }\n'
    with pytest.raises(ConfigError) as raised:
        load(base_files({"hosts/a.toml": host}))
    error = raised.value
    p = find(error.problems, "hosts/a.toml", "services.web.env.PIN")
    assert p.message.startswith("expected a string, got an integer") and "987654" not in str(error)


def test_unknown_key_with_secret_value_never_shows_the_value() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nevn = { TOKEN = "hf_SeCrEt" }\n'
    with pytest.raises(ConfigError) as raised:
        load(base_files({"hosts/a.toml": host}))
    error = raised.value
    assert find(error.problems, "hosts/a.toml", "services.web.evn")
    assert "hf_SeCrEt" not in str(error)


def test_tab_in_env_value_is_fine_but_control_chars_are_not() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nenv = { A = "x\\ty", B = "x\\u0000", C = "\\r" }\n'
    probs = problems(base_files({"hosts/a.toml": host}))
    find(probs, "hosts/a.toml", "services.web.env.B")
    find(probs, "hosts/a.toml", "services.web.env.C")
    assert not [p for p in probs if p.key.endswith("env.A")]


def test_bad_env_key() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nenv = { "1BAD" = "x", "A-B" = "y" }\n'
    probs = problems(base_files({"hosts/a.toml": host}))
    assert "invalid name" in find(probs, "hosts/a.toml", 'services.web.env.1BAD').message
    find(probs, "hosts/a.toml", 'services.web.env.A-B')


def test_missing_unit_file() -> None:
    probs = problems(base_files({"units/server.service": None}))
    p = find(probs, "services/server.toml", "unit_file")
    assert "'units/server.service' not found" in p.message


def test_missing_unit_file_named_in_host() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nunit_file = "units/nope.service"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.unit_file")
    assert "units/nope.service" in p.message


def test_both_unit_and_unit_file() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nunit_file = "units/server.service"\nunit = "[Service]"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.unit")
    assert "not both" in p.message


def test_both_in_an_unused_definition() -> None:
    files = base_files({"services/other.toml": 'unit_file = "units/server.service"\nunit = "[Service]"\n'})
    find(problems(files), "services/other.toml", "unit")


def test_neither_unit_nor_unit_file() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nenv = { A = "1" }\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web")
    assert p.message.startswith("no unit")


def test_unit_without_service_section() -> None:
    files = base_files({"units/server.service": "[Unit]\nDescription=x\n"})
    p = find(problems(files), "units/server.service", "")
    assert p.message == "not a service unit: no [Service] section"


def test_toml_syntax_error_reports_line_and_column() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = \n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "")
    assert p.message.startswith("TOML syntax error at line 3, column ")


def test_toml_duplicate_key() -> None:
    p = find(problems(base_files({"fleet.toml": "concurrency = 1\nconcurrency = 2\n"})), "fleet.toml", "")
    assert "line 2" in p.message


@pytest.mark.parametrize("name", ["a;b", "x.service", "web@1", "-x", "a b", "$(id)"])
def test_bad_service_names(name: str) -> None:
    host = f'address = "127.0.0.5"\n[services."{name}"]\nuse = "server"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", dotted("services", name))
    assert p.message.startswith("invalid name: expected a service name")


@pytest.mark.parametrize("name", ["bad name", "a;b", "-x"])
def test_bad_host_file_names(name: str) -> None:
    files = base_files({f"hosts/{name}.toml": 'address = "127.0.0.6"\n'})
    p = find(problems(files), f"hosts/{name}.toml", "")
    assert "invalid host name" in p.message


@pytest.mark.parametrize(
    "address", ["", "a b", "127.0.0.1; rm -rf /", "$(id)", "-oProxyCommand=x", "host_name", "127.0.0.999"]
)
def test_bad_addresses(address: str) -> None:
    files = base_files({"hosts/a.toml": f"address = {address!r}\n".replace("'", '"')})
    p = find(problems(files), "hosts/a.toml", "address")
    assert p.message.startswith("expected an IP address or hostname")


def test_ipv6_address_is_accepted() -> None:
    assert load(base_files({"hosts/a.toml": 'address = "::1"\n'})).hosts["a"].ssh.address == "::1"


def test_unknown_placeholder_in_unit_file() -> None:
    files = base_files({"units/server.service": "[Service]\nExecStart=/bin/x {vars.nope} {host.foo}\n"})
    probs = problems(files)
    messages = [p.message for p in probs if p.file == "units/server.service"]
    assert any("line 2" in m and "{vars.nope}" in m and "port" in m and "service web on host a" in m for m in messages)
    assert any("{host.foo}" in m and "{host.name}" in m for m in messages)


def test_model_placeholder_without_model() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nunit = "[Service]\\nExecStart=/bin/x {model.path}"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.unit")
    assert "{model.path}" in p.message and "no model" in p.message and "line 2" in p.message


def test_unknown_placeholder_in_env_names_the_key() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nenv = { A = "{vars.nope}" }\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.env.A")
    assert "{vars.nope}" in p.message


def test_vars_cannot_refer_to_vars() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nvars = { b = "{vars.port}" }\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.vars.b")
    assert "vars cannot refer to other vars" in p.message


def test_same_problem_in_a_shared_file_is_reported_once_for_all_hosts() -> None:
    files = base_files({"units/server.service": "[Service]\nExecStart=/bin/x {vars.nope}\n"})
    files["hosts/b.toml"] = 'address = "127.0.0.6"\n[services.web]\nuse = "server"\n'
    probs = [p for p in problems(files) if p.file == "units/server.service"]
    assert len(probs) == 1 and probs[0].message.endswith("(in service web on hosts a, b)")


def test_unknown_use_lists_available_definitions() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "servr"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.use")
    assert "'servr'" in p.message and "available: server" in p.message


def test_unused_definition_is_still_validated() -> None:
    files = base_files({"services/spare.toml": 'unit_file = "units/server.service"\nenv = { X = 1 }\nport = 3\n'})
    probs = problems(files)
    find(probs, "services/spare.toml", "env.X")
    assert "allowed: unit_file" in find(probs, "services/spare.toml", "port").message


def test_use_inside_a_definition_is_rejected() -> None:
    files = base_files({"services/spare.toml": 'use = "server"\n'})
    assert "cannot `use`" in find(problems(files), "services/spare.toml", "use").message


def test_incomplete_model_after_merge() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nunit = "[Service]"\nmodel = { id = "m" }\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.model.path")
    assert p.message.startswith("required key missing")


def test_model_path_must_be_absolute() -> None:
    host = 'address = "127.0.0.5"\n[services.web]\nuse = "server"\nmodel = { path = "models/m" }\n'
    find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.model.path")


@pytest.mark.parametrize(
    ("health", "key", "expected"),
    [
        ('http = "ftp://x:1/"', "http", "expected an http:// or https:// URL"),
        ('http = "http://{host.address}/health"', "http", "explicit port"),
        ("startup_timeout = 0", "startup_timeout", "expected a number of seconds > 0"),
        ("interval = -1", "interval", "expected a number of seconds > 0"),
        ("stable_for = -1", "stable_for", "expected a number of seconds >= 0"),
        ("expect_status = 99", "expect_status", "expected an HTTP status code 100-599"),
        ('startup_timeout = "10"', "startup_timeout", "got '10'"),
    ],
)
def test_bad_health_values(health: str, key: str, expected: str) -> None:
    host = f'address = "127.0.0.5"\n[services.web]\nuse = "server"\n[services.web.health]\n{health}\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", f"services.web.health.{key}")
    assert expected in p.message


def test_bad_host_key() -> None:
    host = 'address = "127.0.0.5"\n[ssh]\nhost_key = "ssh-ed25519 notbase64!"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "ssh.host_key")
    assert "ssh-ed25519 AAAA" in p.message


def test_host_key_type_must_match_key_data() -> None:
    host = f'address = "127.0.0.5"\n[ssh]\nhost_key = "ssh-rsa {KEY.split()[1]}"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "ssh.host_key")
    assert "'ssh-ed25519', not 'ssh-rsa'" in p.message


def test_missing_known_hosts_file() -> None:
    p = find(problems(base_files({"known_hosts": None})), "fleet.toml", "ssh.known_hosts")
    assert "'known_hosts' not found" in p.message


def test_malformed_known_hosts_line() -> None:
    p = find(problems(base_files({"known_hosts": "# ok\n127.0.0.5 ssh-ed25519\n"})), "known_hosts", "")
    assert p.message.startswith("line 2:")


@pytest.mark.parametrize("path", ["/etc/passwd", "../x", "a//b", "a/./b"])
def test_unit_file_must_be_a_repo_path(path: str) -> None:
    host = f'address = "127.0.0.5"\n[services.web]\nunit_file = "{path}"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "services.web.unit_file")
    assert "a path inside the repository" in p.message


def test_bad_labels_and_concurrency() -> None:
    files = base_files({
        "hosts/a.toml": 'address = "127.0.0.5"\nlabels = { "a b" = "x", ok = "y z" }\n',
        "fleet.toml": "concurrency = 0\n",
    })
    probs = problems(files)
    find(probs, "hosts/a.toml", 'labels."a b"')
    find(probs, "hosts/a.toml", "labels.ok")
    assert find(probs, "fleet.toml", "concurrency").message == "expected an integer >= 1, got 0"


def test_table_expected() -> None:
    host = 'address = "127.0.0.5"\nssh = "root@x"\n'
    p = find(problems(base_files({"hosts/a.toml": host})), "hosts/a.toml", "ssh")
    assert p.message == "expected a table, got a string"


def test_no_hosts() -> None:
    assert "no hosts" in find(problems({"fleet.toml": ""}), "hosts/", "").message


def test_non_toml_file_in_hosts() -> None:
    files = base_files({"hosts/b.tml": 'address = "127.0.0.6"\n'})
    assert "not a .toml file" in find(problems(files), "hosts/b.tml", "").message


def test_duplicate_address() -> None:
    files = base_files({"hosts/b.toml": 'address = "127.0.0.5"\n'})
    assert "hosts/a.toml" in find(problems(files), "hosts/b.toml", "address").message


def test_problems_across_files_are_all_reported() -> None:
    files = base_files({
        "fleet.toml": "[ssh]\nport = \"x\"\n",
        "hosts/a.toml": 'address = "127.0.0.5"\n[services.web]\nuse = "nope"\n',
        "hosts/b.toml": "adress = 1\n",
        "hosts/c.toml": "[broken\n",
        "services/server.toml": 'unit_file = "units/gone.service"\n',
    })
    probs = problems(files)
    find(probs, "fleet.toml", "ssh.port")
    find(probs, "hosts/a.toml", "services.web.use")
    find(probs, "hosts/b.toml", "address")
    find(probs, "hosts/b.toml", "adress")
    find(probs, "hosts/c.toml", "")
    find(probs, "services/server.toml", "unit_file")
    assert len(probs) == 6
    text = str(ConfigError(probs))
    assert "hosts/b.toml: adress: unknown key" in text


def test_rest_of_a_bad_host_file_is_still_checked() -> None:
    host = 'address = "127.0.0.5"\n[ssh]\nport = "22"\n[services.web]\nuse = "nope"\n[services.ok]\nuse = "server"\n'
    probs = problems(base_files({"hosts/a.toml": host}))
    find(probs, "hosts/a.toml", "ssh.port")
    find(probs, "hosts/a.toml", "services.web.use")
    assert len(probs) == 2


def test_a_bad_service_gives_no_follow_on_problems() -> None:
    # A bad unit_file path is one problem, not also "no unit".
    host = 'address = "127.0.0.5"\n[services.web]\nunit_file = "/etc/x.service"\n'
    probs = problems(base_files({"hosts/a.toml": host}))
    assert [(p.file, p.key) for p in probs] == [("hosts/a.toml", "services.web.unit_file")]


def test_example_hosts_differ_in_one_env_value() -> None:
    state = load_desired(example_snapshot())
    h2, h3 = (state.hosts[h].services["sglang-qwen"] for h in ("h2", "h3"))
    assert {k for k in h2.env if h2.env[k] != h3.env.get(k)} == {"SGLANG_LOG_LEVEL"}
    assert h2.unit_text.replace("127.0.0.2", "127.0.0.3") == h3.unit_text
