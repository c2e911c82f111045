"""What the apply script and the observation say, read as data (review N5, N6): a result line
that does not read as its mark says is read as far as it goes, and host text quoted in an error
or a failed step's message is redacted whole, then cut."""

from __future__ import annotations

import base64

import pytest

from reconciler.errors import ObserveError
from reconciler.host.apply import parse_results
from reconciler.plan.facts import parse_observation
from reconciler.plan.model import Kind
from tests.plan.test_facts import _plan

# ---- host output quoted in errors and results: redacted whole, then cut (review N6) -------------

def test_a_secret_across_the_cut_of_a_malformed_line_or_a_failed_steps_message_leaves_no_fragment():
    from reconciler import redact
    from reconciler.host.apply import MESSAGE_MAX
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
    err = base64.b64encode(said.encode()).decode()
    _clock, failures, fatal = parse_results(p, f"@@fail {start} 1 {err}\n@@fatal 0 1\n", f"@@step 0\n{said}\n")
    (f,) = failures
    assert len(f.message) == MESSAGE_MAX and "***" in f.message and not leaked(secret, f.message)
    assert fatal is not None and len(fatal[2]) == MESSAGE_MAX and not leaked(secret, fatal[2])


@pytest.mark.parametrize("out,failed", [
    ("@@now 1e999", 0), ("@@now nan", 0), ("@@now ²", 0), ("@@fail ² 1 x", 0), (f"@@fatal {'9' * 5000} 1", 0),
    ("@@fail 99 1", 0), ("@@fail 0 ² !!!", 1),          # step 0 failed: its status and message unreadable
])
def test_a_result_line_that_does_not_read_as_its_mark_says_is_read_as_far_as_it_goes(out, failed):
    p = _plan()
    clock, failures, fatal = parse_results(p, f"@@now 7\n{out}\n", "")
    assert clock == 7.0 and fatal is None
    assert [(f.action, f.exit_status, f.message) for f in failures] == [(p.actions[0], 1, "")] * failed
