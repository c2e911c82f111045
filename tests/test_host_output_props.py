"""Host output is data (issue 39 item 4; review N5): every parser of what a host prints is total.

Whatever bytes come back, decoded as the transport decodes them (UTF-8, errors replaced), each
parser returns a value, or, where its fact must be whole, an ObserveError (a ReconcilerError,
which the host run reports): never another exception, which would end the whole fleet run with
other hosts mid-apply (E4: a 400-digit shard count raised OverflowError).

The outputs are built the way the programs frame them, around the real token, so the parsers'
deep paths are reached: records of every kind each parser reads, with arbitrary fields (numbers
of 400 and 5,000 digits, `²` and `٣` that str.isdigit() accepts and int() may not, `inf`, bad
base64, JSON nested past the parser's depth, Infinity, byte arrays that are no bytes), between
lines of noise, with and without their END line. Each known case that once raised is an explicit
example, so the property fails at once, not by chance, where it regresses.

The GPU and engine/version parsers are here too: every parser of host output is total.
"""

from __future__ import annotations

import base64
import json

from hypothesis import example, given, settings
from hypothesis import strategies as st

from reconciler import frames as framing
from reconciler.errors import ObserveError
from reconciler.host import progress as following
from reconciler.host.lock import holder_said
from reconciler.host.session import ended
from reconciler.plan import gpuhealth, judges
from reconciler.plan.facts import parse_observation, parse_show, progress
from reconciler.plan.facts.apply import parse_apply
from reconciler.plan.facts.journal import parse_journal
from reconciler.plan.facts.verify import parse_verify
from reconciler.plan.model import Action, HostPlan, Kind, Reason
from reconciler.plan.records import HostRecord, ServiceRecord
from reconciler.preflight import _hostcheck

PROPERTY = settings(max_examples=100, deadline=None)   # about 12 s in all, on 2 cores
T = "0123456789abcdef"                      # the token a program was given
INV = "a" * 32                              # an invocation a follower reads
DEEP = "[" * 5000                           # nested past json's depth: RecursionError
INDEX_400 = '{"weight_map":{"a":"x.safetensors"},"metadata":{"total_size":' + "9" * 400 + "}}"
E4 = "Loading safetensors checkpoint shards:  50% Completed | " + "9" * 400 + "/1 ["


def decoded(data: bytes) -> str:
    """What the transport makes of a host's bytes (host/transport.py `_text`)."""
    return data.decode(errors="replace")


# ---- what a host may print ------------------------------------------------------------------------

noise = st.binary(max_size=120).map(decoded)
numbers = st.one_of(
    st.integers(-5, 10**20).map(str),
    st.integers(4301, 4400).map(lambda n: "9" * n),                      # int() refuses it
    st.sampled_from(["9" * 400, "9" * 19, "9" * 20, "²", "٣", "१२", "\U0001d7d9", "inf", "-inf", "nan", "1e999",
                     "Infinity", "NaN", "1.5", "-1", "0", "00", "", " 7", "0x1f", "1_0", "255", "256", "999"]),
)
json_atoms = st.sampled_from([
    DEEP, '{"a":' * 3000, "1" * 5000, "Infinity", "NaN", "-Infinity", "[256]", '["a"]', "{}", "[]", "null", '"x"',
    '{"hash":"h","at":Infinity}', '{"hash":"h","at":NaN}', '{"hash":"h","at":1e999}',
    '{"hash":"h","schema":' + "9" * 400 + "}", '{"hash":"h","pending":{"hash":"p","attempts":-Infinity}}',
    '{"hash":"h","quarantine":{"hash":"q","wave":' + "9" * 400 + "}}",
    '{"applied_revision":"r","applied_at":' + "9" * 4000 + "}",
    '{"quote":"q","at":' + "9" * 5000 + "}", '{"quote":"q","at":Infinity,"lines":[1,' + DEEP + "]}",
    '{"weight_map":{"a":"x.safetensors"},"metadata":{"total_size":' + "9" * 400 + "}}",
    '{"weight_map":{"a":"x.safetensors"},"metadata":{"total_size":1e400}}', '{"weight_map":' + DEEP + "}",
])
json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=12)
json_texts = st.one_of(json_atoms, json_values.map(json.dumps), noise)


def b64(text: str) -> str:
    return base64.b64encode(text.encode(errors="surrogatepass")).decode()


fields = st.one_of(noise.map(lambda s: s.replace("\n", " ")), numbers, json_texts.map(b64),
                   st.sampled_from(["-", "=", "@", "@x", "!!!", "a=b", "L", "P", "F", "N", "B", "0", "1", INV]))


