"""Trying to break in (security review M3): hypothesis generates secrets in every format the
redactor knows (tokens, URL passwords with '/' and '@', NAME=value under a secret-looking name,
registered values in other cases and normal forms) and puts each, at a random place, into every
way text leaves the controller: a diff, --json, a git note (cut at 300 characters), the fleet
page, a webhook body and a ConfigError. No secret may come out, in any escaped form either."""

from __future__ import annotations

import asyncio
import contextlib
import html
import io
import json
import string
import tempfile
import time
import unicodedata
import warnings
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from reconciler import redact
from reconciler.cli.output import print_json
from reconciler.controller import gitnotes
from reconciler.controller.store import Store
from reconciler.controller.web import view
from reconciler.controller.web.app import create_app
from reconciler.controller.web.hub import Hub
from reconciler.desired.load import MemorySnapshot, load_desired
from reconciler.desired.spec import NotifySpec
from reconciler.errors import ConfigError
from reconciler.host.health import Outcome
from reconciler.host.notify import Notifier
from reconciler.loop.results import FleetResult, HostResult, ServiceEvent
from reconciler.plan.files import _env_quote, render_env_file, unified_diff
from reconciler.plan.model import HostPlan
from reconciler.plan.records import Result

with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    from starlette.testclient import TestClient

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning")

ALNUM = string.ascii_letters + string.digits
B64URL = ALNUM + "_-"
REV = "bcdefabcdefabcdefabcdefabcdefabcdefabcde"       # no digit: a generated secret never matches it
SECRET_NAMES = ("HF_TOKEN", "DB_PASSWORD", "OPENAI_KEY", "OPENAI_API_KEY", "SENTRY_DSN", "AUTH", "BEARER",
                "MY_SECRET", "GCP_CREDENTIALS", "SLACK_WEBHOOK_TOKEN")
SETTINGS = settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@dataclass(frozen=True)
class Secret:
    """A secret as it appears in text (`text`, e.g. `Bearer <value>`), and the part that must never
    come out (`value`)."""

    kind: str
    text: str
    value: str


def chars(alphabet: str, lo: int, hi: int) -> st.SearchStrategy[str]:
    return st.text(alphabet=alphabet, min_size=lo, max_size=hi)


def distinct(value: str) -> bool:
    """Long and mixed enough that no other text on the way out could hold it by chance."""
    return len(value) >= 10 and any(c.isdigit() for c in value) and any(c.isalpha() for c in value)


@st.composite
def tokens(draw: st.DrawFn) -> Secret:
    kind = draw(st.sampled_from(["hf", "sk", "gh", "github_pat", "glpat", "slack", "aws_id", "aws_secret", "jwt",
                                 "bearer", "authorization"]))
    digit = draw(st.sampled_from(string.digits))
    if kind == "hf":
        value = "hf_" + draw(chars(ALNUM, 7, 40)) + digit
    elif kind == "sk":
        value = "sk-" + draw(chars(ALNUM + "_-", 15, 48)) + digit
    elif kind == "gh":
        value = "gh" + draw(st.sampled_from("pousr")) + "_" + draw(chars(ALNUM, 19, 40)) + digit
    elif kind == "github_pat":
        value = "github_pat_" + draw(chars(ALNUM + "_", 19, 82)) + digit
    elif kind == "glpat":
        value = "glpat-" + draw(chars(ALNUM + "_-", 19, 19)) + digit
    elif kind == "slack":
        value = "xox" + draw(st.sampled_from("abp")) + "-" + draw(chars(ALNUM + "-", 9, 50)) + digit
    elif kind == "aws_id":
        upper = string.ascii_uppercase + string.digits
        value = draw(st.sampled_from(["AKIA", "ASIA"])) + draw(chars(upper, 15, 15)) + digit
    elif kind == "jwt":
        value = ("eyJ" + draw(chars(B64URL, 8, 40)) + "." + draw(chars(B64URL, 8, 80)) + digit + "."
                 + draw(chars(B64URL, 0, 43)))
    else:
        value = draw(chars(ALNUM + "/+" if kind == "aws_secret" else B64URL + ".~+/", 39 if kind == "aws_secret"
                           else 7, 39 if kind == "aws_secret" else 60)) + digit
    head = {"aws_secret": draw(st.sampled_from(["aws_secret_access_key = ", "AWS_SECRET_ACCESS_KEY=",
                                                 '"aws_secret_access_key": "'])),
            "bearer": "Bearer ", "authorization": "Authorization: Basic "}.get(kind, "")
    assume(distinct(value))
    return Secret(kind, head + value, value)


