"""Records read leniently through msgspec (plan/records.py `read`): one value of the wrong type
costs that field alone, never the record; numbers and nesting stay bounded (review N5)."""

from __future__ import annotations

import json

import pytest

from reconciler.plan.records import SCHEMA, Adopted, HostRecord, Pending, Quarantine, ServiceRecord

GOOD = {"schema": 2, "hash": "h2", "revision": "r2", "last_good_hash": "h1", "last_good_revision": "r1",
        "quarantine": {"hash": "h3", "revision": "r3", "reason": "CrashLoop", "at": 7, "wave": 2},
        "pending": {"hash": "h2", "revision": "r2", "at": 5, "started": True, "attempts": 1},
        "adopted": {"files": ["/etc/systemd/system/m.service"], "was_enabled": True},
        "secrets": {"A": "age:1"}}


def test_a_record_we_wrote_reads_back_as_it_was() -> None:
    rec = ServiceRecord.from_json(GOOD)
    assert rec == ServiceRecord(hash="h2", revision="r2", last_good_hash="h1", last_good_revision="r1",
                                quarantine=Quarantine("h3", "r3", "CrashLoop", at=7, wave=2),
                                pending=Pending("h2", "r2", at=5, started=True, attempts=1),
                                adopted=Adopted(files=("/etc/systemd/system/m.service",), was_enabled=True),
                                secrets={"A": "age:1"}, schema=2)
    assert ServiceRecord.parse(rec.dumps()) == rec
    assert json.loads(rec.dumps())["pending"] == {"hash": "h2", "revision": "r2", "rollback": False,
                                                   "replaces_hash": None, "replaces_revision": None, "at": 5,
                                                   "started": True, "blocked": None, "unjudged": None,
                                                   "attempts": 1}


@pytest.mark.parametrize(("spoil", "want"), [
    ({"hash": 5}, {"hash": None}),
    ({"hash": ""}, {"hash": None}),
    ({"secrets": {"A": 3, "B": "file:1"}}, {"secrets": {"B": "file:1"}}),
    ({"schema": "two"}, {"schema": 1}),
    ({"schema": 0}, {"schema": 1}),
    ({"quarantine": {"hash": "h3", "reason": "", "at": "x", "wave": True}},
     {"quarantine": Quarantine("h3", "", "Failed")}),
    ({"quarantine": {"hash": "h3", "at": 2**63, "wave": 2**63}}, {"quarantine": Quarantine("h3", "", "Failed")}),
    ({"quarantine": {"reason": "CrashLoop"}}, {"quarantine": None}),
    ({"pending": {"hash": "h2", "at": 12.9, "attempts": -1.5, "started": 1}},
     {"pending": Pending("h2", "", at=12, attempts=-1)}),
    ({"adopted": {"files": ["/a", 3, "/b"], "fragment": ""}}, {"adopted": Adopted(files=("/a", "/b"))}),
    ({"adopted": "yes"}, {"adopted": None}),
])
def test_a_value_of_the_wrong_type_costs_its_field_alone(spoil: dict, want: dict) -> None:
    rec = ServiceRecord.from_json({**GOOD, **spoil})
    assert not rec.corrupt
    kept = ServiceRecord.from_json(GOOD)
    for name in ("hash", "revision", "last_good_hash", "quarantine", "pending", "adopted", "secrets", "schema"):
        assert getattr(rec, name) == want.get(name, getattr(kept, name)), name


@pytest.mark.parametrize("text", ["", "[]", "null", "{not json", '{"hash": "h", "at": NaN}', "1" * 5000,
                                  "[" * 100_000 + "]" * 100_000, '{"hash": "h"} trailing'])
def test_text_that_is_not_a_json_object_is_a_corrupt_record(text: str) -> None:
    assert ServiceRecord.parse(text) == ServiceRecord(corrupt=True)
    assert HostRecord.parse(text) == HostRecord()


def test_the_host_record_reads_leniently_and_writes_its_schema() -> None:
    assert HostRecord.parse('{"applied_revision": "r", "applied_at": 5}') == HostRecord("r", 5, 1)
    assert HostRecord.parse('{"applied_revision": 5, "applied_at": 5}') == HostRecord(None, 5, 1)
    assert json.loads(HostRecord("r", 5, 1).dumps()) == {"schema": SCHEMA, "applied_revision": "r", "applied_at": 5}
