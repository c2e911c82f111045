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
* SIGTERM (or SIGINT) exits 0.

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
``STANDIN_SECRETS``        comma-separated names of secrets the server needs: each is read from
                           ``$CREDENTIALS_DIRECTORY/NAME`` (a systemd credential) or else the
                           environment; one missing exits 1 naming it. The log says where each
                           came from and its length, never the value.
``STANDIN_REJECT_SECRET``  a name: exit 1 with an error that quotes that secret's value (a badly
                           behaved server echoing a token it rejects), for redaction tests.

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
        return str(getattr(importlib.import_module("sglang"), "__version__", DEFAULT_VERSION))
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


def make_handler(args, health_status: int):
    served = args.served_model_name or args.model_path

    class Handler(http.server.BaseHTTPRequestHandler):
        server_version = "sglang-standin"

        def _send(self, status: int, body: bytes, ctype: str = "text/plain") -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            if self.command != "HEAD":
                self.wfile.write(body)

        def _json(self, obj) -> None:
            self._send(200, json.dumps(obj).encode(), "application/json")

        def do_GET(self):  # http.server's naming
            path = self.path.split("?", 1)[0]
            if path in ("/health", "/health_generate"):
                self._send(health_status, b"" if health_status == 200 else b"unhealthy\n")
            elif path == "/get_model_info":
                self._json({"model_path": args.model_path, "served_model_name": served, "is_generation": True})
            elif path == "/v1/models":
                self._json({"object": "list", "data": [{"id": served, "object": "model", "created": int(START),
                                                        "owned_by": "sglang", "root": args.model_path}]})
            else:
                self._send(404, b'{"detail":"Not Found"}', "application/json")

        do_HEAD = do_GET

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


def main(argv=None) -> int:
    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    try:
        version = server_version()
        return run(build_parser(version).parse_args(argv), version)
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
        server = Server((args.host, args.port), make_handler(args, health_status))
    except OSError as e:
        bind_error(e)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.2},
                              daemon=True)
    thread.start()
    log(f"Uvicorn running on http://{args.host}:{args.port} (Press CTRL+C to quit)")
    log("The server is fired up and ready to roll!")

    try:
        deadline = None if crash_after is None else time.monotonic() + crash_after
        while deadline is None or time.monotonic() < deadline:
            time.sleep(0.1 if deadline is not None else 3600)
        fail(CRASH_LINE)
    finally:
        server.shutdown()
        server.server_close()


if __name__ == "__main__":
    sys.exit(main())
