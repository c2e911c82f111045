"""host/programs.Seen: a warm daemon reads a host that answered the same text as last round (but
for its token) as it read it then, without parsing it again; any other answer is parsed."""

from __future__ import annotations

import asyncio
from typing import ClassVar

import pytest

from reconciler.errors import ObserveError
from reconciler.frames import HostProgram, Records
from reconciler.host import programs
from reconciler.host.programs import Seen
from reconciler.host.transport import Completed
from reconciler.plan.facts.observe import Observe, parse_observation

# An observation as observe.sh answers it ("@" where its token goes): the host record, one
# service's record, unit, env drop-in and env file, and systemd's reading of it.
ANSWER = """\
@ G 3
@ H - L {"applied_at": 1796444228, "applied_revision": "bbc387ba43bb1f4ab7f9b2b53554042a0b161786", "schema": 2}
@ H - F
@ H gpu -
@ R bench L {"hash": "29a57e979ede6e6c", "revision": "bbc387ba43bb1f4ab7f9b2b53554042a0b161786", "schema": 2}
@ R bench F
@ U bench L [Service]
@ U bench L ExecStart=/usr/bin/python3 -m sglang.launch_server --port 30000
@ U bench F
@ E bench L [Service]
@ E bench L EnvironmentFile=/etc/reconciler/env/bench.env
@ E bench F
@ V bench L BENCH_VALUE="5"
@ V bench F
@ O bench -
@ S -
Id=bench.service
LoadState=loaded
ActiveState=active
SubState=running

@ END
"""


class Counted(HostProgram[Records], frozen=True):
    """A program whose parse counts its calls and answers its records as they are."""

    name: ClassVar[str] = "counted"
    parses: ClassVar[list[str]] = []
    ask: str = ""

    def parse(self, answer: Records) -> Records:
        Counted.parses.append(answer.token)
        if "bad" in answer.stdout:
            raise ObserveError(answer.host, "not a reading")
        return answer


@pytest.fixture(autouse=True)
def _fresh_counts() -> None:
    Counted.parses.clear()


def answer(text: str, token: str, host: str = "h1") -> Records:
    return Records(text.replace("@", token), token, host)


def test_the_same_answer_with_another_token_is_the_last_reading():
    seen = Seen()
    program = Observe(("bench",))
    first = seen.parse(program, answer(ANSWER, "aaaa1111"))
    again = seen.parse(program, answer(ANSWER, "bbbb2222"))
    assert again is first
    assert first == parse_observation(ANSWER.replace("@", "cccc3333"), "cccc3333", "h1")
    assert first.services["bench"].envfile_text == 'BENCH_VALUE="5"\n' and first.lock_count == "3"


def test_any_other_answer_is_parsed_and_replaces_the_last():
    seen = Seen()
    program = Observe(("bench",))
    first = seen.parse(program, answer(ANSWER, "aaaa1111"))
    changed = seen.parse(program, answer(ANSWER.replace('BENCH_VALUE="5"', 'BENCH_VALUE="6"'), "bbbb2222"))
    assert changed.services["bench"].envfile_text == 'BENCH_VALUE="6"\n'
    back = seen.parse(program, answer(ANSWER, "cccc3333"))
    assert back == first and back is not first        # one reading a host: the first was replaced
    assert len(seen) == 1


def test_the_pieces_between_tokens_count_not_only_their_text():
    def parsed_again(first: Records, then: Records) -> bool:
        seen, p = Seen(), Counted()
        seen.parse(p, first)
        Counted.parses.clear()
        seen.parse(p, then)
        return Counted.parses == [then.token]
    assert not parsed_again(Records("t1 A x\nt1 B y\n", "t1"), Records("t2 A x\nt2 B y\n", "t2"))
    assert parsed_again(Records("t1 A x\nt1 B y\n", "t1"), Records("t2 A x\nt2t2 B y\n", "t2"))   # a token more
    # the same text, its token found elsewhere in it
    assert parsed_again(Records("k1 A k1x\n", "k1"), Records("k1 A k1x\n", "k1 A"))
    assert parsed_again(Records("t1 A x\n", "t1"), Records("t1 A x\n", "t1", host="h2"))    # another host


def test_what_the_program_asks_is_part_of_the_answer():
    seen = Seen()
    seen.parse(Counted(ask="a"), answer("@ A x\n", "t1"))
    seen.parse(Counted(ask="b"), answer("@ A x\n", "t2"))
    seen.parse(Counted(ask="b"), answer("@ A x\n", "t3"))
    assert Counted.parses == ["t1", "t2"]


def test_an_answer_that_is_no_reading_is_never_kept():
    seen = Seen()
    p = Counted()
    for tok in ("t1", "t2"):
        with pytest.raises(ObserveError):
            seen.parse(p, answer("@ bad\n", tok))
    assert len(seen) == 0 and Counted.parses == ["t1", "t2"]


def test_retain_drops_the_hosts_that_left():
    seen = Seen()
    for host in ("h1", "h2", "h3"):
        seen.parse(Counted(), answer("@ A x\n", "t", host=host))
    seen.retain(["h2"])
    assert len(seen) == 1
    seen.parse(Counted(), answer("@ A x\n", "u", host="h2"))
    assert Counted.parses == ["t", "t", "t"]


class Canned:
    """A transport that answers every command with a text, its token put in (from the
    program's parameters on stdin, where observe.sh reads it)."""

    host = "h1"

    def __init__(self, text: str):
        self.text = text

    async def run(self, cmd: str, *, input: str | None = None, check: bool = False, timeout: float | None = 60.0,
                  what: str = "command") -> Completed:
        assert input is not None
        token = next(line.split("=", 1)[1] for line in input.splitlines() if line.startswith("token="))
        return Completed(0, self.text.replace("@", token), "")


def test_a_run_of_one_program_reads_through_seen():
    seen = Seen()
    t = Canned(ANSWER)

    async def twice() -> tuple[object, object]:
        a = await programs.run(t, Observe(("bench",)), what="observe", seen=seen)   # type: ignore[arg-type]
        b = await programs.run(t, Observe(("bench",)), what="observe", seen=seen)   # type: ignore[arg-type]
        return a, b
    a, b = asyncio.run(twice())
    assert a is b and len(seen) == 1