def framed(kinds: list[str], *, extra: st.SearchStrategy[list[str]] | None = None) -> st.SearchStrategy[str]:
    """A program's answer: records of `kinds` with arbitrary fields, lines of noise (lines
    without the token, or with another), records of the whole-structure strategy `extra`, with
    or without the END line and whatever follows it."""
    record = st.builds(lambda k, fs: " ".join([T, k, *fs]), st.sampled_from(kinds), st.lists(fields, max_size=5))
    other = st.one_of(noise, st.builds(lambda k, p: f"{T[:-1]}x {k} {p}", st.sampled_from(kinds), noise))
    line_lists = st.lists(st.one_of(record, record, other), max_size=25)
    parts = [line_lists] + ([extra] if extra is not None else [])
    return st.builds(lambda groups, end, tail: "\n".join([x for g in groups for x in g]
                                                         + ([f"{T} END"] if end else []) + [tail]),
                     st.lists(st.one_of(*parts), max_size=4), st.booleans(), noise)


def allowing(call, *errors: type[BaseException]):
    """call(), or None where it raised one of `errors` (the parser's own, documented error)."""
    try:
        return call()
    except errors:
        return None


# ---- the journal's load progress (host/progress.py, sh/progress.sh) -------------------------------

progress_lines = st.one_of(
    noise, st.just(E4),
    st.builds(lambda d, n, t: f"Loading safetensors checkpoint shards: {d}% Completed | {n}/{t} [", numbers, numbers,
              numbers),
    st.builds(lambda n, t: f"Capturing CUDA graphs (decode): 50%|█| {n}/{t} [", numbers, numbers),
    st.builds(lambda sizes: f"Capture cuda graph bs [{sizes}]", noise),
    st.sampled_from(["Load weight begin.", "Load weight end.", "Capture cuda graph begin. x", "Capture x end. ",
                     "Loading weights took 9.99 s", "The server is fired up and ready to roll!", "\r", "]"]),
)
records = st.lists(progress_lines, max_size=6).map("\r".join)
tails = framed(["U", "L"], extra=st.lists(records.map(lambda r: f"{T} L {r}"), max_size=8).map(
    lambda ls: [f"{T} U {INV}", *ls, f"{T} L -- cursor: s={'f' * 40};i=1;b=2;m=3;t=4;x=5"]))


@PROPERTY
@given(st.lists(records, max_size=8))
@example([E4])
@example(["Capturing batches (bs=1 avail_mem=1 GB):  9%|| " + "9" * 5000 + "/" + "9" * 5000 + " ["])
def test_progress_advance_and_its_words_never_raise(lines: list[str]) -> None:
    p = progress.advance(None, lines)
    if p is not None:
        assert p.text() and p.to_json()["text"] == p.text()
        assert p.percent() is None or 0 <= p.percent() <= 100      # type: ignore[operator]
        assert p.done is None or p.total is None or p.done <= p.total


@PROPERTY
@given(tails)
@example(f"{T} U {INV}\n{T} L {E4}\n{T} END\n")
def test_progress_tail_and_the_follower_never_raise(stdout: str) -> None:
    sections = progress.parse_tail(stdout, T)
    assert all(len(c or "") < 300 for _, c in sections.values())
    f = following.LoadFollower()
    f.follow("m.service")
    f.saw("m.service", {"InvocationID": INV})
    f.take(sections)
    assert f.failed("m.service") is None
    p = f.progress("m.service")
    assert p is None or (p.text() and len(p.line) <= 4 * progress.QUOTE_MAX)


# ---- the health watch's readings (plan/judges.py, plan/facts/ journal and show) -----------------------

journal_entries = st.dictionaries(
    st.sampled_from(["MESSAGE", "_PID", "SYSLOG_IDENTIFIER", "INVOCATION_ID", "_SYSTEMD_INVOCATION_ID", "EXIT_CODE",
                     "EXIT_STATUS"]),
    st.one_of(json_values, st.lists(st.integers(-300, 300), max_size=6), st.just("1"), st.just("systemd"),
              st.just("exited"), numbers), max_size=7).map(json.dumps)
journals = st.lists(st.one_of(journal_entries, json_texts), max_size=12).map("\n".join)


@PROPERTY
@given(journals, st.dictionaries(st.sampled_from(["NRestarts", "ActiveState", "SubState", "Result", "LoadState",
                                                  "InvocationID", "Job", "ExecMainCode", "ExecMainStatus",
                                                  "ActiveEnterTimestampMonotonic"]), st.one_of(numbers, noise)),
       st.integers(0, 5))
