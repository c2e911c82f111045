"""Load progress lines are data (review N5, N6): what runs in a service writes them, so a count
the parser does not take says nothing, the percentage is integer arithmetic, no piece of a
secret survives a cut (progress.sh's on the host, the quote's on the controller), and an
exception in reading one unit's lines is that unit's alone."""

from __future__ import annotations

import pytest

from reconciler.host.progress import LoadFollower
from reconciler.plan.facts import progress
from reconciler.plan.facts.progress import WEIGHTS, LoadProgress, advance, parse_tail
from tests.host.test_progress import CURSOR, INV_A, INV_B, TOKEN, P, _strip, fed, run_program
from tests.test_redact import fresh, leaked, straddling

E4 = "Loading safetensors checkpoint shards:  50% Completed | " + "9" * 400 + "/1 ["     # review N5


@pytest.mark.parametrize("line", [
    E4,                                                                      # 400 digits: no count we take
    "Loading safetensors checkpoint shards:  50% Completed | 1/" + "9" * 7 + " [",
    "Capturing batches (bs=1 avail_mem=1 GB):  50%|█| 9999999/9999999 [",   # 7 digits each
    "Loading safetensors checkpoint shards:  50% Completed | 5/4 [",          # past its total
    "Loading safetensors checkpoint shards:  50% Completed | ²/4 [",          # not an ASCII digit
])
def test_a_count_the_parser_does_not_take_says_nothing(line):
    before = LoadProgress(WEIGHTS, 1, 4, line="x")
    assert advance(before, [line]) is before
    p = advance(None, ["Load weight begin.", line])
    assert _strip(p) == LoadProgress(WEIGHTS) and p is not None and p.text() == "loading weights"
    assert _strip(advance(None, ["Loading safetensors checkpoint shards:  50% Completed | 999999/999999 ["])) == \
        LoadProgress(WEIGHTS, 999999, 999999)                                 # 6 digits: taken


def test_the_percentage_is_integer_arithmetic_rounded_as_round_does():
    assert all(P(WEIGHTS, d, t).percent() == round(100 * d / t) for t in range(1, 60) for d in range(t + 1))
    assert P(WEIGHTS, 10**400, 10**400 + 1).percent() == 100                  # a float would overflow
    assert P(WEIGHTS, 1, 10**400).percent() == 0 and P(WEIGHTS, 1, 0).percent() is None
    assert P(WEIGHTS, -1, 4).percent() is None and P(WEIGHTS, 1, -4).percent() is None


def test_the_programs_cut_leaves_no_fragment_of_a_secret_it_went_through(tmp_path):
    """Review N6: the host cuts a line to its last LINE_MAX bytes before the controller, which
    alone knows the secrets, sees it; the word the cut goes through is dropped whole. A cut at
    the start of a word keeps it."""
    secret = fresh("Zq9-vT3")
    rest = "z" * (progress.LINE_MAX - (len(secret) - len(secret) // 2) - 1)
    through = f"{'y' * 900} {secret} {rest}"                    # the cut is in the middle of the secret
    at_word = f"{'y' * 900} {secret} {'z' * progress.LINE_MAX}"   # the cut is where a word begins
    assert leaked(secret, through[-progress.LINE_MAX:]) and len(through) > progress.LINE_MAX
    out = f"{through}\n{at_word}\n-- cursor: {CURSOR}\n".encode()
    stdout, _ = run_program(tmp_path, out, [(INV_A, None)])
    lines, _cursor = parse_tail(stdout, TOKEN)[INV_A]
    assert not leaked(secret, stdout) and lines == [rest, "z" * progress.LINE_MAX]


def test_a_secret_across_the_quotes_cut_leaves_no_fragment():
    """Review E5: a registered secret straddling character 240 of a progress line kept 9 of its
    characters in the quote, which was cut before it was redacted. The line is redacted whole
    first, then cut."""
    from reconciler import redact
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    line = "Load weight begin. " + straddling(secret, progress.QUOTE_MAX - 19)
    assert secret not in line[:progress.QUOTE_MAX] and leaked(secret, line[:progress.QUOTE_MAX])
    f = LoadFollower()
    f.follow("m.service")
    f.saw("m.service", {"InvocationID": INV_A})
    fed(f, f"{TOKEN} U {INV_A}\n{TOKEN} L {line}\n{TOKEN} END\n")
    p = f.progress("m.service")
    assert p is not None and p.line.startswith("Load weight begin.") and p.line.endswith("*** after")
    assert not leaked(secret, p.line)


def test_an_exception_reading_one_units_lines_is_kept_for_that_unit_and_the_others_are_read(monkeypatch):
    """Review N5: reading E4's line raised from the tick, and so for every watch of the host and
    the whole run. Now it is the unit's own (`failed`, which its watch turns into no verdict).
    RECONCILER_FAULT=progress-raises makes reading such a line raise again (faults.py)."""
    monkeypatch.setenv("RECONCILER_FAULT", "progress-raises")
    f = LoadFollower()
    for unit, inv in (("a.service", INV_A), ("b.service", INV_B)):
        f.follow(unit)
        f.saw(unit, {"InvocationID": inv})
    fed(f, f"{TOKEN} U {INV_A}\n{TOKEN} L Load weight begin.\n{TOKEN} L -- cursor: {CURSOR}\n"
           f"{TOKEN} U {INV_B}\n{TOKEN} L {E4}\n{TOKEN} L -- cursor: {CURSOR}\n{TOKEN} END\n")
    err = f.failed("b.service")
    assert isinstance(err, OverflowError) and "progress-raises" in str(err)
    assert f.failed("a.service") is None and _strip(f.progress("a.service")) == LoadProgress(WEIGHTS)
    assert f.units["b.service"].cursor == CURSOR           # the read moved on all the same
    monkeypatch.delenv("RECONCILER_FAULT")
    f.follow("b.service")                                   # a new watch of it starts afresh
    assert f.failed("b.service") is None
