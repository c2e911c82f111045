"""Ask the installed vLLM whether it accepts a unit's arguments (a host program).

Copied to a host and run with the unit's own interpreter, so the answer comes from the exact
vLLM version the unit would start. It imports only the standard library and vLLM, and makes
the calls ``vllm serve`` makes before it starts an engine process::

    make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=OPENAI_API_SERVER)

Usage::

    PYTHON -I vllm_probe.py [--facts JSON] [--path DIR]... [--] ARGS...

ARGS are what follows ``vllm serve`` in the unit's command (a positional model is allowed).
The last line on stdout is ``RECONCILER-ENGINE {json}`` (the same shape as sglang_probe.py);
everything the engine prints goes to stderr. Exit status 0 whenever that line was printed.

``--facts {"count": 4, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}``:
the host's GPUs, for a run with the GPUs hidden (``CUDA_VISIBLE_DEVICES=``). vLLM has no
override point: a subclass of its ``CudaPlatform`` that answers from the facts is made the
current platform before anything else of vLLM is imported (its modules bind the platform at
import). Pinned to the versions it was tested on (``FACTS_SHIMS``); any other version with
``--facts`` is inconclusive. Importing vLLM's CUDA platform needs ``libcuda.so.1`` (the NVIDIA
driver), even with the GPUs hidden.

vLLM inspects a model's architecture in a subprocess once and caches the answer under
``VLLM_CACHE_ROOT``; when that is unset the probe points it at a directory of its own under the
system's temporary directory, kept between runs where that directory is (the first run of an
architecture is slower; the reconciler runs the probe with a private /tmp, so every run is a first).

``--path DIR`` (repeatable): a directory the unit's interpreter would search (its PYTHONPATH,
its user site): the probe runs isolated (``python -I``: no ``PYTHON*`` variable is read, no
user site, no current directory), so it puts them on ``sys.path`` itself, in their order,
ahead of the site directories and behind the standard library, before the engine is imported.
``--trust-remote-code`` is taken out of ARGS: a model's own code never runs in the probe (the
verdict's ``note`` says so), and a refusal that only says remote code is needed is
inconclusive, never a refusal of the command line.
"""

from __future__ import annotations

import importlib
import json
import linecache
import os
import re
import stat
import sys
import tempfile
import time
import traceback
from types import TracebackType
from typing import Any

MARKER = "RECONCILER-ENGINE "
ENGINE = "vllm"
# Where vLLM raises its own configuration errors (review 2026-12-02 section 7.5), and the
# serve command's own argument checks (validate_parsed_serve_args).
CONFIG_SOURCES = ("vllm/config/", "vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py")
# Tested engine versions: the platform methods overridden below exist with these signatures.
FACTS_SHIMS = {"0.33.0"}


class Inconclusive(Exception):
    """The probe could not ask the engine (its own setup failed), with the reason."""


def main(argv: list[str]) -> None:
    facts, paths, args = split_argv(argv)
    add_paths(paths)
    args, note = without_remote_code(args)
    real_stdout = os.dup(1)
    os.dup2(2, 1)              # the engine's chatter goes to stderr; stdout carries our line only
    os.environ["HF_HUB_OFFLINE"] = "1"        # a wrong model path must fail, never download
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    if not os.environ.get("VLLM_CACHE_ROOT"):
        os.environ["VLLM_CACHE_ROOT"] = cache_root()
    result = probe(facts, args)
    if note:
        result["note"] = note
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(real_stdout, (MARKER + json.dumps(result, sort_keys=True) + "\n").encode())
    os._exit(0)                # no engine teardown (atexit, threads) after the verdict line


def split_argv(argv: list[str]) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """The probe's own options (``--facts JSON``, ``--path DIR``..., ``--``) and the engine's argv after them."""
    facts = None
    paths: list[str] = []
    while argv[:1] in (["--facts"], ["--path"]) and len(argv) > 1:
        if argv[0] == "--facts":
            facts = json.loads(argv[1])
        else:
            paths.append(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return facts, paths, list(argv)


def add_paths(paths: list[str]) -> None:
    """The unit's own search path (``--path``), ahead of the first site directory, as its
    interpreter would search them: after the standard library, before site-packages."""
    at = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))),
              len(sys.path))
    sys.path[at:at] = [p for p in paths if p not in sys.path]


REMOTE_CODE = "--trust-remote-code"


