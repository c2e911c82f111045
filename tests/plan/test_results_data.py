"""What the apply script and the observation say, read as data (review N5, N6): a result line
that does not read as its mark says is read as far as it goes, and host text quoted in an error
or a failed step's message is redacted whole, then cut."""

from __future__ import annotations

import pytest

from reconciler.errors import ObserveError
from reconciler.frames import Records
from reconciler.plan.facts import parse_observation
from reconciler.plan.facts.apply import parse_apply
from reconciler.plan.model import Kind
from tests.host.test_apply import _plan

# ---- host output quoted in errors and results: redacted whole, then cut (review N6) -------------

def test_a_secret_across_the_cut_of_a_malformed_line_or_a_failed_steps_message_leaves_no_fragment():
    from reconciler import redact
    from reconciler.plan.facts.apply import MESSAGE_MAX
    from tests.test_redact import fresh, leaked, straddling
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    tok = "0123456789abcdef"
    line = f"{tok} Q " + straddling(secret, 80 - len(tok) - 3)          # malformed() quotes 80 characters
    assert leaked(secret, line[:80]) and secret not in line[:80]
    with pytest.raises(ObserveError) as e:
        parse_observation(f"{line}\n{tok} END\n", tok, "h1")
    assert "malformed observation line" in str(e.value) and not leaked(secret, str(e.value))

    p = _plan()
    start = next(i for i, a in enumerate(p.actions) if a.kind is Kind.START)
    said = straddling(secret, MESSAGE_MAX, after=" " + "w" * 3000)
    answer = parse_apply(Records(f"T fail {start} 1\nT fatal 0 1\n", "T", "h1", f"T step 0\n{said}\nT step {start}\n"
                                 f"{said}\n"), len(p.actions))
    (f,) = answer.failures
    assert len(f.message) == MESSAGE_MAX and "***" in f.message and not leaked(secret, f.message)
    assert answer.fatal is not None and len(answer.fatal.message) == MESSAGE_MAX
    assert not leaked(secret, answer.fatal.message)


@pytest.mark.parametrize("out,failed", [
    ("T now 1e999", 0), ("T now nan", 0), ("T now ²", 0), ("T fail ² 1", 0), (f"T fatal {'9' * 5000} 1", 0),
    ("T fail 99 1", 0), ("T fail 0 ² !!!", 1), ("T fatal 99 1", 0),   # step 0 failed: its status unreadable
])
def test_a_result_line_that_does_not_read_as_its_mark_says_is_read_as_far_as_it_goes(out, failed):
    p = _plan()
    answer = parse_apply(Records(f"T now 7\n{out}\n", "T", "h1"), len(p.actions))
    assert answer.clock == 7.0 and answer.fatal is None
    assert [(f.step, f.status, f.message) for f in answer.failures] == [(0, 1, "")] * failed
