"""Ask the engine: which services have an engine check, what the probe's answers mean, what
a message keeps (redacted before it is cut), and the verdict cache (expiry, the stamp an
answer was taken on). The host program is tests/host/test_engine_program.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import reconciler.values
from reconciler import redact
from reconciler.desired.spec import ServiceSpec
from reconciler.host import engine
from reconciler.preflight import EngineVerdict, engine_run_for, parse_verdict


def spec(unit: str, env: dict[str, str] | None = None) -> ServiceSpec:
    return ServiceSpec(name="m", unit_text=unit, env=env or {})


SEED = ("--model-path /models/Qwen3.5-122B-A10B --tp-size 4 --speculative-algo NEXTN --speculative-num-steps 3 "
        "--speculative-eagle-topk 1 --speculative-num-draft-tokens 4")


def test_a_python_module_unit_runs_its_own_interpreter_on_the_servers_own_arguments():
    unit = ("[Service]\nUser=llm\nWorkingDirectory=-/srv/llm\nEnvironment=SGLANG_ENABLE_SPEC_V2=1\n"
            "EnvironmentFile=-/etc/default/sglang\n"
            f"ExecStart=/opt/sglang/bin/python3 -u -m sglang.launch_server {SEED}\n")
    run = engine_run_for("m", spec(unit, {"HF_HOME": "/srv/hf"}))
    assert run is not None
    assert (run.server, run.interpreter) == ("sglang", "/opt/sglang/bin/python3")
    assert (run.user, run.workdir, run.mode, run.user_site) == ("llm", "/srv/llm", "hidden", True)
    assert run.args == tuple(SEED.split())
    assert dict(run.env) == {"SGLANG_ENABLE_SPEC_V2": "1", "HF_HOME": "/srv/hf"}
    assert run.env_files == ("-/etc/default/sglang",)
    assert run.unit == (("User", "llm"), ("WorkingDirectory", "-/srv/llm"))


@pytest.mark.parametrize(("line", "env", "user_site"), [
    ("/opt/s/bin/python3 -m sglang.launch_server", {}, True),
    ("/opt/s/bin/python3 -s -m sglang.launch_server", {}, False),
    ("/opt/s/bin/python3 -I -m sglang.launch_server", {}, False),
    ("/opt/s/bin/python3 -Es -m sglang.launch_server", {}, False),
    ("/opt/s/bin/python3 -m sglang.launch_server", {"PYTHONNOUSERSITE": "1"}, False),
    ("/opt/s/bin/python3 -E -m sglang.launch_server", {"PYTHONNOUSERSITE": "1"}, True),
    ("/opt/s/bin/python3 -u -m sglang.launch_server --s x", {}, True),
])
def test_whether_the_interpreter_reads_the_users_site_directory(line: str, env: dict[str, str], user_site: bool):
    run = engine_run_for("m", spec(f"[Service]\nExecStart={line}\n", env))
    assert run is not None and run.user_site is user_site


def test_console_scripts_take_the_python_beside_them_and_sglang_serve_gets_its_model_path():
    v = engine_run_for("m", spec("[Service]\nExecStart=/opt/vllm/bin/vllm serve /models/q -tp 4\n"))
    assert v is not None and (v.server, v.interpreter, v.args) == ("vllm", "/opt/vllm/bin/python3",
                                                                    ("/models/q", "-tp", "4"))
    s = engine_run_for("m", spec("[Service]\nExecStart=/opt/sg/bin/sglang serve /models/q --tp-size 2\n"))
    assert s is not None and s.args == ("--model-path", "/models/q", "--tp-size", "2")


def test_a_service_can_turn_its_engine_check_off():
    svc = reconciler.values.replace(spec(f"[Service]\nExecStart=/opt/s/bin/python3 -m sglang.launch_server {SEED}\n"),
                              engine_check="off")
    assert engine_run_for("m", svc) is None


@pytest.mark.parametrize("unit", [
    "[Service]\nExecStart=/bin/sleep infinity\n",                       # no server
    "[Service]\nExecStart=python3 -m sglang.launch_server --tp-size 1\n",  # an interpreter found on PATH
    "[Service]\nExecStart=sglang serve /models/q\n",
])
def test_no_engine_check_where_no_interpreter_can_be_named(unit: str):
    assert engine_run_for("m", spec(unit)) is None


def answer(**fields: object) -> str:
    """What a probe prints: the engine's own chatter, then its answer as the last line."""
    return "INFO loading\n" + "RECONCILER-ENGINE " + json.dumps(fields) + "\n"


