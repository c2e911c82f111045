"""Secrets at the edges, without hosts: redaction (patterns, values, the console, --json, the store,
webhooks, the push stream, tracebacks), the age round trip (keygen, encrypt, Decryptor), the
`reconcile secrets` commands and validate's warning about a secret-looking env value."""

from __future__ import annotations

import asyncio
import io
import json
import secrets as pysecrets
import stat
from pathlib import Path

import httpx
import pytest
from click.testing import CliRunner
from prometheus_client import generate_latest
from rich.console import Console

from reconciler import cli, redact
from reconciler.cli.output import print_json
from reconciler.controller import hooks
from reconciler.controller.metrics import Metrics
from reconciler.controller.runlog import tee
from reconciler.controller.store import Store, remember
from reconciler.desired import secrets
from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.desired.spec import DesiredState, HostSpec, NotifySpec, SecretSpec, ServiceSpec, SSHSpec
from reconciler.host.notify import Notifier
from reconciler.loop.options import RunOptions
from reconciler.loop.report import print_host, print_result
from reconciler.loop.results import FleetResult, HostResult
from reconciler.loop.revision import open_revision
from reconciler.plan.model import Action, HostPlan, Kind, Reason
from reconciler.plan.records import Result
from reconciler.preflight import argv_secret_warnings, env_secret_warnings, secret_file, secret_problems
from tests.conftest import DesiredRepo

HF = "hf_" + "A1b2C3d4E5f6G7h8I9j0K1l2"
SK = "sk-" + "proj-abcdefghijklmnop0123"
GH = "ghp_" + "0123456789abcdefghijABCDEFGHIJ"
URL = "postgres://app:" + "S3cretPassw0rd" + "@db.internal:5432/x"


def canary() -> str:
    """A fresh secret value that matches no pattern: only registering it masks it."""
    return "canary-" + pysecrets.token_hex(12)


# ---- redact: patterns and registered values ----------------------------------------------

@pytest.mark.parametrize("text, hidden, kept", [
    (f"token {HF} here", HF, "token *** here"),
    (f"--api-key {SK}", SK, "--api-key ***"),
    (f"remote {GH}", GH, "remote ***"),
    (f"DATABASE_URL={URL}", "S3cretPassw0rd", "DATABASE_URL=postgres://app:***@db.internal:5432/x"),
])
def test_token_like_patterns_are_masked(text: str, hidden: str, kept: str) -> None:
    out = redact.redact(text)
    assert hidden not in out
    assert out == kept


@pytest.mark.parametrize("value, kind", [
    (HF, "a Hugging Face token"), (SK, "an API key (sk-...)"), (GH, "a GitHub token"),
    (URL, "a URL with a password"),
    ("info", None), ("http://{host.address}:30000/health", None), ("0,1,2,3", None), ("hf_short", None),
])
def test_looks_secret_names_the_kind(value: str, kind: str | None) -> None:
    assert redact.looks_secret(value) == kind


def test_registered_values_are_masked_each_line_too() -> None:
    value = canary()
    multi = f"first-{canary()}\nsecond-{canary()}"
    assert redact.redact(f"x {value} y") == f"x {value} y"      # not registered yet
    redact.register(value)
    redact.register(multi.encode())
    assert redact.redact(f"x {value} y") == "x *** y"
    for line in multi.splitlines():
        assert redact.redact(f"journal: {line}") == "journal: ***"
    assert redact.redact("abc") == "abc"                        # too short to register: never masked
    redact.register("abc")
    assert redact.redact("abc") == "abc"


def test_redact_data_masks_before_json_escapes_a_value() -> None:
    value = 'pa"ss\\' + canary()                  # JSON would escape the quote and the backslash
    redact.register(value)
    data = {"message": f"failed: {value}", "nested": [{"quote": value}], "n": 3, "ok": None}
    text = json.dumps(redact.redact_data(data))
    assert "canary-" not in text
    assert json.loads(text) == {"message": "failed: ***", "nested": [{"quote": "***"}], "n": 3, "ok": None}
    # Redacting the serialized text instead would miss it: the escaped form is not the value.
    assert "canary-" in redact.redact(json.dumps(data))


def test_the_redacting_console_masks_each_print() -> None:
    value = canary()
    redact.register(value)
    buf = io.StringIO()
    console = Console(file=redact.RedactingWriter(buf), width=160, highlight=False)   # type: ignore[arg-type]
    console.print(f"the server said {value} and {HF}", soft_wrap=True)
    console.print("a" * 150 + f" {value}")             # wrapped onto a second line, still one write
    out = buf.getvalue()
    assert value not in out and HF not in out and out.count("***") == 3


