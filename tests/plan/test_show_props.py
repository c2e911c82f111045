"""Properties of `facts.parse_show`: whatever `systemctl show` prints for a set of units, the
parser gives back every unit's properties, by key and not by position, and tolerates any key
being absent (systemd versions differ in what they print)."""

from __future__ import annotations

import random

from hypothesis import given, settings
from hypothesis import strategies as st

from reconciler.plan.facts import SHOW_PROPS, ServiceFacts, parse_show

Props = dict[str, str]

# Fast enough to run with the unit tests; no deadline (a loaded CI machine is not a failure).
PROPERTY = settings(max_examples=200, deadline=None)

# The keys the reconciler asks for, plus made-up CamelCase keys (newer systemd versions print
# keys we have never seen). "Id" is left out: the rendering writes each block's Id line itself.
KNOWN_KEYS = [k for k in SHOW_PROPS.split(",") if k != "Id"]
LOWER = "abcdefghijklmnopqrstuvwxyz"
keys = st.one_of(
    st.sampled_from(KNOWN_KEYS),
    st.lists(st.text(LOWER, min_size=2, max_size=8), min_size=1, max_size=4)
    .map(lambda words: "".join(w.capitalize() for w in words)).filter(lambda k: k != "Id"),
)

# One line of output: systemctl never puts a line break inside a value. parse_show splits with
# str.splitlines, so every character that splits a line there is kept out, not just "\n".
LINE_BREAKS = "\n\r\x0b\x0c\x1c\x1d\x1e\x85\u2028\u2029"
values = st.one_of(
    st.sampled_from(["", "active", "auto-restart", "0", "/etc/systemd/system/model-a.service",
                     "Environment=HF_HOME=/models PORT=30000", "a=b=c", "="]),
    st.text(st.characters(exclude_characters=LINE_BREAKS, exclude_categories=("Cs",)), max_size=40),
)
unit_ids = st.builds(lambda name, instance: f"{name}{instance}.service",
                     st.text(LOWER + "0123456789-", min_size=1, max_size=16),
                     st.sampled_from(["", "@0", "@gpu1"]))
units = st.dictionaries(unit_ids, st.dictionaries(keys, values, max_size=8), min_size=1, max_size=4)


def render(shown: dict[str, Props], order: random.Random | None = None) -> str:
    """What `systemctl show -p ... UNIT...` prints: Key=value lines, one block per unit with an
    Id= line, blocks separated by a blank line. With `order`, lines and blocks are shuffled."""
    blocks = []
    for unit_id, props in shown.items():
        lines = [f"Id={unit_id}", *(f"{k}={v}" for k, v in props.items())]
        if order is not None:
            order.shuffle(lines)
        blocks.append("".join(line + "\n" for line in lines))
    if order is not None:
        order.shuffle(blocks)
    return "\n".join(blocks)


def with_ids(shown: dict[str, Props]) -> dict[str, Props]:
    """What parse_show returns for `shown`: each unit's properties, its Id among them."""
    return {unit_id: {"Id": unit_id, **props} for unit_id, props in shown.items()}


@PROPERTY
@given(units)
def test_parse_show_round_trips(shown: dict[str, Props]) -> None:
    assert parse_show(render(shown)) == with_ids(shown)


@PROPERTY
@given(units, st.randoms(use_true_random=False))
def test_keys_are_found_by_name_not_position(shown: dict[str, Props], order: random.Random) -> None:
    assert parse_show(render(shown, order)) == with_ids(shown)


@PROPERTY
@given(units, st.data())
def test_missing_keys_are_tolerated(shown: dict[str, Props], data: st.DataObject) -> None:
    kept = {unit_id: {k: v for k, v in props.items() if data.draw(st.booleans(), label=f"{unit_id} keeps {k}")}
            for unit_id, props in shown.items()}
    parsed = parse_show(render(kept))
    assert parsed == with_ids(kept)
    for unit_id, props in kept.items():
        facts = ServiceFacts(unit_id.removesuffix(".service"), props=parsed[unit_id])
        # What a consumer reads of a key that was not printed: empty, never a KeyError.
        assert facts.active_state == props.get("ActiveState", "")


@PROPERTY
@given(units, st.dictionaries(keys, values, min_size=1, max_size=5))
def test_a_block_without_an_id_is_skipped(shown: dict[str, Props], stray: Props) -> None:
    text = render(shown) + "\n" + "".join(f"{k}={v}\n" for k, v in stray.items())
    assert parse_show(text) == with_ids(shown)
