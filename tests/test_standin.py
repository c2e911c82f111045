"""Tests for the SGLang server stand-in (tests/standin.py), run locally as a subprocess.

The stand-in is what the test hosts run under systemd; these tests pin the behaviour the
reconciler's end-to-end tests rely on: health only after the simulated load, the incident's
flag rule with its exact journal line, crash and hang knobs, clean SIGTERM.
"""

from __future__ import annotations

import ast
import http.client
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
STANDIN = HERE / "standin.py"
MODELS = HERE / "models"
DENSE = MODELS / "Qwen3-8B"
HYBRID = MODELS / "Qwen3.5-122B-A10B"
HYBRID_UNKNOWN = MODELS / "Hybrid-Unknown"
BROKEN = MODELS / "Broken-MissingShard"

INCIDENT_LINE = (
    "MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer "
    "and SGLANG_ENABLE_SPEC_V2=1"
)
CRASH_LINE = "RuntimeError: CUDA error: an illegal memory access was encountered"
# The flags added in the incident.
SPEC_FLAGS = [
    "--speculative-algo", "NEXTN", "--speculative-num-steps", "3",
    "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4",
]

pytestmark = pytest.mark.timeout(20)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def clean_env(**extra: str) -> dict[str, str]:
    env = {
        k: v for k, v in os.environ.items()
        if not k.startswith("STANDIN_") and k not in ("SGLANG_ENABLE_SPEC_V2", "CUDA_VISIBLE_DEVICES")
    }
    env.update(extra)
    return env


def run_once(*args: str, timeout: float = 10, **env: str) -> subprocess.CompletedProcess:
    """Run the stand-in to completion (for cases where it must exit on its own)."""
    return subprocess.run(
        [sys.executable, str(STANDIN), *args], env=clean_env(**env),
        capture_output=True, text=True, timeout=timeout,
    )


def last_line(text: str) -> str:
    lines = [ln for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else ""


def get(port: int, path: str) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=2)
    try:
        conn.request("GET", path)
        resp = conn.getresponse()
        return resp.status, resp.read()
    finally:
        conn.close()


