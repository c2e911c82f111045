"""The planner and executor with secrets (issue 13), pure: what is delivered, what restarts, what
is blocked, and that no value ever reaches an action, a diff, a record or the script's argv."""

from __future__ import annotations

import base64
import json

from reconciler.desired import secrets
from reconciler.desired.spec import SecretSpec, ServiceSpec
from reconciler.host import script
from reconciler.plan.actions import plan_host
from reconciler.plan.confirm import KEPT, Previous, arm
from reconciler.plan.facts import HostFacts
from reconciler.plan.files import render_secrets, secret_files
from reconciler.plan.layout import cred_env_path, cred_path, secrets_path
from reconciler.plan.model import Context, Kind, Reason, State
from reconciler.plan.records import ServiceRecord
from reconciler.values import replace
from tests.plan.test_plan import REV, UNIT, host, on_host, svc, verified

CANARY = b"canary-7f3a9c1e5b"
DIGEST = "d" * 32
AGE = SecretSpec("API_KEY", "age", "secrets/api-key.age", ciphertext=b"x", digest=DIGEST)
AGE_ENV = SecretSpec("DB_URL", "age", "secrets/db.age", env=True, ciphertext=b"y", digest="e" * 32)
REF = SecretSpec("HF_TOKEN", "file", "/etc/credstore/hf_token")


def with_secrets(*ss: SecretSpec) -> ServiceSpec:
    return svc(secrets=tuple(ss))


def observed(**extra: str | None) -> dict[str, str | None]:
    """Every secret file of M (with all three secrets) present, with these overrides."""
    base: dict[str, str | None] = {"/etc/credstore/hf_token": "h1", cred_path("m", "API_KEY"): "c1",
                                   cred_path("m", "DB_URL"): "c2", cred_env_path("m"): "c3"}
    base.update(extra)
    return base


def deployed(s: ServiceSpec, obs: dict[str, str | None], **rec: object) -> HostFacts:
    """s applied, healthy, its secrets delivered as observed now."""
    versions = {x.name: (f"age:{x.digest}" if x.source == "age" else f"file:{obs[x.path]}") for x in s.secrets}
    r = replace(verified(s), secrets=versions, **rec)  # type: ignore[arg-type]
    f = on_host(s, r, dropins={secrets_path("m"): render_secrets(s)} if s.secrets else None)
    return HostFacts({"m": f}, secret_files=obs)


def kinds(plan) -> list[tuple[str, str]]:
    return [(a.kind.value, a.reason.value) for a in plan.actions]


def test_drop_in_holds_paths_only_and_never_environment():
    text = render_secrets(with_secrets(AGE, AGE_ENV, REF))
    assert text is not None
    assert "LoadCredential=API_KEY:/var/lib/reconciler/credstore/m/API_KEY" in text
    assert "LoadCredential=HF_TOKEN:/etc/credstore/hf_token" in text
    assert "EnvironmentFile=/var/lib/reconciler/credstore/m.env" in text
    assert "DB_URL" not in text            # env delivery: only through the root-only file
    assert "Environment=" not in text.replace("EnvironmentFile=", "")


def test_new_service_delivers_secrets_and_records_versions_only():
    s = with_secrets(AGE, REF)
    obs = {"/etc/credstore/hf_token": "h1", cred_path("m", "API_KEY"): None}
    plan = plan_host(host(s), HostFacts({}, secret_files=obs), Context(REV))
    assert plan.services["m"].state is State.NEW
    sec = [a for a in plan.actions if a.kind is Kind.SECRETS]
    assert len(sec) == 1 and sec[0].secrets == s.secrets
    assert "API_KEY added" in sec[0].detail and "HF_TOKEN added" in sec[0].detail
    started = next(a.record for a in plan.actions if a.kind is Kind.RECORD and a.service == "m")
    assert started is not None and started.secrets == {"API_KEY": f"age:{DIGEST}", "HF_TOKEN": "file:h1"}
    assert {a.path for a in plan.actions if a.kind is Kind.WRITE} >= {secrets_path("m")}