def test_a_wrapped_or_truncated_line_leaks_no_part_of_a_value() -> None:
    """report.py redacts before rich lays text out: a narrow console that folds a long token, or
    a table cell cut to its width, would otherwise print a piece of it."""
    value = "canary" + pysecrets.token_hex(30)       # 66 characters: longer than the console
    redact.register(value)
    buf = io.StringIO()
    console = Console(file=buf, width=40, highlight=False)
    write = Action(Kind.WRITE, Reason.ENV_CHANGED, "m", path="/etc/reconciler/env/m.env",
                   diff=f'+Environment="X={value}"\n')
    print_host(console, HostResult("h1", "127.0.0.5", plan=HostPlan("h1", "ab" * 20, (write,), {})), dry_run=True)
    res = FleetResult(revision="ab" * 20, dry_run=True, hosts=[
        HostResult("h1", "127.0.0.5", status=Result.FAILED, reason="Unreachable",
                   message=f"connection refused by {value}", notes=[f"note {value}"])])
    print_result(console, res)
    out = buf.getvalue()
    assert "canary" not in out and value[10:20] not in out


# ---- age: keygen, encrypt, decrypt -------------------------------------------------------

def state_with(*specs: SecretSpec) -> DesiredState:
    svc = ServiceSpec(name="m", unit_text="[Service]\nExecStart=/bin/true\n", secrets=specs)
    host = HostSpec(name="h1", ssh=SSHSpec(address="127.0.0.5"), services={"m": svc}, source="hosts/h1.toml")
    return DesiredState(revision="ab" * 20, hosts={"h1": host})


def age_secret(name: str, value: bytes, public: str) -> SecretSpec:
    return SecretSpec(name, "age", secret_file(name), ciphertext=secrets.encrypt(value, [public]))


def test_keygen_writes_a_private_identity_once(tmp_path: Path) -> None:
    key = tmp_path / "age.key"
    public = secrets.keygen(key)
    assert public.startswith("age1")
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "AGE-SECRET-KEY-1" in key.read_text() and public in key.read_text()
    with pytest.raises(FileExistsError):
        secrets.keygen(key)


def test_decrypt_round_trip_gives_a_digest_and_masks_the_value(tmp_path: Path) -> None:
    public = secrets.keygen(tmp_path / "age.key")
    value = canary().encode()
    state = state_with(age_secret("API_KEY", value, public), SecretSpec("HF_TOKEN", "file", "/etc/credstore/hf"))
    dec = secrets.Decryptor(str(tmp_path / "age.key"))
    got = {s.name: s for s in dec.state(state).hosts["h1"].services["m"].secrets}
    assert got["API_KEY"].problem is None and got["API_KEY"].digest
    assert value.decode() not in got["API_KEY"].digest and value.decode() not in repr(got["API_KEY"])
    assert secrets.value(got["API_KEY"].digest) == value
    assert redact.redact(f"echo {value.decode()}") == "echo ***"
    assert got["HF_TOKEN"] == SecretSpec("HF_TOKEN", "file", "/etc/credstore/hf")    # a reference: untouched
    # The same value under the same identity gives the same digest; another value another one.
    again = secrets.Decryptor(str(tmp_path / "age.key")).state(state_with(age_secret("API_KEY", value, public)))
    assert again.hosts["h1"].services["m"].secrets[0].digest == got["API_KEY"].digest
    other = dec.state(state_with(age_secret("API_KEY", canary().encode(), public)))
    assert other.hosts["h1"].services["m"].secrets[0].digest != got["API_KEY"].digest


def test_a_wrong_or_missing_identity_gives_a_problem_never_the_value(tmp_path: Path) -> None:
    public = secrets.keygen(tmp_path / "right.key")
    secrets.keygen(tmp_path / "wrong.key")
    value = canary()
    state = state_with(age_secret("API_KEY", value.encode(), public))
    for identity, says in ((str(tmp_path / "wrong.key"), "cannot decrypt secrets/api-key.age with this controller"),
                           (None, "no age identity"),
                           (str(tmp_path / "absent.key"), "cannot read the age identity")):
        s = secrets.Decryptor(identity).state(state).hosts["h1"].services["m"].secrets[0]
        assert s.problem is not None and says in s.problem, s.problem
        assert s.digest == "" and value not in s.problem
    assert redact.redact(value) == value            # never decrypted, so never registered