def test_a_refusal_quotes_the_engine_and_names_its_version():
    out = answer(engine="sglang", version="0.5.12", verdict="rejected", stage="parse", error="ValueError",
                 message="Speculative decoding for Qwen3_5MoeForConditionalGeneration is not compatible with "
                         "radix cache when using --mamba-scheduler-strategy no_buffer.",
                 where="sglang/srt/server_args.py:2568 _handle_mamba_radix_cache", resolved={},
                 seconds={"import": 6.1, "check": 1.5})
    v = parse_verdict("m", "sglang", out)
    assert (v.verdict, v.version, v.error, v.seconds) == ("rejected", "0.5.12", "ValueError", 7.6)
    assert v.block() == (
        "m: the installed sglang 0.5.12 refuses this command line: ValueError: Speculative decoding for "
        "Qwen3_5MoeForConditionalGeneration is not compatible with radix cache when using "
        "--mamba-scheduler-strategy no_buffer. (sglang/srt/server_args.py:2568 _handle_mamba_radix_cache). "
        "Nothing was stopped. Fix: change the flags as the engine says, or pin the engine version the unit "
        "was written for")


def test_an_accepted_command_line_shows_what_the_engine_resolved():
    out = answer(engine="sglang", version="0.5.23", verdict="ok", resolved={
        "mamba_radix_cache_strategy": ["auto", "extra_buffer"], "speculative_algorithm": "EAGLE",
        "attention_backend": "fa3", "context_length": 262144, "tp_size": 4, "disable_overlap_schedule": False},
        seconds={"import": 6.0, "check": 2.0})
    v = parse_verdict("m", "sglang", out)
    assert v.note() == ("m: sglang 0.5.23 accepts the command line, 8.0 s: mamba strategy auto -> extra_buffer, "
                        "speculative EAGLE, attention fa3, context 262144, tp 4")


def test_usage_errors_read_as_argparse_wrote_them():
    out = answer(engine="sglang", version="0.5.23", verdict="rejected", stage="parse", error="usage",
                 message="unrecognized arguments: --mamba-scheduler-strategy extra_buffer")
    assert "refuses this command line: unrecognized arguments: --mamba-scheduler-strategy extra_buffer. " \
        in parse_verdict("m", "sglang", out).block()


@pytest.mark.parametrize(("stdout", "status", "tail", "message"), [
    ("", 124, "", "the probe gave no answer (killed at its time limit)"),
    ("partial\n", 1, "Traceback\nMemoryError\n", "the probe gave no answer (exit status 1): MemoryError"),
    ("RECONCILER-ENGINE {not json\n", 0, "", "the probe's answer could not be read"),
    ("RECONCILER-ENGINE {\"verdict\": \"maybe\"}\n", 0, "", "the probe's answer could not be read"),
])
def test_no_answer_is_inconclusive_and_says_why(stdout: str, status: int, tail: str, message: str):
    v = parse_verdict("m", "vllm", stdout, exit_status=status, tail=tail)
    assert v.seconds is None
    assert (v.verdict, v.message) == ("inconclusive", message)
    assert v.answered is ("gave no answer" not in message)     # an answer that cannot be read is still one
    assert v.note() == f"m: engine check inconclusive (vllm): {message}; the static rules decide"


def test_a_long_or_multi_line_message_is_one_bounded_printable_line():
    v = parse_verdict("m", "sglang", answer(engine="sglang", verdict="rejected", message="a\nb\x1b[31m" + "x" * 900))
    assert "\n" not in v.message and "\x1b" not in v.message and len(v.message) == 600


@pytest.mark.parametrize("at", [580, 585, 590, 592])
def test_a_secret_straddling_the_cut_is_redacted_before_it_so_no_part_of_it_is_left(at: int):
    """Review 2026-12-03 N6, E5: a registered secret across character 600 of an engine message
    kept its first 8 characters. The whole message is redacted first, then cut."""
    secret = "Zq9-vT3-s8Kd2-Lw5"
    redact.register(secret)
    message = "x" * at + " " + secret + " and the rest of the message"
    v = parse_verdict("m", "sglang", answer(engine="sglang", verdict="rejected", message=message))
    assert len(v.message) <= 600
    assert not any(secret[:n] in v.message for n in range(4, len(secret) + 1)), v.message[-40:]
    tail = parse_verdict("m", "sglang", "", exit_status=1, tail=f"Traceback\nValueError: {message}\n")
    assert not any(secret[:n] in tail.message for n in range(4, len(secret) + 1))


def test_a_note_of_the_probe_is_said_with_the_verdict_and_kept_in_the_cache(tmp_path: Path):
    note = "--trust-remote-code left out: the model's own code never runs in the engine check"
    v = parse_verdict("m", "sglang", answer(engine="sglang", version="0.5.23", verdict="ok", notes=[note]))
    assert v.notes == (note,)
    assert v.note() == f"m: sglang 0.5.23 accepts the command line ({note})"
    refused = parse_verdict("m", "sglang", answer(engine="sglang", version="0.5.23", verdict="rejected",
                                                  error="usage", message="unrecognized arguments: --x", notes=[note]))
    assert refused.block().startswith("m: the installed sglang 0.5.23 refuses this command line: unrecognized "
                                      "arguments: --x. Nothing was stopped.")
    assert refused.block().endswith(f"the unit was written for ({note})")
    store = engine.VerdictCache(tmp_path / "v.json", wall=lambda: 1000.0)
    store.remember("h", "k", "s", v)
    again = store.verdict("h", "k", "m")
    assert again is not None and again.notes == (note,)