@example('{"MESSAGE": [256]}\n{"MESSAGE": ["a"]}\n' + DEEP + '\n{"_PID": "1", "EXIT_STATUS": ' + "9" * 5000 + "}",
         {"NRestarts": "9" * 5000}, 0)
def test_journal_and_systemd_judges_never_raise(stdout: str, props: dict[str, str], baseline: int) -> None:
    entries = parse_journal(stdout)
    judges.explain(entries)
    judges.spawn_failure(props, entries, INV)
    judges.judge_systemd(props, baseline, baseline_invocation=INV, baseline_active_enter="0")


@PROPERTY
@given(st.lists(st.one_of(noise, st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["Id", "NRestarts", "X"]),
                                           noise)), max_size=20).map("\n".join))
def test_systemctl_show_never_raises(text: str) -> None:
    assert all(isinstance(v, dict) for v in parse_show(text).values())


# ---- the observation (plan/facts.py) and the records on a host (plan/records.py) ------------------

def file_records(kinds: str, names: list[str]) -> st.SearchStrategy[list[str]]:
    """A file of the observation, whole: its lines (L, the last P), then F; or absent (-)."""
    return st.builds(lambda k, n, text, whole: [f"{T} {k} {n} L {x}" for x in text.split("\n")]
                     + [f"{T} {k} {n} {'F' if whole else '-'}"],
                     st.sampled_from(list(kinds)), st.sampled_from(names), json_texts, st.booleans())


observations = framed([*"GTKHRUEVD", "S"], extra=st.one_of(
    file_records("HR", ["gpu", "host", "m"]),
    st.builds(lambda show: [f"{T} S -", *show.split("\n")], noise)))


@PROPERTY
@given(observations)
@example(f"{T} G ²\n{T} H gpu L {DEEP}\n{T} H gpu F\n{T} R m L {'9' * 5000}\n{T} R m F\n"
         f'{T} H host L {{"applied_at": Infinity}}\n{T} H host F\n{T} S -\nId=m.service\n{T} END\n')
def test_the_observation_is_facts_or_an_observe_error(stdout: str) -> None:
    facts = allowing(lambda: parse_observation(stdout, T, "h"), ObserveError)
    if facts is not None:
        assert facts.lock_count is None or facts.lock_count.isascii()
        for s in facts.services.values():
            assert s.record is None or s.record.dumps()


@PROPERTY
@given(json_texts)
@example('{"hash": "h", "at": Infinity, "pending": {"hash": "p", "at": NaN, "attempts": 1e999}}')
@example("1" * 5000)
@example(DEEP)
def test_a_record_on_a_host_reads_as_a_record_whatever_it_holds(text: str) -> None:
    rec = ServiceRecord.parse(text)
    assert rec.dumps() and HostRecord.parse(text).dumps()
    assert all(abs(x) < 2**63 for x in (rec.schema, rec.pending.at if rec.pending else 0,
                                        rec.pending.attempts if rec.pending else 0))


# ---- pre-flight: systemd's check of a unit, the model check (plan/facts/verify.py, _hostcheck.py) -------

verify_records = st.lists(st.builds(
    lambda k, n, rest: f"{T} {k} {n} {rest}", st.sampled_from("OBV"), st.sampled_from(["m", "-"]),
    st.one_of(fields, numbers.map(lambda n: f"/etc/systemd/system/reconciler-verify-0a-m.service:{n}: bad"))),
    max_size=6)


@PROPERTY
@given(framed(["O", "B", "V"], extra=verify_records))
@example(f"{T} B m !!!\n{T} O m /x/reconciler-verify-0a-m.service:{'9' * 5000}: bad\n{T} V m 1\n{T} END\n")
def test_systemds_unit_check_never_raises(stdout: str) -> None:
    verified = parse_verify(stdout, T, {"m": ("[Service]\nExecStart=/bin/true\n", "[Service]\n")})
    assert isinstance(verified.available, bool)
    assert all(isinstance(p, str) for ps in verified.problems.values() for p in ps)


def file_lines(name: str, text: str) -> list[str]:
    """A JSON file as model-check.sh sends it: line by line, then its end."""
    *lines, last = text.split("\n")
    return ([f"{T} F {name} L {x}" for x in lines] + ([f"{T} F {name} P {last}"] if last else [])
            + [f"{T} F {name} E"])


