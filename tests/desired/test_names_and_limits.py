"""Names validated whole (review M4: a trailing newline passed every `^...$` pattern), names
reserved for the reconciler's own units (L3), a problem's text redacted (M3), and TOML parse
bombs as problems of their file (L6): each a ConfigError naming file and key, never a traceback."""

from __future__ import annotations

import pytest

from reconciler.desired import fields, toml_files
from reconciler.errors import ConfigError
from tests.desired.test_load import base_files, find, load, problems

A = 'address = "127.0.0.5"\n'
WEB = A + '[services.web]\nuse = "server"\n'


# ---- M4: a name with a trailing newline ----------------------------------------------------------


@pytest.mark.parametrize(("files", "file", "key", "expected"), [
    ({"hosts/a.toml": A + '[services."web\\n"]\nuse = "server"\n'}, "hosts/a.toml", 'services."web\\n"',
     "invalid name: expected a service name"),
    ({"hosts/a.toml": WEB.replace('"server"', '"server\\n"')}, "hosts/a.toml", "services.web.use",
     "expected a service name"),
    ({"hosts/gpu9\n.toml": 'address = "127.0.0.9"\n'}, '"hosts/gpu9\\n.toml"', "", "invalid host name 'gpu9\\n'"),
    ({"services/other\n.toml": 'unit = "[Service]\\nExecStart=/bin/true\\n"\n'}, '"services/other\\n.toml"', "",
     "invalid definition name 'other\\n'"),
    ({"hosts/a.toml": WEB + 'env = { "FOO\\n" = "bar" }\n'}, "hosts/a.toml", 'services.web.env."FOO\\n"',
     "invalid name: expected an environment variable name"),
    ({"hosts/a.toml": WEB + 'secrets = { "TOK\\n" = { file = "/etc/credstore/t" } }\n'}, "hosts/a.toml",
     'services.web.secrets."TOK\\n"', "invalid name: expected an environment variable name"),
    ({"hosts/a.toml": A + 'labels = { "role\\n" = "a" }\n'}, "hosts/a.toml", 'labels."role\\n"',
     "invalid name: expected letters, digits"),
    ({"hosts/a.toml": A + 'labels = { role = "a\\n" }\n'}, "hosts/a.toml", "labels.role", "expected letters, digits"),
    ({"hosts/a.toml": A + '[ssh]\nuser = "root\\n"\n'}, "hosts/a.toml", "ssh.user", "expected a user name"),
    ({"hosts/a.toml": WEB + 'vars = { "port\\n" = "1" }\n'}, "hosts/a.toml", 'services.web.vars."port\\n"',
     "invalid name: expected a var name"),
    ({"hosts/a.toml": WEB + 'allow_dropins = ["10-numa.conf\\n"]\n'}, "hosts/a.toml",
     "services.web.allow_dropins[#1]", "expected a drop-in file name"),
    ({"hosts/a.toml": 'address = "gpu-9.lab\\n"\n'}, "hosts/a.toml", "address", "expected an IP address or hostname"),
    ({"hosts/a.toml": 'address = "127.0.0.5\\n"\n'}, "hosts/a.toml", "address", "expected an IP address or hostname"),
    ({"fleet.toml": '[rollout]\nmax_unavailable = "25%\\n"\n'}, "fleet.toml", "rollout.max_unavailable",
     'expected an integer >= 1 or a percentage 1-100 like "25%"'),
    ({"fleet.toml": '[pull]\nwaves = [{ name = "canary\\n" }]\n'}, "fleet.toml", "pull.waves[#1].name",
     "expected letters, digits"),
])
def test_a_name_with_a_trailing_newline_is_refused(files: dict[str, str], file: str, key: str,
                                                   expected: str) -> None:
    assert expected in find(problems(base_files(files)), file, key).message


@pytest.mark.parametrize("pattern", [fields.SERVICE_NAME, fields.HOST_NAME, fields.ENV_KEY, fields.VAR_NAME,
                                     fields.LABEL, fields.USER])
def test_the_name_patterns_refuse_a_trailing_newline_with_match_too(pattern) -> None:
    """Other layers call .match on them (`--label`, `secrets encrypt NAME`): `\\Z`, not `$`."""
    assert pattern.match("ab") and pattern.fullmatch("ab")
    assert pattern.match("ab\n") is None


# ---- L3: reserved names --------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["reconciler-confirm-web", "reconciler-rearm-switches", "reconciler-pull",
                                  "Reconciler-x"])
def test_service_names_starting_with_reconciler_are_reserved(name: str) -> None:
    files = base_files({"hosts/a.toml": A + f'[services.{name}]\nuse = "server"\n'})
    message = find(problems(files), "hosts/a.toml", f"services.{name}").message
    assert message.startswith(f"invalid name: '{name}' starts with 'reconciler-': names starting with it are "
                              "reserved for the reconciler's own units")


