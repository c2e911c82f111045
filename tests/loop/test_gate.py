"""Pre-flight on what the repo declares: `reconcile validate` rejects the incident's flags."""

from __future__ import annotations

from tests.conftest import DesiredRepo, run_cli, write_fleet
from tests.fleet import Host

HOST_KEY = "ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAIOMqqnkVzrm0SdG6UOoqKLsabgH5C9okWi0dh2l9GKJl"
SPEC = "--speculative-algo NEXTN --speculative-num-steps 3 --speculative-eagle-topk 1 --speculative-num-draft-tokens 4"
H = Host("g1", "127.0.0.2", 0)


def test_validate_rejects_incident_flags_from_the_model_id(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.fleet.host_public_key", lambda: HOST_KEY)
    r = DesiredRepo(tmp_path / "r")
    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3.5-122B-A10B", "args": SPEC}}, extra={})
    r.commit("incident flags")
    res = run_cli("validate", "--repo", str(r.path), check_codes=(1,))
    assert "hosts/g1.toml: services.sglang: sglang-spec-hybrid-extra-buffer" in res.stderr
    assert "needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1" in res.stderr
    assert "Fix:" in res.stderr

    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3.5-122B-A10B",
                                    "args": SPEC + " --mamba-scheduler-strategy extra_buffer",
                                    "env": {"SGLANG_ENABLE_SPEC_V2": "1"}}}, extra={})
    r.commit("fixed")
    res = run_cli("validate", "--repo", str(r.path), check_codes=(0,))
    assert "valid (1 hosts, 1 services)" in res.stdout


def test_validate_accepts_speculative_decoding_on_a_dense_model(tmp_path, monkeypatch):
    monkeypatch.setattr("tests.fleet.host_public_key", lambda: HOST_KEY)
    r = DesiredRepo(tmp_path / "r")
    write_fleet(r, [H], {"sglang": {"port": 30000, "model": "Qwen3-8B", "args": SPEC}}, extra={})
    r.commit()
    run_cli("validate", "--repo", str(r.path), check_codes=(0,))


OLD_ANALYZE = """#!/bin/sh
for a in "$@"; do
  case "$a" in --recursive-errors=*) echo "systemd-analyze: unrecognized option '$a'" >&2; exit 1;; esac
done
for a in "$@"; do f="$a"; done
grep -q '^Bogus=' "$f" && { echo "$f:3: Unknown key 'Bogus' in section [Service], ignoring."; exit 1; }
exit 0
"""
NEW_ANALYZE = """#!/bin/sh
for a in "$@"; do f="$a"; done
case " $* " in *" --recursive-errors=no "*) ;; *) echo "other.service: broken dependency"; exit 1;; esac
grep -q '^Bogus=' "$f" && { echo "$f:3: Unknown key 'Bogus' in section [Service], ignoring."; exit 1; }
exit 0
"""


def _verify_with(tmp_path, analyze: str) -> dict[str, list[str]]:
    """Run the pre-flight's verify script with a stand-in systemd-analyze first on PATH."""
    import os

    from reconciler.plan.facts.verify import Verify
    from tests.host.programs import answer
    bindir = tmp_path / "bin"
    bindir.mkdir(parents=True)
    (bindir / "systemd-analyze").write_text(analyze)
    (bindir / "systemd-analyze").chmod(0o755)
    units = {"good": ("[Unit]\nDescription=g\n[Service]\nExecStart=/bin/true\n", None),
             "bad": ("[Unit]\n[Service]\nBogus=1\nExecStart=/bin/true\n", None)}
    verified = answer(Verify(units), path=f"{bindir}:{os.environ['PATH']}")
    assert verified.available
    return dict(verified.problems)


def test_verify_checks_only_the_unit_itself_and_falls_back_for_an_older_systemd_analyze(tmp_path):
    """--recursive-errors=no: a broken unit elsewhere on the host never blocks ours; an older
    systemd-analyze that does not know the option still checks the unit (no false block)."""
    for analyze in (NEW_ANALYZE, OLD_ANALYZE):
        problems = _verify_with(tmp_path / str(len(analyze)), analyze)
        assert set(problems) == {"bad"}, problems
        assert problems["bad"] == ["line 3: Unknown key 'Bogus' in section [Service], ignoring. (`Bogus=1`)"]


COPY_ANALYZE = """#!/bin/sh
for a in "$@"; do f="$a"; done
n=${f##*/}; n=${n#reconciler-verify-*-}; n=${n%.service}
cp "$f" "$VERIFY_COPY/$n.unit"
[ -d "$f.d" ] && cp "$f.d"/* "$VERIFY_COPY/$n.env"
printf '%s:2: Unknown key name \\342\\200\\234B\\303\\266gus\\342\\200\\235, ignoring.\\n' "$f"
exit 1
"""


def test_verify_writes_the_units_byte_for_byte_and_reads_any_output(tmp_path):
    """The texts come on stdin as counted lines and are written by the shell itself: backslash
    continuations, CRs, blank and space-only lines, a missing final newline, UTF-8 and quotes all
    arrive unchanged. systemd-analyze's output that is not plain ASCII still reads right."""
    import os

    from reconciler.frames import batch
    from reconciler.plan.facts.verify import Verify
    from tests.host.programs import answer
    bindir, copy = tmp_path / "bin", tmp_path / "copy"
    bindir.mkdir()
    copy.mkdir()
    (bindir / "systemd-analyze").write_text(COPY_ANALYZE)
    (bindir / "systemd-analyze").chmod(0o755)
    units = {
        "a": ("[Service]\nExecStart=/bin/echo a \\\n  b\r\n\n   \n\tB\u00f6gus=1 \"q\" $x %i `c`\n-x\nend", None),
        "b": ("[Unit]\n", '[Service]\nEnvironment="B=2"\nEnvironment="SECRET=s3 %%cr\\"et\\\\ \u00e9"\n'),
        "c": ("", None),
    }
    cmd, _ = batch([Verify(units)], ["T"])
    assert "s3 %cr" not in cmd and "B\u00f6gus" not in cmd           # texts only on stdin
    verified = answer(Verify(units), path=f"{bindir}:{os.environ['PATH']}", env={"VERIFY_COPY": str(copy)})
    for name, (unit, env) in units.items():
        assert (copy / f"{name}.unit").read_bytes() == unit.encode()
        assert (copy / f"{name}.env").read_bytes() == env.encode() if env else not (copy / f"{name}.env").exists()
    problems = verified.problems
    assert verified.available
    assert problems["a"] == ["line 2: Unknown key name \u201cB\u00f6gus\u201d, ignoring. (`ExecStart=/bin/echo a \\`)"]
    assert set(problems) == {"a", "b", "c"}


def test_parse_verify_framing():
    from reconciler.plan.facts.verify import Verified, parse_verify
    units = {"s": ("[Service]\nBogus=1\n", None)}
    out = "\n".join(["T O s /tmp/x/reconciler-verify-ab12-s.service:2: Unknown key 'Bogus', ignoring.",
                     "T O s other.service: broken", "other O s /tmp/x/reconciler-verify-1-s.service:1: forged",
                     "T V s 1", "T END"])
    assert parse_verify(out, "T", units) == Verified({"s": ["line 2: Unknown key 'Bogus', ignoring. (`Bogus=1`)"]})
    assert parse_verify("T V s 3\nT END\n", "T", units) == Verified({"s": ["systemd-analyze verify exited 3"]})
    assert parse_verify("T V - -\nT END\n", "T", units) == Verified({}, False)