model_paths = st.lists(st.builds(
    lambda path, d, cfg, index, size, kb: [f"{T} P {b64(path)}", f"{T} D {d}", *file_lines("config.json", cfg),
                                          *file_lines(_hostcheck.INDEX_FILE, index),
                                          f"{T} S {size} {b64('x.safetensors')}", f"{T} A {kb}"],
    noise, st.sampled_from(["0", "1", "²"]), json_texts, json_texts, numbers, numbers), max_size=3)


@PROPERTY
@given(framed(["P", "D", "F", "S", "A"], extra=model_paths.map(lambda groups: [x for g in groups for x in g])))
@example(f"{T} P {b64('/m')}\n{T} D 1\n{T} S ² {b64('x.safetensors')}\n{T} A {'9' * 5000}\n"
         + "\n".join(file_lines(_hostcheck.INDEX_FILE, INDEX_400)) + f"\n{T} END\n")
def test_the_model_check_is_model_facts_or_an_observe_error(stdout: str) -> None:
    from reconciler.preflight._hardware import weights_bytes
    found = allowing(lambda: _hostcheck.parse_model_check(stdout, T, "h"), ObserveError)
    for m in (found or {}).values():
        m.problems()
        size = weights_bytes(m)
        assert size is None or size / 1e9 >= 0                     # fetch and the rules divide it as a float
        assert m.free_bytes is None or m.free_bytes / 1e9 >= 0


# ---- the executor's results, the session, the lock (host/apply.py, session.py, lock.py) ----------

PLAN = HostPlan("h", "r", (Action(Kind.START, Reason.NEW_SERVICE, "m"), Action(Kind.RESTART, Reason.NEW_SERVICE, "m")),
                {})
shown = st.lists(st.one_of(noise, st.builds(lambda k, v: f"{k}={v}", st.sampled_from(["Id", "ActiveState", "X"]),
                                               noise)), max_size=6).map(lambda ls: [f"{T} S -", *ls])


@PROPERTY
@given(framed(["now", "fail", "fatal", "ok"], extra=shown),
       st.lists(st.one_of(st.builds(lambda n: f"{T} step {n}", numbers), noise), max_size=6).map("\n".join))
@example(f"{T} now nan\n{T} now 1e999\n{T} fail ² 1 x\n{T} fail 0 ² !!!\n{T} fatal " + "9" * 5000 + " 1", "")
@example(f"{T} fatal 1 1\n{T} S -\nId=m.service\n", f"{T} step 1\n" + "x" * 5000)
def test_the_apply_scripts_results_never_raise(stdout: str, stderr: str) -> None:
    answer = parse_apply(framing.Records(stdout, T, "h", stderr), len(PLAN.actions))
    assert answer.clock is None or answer.clock >= 0
    ends = [*answer.failures, *([answer.fatal] if answer.fatal else [])]
    assert all(0 <= f.status <= 255 and 0 <= f.step < len(PLAN.actions) and len(f.message) <= 2000 for f in ends)


@PROPERTY
@given(noise, st.one_of(numbers, noise))
@example("out", "9" * 5000)
@example("out", "²")
def test_a_session_commands_end_and_the_lock_holders_word_never_raise(body: str, status: str) -> None:
    tok = "s3ss:" + T
    res = ended(f"{body}\n{tok} END {status}\n", tok, "")
    assert 0 <= res.exit_status <= 255                                 # type: ignore[operator]
    assert len(holder_said(body + status)) <= 200


# ---- the framing itself (frames.py) ---------------------------------------------------------------

@PROPERTY
@given(framed(["X", "Y", "S"]), st.one_of(numbers, noise))
def test_framing_reads_any_text(stdout: str, text: str) -> None:
    for f in allowing(lambda: list(framing.frames(stdout, T, "h", early="cut short")), ObserveError) or []:
        f.fields(2)
        framing.malformed("h", "x", f)
    allowing(lambda: framing.raw_section(stdout, T, "S -", "h", "cut short"), ObserveError)
    allowing(lambda: framing.decode(text), ValueError)                  # decode's own contract
    n = framing.number(text)
    assert n is None or 0 <= n < 10**18


# ---- the GPU reading and the engine check: other work's parsers (see the module's docstring) -------

gpu_outputs = framed(["H", "C", "SMI", "G", "A", "GRC", "ARC", "NOW", "Q", "K", "D", "QRC", "KRC", "DRC"],
                     extra=st.lists(st.builds(lambda k, n: f"{T} {k} {n}", st.sampled_from(["K", "G", "A", "H", "NOW"]),
                                              st.one_of(numbers.map(lambda n: f"NVRM: Xid (PCI:0000:41:00): {n}, x"),
                                                        numbers.map(lambda n: f"0, GPU-1, {n}, 81559, 9.0"),
                                                        numbers.map(lambda n: f"{n}, python3, {n} MiB, GPU-1"),
                                                        numbers.map(lambda n: f"{n} @comm - /dev/nvidia0"))),
                                    max_size=6))