@st.composite
def url_passwords(draw: st.DrawFn) -> Secret:
    """A URL's password with '/', '@' and the other characters a generated password holds."""
    password = draw(chars(ALNUM + "/@+=%!*~._-", 10, 40))
    assume(distinct(password))
    scheme = draw(st.sampled_from(["postgres", "redis", "mysql", "amqp", "https"]))
    user = draw(st.sampled_from(["app", "", "x-access-token"]))
    return Secret("url", f"{scheme}://{user}:{password}@db.internal:5432/app", password)


@st.composite
def settings_by_name(draw: st.DrawFn) -> Secret:
    """NAME=value under a name that says it is a secret (the value looks like anything)."""
    value = draw(chars(ALNUM + "/+=._@:!", 10, 40))
    assume(distinct(value) and value[0] not in "$%{-")
    return Secret("setting", f"{draw(st.sampled_from(SECRET_NAMES))}={value}", value)


@st.composite
def registered(draw: st.DrawFn) -> Secret:
    """A value the controller decrypted, shown in another case or normal form than registered."""
    value = draw(chars(ALNUM + "äöüéß-_.:/ ", 10, 40)).strip()
    assume(distinct(value) and redact.maskable(value))
    redact.register(value)
    shown = draw(st.sampled_from([value, value.upper(), value.lower(), unicodedata.normalize("NFD", value)]))
    return Secret("registered", shown, shown)


SECRETS = st.one_of(tokens(), url_passwords(), settings_by_name(), registered())
# Text before a secret (it ends where a word ends: a token glued to a word is not one, e.g. task-...).
PADDING = st.integers(min_value=0, max_value=320).map(lambda n: ("log " * 80)[:n])


def forms(value: str) -> set[str]:
    """The secret as it could appear once a sink escaped or flattened it."""
    out = {value, " ".join(value.split()), json.dumps(value)[1:-1], json.dumps(value, ensure_ascii=False)[1:-1],
           html.escape(value), html.escape(value, quote=False), _env_quote(value)[1:-1], repr(value)[1:-1]}
    return {f for f in out if len(f) >= 10}


def assert_hidden(secret: Secret, out: str) -> None:
    for form in forms(secret.value):
        assert form not in out, (secret, form)


# ---- the sinks ---------------------------------------------------------------------------------


@SETTINGS
@given(secret=SECRETS, padding=PADDING)
def test_no_secret_survives_into_a_diff(secret: Secret, padding: str) -> None:
    unit = f"[Service]\nExecStart=/usr/bin/server {padding} {secret.text} --port 1\n"
    out = unified_diff("/etc/systemd/system/m.service", "[Service]\nExecStart=/usr/bin/old\n", unit, "gpu-1", "bcdefab")
    name, _, value = secret.text.partition("=")
    env = {"LOG": "info", name: value} if secret.kind == "setting" else {"LOG": "info", "MSG": secret.text}
    out += unified_diff("/etc/reconciler/env/m.env", None, render_env_file(env), "gpu-1", "bcdefab")
    assert_hidden(secret, out)


@SETTINGS
@given(secret=SECRETS, value=chars(string.printable.strip() + " ", 10, 60), name=st.sampled_from(SECRET_NAMES))
def test_a_secret_named_variable_is_masked_in_a_diff_whatever_its_value(secret: Secret, value: str, name: str) -> None:
    """By name: the value need not look like anything (the `secret` draw keeps the registry busy)."""
    assume(distinct(value))
    out = unified_diff("/etc/reconciler/env/m.env", render_env_file({name: "old-" + value[::-1]}),
                       render_env_file({name: value, "LOG": "info"}), "gpu-1", "bcdefab")
    legacy = f'[Service]\nEnvironment=A=1 {name}={value.replace(" ", "_")}\n'
    out += unified_diff("/etc/systemd/system/m.service.d/50-reconciler-env.conf", None, legacy, "gpu-1", "bcdefab")
    for form in forms(value) | forms(value.replace(" ", "_")) | forms(value[::-1]):
        assert form not in out
    assert f'+{name}="***"' in out and f"{name}=***" in out