def test_in_sync_with_secrets_does_nothing():
    s = with_secrets(AGE, AGE_ENV, REF)
    plan = plan_host(host(s), deployed(s, observed()), Context(REV))
    assert plan.services["m"].state is State.IN_SYNC
    assert not plan.changes


def test_rotated_age_secret_restarts_and_names_only_the_secret():
    old = with_secrets(AGE, REF)
    new = with_secrets(replace(AGE, digest="f" * 32), REF)
    facts = deployed(old, observed())
    plan = plan_host(host(new), facts, Context(REV))
    assert plan.services["m"].state is State.CHANGED
    sec = next(a for a in plan.actions if a.kind is Kind.SECRETS)
    assert sec.detail == "secret API_KEY changed"
    restart = next(a for a in plan.actions if a.kind is Kind.RESTART)
    assert restart.reason is Reason.SECRET_CHANGED and restart.detail == "secret API_KEY changed"
    assert not [a for a in plan.actions if a.kind is Kind.WRITE]      # the drop-in is the same


def test_rotated_referenced_file_restarts_exactly_its_service():
    s = with_secrets(REF)
    other = svc("n", unit="[Service]\nExecStart=/bin/n\n", env={})
    obs = observed()
    facts = deployed(s, obs)
    facts = HostFacts({**facts.services, "n": on_host(other, verified(other))}, secret_files=obs)
    rotated = HostFacts(facts.services, secret_files={**obs, "/etc/credstore/hf_token": "h2"})
    plan = plan_host(host(s, other), rotated, Context(REV))
    assert plan.restarts == ["m"]
    assert next(a for a in plan.actions if a.kind is Kind.SECRETS).detail == "secret HF_TOKEN changed"
    started = next(a.record for a in plan.actions if a.kind is Kind.RECORD and a.service == "m")
    assert started is not None and started.secrets["HF_TOKEN"] == "file:h2"


def test_missing_reference_blocks_and_writes_nothing():
    s = with_secrets(REF)
    plan = plan_host(host(s), HostFacts({}, secret_files={"/etc/credstore/hf_token": None}), Context(REV))
    sp = plan.services["m"]
    assert sp.state is State.BLOCKED and sp.reason == "SecretMissing"
    assert "/etc/credstore/hf_token does not exist on the host" in sp.note
    assert not plan.changes


def test_undecryptable_blocks_with_the_reason():
    s = with_secrets(replace(AGE, digest="", problem="cannot decrypt secrets/api-key.age with this controller's "
                                                     "age identity"))
    plan = plan_host(host(s), HostFacts({}, secret_files={}), Context(REV))
    assert plan.services["m"].reason == "SecretUndecryptable"
    assert not plan.changes


def test_own_copy_missing_on_host_is_drift():
    s = with_secrets(AGE)
    facts = deployed(s, observed())
    gone = HostFacts(facts.services, secret_files={**observed(), cred_path("m", "API_KEY"): None})
    plan = plan_host(host(s), gone, Context(REV))
    assert plan.services["m"].state is State.DRIFTED
    assert next(a for a in plan.actions if a.kind is Kind.SECRETS).detail == "secret API_KEY missing on the host"


def test_secrets_dropped_from_git_are_removed():
    old = with_secrets(AGE)
    plan = plan_host(host(svc()), deployed(old, observed()), Context(REV))
    assert (Kind.REMOVE.value, Reason.ENV_CHANGED.value) in kinds(plan)
    sec = next(a for a in plan.actions if a.kind is Kind.SECRETS)
    assert sec.secrets == () and sec.detail == "secret API_KEY removed"
    # its environment file goes: nothing is wanted by env (apply.sh's secrets_env with env empty)
    assert list(script._secrets(3, "m", (), remove=False))[-1] == "secrets_env step=3 service=m keep= env="