@PROPERTY
@given(gpu_outputs)
@example(f"{T} G 0, GPU-1, inf, 81559, 9.0\n{T} END\n")
def test_the_gpu_reading_is_gpu_facts_or_an_observe_error(stdout: str) -> None:
    from reconciler.plan.facts.gpu import parse_gpu
    allowing(lambda: parse_gpu(stdout, T, "h"), ObserveError)


@PROPERTY
@given(framed(["S", "F", "A"]))
@example(f"{T} S ²\n{T} A {'9' * 5000}\n{T} END\n")
def test_the_gpu_kill_report_never_raises(stdout: str) -> None:
    from reconciler.host.gpu import Signal
    said = Signal("alive", ()).parse(framing.Records(stdout, T))
    assert all(isinstance(p, int) and p < 10**12 for pids in said.values() for p in pids)


@PROPERTY
@given(st.lists(st.one_of(noise, numbers.map(lambda n: f"kernel: NVRM: Xid (PCI:0000:41:00): {n}, pid=1")),
                max_size=6))
@example([f"NVRM: Xid (PCI:0000:41:00): {'9' * 5000}, x"])
def test_kernel_xid_lines_never_raise(lines: list[str]) -> None:
    gpuhealth.xid_health(lines)


@PROPERTY
@given(st.lists(st.one_of(noise, st.builds(lambda k, v: f"        {k} : {v}", st.sampled_from(
    ["Uncorrectable", "Pending", "Reset Required", "GPU Recovery Action"]), numbers),
    st.just("GPU 00000000:41:00.0"), st.just("    ECC Errors"), st.just("        Volatile")), max_size=12)
    .map("\n".join))
@example("GPU 00000000:41:00.0\n    ECC Errors\n        Volatile\n            SRAM Uncorrectable : " + "9" * 5000)
def test_nvidia_smi_q_and_dcgm_never_raise(text: str) -> None:
    gpuhealth.smi_health(text)
    gpuhealth.dcgm_health(text)


host_record_reads = framed(["H"], extra=st.one_of(
    st.builds(lambda text: [f"{T} H L {x}" for x in text.split("\n")] + [f"{T} H F"], json_texts),
    st.just([f"{T} H -"])))


@PROPERTY
@given(host_record_reads)
@example(f'{T} H L {{"applied_revision": "{"a" * 40}", "applied_at": Infinity}}\n{T} H F\n{T} END\n')
@example(f"{T} H L {DEEP}\n{T} END\n")
def test_pull_modes_host_record_read_is_a_record_or_an_observe_error(stdout: str) -> None:
    from reconciler.plan.facts.host_record import parse_host_record
    rec = allowing(lambda: parse_host_record(framing.Records(stdout, T, "h")), ObserveError)
    assert rec is None or rec.dumps()


@PROPERTY
@given(json_texts)
@example(DEEP)
def test_a_gpu_fault_record_reads_whatever_it_holds(text: str) -> None:
    gpuhealth.GpuFault.parse(text)


@PROPERTY
@given(framed(["V"], extra=st.lists(st.builds(lambda s, v: f"{T} V m {s} {v}", fields, fields), max_size=4)))
def test_the_version_read_never_raises(stdout: str) -> None:
    from reconciler.plan.facts.versions import parse_versions
    parse_versions(stdout, T)


@PROPERTY
@given(framed(["N", "S", "C", "R", "O", "E"]))
@example(f"{T} O !\n{T} END\n")
def test_the_engine_checks_answer_never_raises(stdout: str) -> None:
    from reconciler.host.engine import read_answer
    from reconciler.preflight._engine import EngineRun
    read_answer(EngineRun("m", "sglang", "/opt/sglang/bin/python3", ()), stdout, T)


@PROPERTY
@given(st.one_of(json_texts, json_values.map(lambda v: json.dumps({"verdict": "ok", "seconds": v}))), noise)
@example(DEEP, "")
@example('{"verdict": "ok", "seconds": {"a": ' + "9" * 400 + ', "b": 1.0}}', "")
def test_the_engine_probes_verdict_never_raises(payload: str, tail: str) -> None:
    from reconciler.preflight._engine import MARKER, parse_verdict
    parse_verdict("m", "sglang", f"{MARKER}{payload}\n", exit_status=0, tail=tail)