def test_render_at_decrypts_the_revisions_a_rollback_renders(tmp_path: Path) -> None:
    public = secrets.keygen(tmp_path / "age.key")
    old = state_with(age_secret("API_KEY", canary().encode(), public))
    render = secrets.Decryptor(str(tmp_path / "age.key")).render_at(lambda rev: old if rev == "old" else None)
    got = render("old")
    assert got is not None and got.hosts["h1"].services["m"].secrets[0].digest
    assert render("missing") is None


# ---- reconcile secrets keygen / encrypt --------------------------------------------------

runner = CliRunner()


def test_cli_keygen_prints_the_public_key_and_refuses_to_overwrite(tmp_path: Path) -> None:
    key = tmp_path / "age.key"
    res = runner.invoke(cli.app, ["secrets", "keygen", "--out", str(key)])
    assert res.exit_code == 0, res.stderr
    public = res.stdout.strip()
    assert public.startswith("age1") and "\n" not in public
    assert stat.S_IMODE(key.stat().st_mode) == 0o600
    assert "secrets/recipients.txt" in res.stderr and "age_identity" in res.stderr
    before = key.read_text()
    res = runner.invoke(cli.app, ["secrets", "keygen", "--out", str(key)])
    assert res.exit_code == 1 and "exists" in res.stderr and "not overwriting" in res.stderr
    assert key.read_text() == before


def make_recipients(tmp_path: Path) -> tuple[Path, Path, str]:
    repo = tmp_path / "repo"
    (repo / "secrets").mkdir(parents=True)
    public = secrets.keygen(tmp_path / "age.key")
    (repo / "secrets" / "recipients.txt").write_text(f"# the controller\n{public}  # control-1\n\n")
    return repo, tmp_path / "age.key", public


def decrypt_file(path: Path, identity: Path) -> bytes:
    import pyrage
    from pyrage import x25519
    key = next(ln for ln in identity.read_text().splitlines() if ln.startswith("AGE-SECRET-KEY-"))
    return bytes(pyrage.decrypt(path.read_bytes(), [x25519.Identity.from_str(key)]))


def test_cli_encrypt_writes_the_file_and_prints_the_toml_line_never_the_value(tmp_path: Path) -> None:
    repo, identity, _ = make_recipients(tmp_path)
    value = canary()
    res = runner.invoke(cli.app, ["secrets", "encrypt", "HF_TOKEN", "--repo", str(repo)], input=value + "\n")
    assert res.exit_code == 0, res.stderr
    target = repo / "secrets" / "hf-token.age"
    assert target.read_bytes().startswith(b"-----BEGIN AGE ENCRYPTED FILE-----")
    assert decrypt_file(target, identity) == value.encode()          # exactly one trailing newline dropped
    assert res.stdout.strip() == 'HF_TOKEN = { age = "secrets/hf-token.age" }'
    assert value not in res.stdout + res.stderr
    assert "[services.<service>.secrets]" in res.stderr and "env = true" in res.stderr
    # Rotation: the same command replaces the file.
    res = runner.invoke(cli.app, ["secrets", "encrypt", "HF_TOKEN", "--repo", str(repo)], input="second\r\n")
    assert res.exit_code == 0 and "replaced" in res.stderr
    assert decrypt_file(target, identity) == b"second"


def test_cli_encrypt_with_out_and_recipient(tmp_path: Path) -> None:
    _, identity, public = make_recipients(tmp_path)
    out = tmp_path / "elsewhere" / "key.age"
    res = runner.invoke(cli.app, ["secrets", "encrypt", "API_KEY", "--out", str(out), "--recipient", public,
                                  "--repo", str(tmp_path / "nowhere")], input="v\n\n")
    assert res.exit_code == 0, res.stderr
    assert decrypt_file(out, identity) == b"v\n"                      # only one newline is dropped
    assert f'API_KEY = {{ age = "{out}" }}' in res.stdout


@pytest.mark.parametrize("args, stdin, says", [
    (["EMPTY"], "", "the value is empty"),
    (["EMPTY"], "\n", "the value is empty"),
    (["9BAD"], "x", "not a valid name"),
    (["X", "--recipient", "age1nope"], "x", "not an age public key"),
])
def test_cli_encrypt_refuses(tmp_path: Path, args: list[str], stdin: str, says: str) -> None:
    repo, _, _ = make_recipients(tmp_path)
    res = runner.invoke(cli.app, ["secrets", "encrypt", *args, "--repo", str(repo)], input=stdin)
    assert res.exit_code == 1 and says in res.stderr, res.stderr
    assert not list((repo / "secrets").glob("*.age"))


