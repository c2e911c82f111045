"""Ask the engine: which services have an engine check, what the probe's answers mean, and the
host program that runs it (reconciler/sh/engine-probe.sh, run here with a recording
systemd-run, a stand-in nvidia-smi and a stand-in probe in place of the engine's)."""

from __future__ import annotations

import base64
import dataclasses
import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.desired.spec import ServiceSpec
from reconciler.host import engine
from reconciler.preflight import EngineVerdict, engine_run_for, parse_verdict
from reconciler.shell import ShCommand

SH = Path(__file__).resolve().parents[2] / "reconciler" / "sh" / "engine-probe.sh"


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
    assert (run.user, run.workdir, run.mode) == ("llm", "/srv/llm", "hidden")
    assert run.args == tuple(SEED.split())
    assert dict(run.env) == {"SGLANG_ENABLE_SPEC_V2": "1", "HF_HOME": "/srv/hf"}
    assert run.env_files == ("-/etc/default/sglang",)


def test_console_scripts_take_the_python_beside_them_and_sglang_serve_gets_its_model_path():
    v = engine_run_for("m", spec("[Service]\nExecStart=/opt/vllm/bin/vllm serve /models/q -tp 4\n"))
    assert v is not None and (v.server, v.interpreter, v.args) == ("vllm", "/opt/vllm/bin/python3",
                                                                    ("/models/q", "-tp", "4"))
    s = engine_run_for("m", spec("[Service]\nExecStart=/opt/sg/bin/sglang serve /models/q --tp-size 2\n"))
    assert s is not None and s.args == ("--model-path", "/models/q", "--tp-size", "2")


def test_a_service_can_turn_its_engine_check_off():
    svc = dataclasses.replace(spec(f"[Service]\nExecStart=/opt/s/bin/python3 -m sglang.launch_server {SEED}\n"),
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
    assert v.note() == f"m: engine check inconclusive (vllm): {message}; the static rules decide"


def test_a_long_or_multi_line_message_is_one_bounded_printable_line():
    v = parse_verdict("m", "sglang", answer(engine="sglang", verdict="rejected", message="a\nb\x1b[31m" + "x" * 900))
    assert "\n" not in v.message and "\x1b" not in v.message and len(v.message) == 600


# ---- the host program ------------------------------------------------------------------------------

FAKE_PROBE = """import json, os, sys
args = sys.argv[1:]
print("engine log line")
print("RECONCILER-ENGINE " + json.dumps({"engine": "sglang", "version": "0.0-standin", "verdict": "ok",
      "resolved": {"argv": args, "cuda": os.environ.get("CUDA_VISIBLE_DEVICES"),
                   "hub": os.environ.get("HF_HUB_OFFLINE"), "mine": os.environ.get("MINE")}}))
"""

# Records systemd-run's options, reads the EnvironmentFile=s it was given in order (later wins,
# as systemd does), and runs the command after the first `--` with that environment.
FAKE_SYSTEMD_RUN = """#!/bin/sh
: > "$REC"
while [ "$1" != -- ]; do
  printf '%s\\n' "$1" >> "$REC"
  case "$1" in EnvironmentFile=*)
    f=${1#EnvironmentFile=}; f=${f#-}
    [ -r "$f" ] && { set -a; . "$f"; set +a; } ;;
  esac
  shift
done
shift
exec "$@"
"""

FAKE_SMI = """#!/bin/sh
printf 'NVIDIA H200, 9.0, 143771\\nNVIDIA H200, 9.0, 143771\\n'
"""


@pytest.fixture
def host_bin(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    for name, text in (("systemd-run", FAKE_SYSTEMD_RUN), ("nvidia-smi", FAKE_SMI)):
        (bin_dir / name).write_text(text)
        (bin_dir / name).chmod(stat.S_IRWXU)
    monkeypatch.setattr(engine, "probe_text", lambda server: FAKE_PROBE)
    # the engine's argument stage, where the host program looks for it (here: on PYTHONPATH)
    stage = tmp_path / "site" / "sglang" / "srt" / "server_args.py"
    stage.parent.mkdir(parents=True)
    stage.write_text("")
    return bin_dir


def site(tmp_path: Path) -> dict[str, str]:
    return {"PYTHONPATH": str(tmp_path / "site")}


def run_program(cmd: ShCommand, stdin: str, bin_dir: Path, rec: Path) -> str:
    res = subprocess.run(["/bin/sh", str(SH), *cmd.args], input=stdin, capture_output=True, text=True, timeout=60,
                         env={**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "REC": str(rec)})
    assert res.returncode == 0, res.stderr
    return res.stdout


def test_the_host_program_runs_the_probe_hidden_with_facts_the_units_env_and_guards_last(host_bin: Path,
                                                                                       tmp_path: Path):
    envfile = tmp_path / "unit.env"
    envfile.write_text("MINE=from-unit-file\nCUDA_VISIBLE_DEVICES=0,1\n")
    unit = (f"[Service]\nUser=nobody\nEnvironmentFile={envfile}\nEnvironmentFile=-/etc/reconciler/env/m.env\n"
            f"ExecStart={sys.executable} -m sglang.launch_server --model-path /nonexistent --tp-size 2\n")
    run = engine_run_for("m", spec(unit, {"MINE": "from-git", **site(tmp_path)}))
    assert run is not None
    cmd, stdin, token = engine.engine_command(run, seconds=30)
    assert "from-git" not in cmd and 'MINE="from-git"' in stdin      # values only on stdin
    rec = tmp_path / "rec"
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, rec), token)
    assert a.verdict is not None and a.verdict.verdict == "ok" and a.stamp
    facts = '{"count": 2, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}'
    assert a.verdict.resolved == {"argv": ["--facts", facts, "--", "--model-path", "/nonexistent", "--tp-size", "2"],
                                  "cuda": "", "hub": "1", "mine": "from-git"}
    options = rec.read_text().splitlines()
    assert options[:9] == ["--quiet", "--wait", "--pipe", "--collect", "--service-type=exec", "-p", "MemoryMax=4G",
                           "-p", "RuntimeMaxSec=30"]
    files = [o for o in options if o.startswith("EnvironmentFile=")]
    assert files[0] == f"EnvironmentFile={envfile}" and files[1].endswith("/env") and len(files) == 2
    assert "User=nobody" in options
    assert not list(Path("/run").glob("reconciler-engine.*"))          # nothing left behind