def without_remote_code(args: list[str]) -> tuple[list[str], str | None]:
    """The arguments without ``--trust-remote-code``: the model's own Python files (``auto_map``)
    are never imported by the probe; and the note that says so, if it was there."""
    kept = [a for a in args if a != REMOTE_CODE and not a.startswith(REMOTE_CODE + "=")]
    return kept, (f"{REMOTE_CODE} left out: the model's own code never runs in the check"
                  if len(kept) != len(args) else None)


def cache_root() -> str:
    """A writable cache directory of this user's own, kept between runs: the system temporary
    directory's ``reconciler-vllm-cache-UID``, or a fresh one when that name is not ours."""
    path = os.path.join(tempfile.gettempdir(), f"reconciler-vllm-cache-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="reconciler-vllm-cache-")
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return tempfile.mkdtemp(prefix="reconciler-vllm-cache-")
    return path


def probe(facts: dict[str, Any] | None, args: list[str]) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {"engine": ENGINE, "version": installed_version(), "verdict": "ok", "stage": None,
                           "error": None, "message": None, "where": None, "resolved": {}, "seconds": seconds}
    stage = "import"
    t0 = time.monotonic()
    try:
        if facts is not None:
            if out["version"] is None:
                importlib.import_module("vllm.platforms")  # not installed: the import says why
            if out["version"] not in FACTS_SHIMS:
                raise Inconclusive(f"no facts shim for vllm {out['version'] or '(unknown version)'}")
            install_host_platform(facts)     # before any other vllm import
        import vllm
        from vllm.entrypoints.common.cli_args import make_arg_parser, validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        seconds["import"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        stage = "parse"
        parsed = make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(args)
        if getattr(parsed, "model_tag", None) is not None:
            parsed.model = parsed.model_tag       # as `vllm serve MODEL` does
        validate_parsed_serve_args(parsed)
        stage = "config"
        engine_args = vllm.AsyncEngineArgs.from_cli_args(parsed)
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        seconds["check"] = round(time.monotonic() - t1, 2)
        out["resolved"] = resolved(config)
    except BaseException as e:  # every failure becomes a verdict
        seconds.setdefault("import", round(time.monotonic() - t0, 2))
        if stage != "import":
            seconds["check"] = round(time.monotonic() - t0 - seconds["import"], 2)
        out.update(judge(e, stage))
    return out


def installed_version() -> str | None:
    try:
        from importlib.metadata import version
        return version(ENGINE)
    except Exception:  # no engine installed: the import stage says why
        return None


def install_host_platform(facts: dict[str, Any]) -> None:
    """Make vLLM's current platform a CUDA platform that answers from the host's facts."""
    from vllm import platforms
    from vllm.platforms.cuda import CudaPlatform
    from vllm.platforms.interface import DeviceCapability

    count, name = int(facts["count"]), str(facts["name"])
    major, minor = (int(x) for x in facts["capability"])
    memory = int(facts["memory_mib"]) * 1024 * 1024

    class HostCuda(CudaPlatform):  # type: ignore[misc,valid-type]
        """The host's GPUs as its nvidia-smi reported them (the probe runs with them hidden)."""

        @classmethod
        def device_count(cls) -> int:
            return count

        @classmethod
        def get_device_capability(cls, device_id: int = 0) -> Any:
            return DeviceCapability(major=major, minor=minor)

        @classmethod
        def get_device_name(cls, device_id: int = 0) -> str:
            return name

        @classmethod
        def get_device_uuid(cls, device_id: int = 0) -> str:
            return f"GPU-reconciler-probe-{device_id}"

        @classmethod
        def get_device_total_memory(cls, device_id: int = 0) -> int:
            return memory

        @classmethod
        def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
            return True

        @classmethod
        def log_warnings(cls) -> None:
            return None

    platforms.current_platform = HostCuda()


def resolved(config: Any) -> dict[str, Any]:
    """What the dry run shows: the values vLLM resolved that change how the server runs."""
    spec = config.speculative_config
    values = {"max_model_len": config.model_config.max_model_len,
              "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
              "speculative_method": getattr(spec, "method", None) if spec is not None else None,
              "mamba_cache_mode": getattr(config.cache_config, "mamba_cache_mode", None),
              "architecture": getattr(config.model_config, "architecture", None)}
    return {k: v if isinstance(v, (str, int, float, bool, type(None))) else str(v) for k, v in values.items()}


def judge(e: BaseException, stage: str) -> dict[str, Any]:
    """The verdict for an exception raised at `stage` (review 2026-12-02 section 7.5)."""
    if isinstance(e, Inconclusive):
        return {"verdict": "inconclusive", "stage": stage, "error": "Inconclusive", "message": str(e)}
    if "trust_remote_code" in str(e) or REMOTE_CODE in str(e):
        # the model needs its own code, which the check never runs: not the command line's fault
        return {"verdict": "inconclusive", "stage": stage, "error": type(e).__name__,
                "message": f"{str(e).strip()} (the check runs no model code)"}
    where, source = innermost_engine_frame(e.__traceback__)
    base = {"stage": stage, "error": type(e).__name__, "where": where}
    if isinstance(e, SystemExit):
        if e.code == 2:
            return {**base, "verdict": "rejected", "error": "usage", "message": usage_error()}
        return {**base, "verdict": "inconclusive", "message": f"the engine exited with status {e.code} while parsing"}
    message = validation_message(e) if type(e).__name__ == "ValidationError" else str(e).strip()
    if "failed to be inspected" in message:
        # vLLM inspects the architecture in a subprocess of the same interpreter: its failure is
        # the environment's (a missing module, no driver), which the engine's log names.
        return {**base, "verdict": "inconclusive", "message": message}
    pydantic_refusal = stage == "config" and type(e).__name__ == "ValidationError"
    if pydantic_refusal or (isinstance(e, (ValueError, AssertionError)) and raised_in(e.__traceback__, CONFIG_SOURCES)):
        if not message and isinstance(e, AssertionError):
            message = source
        return {**base, "verdict": "rejected", "message": message}
    missing = re.search(r"Repo id must be in the form .*?: '([^']+)'", message)
    if missing and stage != "import":
        return {**base, "verdict": "rejected", "message": f"model path not found: {missing.group(1)} ({message})"}
    return {**base, "verdict": "inconclusive", "message": message or source}


def validation_message(e: BaseException) -> str:
    """A pydantic ValidationError's messages without its boilerplate: ``field: message; ...``."""
    try:
        errors = e.errors()  # type: ignore[attr-defined]
    except Exception:  # not pydantic's after all
        return str(e).strip()
    parts = []
    for err in errors:
        msg = str(err.get("msg", "")).removeprefix("Value error, ").removeprefix("Assertion failed, ")
        loc = ".".join(str(x) for x in err.get("loc", ()))
        parts.append(f"{loc}: {msg}" if loc else msg)
    return "; ".join(parts)


_usage: list[str] = []


class _StderrTee:
    """Keeps what argparse writes to stderr, so its ``error:`` line can be quoted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, s: str) -> int:
        _usage.append(s)
        return int(self.inner.write(s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def usage_error() -> str:
    text = "".join(_usage)
    found = re.findall(r"^\S.*?error: (.*)$", text, re.M)
    return found[-1].strip() if found else tail(text.strip(), 500)


def tail(text: str, limit: int) -> str:
    """The end of a text, at most `limit` characters, whole words only: a word cut in two may be
    part of a secret that the controller, which redacts everything it is told, would no longer
    recognise."""
    if len(text) <= limit:
        return text
    cut = text[-limit:]
    if not cut[0].isspace() and not text[-limit - 1].isspace():       # the first word cut in two
        cut = cut.split(None, 1)[1] if len(cut.split(None, 1)) == 2 else ""
    return cut.lstrip()


def engine_file(path: str) -> str | None:
    """``vllm/...py`` for a file of the engine package, else None."""
    m = re.search(r"(?:^|/)(vllm/.+)$", path)
    return m.group(1) if m and ("-packages/" in path or "/lib/python" in path) else None


def innermost_engine_frame(tb: TracebackType | None) -> tuple[str | None, str]:
    """``"vllm/x.py:LINE qualname"`` of the innermost engine frame, and that frame's source line."""
    where, source = None, ""
    for frame, lineno in traceback.walk_tb(tb):
        rel = engine_file(frame.f_code.co_filename)
        if rel:
            where = f"{rel}:{lineno} {frame.f_code.co_qualname}"
            source = linecache.getline(frame.f_code.co_filename, lineno).strip()
    return where, source


def raised_in(tb: TracebackType | None, sources: tuple[str, ...]) -> bool:
    """Whether the innermost frame (where the exception was raised) is one of `sources`."""
    last = None
    for frame, _ in traceback.walk_tb(tb):
        last = frame.f_code.co_filename
    rel = engine_file(last or "")
    return rel is not None and rel.startswith(sources)


if __name__ == "__main__":
    sys.stderr = _StderrTee(sys.stderr)
    main(sys.argv[1:])