def test_cli_encrypt_explains_missing_or_bad_recipients(tmp_path: Path) -> None:
    res = runner.invoke(cli.app, ["secrets", "encrypt", "X", "--repo", str(tmp_path)], input="x")
    assert res.exit_code == 1
    assert f"{tmp_path}/secrets/recipients.txt does not exist" in res.stderr and "keygen" in res.stderr
    (tmp_path / "secrets").mkdir()
    (tmp_path / "secrets" / "recipients.txt").write_text("# comment\nssh-ed25519 AAAA\n")
    res = runner.invoke(cli.app, ["secrets", "encrypt", "X", "--repo", str(tmp_path)], input="x")
    assert res.exit_code == 1 and "recipients.txt: line 2: expected an age public key" in res.stderr


# ---- validate: secret-looking env values, undecryptable secrets ---------------------------

UNIT = "[Service]\nExecStart=/usr/bin/server --port 30000\n"
FILES = {
    "units/server.service": UNIT,
    "services/shared.toml": f'unit_file = "units/server.service"\nenv = {{ LOG = "info", HUB_TOKEN = "{HF}" }}\n',
    "hosts/a.toml": ('address = "127.0.0.5"\n[services.web]\nuse = "shared"\n'
                     f'[services.web.env]\nDATABASE_URL = "{URL}"\n'
                     '[services.solo]\nunit_file = "units/server.service"\n'
                     f'env = {{ API_KEY = "{SK}", PLAIN = "x" }}\n'),
    "hosts/b.toml": 'address = "127.0.0.6"\n[services.web]\nuse = "shared"\n',
}


def test_env_secret_warnings_name_file_and_key_never_the_value() -> None:
    snap = MemorySnapshot(FILES)
    warnings = env_secret_warnings(load_desired(snap), snap.read)
    assert len(warnings) == 3
    text = "\n".join(warnings)
    for v in (HF, URL, SK, "S3cretPassw0rd"):
        assert v not in text
    by_where = {w.split(": warning:")[0]: w for w in warnings}
    assert set(by_where) == {"services/shared.toml: env.HUB_TOKEN", "hosts/a.toml: services.web.env.DATABASE_URL",
                             "hosts/a.toml: services.solo.env.API_KEY"}
    shared = by_where["services/shared.toml: env.HUB_TOKEN"]
    assert "a Hugging Face token" in shared and "(in service web on hosts a, b)" in shared
    assert '[secrets] HUB_TOKEN = { age = "secrets/hub-token.age", env = true }' in shared
    url = by_where["hosts/a.toml: services.web.env.DATABASE_URL"]
    assert "a URL with a password" in url and "reconcile secrets encrypt DATABASE_URL" in url
    assert '[services.web.secrets] DATABASE_URL = { age = "secrets/database-url.age", env = true }' in url
    # Without the files, a key is named where it takes effect: the host's service.
    assert "hosts/a.toml: services.web.env.HUB_TOKEN: warning:" in "\n".join(env_secret_warnings(load_desired(snap)))


def test_secret_problems_name_file_and_key(tmp_path: Path) -> None:
    public = secrets.keygen(tmp_path / "right.key")
    secrets.keygen(tmp_path / "wrong.key")
    files = {**FILES, "secrets/api.age": secrets.encrypt(b"value-xyz", [public]),
             "services/shared.toml": ('unit_file = "units/server.service"\n'
                                      '[secrets]\nAPI = { age = "secrets/api.age" }\n'),
             "hosts/b.toml": 'address = "127.0.0.6"\n[services.web]\nuse = "shared"\n'
                             '[services.web.secrets]\nOWN = { age = "secrets/api.age", env = true }\n'}
    snap = MemorySnapshot(files)
    state = load_desired(snap)
    assert secret_problems(secrets.Decryptor(str(tmp_path / "right.key")).state(state), snap.read) == []
    bad = secret_problems(secrets.Decryptor(str(tmp_path / "wrong.key")).state(state), snap.read)
    assert [(p.file, p.key) for p in bad] == [("services/shared.toml", "secrets.API"),
                                              ("hosts/b.toml", "services.web.secrets.OWN")]
    assert all("cannot decrypt secrets/api.age" in p.message for p in bad)