def test_a_definition_may_be_named_reconciler_something() -> None:
    """Only a service's name becomes a unit's name; a shared definition's never does."""
    files = base_files({"services/reconciler-base.toml": (base_files()["services/server.toml"]),
                        "hosts/a.toml": A + '[services.web]\nuse = "reconciler-base"\n'})
    assert load(files).hosts["a"].services["web"].definition == "reconciler-base"


# ---- M3: a problem's text is redacted ------------------------------------------------------------


def test_a_value_shown_in_a_problem_is_redacted_before_it_is_cut() -> None:
    """describe() cuts a shown value at 80 characters: redacted first, or a token's head leaks."""
    token = "hf_" + "Zy9Xw8Vu7Ts6Rq5Po4Nm3Lk2"
    health = '[health]\nhttp = "ftp://' + "h" * 62 + f'/{token} "\n'
    bad = base_files({"hosts/a.toml": WEB + health + '[ssh]\nuser = "postgres://app:Zm9v/YmFy@db"\n'})
    with pytest.raises(ConfigError) as info:
        load(bad)
    text = str(info.value)
    assert "hf_Zy9" not in text and "Zm9v" not in text
    assert "ssh.user: expected a user name like 'root', got 'postgres://app:***@db'" in text


# ---- L6: parse bombs -------------------------------------------------------------------------------


def test_a_file_nested_too_deep_for_the_parser_is_a_problem_of_that_file() -> None:
    bomb = "x = " + "[" * 50_000 + "]" * 50_000 + "\n"
    assert find(problems(base_files({"hosts/b.toml": bomb})), "hosts/b.toml", "").message == (
        f"tables or arrays nested more than {toml_files.MAX_DEPTH} deep: not a desired-state file; it was not read")


def test_a_file_nested_deeper_than_the_limit_is_refused_before_validation() -> None:
    deep = "x = " + "[" * (toml_files.MAX_DEPTH + 1) + "]" * (toml_files.MAX_DEPTH + 1) + "\n"
    assert "nested more than" in find(problems(base_files({"fleet.toml": deep})), "fleet.toml", "").message


def test_a_file_nested_deep_with_a_syntax_error_is_a_problem_of_that_file() -> None:
    """Too deep for tomllib: nested too deep, not handed to tomlkit. Deep but within tomllib's
    reach: tomlkit words the syntax error (it has a depth limit of its own)."""
    deep = find(problems(base_files({"hosts/b.toml": "x = " + "[" * 5_000 + "\n= oops\n"})), "hosts/b.toml", "")
    assert deep.message.startswith("tables or arrays nested more than")
    less = find(problems(base_files({"hosts/b.toml": "x = " + "[" * 300 + "\n= oops\n"})), "hosts/b.toml", "")
    assert less.message == "TOML syntax error at line 1, column 104: TOML value nested more than 100 levels deep"


def test_a_file_over_the_size_limit_is_not_read() -> None:
    big = 'address = "127.0.0.9"\n' + "# padding\n" * (toml_files.MAX_FILE_BYTES // 10)
    assert find(problems(base_files({"hosts/b.toml": big})), "hosts/b.toml", "").message == (
        f"the file is {len(big):,} bytes: a TOML file may be at most 1,048,576 bytes (1 MiB); it was not read")


def test_the_toml_files_of_a_revision_have_a_limit_together(monkeypatch) -> None:
    monkeypatch.setattr(toml_files, "MAX_REPO_BYTES", 2_000)
    hosts = {f"hosts/h{i:02d}.toml": f'address = "127.0.1.{i}"\n' + "#" * 300 + "\n" for i in range(10)}
    found = problems(base_files(hosts))
    over = [p for p in found if "together" in p.message]
    assert len(over) == 1 and over[0].file.startswith("hosts/h")
    assert over[0].message.startswith("the TOML files of this revision are over 2,000 bytes")


def test_the_tomlkit_fallback_never_runs_on_a_big_file(monkeypatch) -> None:
    """A file over MAX_FALLBACK_BYTES with a syntax error gets tomllib's words; tomlkit (about
    1.8 s per MiB) is never imported for it."""
    import tomlkit
    calls: list[int] = []
    monkeypatch.setattr(tomlkit, "parse", lambda text: calls.append(len(text)))
    big = 'address = "127.0.0.9"\n' + "# padding\n" * (toml_files.MAX_FALLBACK_BYTES // 10) + "x = = 1\n"
    message = find(problems(base_files({"hosts/b.toml": big})), "hosts/b.toml", "").message
    assert message.startswith("TOML syntax error: Invalid value (at line") and calls == []


def test_a_small_file_with_a_syntax_error_still_gets_tomlkits_words() -> None:
    message = find(problems(base_files({"hosts/b.toml": 'address = "127.0.0.9"\nx = = 1\n'})), "hosts/b.toml", "")
    assert message.message.startswith("TOML syntax error at line 2, column")