# ---- the verdict cache ----------------------------------------------------------------------------


def test_the_verdict_cache_keeps_answers_per_host_and_request_and_drops_probe_crashes(tmp_path: Path):
    store = engine.VerdictCache(tmp_path / "v.json", wall=lambda: 1000.0)
    ok = EngineVerdict("m", "sglang", "ok", version="0.5.23", resolved={"tp_size": 4}, seconds=8.0)
    store.remember("h1", "k", "s1", ok)
    store.remember("h1", "k2", "s1", parse_verdict("m", "sglang", "partial\n", exit_status=1))
    # an answer is kept whatever its words: the probe's own inconclusive verdict that quotes them too
    said = EngineVerdict("m", "sglang", "inconclusive", message="the engine says: the probe gave no answer")
    store.remember("h1", "k3", "s1", said)
    store.save()
    again = engine.VerdictCache(tmp_path / "v.json", wall=lambda: 1000.0)
    assert again.stamp("h1", "k") == "s1" and again.stamp("h1", "k2") == "" and again.stamp("h2", "k") == ""
    assert again.verdict("h1", "k3", "m") == EngineVerdict("m", "sglang", "inconclusive", message=said.message,
                                                          cached=True)
    cached = again.verdict("h1", "k", "other-name")
    assert cached == EngineVerdict("other-name", "sglang", "ok", version="0.5.23", resolved={"tp_size": 4},
                                   seconds=8.0, cached=True)
    assert cached.note() == "other-name: sglang 0.5.23 accepts the command line: tp 4"


def test_the_verdict_cache_file_holds_no_token_an_engine_quoted(tmp_path: Path):
    store = engine.VerdictCache(tmp_path / "v.json")
    token = "hf_" + "q7Zr2Lk9Xw4Pm8Vn3Bt6"
    store.remember("h1", "k", "s1", EngineVerdict("m", "vllm", "rejected", version="0.33.0",
                                                  message=f"unrecognized arguments: --hf-token {token}"))
    store.save()
    text = (tmp_path / "v.json").read_text()
    assert token not in text and "unrecognized arguments: --hf-token ***" in text




def test_a_cached_answer_expires_after_a_day_whatever_the_stamp(tmp_path: Path):
    now = [1_000_000.0]
    store = engine.VerdictCache(tmp_path / "v.json", wall=lambda: now[0])
    store.remember("h", "k", "s1", EngineVerdict("m", "sglang", "ok", version="0.5.23"))
    store.save()
    now[0] += engine.MAX_AGE
    again = engine.VerdictCache(tmp_path / "v.json", wall=lambda: now[0])
    assert again.stamp("h", "k") == "s1" and again.verdict("h", "k", "m") is not None
    now[0] += 1
    assert again.stamp("h", "k") == "" and again.verdict("h", "k", "m") is None
    now[0] -= engine.MAX_AGE + 2        # taken "in the future" (a clock set back): not trusted either
    assert again.verdict("h", "k", "m") is None


def test_an_entry_without_the_time_it_was_taken_is_not_offered(tmp_path: Path):
    """A cache written before answers expired holds no time: its answers are asked again."""
    (tmp_path / "v.json").write_text(json.dumps({"h": {"k": {"stamp": "s1", "verdict": {
        "service": "m", "server": "sglang", "verdict": "ok"}}}}))
    store = engine.VerdictCache(tmp_path / "v.json", wall=lambda: 1000.0)
    assert store.stamp("h", "k") == "" and store.verdict("h", "k", "m") is None


@pytest.mark.parametrize(("unit", "why"), [
    ("RootDirectory=/srv/root", "the unit runs in RootDirectory=/srv/root, where the engine check does not look"),
    ("RootImage=/srv/os.raw", "the unit runs in RootImage=/srv/os.raw, where the engine check does not look"),
])
def test_a_unit_in_another_root_is_not_checked(unit: str, why: str):
    run = engine_run_for("m", spec(f"[Service]\n{unit}\nExecStart=/opt/s/bin/python3 -m sglang.launch_server\n"))
    assert run is not None and engine.refusal(run) == why


def test_a_setting_with_a_line_break_is_not_sent():
    run = engine_run_for("m", spec("[Service]\nExecStart=/opt/s/bin/python3 -m sglang.launch_server\n",
                                   {"PYTHONPATH": "/a\nprop=User=root"}))
    assert run is not None and engine.refusal(run) == "a unit setting holds a line break"