class Standin:
    """A running stand-in; stderr goes to a file so the test can read it while it runs."""

    def __init__(self, tmp_path: Path, *args: str, **env: str) -> None:
        self.port = free_port()
        self.stderr_path = tmp_path / f"standin-{self.port}.log"
        with open(self.stderr_path, "w") as err:   # the child keeps its own copy of the descriptor
            self.proc = subprocess.Popen(
                [sys.executable, str(STANDIN), "--host", "127.0.0.1", "--port", str(self.port), *args],
                env=clean_env(**env), stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                stderr=err,
            )

    @property
    def stderr(self) -> str:
        return self.stderr_path.read_text()

    def said(self, text: str, timeout: float = 8) -> None:
        """Wait until the stand-in has logged `text` (a poll of its log: an event, not a fixed wait)."""
        deadline = time.monotonic() + timeout
        while text not in self.stderr:
            if self.proc.poll() is not None and text not in self.stderr:
                raise AssertionError(f"exited {self.proc.returncode} before saying {text!r}:\n{self.stderr}")
            if time.monotonic() > deadline:
                raise AssertionError(f"did not say {text!r} within {timeout}s:\n{self.stderr}")
            time.sleep(0.02)

    def wait_healthy(self, timeout: float = 8) -> None:
        """Poll /health until it answers (the port listens only once it has loaded)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise AssertionError(f"exited {self.proc.returncode} before healthy:\n{self.stderr}")
            try:
                get(self.port, "/health")
                return
            except OSError:
                time.sleep(0.05)
        raise AssertionError(f"not healthy after {timeout}s:\n{self.stderr}")

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout=5)


@pytest.fixture
def standin(tmp_path):
    started: list[Standin] = []

    def start(*args: str, **env: str) -> Standin:
        s = Standin(tmp_path, *args, **env)
        started.append(s)
        return s

    yield start
    for s in started:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(timeout=5)


# --- the file itself ---------------------------------------------------------------------

def test_file_is_an_executable_stdlib_only_standin():
    text = STANDIN.read_text()
    assert text.startswith("#!/usr/bin/python3\n")
    assert STANDIN.stat().st_mode & stat.S_IXUSR
    doc = ast.get_docstring(ast.parse(text)) or ""
    assert "STAND-IN" in doc and "SGLang" in doc
    for knob in ("STANDIN_LOAD_SECONDS", "STANDIN_CRASH_AFTER", "STANDIN_HANG", "STANDIN_HEALTH_STATUS"):
        assert knob in doc
    # Only the standard library: the test hosts have nothing else.
    for node in ast.walk(ast.parse(text)):
        names = []
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names = [node.module or ""]
        for name in names:
            assert name.split(".")[0] in sys.stdlib_module_names, name


# --- healthy paths -----------------------------------------------------------------------

def test_healthy_only_after_load_then_serves_endpoints(standin):
    s = standin("--model-path", str(DENSE), "--served-model-name", "qwen3-8b",
                STANDIN_LOAD_SECONDS="1.0")
    s.said("Load weight begin")  # flushed while running
    with pytest.raises(ConnectionRefusedError):  # port not listening while "loading"
        get(s.port, "/health")
    assert s.proc.poll() is None
    assert "Load weight end" not in s.stderr   # the refusal above was during the load

    s.wait_healthy()
    err = s.stderr
    assert err.index("Load weight end") < err.index("fired up")   # healthy only once the load ended
    assert get(s.port, "/health")[0] == 200
    status, body = get(s.port, "/get_model_info")
    assert status == 200
    info = json.loads(body)
    assert info == {"model_path": str(DENSE), "served_model_name": "qwen3-8b", "is_generation": True}
    status, body = get(s.port, "/v1/models")
    assert status == 200
    models = json.loads(body)
    assert models["object"] == "list" and models["data"][0]["id"] == "qwen3-8b"
    assert get(s.port, "/nope")[0] == 404

    err = s.stderr
    for needle in ("server_args=", "Load weight begin", "Load weight end", "The server is fired up and ready to roll!"):
        assert needle in err
    assert s.stop() == 0


def _progress_texts(stderr: str) -> list[str]:
    """What the reconciler's progress view would show, line by line, of this stderr as journald
    stores it (records split at newlines only)."""
    from reconciler.plan.facts.progress import advance
    texts, now = [], None
    for record in stderr.split("\n"):
        now = advance(now, [record])
        if now is not None and (not texts or texts[-1] != now.text()):
            texts.append(now.text())
    return texts


def test_the_load_prints_sglangs_progress_lines_that_the_reconciler_reads(standin, tmp_path):
    s = standin("--model-path", str(DENSE), STANDIN_LOAD_SECONDS="0.4")
    s.wait_healthy()
    err = s.stderr_path.read_bytes().decode()     # as written: read_text() would make each \r a newline
    shard_bar = next(r for r in err.split("\n") if "checkpoint shards" in r)
    # SGLang's BAR_FORMAT: 0/2, 1/2, 2/2 each after a carriage return, one newline when it closes
    assert shard_bar.count("\r") == 3 and shard_bar.startswith("\rLoading safetensors checkpoint shards:   0% ")
    assert shard_bar.endswith("]") and "100% Completed | 2/2 [" in shard_bar
    assert _progress_texts(err) == ["loading weights", "loading weights: 2/2 checkpoint shards (100%)",
                                    "weights loaded (2 checkpoint shards)", "capturing CUDA graphs",
                                    "capturing CUDA graphs (4 batch sizes)", "capturing CUDA graphs: 4/4 (100%)",
                                    "CUDA graphs captured", "engine ready"]
    assert err.index("Capture cuda graph end") < err.index("fired up")


def test_with_a_newline_after_each_redraw_every_shard_is_a_line_of_its_own(standin, tmp_path):
    model = tmp_path / "no-weights"
    model.mkdir()
    (model / "config.json").write_text((DENSE / "config.json").read_text())
    s = standin("--model-path", str(model), STANDIN_BAR_NEWLINE="1")
    s.wait_healthy()
    err = s.stderr_path.read_bytes().decode()
    shards = [r for r in err.split("\n") if "checkpoint shards" in r]
    assert [r.split(" | ")[1].split(" ")[0] for r in shards] == ["0/4", "1/4", "2/4", "3/4", "4/4"]   # 4: no index
    assert _progress_texts(err)[:3] == ["loading weights", "loading weights: 0/4 checkpoint shards (0%)",
                                             "loading weights: 1/4 checkpoint shards (25%)"]


E4 = "Loading safetensors checkpoint shards:  50% Completed | " + "9" * 400 + "/1 ["   # review N5


def test_a_progress_line_of_the_tests_own_is_printed_as_it_is_right_after_the_load_begins(standin):
    s = standin("--model-path", str(DENSE), STANDIN_PROGRESS_LINE=E4)
    s.wait_healthy()
    lines = s.stderr_path.read_bytes().decode().split("\n")
    begin = next(i for i, line in enumerate(lines) if "Load weight begin" in line)
    assert lines[begin + 1] == E4
    # the reconciler takes no 400-digit count: the line says nothing of the load
    assert _progress_texts("\n".join(lines))[:2] == ["loading weights", "loading weights: 2/2 checkpoint shards (100%)"]


def test_a_broken_shard_ends_the_bars_line_then_fails_when_the_load_reaches_it():
    r = run_once("--model-path", str(BROKEN), "--port", str(free_port()))
    lines = r.stderr.split("\n")
    assert r.returncode == 1 and "Load weight end" not in r.stderr
    assert "checkpoint shards" in lines[-3] and "model-00002-of-00003.safetensors is empty" in lines[-2]


def test_health_status_knob(standin):
    s = standin("--model-path", str(DENSE), STANDIN_HEALTH_STATUS="503")
    s.wait_healthy()
    assert get(s.port, "/health")[0] == 503
    assert get(s.port, "/get_model_info")[0] == 200
    assert s.stop() == 0


def test_dense_model_with_speculative_flags_is_fine(standin):
    s = standin("--model-path", str(DENSE), "--tp-size", "2", *SPEC_FLAGS, CUDA_VISIBLE_DEVICES="0,1")
    s.wait_healthy()
    assert INCIDENT_LINE not in s.stderr
    assert s.stop() == 0


@pytest.mark.parametrize("model", [HYBRID, HYBRID_UNKNOWN], ids=["qwen3.5", "unknown-arch"])
def test_hybrid_with_extra_buffer_and_spec_v2_is_healthy(standin, model):
    s = standin("--model-path", str(model), "--tp-size", "4", *SPEC_FLAGS,
                "--mamba-scheduler-strategy", "extra_buffer", "--trust-remote-code",
                SGLANG_ENABLE_SPEC_V2="1")
    s.wait_healthy()
    assert get(s.port, "/health")[0] == 200
    assert s.stop() == 0


def test_hybrid_without_speculative_decoding_is_healthy(standin):
    s = standin("--model-path", str(HYBRID))
    s.wait_healthy()
    assert s.stop() == 0


# --- the incident rule -------------------------------------------------------------------

@pytest.mark.parametrize(
    "model,extra,env",
    [
        (HYBRID, [], {}),  # exactly the incident
        (HYBRID, ["--mamba-scheduler-strategy", "extra_buffer"], {}),
        (HYBRID, [], {"SGLANG_ENABLE_SPEC_V2": "1"}),
        (HYBRID, ["--mamba-scheduler-strategy", "no_buffer"], {"SGLANG_ENABLE_SPEC_V2": "1"}),
        (HYBRID, ["--speculative-algorithm", "EAGLE"], {}),
        (HYBRID_UNKNOWN, [], {}),
    ],
    ids=["incident", "buffer-only", "env-only", "no_buffer+env", "eagle", "unknown-arch"],
)
def test_incident_flags_on_hybrid_model_exit_with_the_journal_line(model, extra, env):
    r = run_once("--model-path", str(model), *SPEC_FLAGS, *extra, **env)
    assert r.returncode == 1, r.stderr
    assert last_line(r.stderr) == INCIDENT_LINE
    assert "server_args=" in r.stderr


# --- start-up failures -------------------------------------------------------------------

def test_missing_config_json_exits_1(tmp_path):
    r = run_once("--model-path", str(tmp_path / "no-such-model"))
    assert r.returncode == 1
    line = last_line(r.stderr)
    assert line.startswith("FileNotFoundError:") and "config.json" in line and "not found" in line
    (tmp_path / "empty").mkdir()
    r = run_once("--model-path", str(tmp_path / "empty"))
    assert r.returncode == 1 and "config.json" in last_line(r.stderr)


def test_broken_shards_exit_1():
    r = run_once("--model-path", str(BROKEN), "--port", str(free_port()))
    assert r.returncode == 1
    assert "model-0000" in last_line(r.stderr)


def test_unknown_flag_exits_2():
    r = run_once("--model-path", str(DENSE), "--no-such-flag")
    assert r.returncode == 2
    assert "unrecognized arguments: --no-such-flag" in r.stderr


def test_bad_choice_exits_2():
    r = run_once("--model-path", str(HYBRID), "--mamba-scheduler-strategy", "huge_buffer")
    assert r.returncode == 2


def test_tp_size_larger_than_visible_gpus_exits_1():
    r = run_once("--model-path", str(DENSE), "--tensor-parallel-size", "4", CUDA_VISIBLE_DEVICES="0,1")
    assert r.returncode == 1
    assert "tp-size 4" in last_line(r.stderr) and "2" in last_line(r.stderr)


def test_port_in_use_exits_1():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = run_once("--model-path", str(DENSE), "--port", str(port))
    assert r.returncode == 1
    assert last_line(r.stderr) == "OSError: [Errno 98] Address already in use"


# --- runtime knobs and signals -----------------------------------------------------------

def test_crash_after_becoming_healthy(standin):
    s = standin("--model-path", str(DENSE), STANDIN_CRASH_AFTER="0.5")
    s.wait_healthy()                            # it served first...
    assert s.proc.wait(timeout=5) == 1          # ...then crashed on its own
    assert last_line(s.stderr) == CRASH_LINE
    assert s.stderr.index("fired up") < s.stderr.index(CRASH_LINE)


def test_hang_never_healthy_and_sigterm_exits_0(standin):
    s = standin("--model-path", str(DENSE), STANDIN_HANG="1")
    s.said("STANDIN_HANG=1: loading forever")
    assert s.proc.poll() is None
    with pytest.raises(ConnectionRefusedError):
        get(s.port, "/health")
    assert s.stop() == 0


def test_sigterm_when_serving_exits_0(standin):
    s = standin("--model-path", str(DENSE))
    s.wait_healthy()
    assert s.stop() == 0                        # SIGTERM: a clean exit (stop waits at most 5 s)
    assert "Received signal" in s.stderr
