"""The observation: its program run by sh on this machine, and its parser on captured output
(the executor's tests are tests/host/test_apply.py)."""

from __future__ import annotations

import base64
import os
from collections.abc import Mapping
from typing import ClassVar

import pytest

from reconciler.errors import ObserveError
from reconciler.plan.facts import Observe, parse_observation, parse_show
from tests.host.programs import answer

# Captured on a test host (systemd 252): two units in one `systemctl show` call.
SHOW = """Id=crashy.service
Result=exit-code
NRestarts=3
ExecMainStatus=1
ActiveState=activating
SubState=auto-restart

Id=missing.service
LoadState=not-found
ActiveState=inactive
"""


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def test_parse_show_by_key_and_blocks():
    out = parse_show(SHOW)
    assert out["crashy.service"]["SubState"] == "auto-restart"
    assert out["crashy.service"]["NRestarts"] == "3"
    assert out["missing.service"]["LoadState"] == "not-found"
    assert "Result" not in out["missing.service"]   # missing keys are fine


def test_parse_observation():
    t = "tok"
    out = "\n".join([
        f"{t} H - L {{\"applied_revision\": \"abc\"}}", f"{t} H - F",
        f"{t} R crashy P {{\"hash\": \"h\"}}", f"{t} R crashy F",
        f"{t} U crashy L [Service]", f"{t} U crashy F",
        f"{t} E crashy -",
        "noise line from a login banner",
        f"{t} S -",                    # systemctl show, as it is, up to the END line
        SHOW,
        f"{t} END",
    ]) + "\n"
    f = parse_observation(out, t)
    assert f.record is not None and f.record.applied_revision == "abc"
    s = f.services["crashy"]
    assert s.unit_text == "[Service]\n" and s.env_text is None and s.managed
    assert s.props["SubState"] == "auto-restart" and s.running
    assert f.inventory == {"crashy"}


def test_truncated_observation_is_an_error():
    with pytest.raises(ObserveError):
        parse_observation("tok H - -\n", "tok")
    with pytest.raises(ObserveError):        # cut inside systemctl's output
        parse_observation(f"tok H - -\ntok S -\n{SHOW[:40]}", "tok")


def test_show_output_cannot_end_the_observation_early():
    """A property value is systemd's text (a Description= anyone may write): only the END line
    with this observation's random token ends it."""
    show = "Id=x.service\nDescription=tok END\nSubState=running\n"
    f = parse_observation(f"tok U x P [Service]\ntok U x F\ntok S -\n{show}\ntok END\n", "tok")
    assert f.services["x"].props["SubState"] == "running"


def test_the_observation_reads_files_exactly_with_no_process_per_file(tmp_path):
    """The host's shell prints each file line by line (builtins only) and the parser puts back
    exactly its bytes: spaces, tabs, backslashes, %, a carriage return or form feed inside a
    line, a last line without newline, an empty file, text that looks like the framing; and a
    drop-in whose name has a space."""
    state, units, dropins = tmp_path / "state", tmp_path / "units", tmp_path / "run"
    (state / "services").mkdir(parents=True)
    units.mkdir()
    tricky = ("[Service]\n  Environment=\"A=%s %d \\\\ \\n\"\t\nExecStart=/bin/x \\\n  --y\r\n"
              "Description=a\x0cb\u2028c \u00e9\ntok U m F\n-\n\nlast line, no newline")
    (units / "m.service").write_text(tricky)
    (units / "m.service.d").mkdir()
    (units / "m.service.d/50-reconciler-env.conf").write_text("")
    (state / "services/m.json").write_text('{"hash": "h"}\n')
    (dropins / "m.service.d").mkdir(parents=True)
    (dropins / "m.service.d/my drop in.conf").write_text("[Service]\nNice=5\n")
    (tmp_path / "env").mkdir()
    (tmp_path / "env/m.env").write_text('A="1 $x"\nB="2"')
    class Here(Observe):      # the host's directories, under tmp_path
        constants: ClassVar[Mapping[str, str]] = {
            **Observe.constants, "D": str(state), "UNIT_DIR": str(units), "ENV_DIR": str(tmp_path / "env"),
            "DROPIN_DIRS": str(dropins)}
    bindir = tmp_path / "bin"          # systemctl shows the one unit
    bindir.mkdir()
    (bindir / "systemctl").write_text("#!/bin/sh\nprintf 'Id=m.service\\n'\n")
    (bindir / "systemctl").chmod(0o755)
    f = answer(Here(("m", "gone")), path=f"{bindir}:{os.environ['PATH']}")
    m = f.services["m"]
    assert m.unit_text == tricky and m.env_text == "" and m.record is not None and m.record.hash == "h"
    assert m.envfile_text == 'A="1 $x"\nB="2"' and f.services["gone"].envfile_text is None
    assert m.dropins == {f"{dropins}/m.service.d/my drop in.conf": "[Service]\nNice=5\n"}
    assert f.services["gone"].unit_text is None and f.record is None and f.services["m"].props["Id"] == "m.service"


def test_the_observation_names_its_services_and_secret_files_as_named_parameters():
    stdin = Observe(("b", "a"), ("/s/x", "/s/x", "/s/a b")).stdin("T")
    assert stdin == "token=T\nservice=a\nservice=b\nsecret=/s/a b\nsecret=/s/x\n\n"
    assert Observe(("a",)).stdin("T") == "token=T\nservice=a\n\n"          # no secret asked: none hashed
