#!/usr/bin/python3
"""STAND-IN for an SGLang inference server. Not a real one: it loads no weights, uses no GPU
and generates no text.

It mimics what ``python -m sglang.launch_server`` does at start-up, closely enough for the
reconciler's end-to-end tests on the test hosts (see ../shared/TESTHOSTS.md), where it is
bind-mounted as the executable /usr/local/bin/sglang-standin and run by systemd units:

* the same command-line flag names as SGLang (``--model-path``, ``--tp-size``,
  ``--speculative-algorithm``/``--speculative-algo``, ``--mamba-scheduler-strategy``, ...);
  an unknown flag exits 2 with argparse's error, as the real server does;
* start-up log lines on stderr, flushed line by line, so journald sees them at once
  (``server_args=...``, ``Load weight begin...``, ``Load weight end. ...``,
  ``The server is fired up and ready to roll!``);
* during its simulated load, the progress lines of SGLang 0.5.12, in its formats (copied from
  its wheel: sglang/srt/model_executor/model_runner.py, model_loader/weight_utils.py with
  utils/common.py's BAR_FORMAT, model_executor/cuda_graph_runner.py): the tqdm bar
  ``Loading safetensors checkpoint shards:  50% Completed | 2/4 [...]`` over its N shards
  (those the model's index names, else ``model.safetensors`` alone, else 4), then ``Capture
  cuda graph begin. ...``, ``Capture cuda graph bs [...]``, the bar ``Capturing batches (bs=...
  avail_mem=... GB):  25%|...| 1/4 [...]`` and ``Capture cuda graph end. ...``. Like tqdm, a
  bar is redrawn after a carriage return and ends with one newline when it closes (so journald
  stores it as one line, when it ends); ``STANDIN_BAR_NEWLINE=1`` ends every redraw with a
  newline instead, as vLLM 0.33.0's ``_BAR_FORMAT`` does (one journal line per shard);
* it reads ``<model-path>/config.json`` (missing: ``FileNotFoundError ...``, exit 1) and, if
  there is a ``model.safetensors.index.json``, checks each shard file it names, as it reaches
  it in the load: it must exist and not be empty (otherwise the bar's line is ended, an error
  line follows and it exits 1, as the real loader would fail);
* the flag rule of the incident (../shared/context/incident.md): on a hybrid linear-attention
  model (Gated DeltaNet / mamba-style state; ``layer_types`` containing ``"linear_attention"``
  at the top level or in ``text_config``, or a Qwen3-Next / Qwen3.5 architecture), speculative
  decoding without ``--mamba-scheduler-strategy extra_buffer`` AND ``SGLANG_ENABLE_SPEC_V2=1``
  exits 1, the last stderr line being exactly::

      MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer and SGLANG_ENABLE_SPEC_V2=1

  as the incident's SGLang did. The stand-in behaves as one SGLang release (``server_version``:
  the stand-in ``sglang`` package's ``__version__``, default 0.5.12): that check exists from
  0.5.10 to 0.5.13, ``extra_buffer_lazy`` from 0.5.13 (refused with speculative decoding
  before 0.5.17), ``--mamba-radix-cache-strategy`` from 0.5.14, and 0.5.20 no longer knows
  ``--mamba-scheduler-strategy``, as reconciler/rules/sglang.toml records with its sources;

* ``--tp-size`` larger than the number of GPUs in ``CUDA_VISIBLE_DEVICES`` (when that is set)
  exits 1; a ``--port`` already in use exits 1 with ``OSError: [Errno 98] Address already in use``;
* like SGLang, the HTTP port only listens once the (simulated) model load is over; then it
  serves ``GET /health`` (and ``/health_generate``), ``GET /get_model_info`` and
  ``GET /v1/models`` on ``--host``:``--port``;
* traffic (issue 42), in the engine's own shapes and names: ``POST /v1/completions`` and
  ``/v1/chat/completions`` answer every greedy request with the same text (``STANDIN_ANSWER``),
  whole or streamed (``"stream": true``: server-sent events ending ``data: [DONE]``), after
  ``STANDIN_REQUEST_SECONDS``; ``GET /metrics`` has the requests in flight as
  ``sglang:num_running_reqs`` (with ``--enable-metrics`` only, as SGLang) or
  ``vllm:num_requests_running``; ``GET /ready`` from SGLang 0.5.20 (200 while up, 503 once
  stopping; vLLM has none outside its DP supervisor);
* it plays vLLM when run as the stand-in ``vllm`` package's ``python3 -m
  vllm.entrypoints.openai.api_server`` (``STANDIN_ENGINE=vllm``): vLLM's flags (``--model`` or
  the model first, ``--port`` 8000, ``--shutdown-timeout``), /metrics always, and a request for
  a model it does not serve is 404;
* SIGTERM (or SIGINT) stops it as the engine it plays stops (``stop_like_engine``): SGLang
  finishes every request in flight, without a bound (/health and /ready answer 503 meanwhile,
  new requests are still taken), unless ``SGL_FORCE_SHUTDOWN=1``; vLLM with
  ``--shutdown-timeout 0`` (its default) aborts them (each ends with HTTP 500), with ``S > 0``
  refuses new ones (503) and waits up to S seconds for them. Then it exits 0.

Environment knobs for tests:

``STANDIN_LOAD_SECONDS``   float, default 0: simulated model-load time (70% the shards, 30% the
                           CUDA graphs); the port is not listening during it (connection
                           refused), then /health answers.
``STANDIN_BAR_NEWLINE=1``  end every redraw of a progress bar with a newline (vLLM's shard bar).
``STANDIN_PROGRESS_LINE``  a line printed as it is (stderr) right after ``Load weight begin``: any
                           progress line a test wants the journal to hold while the server loads
                           (e.g. a shard bar with a 400-digit count, review N5's E4).
``STANDIN_CRASH_AFTER``    float seconds after becoming healthy: print
                           ``RuntimeError: CUDA error: an illegal memory access was encountered``
                           to stderr and exit 1. Unset: run until stopped.
``STANDIN_HANG=1``         never become healthy: stay "loading" forever (port never listens).
``STANDIN_HEALTH_STATUS``  int, default 200: the HTTP status /health answers (503: unhealthy).
``STANDIN_READY_STATUS``   int, default 200: the HTTP status /ready answers while up (SGLang 0.5.20+;
                           503: up, /health 200, and not ready, as a paused SGLang).
``STANDIN_NO_MODELS=1``    /v1/models lists no model (``"data": []``): up, and serving nothing.
``STANDIN_SECRETS``        comma-separated names of secrets the server needs: each is read from
                           ``$CREDENTIALS_DIRECTORY/NAME`` (a systemd credential) or else the
                           environment; one missing exits 1 naming it. The log says where each
                           came from and its length, never the value.
``STANDIN_REJECT_SECRET``  a name: exit 1 with an error that quotes that secret's value (a badly
                           behaved server echoing a token it rejects), for redaction tests.
``STANDIN_ENGINE``         ``vllm``: play vLLM (set by the stand-in ``vllm`` package); else SGLang.
``STANDIN_ANSWER``         the text of every answer (default ``" Paris."``; a chat answer is stripped).
``STANDIN_WRONG_ANSWER=1`` every answer is ``" the the the the"``: a server that is up and wrong.
``STANDIN_BROKEN_CHAT_TEMPLATE=1``  chat answers only are template tokens
                           (``<|im_start|>assistant...``), as with a wrong chat template.
``STANDIN_REQUEST_SECONDS`` float, default 0: how long each completion takes.
``STANDIN_TTFT_SECONDS``   float, default 0: a streamed answer's first chunk comes after this.
``SGL_FORCE_SHUTDOWN=1``   SGLang's own: on SIGTERM exit at once, dropping the requests in flight.

Python 3.11 standard library only: the test hosts have nothing else.
"""