def test_orphan_deletes_its_credstore():
    old = with_secrets(AGE)
    facts = deployed(old, observed())
    plan = plan_host(host(), facts, Context(REV))
    sec = next(a for a in plan.actions if a.kind is Kind.SECRETS)
    assert sec.reason is Reason.REMOVED
    step = plan.actions.index(sec)
    assert list(script._fatal(step, sec, plan, 0)) == [f"secrets_aside step={step} service=m remove=1"]


def test_observed_files_are_each_reference_and_own_copy():
    s = with_secrets(AGE, AGE_ENV, REF)
    assert secret_files(host(s)) == sorted(["/etc/credstore/hf_token", cred_path("m", "API_KEY"),
                                            cred_path("m", "DB_URL"), cred_env_path("m")])


def test_no_value_in_plan_output_record_or_script_argv(monkeypatch):
    monkeypatch.setitem(secrets._VAULT, DIGEST, CANARY)
    s = with_secrets(AGE, REF)
    plan = plan_host(host(s), HostFacts({}, secret_files={"/etc/credstore/hf_token": "h1"}), Context(REV))
    shown = json.dumps([a.to_json() for a in plan.actions]) + repr(plan) + "".join(a.describe() for a in plan.actions)
    shown += "".join(a.record.dumps() for a in plan.actions if a.record is not None)
    assert CANARY.decode() not in shown
    text = "\n".join(script.steps(plan, plan.actions, 0))
    assert CANARY.decode() not in text        # base64 on the script's stdin, never in clear or in argv
    value = base64.b64encode(CANARY).decode()
    assert f"service=m name=API_KEY base64={value}" in text


def test_value_not_decrypted_fails_the_step_by_name():
    s = with_secrets(replace(AGE, digest="0" * 32))
    lines = list(script._secrets(2, "m", s.secrets, remove=False))
    assert lines[-1] == "refuse step=2 'message=secret API_KEY was not decrypted by this controller'"


def test_switch_puts_kept_secrets_back_only_when_the_deploy_replaced_them():
    rec = ServiceRecord(hash="h", revision="r", last_good_hash="h", last_good_revision="r", secrets={"A": "age:1"})
    prev = Previous("r", UNIT, None, secrets_text="[Service]\nLoadCredential=A:/x\n", secrets_replaced=True)
    sw = arm("m", revision=REV, new_hash="n", window=60, record=rec, previous=prev)
    assert "\nRESTORE_SECRETS=1\n" in sw.script and f"\nKEPT={KEPT}\n" in sw.script
    assert 'old=$KEPT/$SERVICE' in sw.script and 'mv "$old" "$cur"' in sw.script      # confirm.sh's, as sent
    put = next(ln for ln in sw.script.splitlines() if ln.startswith("RECORD="))
    fired = ServiceRecord.parse(base64.b64decode(put.split("=", 1)[1]).decode())
    assert fired.secrets == {"A": "age:1"} and fired.quarantine is not None     # what the kept copy holds
    same = arm("m", revision=REV, new_hash="n", window=60, record=rec, previous=replace(prev, secrets_replaced=False))
    assert "\nRESTORE_SECRETS=''\n" in same.script


def test_record_round_trips_versions():
    rec = ServiceRecord(hash="h", secrets={"B": "file:2", "A": "age:1"})
    again = ServiceRecord.parse(rec.dumps())
    assert again.secrets == {"A": "age:1", "B": "file:2"}
    assert ServiceRecord.parse('{"hash": "h", "secrets": {"A": 3}}').secrets == {}


def test_no_service_facts_for_unknown_file_is_not_a_block():
    # a path this run did not observe (not in secret_files) is not reported missing
    s = with_secrets(REF)
    plan = plan_host(host(s), HostFacts({}, secret_files={}), Context(REV))
    assert plan.services["m"].state is State.NEW