def commit_repo(tmp_path: Path, files: dict[str, str | bytes]) -> DesiredRepo:
    repo = DesiredRepo(tmp_path / "desired")
    for rel, content in files.items():
        p = repo.path / rel
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_bytes(content if isinstance(content, bytes) else content.encode())
    repo.commit()
    return repo


def test_validate_prints_the_warnings_and_stays_valid(tmp_path: Path) -> None:
    repo = commit_repo(tmp_path, FILES)
    res = runner.invoke(cli.app, ["validate", "--repo", str(repo.path)])
    assert res.exit_code == 0, res.stderr
    assert "valid (2 hosts, 3 services)" in res.stdout
    assert "hosts/a.toml: services.web.env.DATABASE_URL: warning:" in res.stderr
    assert "services/shared.toml: env.HUB_TOKEN: warning:" in res.stderr
    for v in (HF, SK, "S3cretPassw0rd"):
        assert v not in res.stdout + res.stderr
    res = runner.invoke(cli.app, ["validate", "--repo", str(repo.path), "--json"])
    data = json.loads(res.stdout)
    assert data["valid"] is True and len(data["warnings"]) == 3


def test_validate_with_an_identity_checks_that_age_secrets_decrypt(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RECONCILER_AGE_IDENTITY", raising=False)
    public = secrets.keygen(tmp_path / "right.key")
    secrets.keygen(tmp_path / "wrong.key")
    files: dict[str, str | bytes] = {
        "units/server.service": UNIT, "secrets/api-key.age": secrets.encrypt(b"value-xyz", [public]),
        "hosts/a.toml": ('address = "127.0.0.5"\n[services.web]\nunit_file = "units/server.service"\n'
                         '[services.web.secrets]\nAPI_KEY = { age = "secrets/api-key.age" }\n')}
    repo = commit_repo(tmp_path, files)
    assert runner.invoke(cli.app, ["validate", "--repo", str(repo.path)]).exit_code == 0   # no identity: not checked
    res = runner.invoke(cli.app, ["validate", "--repo", str(repo.path), "--age-identity", str(tmp_path / "right.key")])
    assert res.exit_code == 0 and "1 age secret file decrypt" in res.stdout, res.stdout + res.stderr
    res = runner.invoke(cli.app, ["validate", "--repo", str(repo.path), "--json"],
                        env={"RECONCILER_AGE_IDENTITY": str(tmp_path / "wrong.key")})
    assert res.exit_code == 1
    problem = json.loads(res.stdout)["problems"][0]
    assert (problem["file"], problem["key"]) == ("hosts/a.toml", "services.web.secrets.API_KEY")
    assert "cannot decrypt secrets/api-key.age" in problem["message"]


# ---- --json, the store, webhooks, the push stream, the daemon's logs, tracebacks ---------

def test_json_output_is_redacted(tmp_path: Path, capsys) -> None:
    value = 'q"' + canary()
    redact.register(value)
    print_json({"hosts": [{"message": f"failed with {value}"}], "url": URL})
    out = capsys.readouterr().out
    assert "canary-" not in out and "S3cretPassw0rd" not in out
    assert json.loads(out)["hosts"][0]["message"] == "failed with ***"
    # An error as --json: a source error naming a path with a token in it.
    res = runner.invoke(cli.app, ["validate", "--repo", str(tmp_path / HF), "--json"])
    assert res.exit_code == 1 and HF not in res.stdout and json.loads(res.stdout)["error"] == "SourceError"


def test_the_store_keeps_no_secret(tmp_path: Path) -> None:
    value = canary()
    redact.register(value)
    res = FleetResult(revision="cd" * 20, dry_run=False, hosts=[
        HostResult("h1", "127.0.0.5", status=Result.FAILED, reason="Unreachable", message=f"refused {value} {HF}")])
    store = Store(tmp_path / "state")
    remember(store, res)
    store.add_attempt("h1", "m", "cd" * 20, None, "deploy", "CrashLoop", message=f"exit {value}",
                      quote=f"Error: bad key {SK}", journal=[f"line {value}", URL])
    store.set_value(f"last_applied_revision:{URL}:main", "cd" * 20)
    assert store.get_value(f"last_applied_revision:{URL}:main") == "cd" * 20
    # the write-ahead log and its index are the store's alone too, whatever the umask
    modes = {f.name: f.stat().st_mode & 0o777 for f in (tmp_path / "state").iterdir()}
    assert modes == {"state.db": 0o600, "state.db-wal": 0o600, "state.db-shm": 0o600}, modes
    raw = b"".join(f.read_bytes() for f in (tmp_path / "state").iterdir())
    store.close()
    raw += (tmp_path / "state" / "state.db").read_bytes()
    for v in (value, HF, SK, "S3cretPassw0rd"):
        assert v.encode() not in raw
    rows = Store(tmp_path / "state").history("h1")
    assert rows[0]["message"] == "exit ***" and rows[0]["journal"] == ["line ***", "postgres://app:***@db.internal:5432/x"]


def test_webhook_bodies_are_redacted() -> None:
    value = canary()
    redact.register(value)
    bodies: list[bytes] = []
    async def run(fmt: str) -> None:
        n = Notifier(NotifySpec(webhook="http://127.0.0.1:9/hook", format=fmt),
                     transport=httpx.MockTransport(lambda r: bodies.append(r.content) or httpx.Response(204)))
        n.send("rollback", host="h1", service="m", revision="ab" * 20, short="ababab", reason="CrashLoop",
               journal_line=f"auth failed for {value} ({HF})", result="failed")
        await n.close()
    for fmt in ("json", "slack"):
        asyncio.run(run(fmt))
    assert len(bodies) == 2
    for body in bodies:
        assert value.encode() not in body and HF.encode() not in body and b"***" in body


def test_the_push_stream_prints_whole_redacted_lines(tmp_path: Path, capsys) -> None:
    rev = "ef" * 20
    (tmp_path / f"{rev}.log").write_text(f"reconcile {rev[:7]}\nquote: {HF}\nno newline {SK}")
    (tmp_path / f"{rev}.exit").write_text("0\n")
    hooks._stream(tmp_path, rev, timeout=5)
    out = capsys.readouterr().out
    assert HF not in out and SK not in out
    assert "quote: ***\nno newline ***\n" in out


def test_the_daemon_log_tee_and_a_crash_traceback_are_redacted(monkeypatch, capsys) -> None:
    value = canary()
    redact.register(value)
    journal, log = io.StringIO(), io.StringIO()
    tee(journal, log).write(f"restart m: {value}\n")
    assert journal.getvalue() == log.getvalue() == "restart m: ***\n"

    def boom(**_kw: object) -> None:
        raise RuntimeError(f"unexpected: {value}")
    monkeypatch.setattr(cli, "app", boom)
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 1
    err = capsys.readouterr().err
    assert "RuntimeError: unexpected: ***" in err and value not in err


def test_metrics_labels_are_redacted() -> None:
    value = canary()
    redact.register(value)
    m = Metrics()
    m.observe_run(FleetResult(revision="ab" * 20, dry_run=False, hosts=[HostResult(value, "127.0.0.5")]), 1.0)
    text = generate_latest(m.registry).decode()
    assert value not in text and 'host="***"' in text


def test_no_identity_is_needed_without_age_secrets(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.delenv("RECONCILER_AGE_IDENTITY", raising=False)
    state = state_with(SecretSpec("HF_TOKEN", "file", "/etc/credstore/hf"))
    rev = open_revision(MemorySnapshot({}), RunOptions(), state=state)    # type: ignore[arg-type]
    assert rev.state is state


def test_a_secret_expanded_on_the_command_line_is_a_warning() -> None:
    files = {
        "units/leaky.service": "[Service]\nExecStart=/usr/bin/server --api-key ${API_KEY} --hf $HF_TOKEN\n",
        "units/safe.service": "[Service]\nExecStart=/usr/bin/server --api-key-file %d/API_KEY\n",
        "hosts/a.toml": ('address = "127.0.0.5"\n'
                         '[services.leaky]\nunit_file = "units/leaky.service"\n'
                         '[services.leaky.secrets]\nAPI_KEY = { file = "/etc/credstore/k", env = true }\n'
                         'HF_TOKEN = { file = "/etc/credstore/h", env = true }\n'
                         '[services.safe]\nunit_file = "units/safe.service"\n'
                         '[services.safe.secrets]\nAPI_KEY = { file = "/etc/credstore/k" }\n'),
    }
    warnings = argv_secret_warnings(load_desired(MemorySnapshot(files)))
    assert len(warnings) == 2, warnings
    assert all("services.leaky.unit: warning: the unit puts secret" in w for w in warnings)
    assert {w.split("puts secret ")[1].split()[0] for w in warnings} == {"API_KEY", "HF_TOKEN"}