import argparse
import errno
import http.server
import json
import os
import signal
import socket
import socketserver
import sys
import threading
import time
from typing import NoReturn

INCIDENT_LINE = (
    "MTP with the hybrid GDN model needs --mamba-scheduler-strategy extra_buffer "
    "and SGLANG_ENABLE_SPEC_V2=1"
)
CRASH_LINE = "RuntimeError: CUDA error: an illegal memory access was encountered"
HYBRID_ARCHITECTURES = {
    "Qwen3NextForCausalLM",
    "Qwen3_5ForConditionalGeneration",
    "Qwen3_5MoeForConditionalGeneration",
    "Qwen3_5MoeForCausalLM",
    "Qwen3_5ForCausalLM",
}


def log(msg: str) -> None:
    """One log line to stderr, flushed at once (journald sees it immediately)."""
    stamp = time.strftime("%Y-%m-%d %H:%M:%S")
    print(f"[{stamp}] {msg}", file=sys.stderr, flush=True)


def fail(line: str, code: int = 1) -> NoReturn:
    """Print ``line`` as the last stderr line, bare (no prefix), and exit ``code``."""
    print(line, file=sys.stderr, flush=True)
    sys.exit(code)


DEFAULT_VERSION = "0.5.12"


def server_version() -> str:
    """The SGLang release the stand-in behaves as: the stand-in `sglang` package's __version__
    (tests/hostpkg, on the test hosts), else STANDIN_VERSION, else DEFAULT_VERSION."""
    try:
        import importlib
        return str(getattr(importlib.import_module("vllm" if engine() == "vllm" else "sglang"), "__version__",
                           DEFAULT_VERSION))
    except ImportError:
        return os.environ.get("STANDIN_VERSION", DEFAULT_VERSION)