@SETTINGS
@given(secret=SECRETS, padding=PADDING)
def test_no_secret_survives_into_json_output(secret: Secret, padding: str) -> None:
    buf = io.StringIO()
    with contextlib.redirect_stdout(buf):
        print_json({"hosts": [{"message": f"failed: {padding} {secret.text}", "quote": secret.text,
                               "journal": [padding, secret.text],
                               "diff": '+' + secret.text.replace("=", '="', 1) + '"\n'}], "n": 1})
    assert_hidden(secret, buf.getvalue())
    assert json.loads(buf.getvalue())["n"] == 1


@SETTINGS
@given(secret=SECRETS, padding=PADDING)
def test_no_secret_survives_into_a_git_note(secret: Secret, padding: str) -> None:
    """Anywhere around the 300-character cut, and with its spaces flattened."""
    quote = f"{padding} {secret.text}\tafter"
    failed = Outcome("sglang", False, "CrashLoop", "x", quote)
    r = HostResult("gpu-1", "127.0.0.5", Result.ROLLED_BACK, plan=HostPlan("gpu-1", REV, (), {}), reason="RolledBack",
                   message=f"sglang: CrashLoop: {quote}",
                   events=[ServiceEvent("sglang", "deploy", REV, "h2", failed),
                           ServiceEvent("sglang", "quarantined", REV, "", note=f"{padding}:{secret.text}",
                                        quote=quote)])
    note = gitnotes.merge(None, gitnotes.run_lines(FleetResult(REV, False, [r]), 1_795_000_000)[REV])
    assert_hidden(secret, note)


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(secret=SECRETS)
def test_no_secret_survives_onto_the_fleet_page(secret: Secret) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        store = Store(Path(tmp) / "state")
        store.set_status("gpu-1", "sglang", desired_rev=REV, running_rev=REV, health="unhealthy",
                         last_event=f"failed: {secret.text}", quote=f"journal {secret.text}")
        store.add_attempt("gpu-1", "sglang", REV, "h1", "deploy", "CrashLoop", f"crash: {secret.text}",
                          secret.text, ["starting", secret.text], 2.0)
        store.close()
        hub = Hub()
        app = create_app(hub, Path(tmp) / "state",
                         commits=lambda rev: view.CommitInfo(f"deploy {secret.text}", time.time()))
        with TestClient(app, base_url="http://localhost") as client:
            page = client.get("/").text + client.get("/hosts/gpu-1").text
    assert "gpu-1" in page
    assert_hidden(secret, page)


@SETTINGS
@given(secret=SECRETS, fmt=st.sampled_from(["json", "slack"]))
def test_no_secret_survives_into_a_webhook_body(secret: Secret, fmt: str) -> None:
    bodies: list[bytes] = []

    async def run() -> None:
        notifier = Notifier(NotifySpec(webhook="http://127.0.0.1:9/hooks", format=fmt),
                            transport=httpx.MockTransport(lambda r: bodies.append(r.content) or httpx.Response(204)))
        notifier.send("rollback", host="gpu-1", service="sglang", short="bcdefab", result="rolled-back",
                      reason=f"CrashLoop: {secret.text}", journal_line=secret.text, rolled_back_to=REV)
        await notifier.close()
    asyncio.run(run())
    assert len(bodies) == 1
    assert_hidden(secret, bodies[0].decode())


@SETTINGS
@given(secret=SECRETS, padding=st.integers(min_value=0, max_value=90).map(lambda n: "h" * n))
def test_no_secret_survives_into_a_config_error(secret: Secret, padding: str) -> None:
    """Values the schema shows in its message (cut at 80 characters), and a bad key: an address
    with '=' in it, a user name with a space and a label key with a '!' are always refused."""
    files = {
        "hosts/a.toml": f'address = {json.dumps(f"{padding}={secret.text}")}\n'
                        f'labels = {{ {json.dumps(secret.text + " !")} = "x" }}\n'
                        f'[ssh]\nuser = {json.dumps(secret.text + " !")}\n',
    }
    with pytest.raises(ConfigError) as info:
        load_desired(MemorySnapshot(files))
    assert {p.key for p in info.value.problems} >= {"address", "ssh.user"}
    assert any(p.key.startswith("labels.") for p in info.value.problems)
    assert_hidden(secret, str(info.value))