def test_visible_mode_passes_no_facts_and_hides_no_gpu(host_bin: Path, tmp_path: Path):
    run = engine_run_for("m", spec(f"[Service]\nExecStart={sys.executable} -m sglang.launch_server --tp-size 1\n",
                                   {"CUDA_VISIBLE_DEVICES": "3", **site(tmp_path)}))
    assert run is not None
    cmd, stdin, token = engine.engine_command(dataclasses.replace(run, mode="visible"))
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    assert a.verdict is not None and a.verdict.resolved["argv"] == ["--", "--tp-size", "1"]
    assert a.verdict.resolved["cuda"] == "3"


def test_an_unchanged_stamp_answers_from_the_cache_without_running_the_probe(host_bin: Path, tmp_path: Path):
    run = engine_run_for("m", spec(f"[Service]\nExecStart={sys.executable} -m sglang.launch_server\n", site(tmp_path)))
    assert run is not None
    cmd, stdin, token = engine.engine_command(run)
    first = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    cmd, stdin, token = engine.engine_command(run, cached=first.stamp)
    (tmp_path / "rec").unlink()
    again = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    assert again == engine.Answer(first.stamp, None) and not (tmp_path / "rec").exists()


def test_no_python_is_started_where_the_engines_argument_stage_is_not_installed(host_bin: Path, tmp_path: Path):
    run = engine_run_for("m", spec(f"[Service]\nExecStart={sys.executable} -m sglang.launch_server\n",
                                   {"PYTHONPATH": str(tmp_path / "elsewhere")}))
    assert run is not None
    cmd, stdin, token = engine.engine_command(run)
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    assert a.stamp == "" and a.verdict is not None and a.verdict.verdict == "inconclusive"
    assert a.verdict.message == (f"sglang is not installed for {sys.executable} "
                                 "(no sglang/srt/server_args.py in its package directories)")
    assert not (tmp_path / "rec").exists()                    # systemd-run never ran
    # An editable install (a .pth naming the engine) is asked: its sources live elsewhere.
    (tmp_path / "elsewhere").mkdir()
    (tmp_path / "elsewhere" / "__editable__.sglang-0.5.23.pth").write_text("/src/sglang/python\n")
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    assert a.verdict is not None and a.verdict.verdict == "ok" and (tmp_path / "rec").exists()


def test_the_verdict_cache_keeps_answers_per_host_and_request_and_drops_probe_crashes(tmp_path: Path):
    store = engine.VerdictCache(tmp_path / "v.json")
    ok = EngineVerdict("m", "sglang", "ok", version="0.5.23", resolved={"tp_size": 4}, seconds=8.0)
    store.remember("h1", "k", "s1", ok)
    store.remember("h1", "k2", "s1", EngineVerdict("m", "sglang", "inconclusive",
                                                   message="the probe gave no answer (exit status 1)"))
    store.save()
    again = engine.VerdictCache(tmp_path / "v.json")
    assert again.stamp("h1", "k") == "s1" and again.stamp("h1", "k2") == "" and again.stamp("h2", "k") == ""
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


def test_the_program_is_sent_with_the_probe_in_base64(host_bin: Path):
    run = engine_run_for("m", spec("[Service]\nExecStart=/opt/v/bin/python3 -m vllm.entrypoints.openai.api_server\n"))
    assert run is not None
    cmd, _, _ = engine.engine_command(run)
    assert base64.b64decode(cmd.args[2]).decode() == FAKE_PROBE


def test_every_pythonpath_entry_is_searched_and_a_pth_is_read_to_its_last_line(host_bin: Path, tmp_path: Path):
    """The host program looks for the engine with builtins only (no process for "not installed"):
    PYTHONPATH split on ':' (here the engine is in its second entry), and a .pth whose last line
    (without a newline) names the engine."""
    run = engine_run_for("m", spec(f"[Service]\nExecStart={sys.executable} -m sglang.launch_server\n",
                                   {"PYTHONPATH": f"{tmp_path / 'first'}:{tmp_path / 'site'}"}))
    assert run is not None
    cmd, stdin, token = engine.engine_command(run)
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec"), token)
    assert a.verdict is not None and a.verdict.verdict == "ok"
    run = engine_run_for("m", spec(f"[Service]\nExecStart={sys.executable} -m sglang.launch_server\n",
                                   {"PYTHONPATH": f"{tmp_path / 'first'}:{tmp_path / 'other'}"}))
    assert run is not None
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "a.pth").write_text("import os\n/src/sglang/python")
    cmd, stdin, token = engine.engine_command(run)
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec2"), token)
    assert a.verdict is not None and a.verdict.verdict == "ok" and (tmp_path / "rec2").exists()
    (tmp_path / "other" / "a.pth").write_text("import os\n/src/vllm/python")
    cmd, stdin, token = engine.engine_command(run)
    a = engine.read_answer(run, run_program(cmd, stdin, host_bin, tmp_path / "rec3"), token)
    assert a.verdict is not None and a.verdict.verdict == "inconclusive" and not (tmp_path / "rec3").exists()