def version_tuple(v: str) -> tuple[int, ...]:
    return tuple(int(x) for x in v.split(".")[:3] if x.isdigit())


def build_parser(version: str = DEFAULT_VERSION) -> argparse.ArgumentParser:
    """SGLang's flags as `version` has them: --mamba-scheduler-strategy from 0.5.7 (with
    extra_buffer_lazy from 0.5.13), renamed --mamba-radix-cache-strategy in 0.5.14 (the old
    spelling gone in 0.5.20). See reconciler/rules/sglang.toml for the sources."""
    v = version_tuple(version)
    p = argparse.ArgumentParser(
        prog="sglang-standin",
        description="Stand-in for `python -m sglang.launch_server` (tests only; no real model).",
    )
    p.add_argument("--model-path", required=True)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=30000)
    p.add_argument("--tp-size", "--tensor-parallel-size", dest="tp_size", type=int, default=1)
    p.add_argument("--dp-size", "--data-parallel-size", dest="dp_size", type=int, default=1)
    p.add_argument("--mem-fraction-static", type=float, default=None)
    p.add_argument("--context-length", type=int, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.add_argument("--quantization", default=None)
    p.add_argument("--kv-cache-dtype", default="auto")
    p.add_argument(
        "--speculative-algorithm", "--speculative-algo", dest="speculative_algorithm", default=None
    )
    p.add_argument("--speculative-num-steps", type=int, default=None)
    p.add_argument("--speculative-eagle-topk", type=int, default=None)
    p.add_argument("--speculative-num-draft-tokens", type=int, default=None)
    p.add_argument("--speculative-draft-model-path", default=None)
    strategies = ["auto", "no_buffer", "extra_buffer"] + (["extra_buffer_lazy"] if v >= (0, 5, 13) else [])
    names = (["--mamba-scheduler-strategy"] if v < (0, 5, 20) else []) + \
        (["--mamba-radix-cache-strategy"] if v >= (0, 5, 14) else [])
    if names:
        p.add_argument(*names, dest="mamba_scheduler_strategy", choices=strategies, default="auto")
    p.set_defaults(mamba_scheduler_strategy="auto")
    p.add_argument("--log-level", default="info")
    p.add_argument("--attention-backend", default=None)
    p.add_argument("--chunked-prefill-size", type=int, default=None)
    p.add_argument("--max-running-requests", type=int, default=None)
    p.add_argument("--enable-metrics", action="store_true")
    return p


def env_float(name: str, default: float | None) -> float | None:
    raw = os.environ.get(name, "").strip()
    if not raw:
        return default
    try:
        return float(raw)
    except ValueError:
        fail(f"ValueError: environment variable {name}={raw!r} is not a number")


def read_secret(name: str) -> tuple[str | None, str]:
    """A secret's value and where it came from: the credential, else the environment."""
    d = os.environ.get("CREDENTIALS_DIRECTORY")
    if d and os.path.isfile(os.path.join(d, name)):
        with open(os.path.join(d, name), encoding="utf-8", errors="replace") as f:
            return f.read(), "credential"
    if name in os.environ:
        return os.environ[name], "environment"
    return None, ""


def check_secrets() -> None:
    for name in filter(None, (n.strip() for n in os.environ.get("STANDIN_SECRETS", "").split(","))):
        value, where = read_secret(name)
        if value is None:
            fail(f"ValueError: secret {name} was not delivered (no credential, not in the environment)")
        log(f"[standin] secret {name}: {len(value)} bytes from the {where}")
    reject = os.environ.get("STANDIN_REJECT_SECRET", "").strip()
    if reject:
        value, _ = read_secret(reject)
        fail(f"PermissionError: upstream rejected the token {value!s} for {reject}")


def env_bool(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def load_config(model_path: str) -> dict:
    path = os.path.join(model_path, "config.json")
    if not os.path.isfile(path):
        fail(f"FileNotFoundError: {path} not found (is --model-path {model_path} a model directory?)")
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        fail(f"ValueError: cannot read {path}: {e}")
    if not isinstance(cfg, dict):
        fail(f"ValueError: {path} is not a JSON object")
    return cfg


def is_hybrid(cfg: dict) -> bool:
    """Hybrid linear-attention (GDN / mamba-style recurrent state) model?"""
    for section in (cfg, cfg.get("text_config")):
        if not isinstance(section, dict):
            continue
        layer_types = section.get("layer_types")
        if isinstance(layer_types, list) and "linear_attention" in layer_types:
            return True
        archs = section.get("architectures")
        if isinstance(archs, list) and HYBRID_ARCHITECTURES.intersection(
            a for a in archs if isinstance(a, str)
        ):
            return True
    return False


DEFAULT_SHARDS = 4           # shards "loaded" for a model directory that names none
WEIGHTS_SHARE = 0.7          # of STANDIN_LOAD_SECONDS: the shards; the rest: the CUDA graphs
GRAPH_BATCH_SIZES = [1, 2, 4, 8]


def shard_files(model_path: str) -> tuple[list[str | None], str | None]:
    """The shards the load goes through, and the index naming them; None for each of the
    DEFAULT_SHARDS of a model directory without weights."""
    index = os.path.join(model_path, "model.safetensors.index.json")
    if not os.path.isfile(index):
        single = os.path.join(model_path, "model.safetensors")
        return ([single] if os.path.isfile(single) else [None] * DEFAULT_SHARDS), None
    try:
        with open(index, encoding="utf-8") as f:
            weight_map = json.load(f).get("weight_map", {})
    except (OSError, ValueError, AttributeError) as e:
        fail(f"ValueError: cannot read {index}: {e}")
    shards = sorted(set(weight_map.values())) if isinstance(weight_map, dict) else []
    return [os.path.join(model_path, shard) for shard in shards], index


class Bar:
    """A tqdm bar as SGLang's processes write it to stderr (no terminal): each redraw after a
    carriage return, one newline when it closes (STANDIN_BAR_NEWLINE=1: after every redraw).
    `completed`: SGLang's BAR_FORMAT (utils/common.py); else tqdm's default format."""

    def __init__(self, desc: str, total: int, completed: bool):
        self.desc, self.total, self.completed, self.n = desc, total, completed, 0
        self.start, self.newline = time.monotonic(), env_bool("STANDIN_BAR_NEWLINE")
        self.update(0)

    def update(self, step: int = 1) -> None:
        self.n += step
        n, total, spent = self.n, self.total, time.monotonic() - self.start
        rate, left = ((f"{n / spent:5.2f}it/s" if n >= spent else f"{spent / n:5.2f}s/it"),
                      _clock(spent / n * (total - n))) if n else ("?it/s", "?")
        filled = 10 * n // max(1, total)
        mid = " Completed | " if self.completed else f"|{'█' * filled}{' ' * (10 - filled)}| "
        sys.stderr.write(f"\r{self.desc}: {100 * n / max(1, total):3.0f}%{mid}{n}/{total} [{_clock(spent)}<{left}, "
                         f"{rate}]" + ("\n" if self.newline else ""))
        sys.stderr.flush()

    def close(self) -> None:
        print("" if self.newline else "\n", end="", file=sys.stderr, flush=True)


def _clock(seconds: float) -> str:
    return f"{int(seconds) // 60:02d}:{int(seconds) % 60:02d}"


def load_weights(model_path: str, seconds: float) -> int:
    """The shards over `seconds`, with SGLang's bar; a missing or empty one fails as it is reached."""
    shards, index = shard_files(model_path)
    bar = Bar("Loading safetensors checkpoint shards", len(shards), completed=True)
    for path in shards:
        time.sleep(seconds / max(1, len(shards)))
        if path is not None and (not os.path.isfile(path) or os.path.getsize(path) == 0):
            bar.close()
            if not os.path.isfile(path):
                fail(f"FileNotFoundError: {path} not found (named in {index})")
            fail("safetensors_rust.SafetensorError: Error while deserializing header: "
                 f"HeaderTooSmall ({path} is empty)")
        bar.update()
    bar.close()
    return len(shards)


def capture_graphs(seconds: float) -> None:
    """SGLang 0.5.12's CUDA graph capture lines (model_runner.py, cuda_graph_runner.py) over
    `seconds`; nothing is captured."""
    started, sizes = time.monotonic(), list(reversed(GRAPH_BATCH_SIZES))
    log("Capture cuda graph begin. This can take up to several minutes. avail mem=41.27 GB")
    log(f"Capture cuda graph bs {GRAPH_BATCH_SIZES}")
    bar = Bar(f"Capturing batches (bs={sizes[0]} avail_mem=41.20 GB)", len(sizes), completed=False)
    for bs in sizes:
        time.sleep(seconds / len(sizes))
        bar.desc = f"Capturing batches (bs={bs} avail_mem=41.20 GB)"
        bar.update()
    bar.close()
    log(f"Capture cuda graph end. Time elapsed: {time.monotonic() - started:.2f} s. mem usage=0.49 GB. "
        f"avail mem=40.78 GB.")


def check_gpus(tp_size: int) -> None:
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is None:
        return
    ids = [x for x in visible.split(",") if x.strip()]
    if tp_size > len(ids):
        fail(
            f"RuntimeError: --tp-size {tp_size} needs {tp_size} GPUs but only {len(ids)} "
            f"visible (CUDA_VISIBLE_DEVICES={visible!r})"
        )


def bind_error(e: OSError) -> NoReturn:
    if e.errno == errno.EADDRINUSE:
        fail(f"OSError: [Errno {errno.EADDRINUSE}] Address already in use")
    fail(f"OSError: [Errno {e.errno}] {e.strerror}")


def probe_port(host: str, port: int) -> None:
    """Fail early if the port is taken (the real server checks it before loading too)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, port))
    except OSError as e:
        bind_error(e)


def make_handler(args, health_status: int, traffic: "Traffic | None" = None):
    served = args.served_model_name or args.model_path
    traffic = traffic or Traffic(engine(), DEFAULT_VERSION, 0)
    try:
        ready_status = int(os.environ.get("STANDIN_READY_STATUS", "").strip() or 200)
    except ValueError:
        fail("ValueError: STANDIN_READY_STATUS must be an integer HTTP status")
    no_models = env_bool("STANDIN_NO_MODELS")

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "sglang-standin"

        def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj, status: int = 200) -> None:
            self._send(status, json.dumps(obj).encode(), "application/json")

        def do_GET(self):  # http.server's naming
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                # SGLang answers 503 once SIGTERM started its drain (gracefully_exit); vLLM's stays 200
                status = 503 if traffic.engine == "sglang" and traffic.stopping else health_status
                self._send(status, b"" if status == 200 else b"unhealthy\n")
            elif path == "/ready" and traffic.has_ready():
                up = traffic.ready() and health_status == 200
                self._send(ready_status if up else 503, b"")
            elif path == "/metrics" and traffic.has_metrics(args):
                self._send(200, traffic.metrics(served).encode(), "text/plain; version=0.0.4")
            elif path == "/get_model_info":
                self._json({"model_path": args.model_path, "served_model_name": served, "is_generation": True})
            elif path == "/v1/models":
                models = [] if no_models else [{"id": served, "object": "model", "created": int(START),
                                                "owned_by": traffic.engine, "root": args.model_path}]
                self._json({"object": "list", "data": models})
            else:
                self._send(404, b'{"detail":"Not Found"}', "application/json")

        do_HEAD = do_GET

        def do_POST(self):  # http.server's naming
            path = self.path.split("?", 1)[0]
            if path not in ("/v1/completions", "/v1/chat/completions"):
                self._send(404, b'{"detail":"Not Found"}', "application/json")
                return
            try:
                length = int(self.headers.get("Content-Length") or 0)
                body = json.loads(self.rfile.read(min(length, 1 << 20)) or b"{}")
            except ValueError:
                self._json(_error("the body is not JSON", 400), 400)
                return
            model = body.get("model") if isinstance(body, dict) else None
            if traffic.engine == "vllm" and model not in (served, args.model_path):
                self._json(_error(f"The model `{model}` does not exist.", 404, "NotFoundError"), 404)
                return
            if not traffic.begin():
                self._json(_error("the server is shutting down", 503, "ServiceUnavailable"), 503)
                return
            try:
                self._complete(path.endswith("/chat/completions"), body, served)
            finally:
                traffic.end()

        def _complete(self, chat: bool, body: dict, served: str) -> None:
            text = answer_text(chat)
            ttft = env_float("STANDIN_TTFT_SECONDS", 0.0) or 0.0
            total = env_float("STANDIN_REQUEST_SECONDS", 0.0) or 0.0
            if not body.get("stream"):
                if traffic.aborted(max(total, ttft)):
                    self._json(_error("the request was aborted: the engine is shutting down", 500), 500)
                    return
                self._json(completion(chat, text, served))
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.end_headers()
            pieces = [text[i:i + 4] for i in range(0, len(text), 4)] or [""]
            rest = max(0.0, total - ttft) / len(pieces)
            for i, piece in enumerate(pieces):
                if traffic.aborted(ttft if i == 0 else rest):
                    self.wfile.write(b"data: " + json.dumps(_error("aborted", 500)).encode() + b"\n\n")
                    return
                self.wfile.write(b"data: " + json.dumps(chunk(chat, piece, served)).encode() + b"\n\n")
                self.wfile.flush()
            self.wfile.write(b"data: [DONE]\n\n")

        def log_message(self, format, *a):  # http.server's signature
            pass  # quiet: no journald line per health probe

    return Handler


START = time.time()


class Server(http.server.ThreadingHTTPServer):
    """ThreadingHTTPServer without the reverse-DNS lookup of HTTPServer.server_bind
    (no network on the test hosts), and IPv6-capable."""

    daemon_threads = True

    def __init__(self, addr, handler):
        if ":" in addr[0]:
            self.address_family = socket.AF_INET6
        super().__init__(addr, handler)

    def server_bind(self):
        socketserver.TCPServer.server_bind(self)
        self.server_name, self.server_port = self.server_address[:2]


class Stop(Exception):
    """Raised by the signal handler: leave cleanly with exit status 0."""


def on_signal(signum, frame):
    raise Stop(signum)


# ---- traffic: completions, in-flight work, and each engine's stop (issue 42) ----------------

ANSWER = " Paris."                                         # STANDIN_ANSWER's default
WRONG_TEXT = " the the the the"                            # STANDIN_WRONG_ANSWER=1
BROKEN_TEMPLATE_TEXT = "<|im_start|>assistant<|im_start|>assistant"   # STANDIN_BROKEN_CHAT_TEMPLATE=1, chat only
DRAIN_LOG_EVERY = 5.0                                      # SGLang logs the remaining requests every 5 s


def engine() -> str:
    """The engine the stand-in plays: "vllm" when run as the stand-in `vllm` package's api_server
    (STANDIN_ENGINE=vllm), else "sglang"."""
    return "vllm" if os.environ.get("STANDIN_ENGINE", "").strip().lower() == "vllm" else "sglang"


def build_vllm_parser() -> argparse.ArgumentParser:
    """vLLM's flags the stand-in knows (python -m vllm.entrypoints.openai.api_server), under the
    names run() reads (model_path, tp_size ...); unknown flags exit 2 as vLLM's parser does."""
    p = argparse.ArgumentParser(prog="vllm-standin",
                                description="Stand-in for vLLM's OpenAI API server (tests only; no real model).")
    p.add_argument("model_tag", nargs="?", default=None)
    p.add_argument("--model", dest="model_path", default=None)
    p.add_argument("--served-model-name", default=None)
    p.add_argument("--host", default="0.0.0.0")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--tensor-parallel-size", "-tp", dest="tp_size", type=int, default=1)
    p.add_argument("--shutdown-timeout", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--gpu-memory-utilization", type=float, default=None)
    p.add_argument("--trust-remote-code", action="store_true")
    p.set_defaults(speculative_algorithm=None, mamba_scheduler_strategy="auto", enable_metrics=True)
    return _VllmParser(p)


class _VllmParser:
    """vLLM takes the model as --model or as the first word (`vllm serve MODEL`)."""

    def __init__(self, parser: argparse.ArgumentParser):
        self.parser = parser

    def parse_args(self, argv=None):
        args = self.parser.parse_args(argv)
        args.model_path = args.model_path or args.model_tag
        if not args.model_path:
            self.parser.error("the following arguments are required: --model")
        return args


def answer_text(chat: bool) -> str:
    """The greedy answer, the same for every prompt: STANDIN_ANSWER, or a wrong one."""
    if env_bool("STANDIN_WRONG_ANSWER"):
        return WRONG_TEXT
    if chat and env_bool("STANDIN_BROKEN_CHAT_TEMPLATE"):
        return BROKEN_TEMPLATE_TEXT
    text = os.environ.get("STANDIN_ANSWER", ANSWER)
    return text.strip() if chat else text


def completion(chat: bool, text: str, model: str) -> dict:
    """An OpenAI-style completion or chat completion of `text`."""
    choice = ({"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"} if chat
              else {"index": 0, "text": text, "finish_reason": "length"})
    return {"id": f"cmpl-standin-{time.monotonic_ns()}", "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()), "model": model, "choices": [choice],
            "usage": {"prompt_tokens": 1, "completion_tokens": max(1, len(text.split())), "total_tokens": 2}}


def chunk(chat: bool, text: str, model: str) -> dict:
    """One streamed chunk of `text`."""
    choice = {"index": 0, "delta": {"content": text}} if chat else {"index": 0, "text": text}
    return {"object": "chat.completion.chunk" if chat else "text_completion", "model": model, "choices": [choice]}


def _error(message: str, code: int, kind: str = "BadRequestError") -> dict:
    return {"error": {"message": message, "type": kind, "code": code}}


class Traffic:
    """The completions in flight and the engine's state around a stop: what /metrics, /ready and
    /health say, and what SIGTERM does to the requests (stop_like_engine)."""

    def __init__(self, engine_name: str, version: str, shutdown_timeout: int):
        self.engine, self.version, self.shutdown_timeout = engine_name, version, shutdown_timeout
        self.cond = threading.Condition()
        self.inflight = 0
        self.served = 0
        self.stopping = False            # SIGTERM came
        self.refusing = False            # new requests get 503 (vLLM while it drains)
        self.abort = threading.Event()   # requests in flight end with an error (vLLM's abort)

    def has_ready(self) -> bool:
        """SGLang has /ready from 0.5.20; vLLM only under its DP supervisor (not played here)."""
        return self.engine == "sglang" and version_tuple(self.version) >= (0, 5, 20)

    def ready(self) -> bool:
        return not self.stopping

    def has_metrics(self, args) -> bool:
        """vLLM always serves /metrics; SGLang only with --enable-metrics."""
        return self.engine == "vllm" or bool(getattr(args, "enable_metrics", False))

    def metrics(self, model: str) -> str:
        """The in-flight gauges in the engine's own names and labels (Prometheus text format)."""
        with self.cond:
            running = self.inflight
        if self.engine == "vllm":
            labels = f'engine="0",model_name="{model}"'
            return ("# HELP vllm:num_requests_running Number of requests in model execution batches.\n"
                    "# TYPE vllm:num_requests_running gauge\n"
                    f"vllm:num_requests_running{{{labels}}} {float(running)}\n"
                    f"vllm:num_requests_waiting{{{labels}}} 0.0\n")
        labels = f'engine_type="unified",model_name="{model}",tp_rank="0"'
        return ("# HELP sglang:num_running_reqs The number of running requests.\n"
                "# TYPE sglang:num_running_reqs gauge\n"
                f"sglang:num_running_reqs{{{labels}}} {float(running)}\n"
                f"sglang:num_queue_reqs{{{labels}}} 0.0\n")

    def begin(self) -> bool:
        with self.cond:
            if self.refusing:
                return False
            self.inflight += 1
            return True

    def end(self) -> None:
        with self.cond:
            self.inflight -= 1
            self.served += 1
            self.cond.notify_all()

    def aborted(self, seconds: float) -> bool:
        """Generate for `seconds`; True when the engine aborted the request meanwhile."""
        return self.abort.wait(seconds) if seconds > 0 else self.abort.is_set()

    def wait_idle(self, seconds: float | None) -> int:
        """Wait until nothing is in flight (or `seconds` passed); what is still in flight."""
        deadline = None if seconds is None else time.monotonic() + seconds
        with self.cond:
            while self.inflight and (deadline is None or time.monotonic() < deadline):
                self.cond.wait(0.1 if deadline is None else max(0.0, min(0.1, deadline - time.monotonic())))
            return self.inflight


def stop_like_engine(traffic: Traffic, signum: int) -> None:
    """What the engine does with the requests in flight on SIGTERM (the anchors review, section
    1.4, read from the wheels):

    * SGLang: "Draining requests and shutting down...": /health and /ready answer 503, requests
      are still taken, and it waits until none is in flight, without a bound, logging the count
      every 5 s (the stand-in looks every 0.1 s; SGLang every 5 s). SGL_FORCE_SHUTDOWN=1: it
      exits at once, dropping them.
    * vLLM: --shutdown-timeout 0 (its default) aborts them (each ends with an error); S > 0 takes
      no new request (503) and waits up to S seconds, then aborts what is left.
    """
    signal.signal(signal.SIGTERM, lambda *_: log("[standin] another signal while stopping: ignored"))
    signal.signal(signal.SIGINT, lambda *_: log("[standin] another signal while stopping: ignored"))
    with traffic.cond:
        traffic.stopping = True
        left = traffic.inflight
    if traffic.engine == "sglang":
        log(f"SIGTERM received. signum={signum}. Draining requests and shutting down...")
        if env_bool("SGL_FORCE_SHUTDOWN"):
            log("Signal SIGTERM received while force shutdown flag set. Force exiting.")
            return
        while left:
            log(f"Gracefully exiting... Remaining number of requests {left}.")
            left = traffic.wait_idle(DRAIN_LOG_EVERY)
        log("Gracefully exiting... Remaining number of requests 0.")
        return
    timeout = traffic.shutdown_timeout
    log(f"[shutdown] API server: stopping engine client mode={'abort' if timeout == 0 else 'drain'} "
        f"timeout={timeout}s")
    with traffic.cond:
        traffic.refusing = True
    if timeout > 0 and left:
        log(f"[shutdown] EngineCore: draining in-flight requests count={left} timeout={timeout}s")
        left = traffic.wait_idle(float(timeout))
    if left:
        log(f"[shutdown] EngineCore: aborting in-flight requests count={left}")
        traffic.abort.set()
        traffic.wait_idle(2.0)           # the handlers write their errors before the process goes


POLL = 0.02    # seconds: the server loop's look at its shutdown flag (socketserver's own is 0.5)


def serve(server: "Server", crash_after: float | None, traffic: Traffic) -> int:
    """Serve until SIGTERM (the engine's stop behaviour, then exit 0) or the simulated crash."""
    # A stop waits for the server loop's next look at its flag (shutdown()): a short poll keeps that
    # wait short, so a restart's time is the tool's and systemd's, not where in a 0.2 s poll it fell.
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": POLL}, daemon=True)
    thread.start()
    log(f"Uvicorn running on http://{server.server_name}:{server.server_port} (Press CTRL+C to quit)")
    log("The server is fired up and ready to roll!")
    try:
        deadline = None if crash_after is None else time.monotonic() + crash_after
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.1 if deadline is not None else 3600)
    except Stop as e:
        stop_like_engine(traffic, e.args[0])
        raise
    finally:
        server.shutdown()
        server.server_close()
    fail(CRASH_LINE)


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        version = server_version()
        parser = build_vllm_parser() if engine() == "vllm" else build_parser(version)
        return run(parser.parse_args(argv), version)
    except Stop as e:
        log(f"Received signal {e.args[0]}, shutting down (stand-in).")
        return 0


def run(args, version: str = DEFAULT_VERSION) -> int:
    load_seconds = env_float("STANDIN_LOAD_SECONDS", 0.0)
    crash_after = env_float("STANDIN_CRASH_AFTER", None)
    hang = env_bool("STANDIN_HANG")
    try:
        health_status = int(os.environ.get("STANDIN_HEALTH_STATUS", "").strip() or 200)
    except ValueError:
        fail("ValueError: STANDIN_HEALTH_STATUS must be an integer HTTP status")

    log(f"[standin] server_args={vars(args)!r}")
    log(f"[standin] pid={os.getpid()} (stand-in for sglang.launch_server {version}, not a real server)")
    v = version_tuple(version)

    check_gpus(args.tp_size)
    check_secrets()
    cfg = load_config(args.model_path)
    archs = cfg.get("architectures") or (cfg.get("text_config") or {}).get("architectures")
    hybrid = is_hybrid(cfg)
    log(f"Model config: architectures={archs} model_type={cfg.get('model_type')!r} "
        f"hybrid_linear_attention={hybrid}")

    if args.speculative_algorithm and args.mamba_scheduler_strategy == "extra_buffer_lazy" and v < (0, 5, 17):
        fail("AssertionError: extra_buffer_lazy is not yet supported with speculative decoding. "
             "Use --mamba-scheduler-strategy extra_buffer instead.")
    if args.speculative_algorithm and hybrid and (0, 5, 10) <= v < (0, 5, 14):
        spec_v2 = env_bool("SGLANG_ENABLE_SPEC_V2")
        if args.mamba_scheduler_strategy != "extra_buffer" or not spec_v2:
            log(f"Speculative decoding {args.speculative_algorithm} requested on a hybrid "
                f"linear-attention model (mamba_scheduler_strategy="
                f"{args.mamba_scheduler_strategy}, SGLANG_ENABLE_SPEC_V2="
                f"{os.environ.get('SGLANG_ENABLE_SPEC_V2', '')!r})")
            fail(INCIDENT_LINE)
        log("Speculative decoding on hybrid model: extra_buffer + spec v2 enabled.")

    probe_port(args.host, args.port)

    log(f"Load weight begin. avail mem=79.11 GB (tp_size={args.tp_size})")
    extra = os.environ.get("STANDIN_PROGRESS_LINE")
    if extra is not None:
        print(extra, file=sys.stderr, flush=True)
    if hang:
        log("[standin] STANDIN_HANG=1: loading forever")
        while True:
            time.sleep(3600)
    load = max(0.0, load_seconds or 0.0)
    started = time.monotonic()
    n_shards = load_weights(args.model_path, load * WEIGHTS_SHARE)
    log(f"Load weight end. elapsed={time.monotonic() - started:.2f} s, type={archs[0] if archs else '?'}, "
        f"shards={n_shards}, dtype=torch.bfloat16, avail mem=41.27 GB, mem usage=37.84 GB.")
    capture_graphs(load * (1 - WEIGHTS_SHARE))

    try:
        traffic = Traffic(engine(), version, getattr(args, "shutdown_timeout", 0))
        server = Server((args.host, args.port), make_handler(args, health_status, traffic))
    except OSError as e:
        bind_error(e)
    return serve(server, crash_after, traffic)


if __name__ == "__main__":
    sys.exit(main())
