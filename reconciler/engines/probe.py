"""Ask the installed engine whether it accepts a unit's arguments: the engine probe, a host program.

Copied to a host and run with the unit's own interpreter, so the answer comes from the exact
engine the unit would start. It imports only the standard library and the engine. This file is
the part both engines share (arguments, stages, verdicts); ``retired.py`` reads dead
configuration; the calls each engine's launcher makes are its adapter, ``sglang.py`` or
``vllm.py``. The host gets one text, ``probe_text(server)`` (``__init__.py``): this file,
retired.py, the adapter, and one line that runs ``main`` with it. Usage::

    python -I probe.py [--facts JSON] [--path DIR]... [--] ARGS...

``--path DIR`` (the unit's PYTHONPATH, in order) is put on ``sys.path`` ahead of the site
directories, behind the standard library, before anything of the engine is imported: with
``-I`` Python reads no PYTHON* variable. ARGS are the server's
own arguments; ``--trust-remote-code`` is left out of them (a model's own code never runs in the
probe; the verdict's ``notes`` say so), and a refusal that only says the model needs its own code
is inconclusive. ``--facts {"count": 4, "name": "NVIDIA H200", "capability": [9, 0],
"memory_mib": 143771}``: the host's GPUs, for a run with them hidden (``CUDA_VISIBLE_DEVICES=``).

Stages, in order: ``import`` (the engine's hooks are found by what the installed package has,
never by its version: a release without the hook to tell it the facts is inconclusive, naming
the missing hook, but only after its arguments were parsed); ``parse`` (the engine's own
argument parser, no facts needed: an unknown, removed or misspelled flag or a bad choice is
refused in its words on any release); ``facts``; then the engine's own checks (``resolve``,
``check``, ``config``). Dead configuration comes from the engine too: a variable of its prefix
that its environment registry and its code do not know, one its deprecation tables name, a
flag its parser marks deprecated, and its own deprecation warnings while it checks, each one
a line of ``warnings`` in the engine's words.

The last line on stdout is ``RECONCILER-ENGINE {json}``; everything the engine prints goes to
stderr. Exit status 0 whenever that line was printed. Texts are the engine's own, bounded at
``TEXT_MAX`` (8 KiB), not cut shorter: the controller redacts them before it shortens them.
"""

from __future__ import annotations

import argparse
import json
import linecache
import os
import re
import sys
import time
import traceback
from collections.abc import Callable
from importlib import metadata
from types import TracebackType
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from .retired import Heard, Registry, deprecated_flags, engine_file, environment_warnings

MARKER = "RECONCILER-ENGINE "
TEXT_MAX = 8192            # one message or warning, as the engine wrote it (redacted, then cut, by the controller)
WARNINGS_MAX = 40
LINE_MAX = 60 * 1024       # the whole verdict line: the host side returns the last 64 KiB of stdout
REMOTE_CODE = "--trust-remote-code"
ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
MODEL_NOT_FOUND = re.compile(r"Repo id must be in the form .*?: '([^']+)'")


class Inconclusive(Exception):
    """The probe could not ask the engine (its own setup failed), with the reason."""


class MissingHook(Inconclusive):
    """The installed engine has no hook through which the host's GPU facts can be told."""


class Adapter(Protocol):
    """The calls one engine's launcher makes (sglang.py, vllm.py)."""

    engine: str
    prefixes: tuple[str, ...]          # its environment variables' prefixes
    packages: tuple[str, ...]          # the stems of its top-level packages (its code)
    config_sources: tuple[str, ...]    # where it raises its own configuration errors

    def setup(self) -> None: ...
    def normalize(self, args: list[str]) -> list[str]: ...
    def install_facts(self, facts: dict[str, Any]) -> dict[str, Any]: ...
    def registry(self) -> Registry | None: ...
    def environ_refusal(self) -> BaseException | None: ...
    def parser(self) -> argparse.ArgumentParser | None: ...
    def check(self, args: list[str], parsed: argparse.Namespace | None,
              at: Callable[[str], None]) -> dict[str, Any]: ...


def main(adapter: Adapter, argv: list[str]) -> None:
    facts, paths, args = split_argv(argv)
    add_paths(paths)
    real_stdout = os.dup(1)
    os.dup2(2, 1)              # the engine's chatter goes to stderr; stdout carries our line only
    os.environ["HF_HUB_OFFLINE"] = "1"        # a wrong model path must fail, never download
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
    result = probe(adapter, facts, args)
    sys.stdout.flush()
    sys.stderr.flush()
    os.write(real_stdout, (MARKER + verdict_line(result) + "\n").encode())
    os._exit(0)                # no engine teardown (atexit, threads) after the verdict line


def verdict_line(result: dict[str, Any]) -> str:
    """The verdict as JSON, within LINE_MAX: the last warnings give way first."""
    line = json.dumps(result, sort_keys=True)
    while len(line.encode()) > LINE_MAX and result["warnings"]:
        result["warnings"] = result["warnings"][:-1]
        line = json.dumps(result, sort_keys=True)
    return line


def split_argv(argv: list[str]) -> tuple[dict[str, Any] | None, list[str], list[str]]:
    """The probe's own options (``--facts JSON``, ``--path DIR``..., ``--``) and the engine's argv."""
    facts: dict[str, Any] | None = None
    paths: list[str] = []
    while len(argv) > 1 and argv[0] in ("--facts", "--path"):
        if argv[0] == "--facts":
            facts = json.loads(argv[1])
        else:
            paths.append(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return facts, paths, list(argv)


def drop_remote_code(args: list[str]) -> tuple[list[str], list[str]]:
    """ARGS without ``--trust-remote-code`` (and its ``=value`` form), and a note when it was there."""
    kept = [a for a in args if a != REMOTE_CODE and not a.startswith(REMOTE_CODE + "=")]
    if len(kept) == len(args):
        return kept, []
    return kept, [f"{REMOTE_CODE} left out: the model's own code never runs in the engine check"]


def probe(adapter: Adapter, facts: dict[str, Any] | None, args: list[str]) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    args, notes = drop_remote_code(adapter.normalize(args))
    out: dict[str, Any] = {"engine": adapter.engine, "version": installed_version(adapter.engine), "verdict": "ok",
                           "stage": None, "error": None, "message": None, "where": None, "resolved": {},
                           "seconds": seconds, "warnings": [], "notes": notes, "facts": None}
    stage = "import"
    refusal: BaseException | None = None
    t0 = time.monotonic()
    heard = Heard(adapter.engine)
    try:
        with heard.listening():
            adapter.setup()
            missing: MissingHook | None = None
            if facts is not None:
                try:
                    out["facts"] = adapter.install_facts(facts)
                except MissingHook as e:
                    missing = e
            out["warnings"].extend(environment_warnings(adapter.engine, out["version"], adapter.prefixes,
                                                        adapter.packages, adapter.registry))
            refusal = adapter.environ_refusal()
            stage = "parse"
            parser = adapter.parser()
            seconds["import"] = round(time.monotonic() - t0, 2)
            parsed = parser.parse_args(args) if parser is not None else None
            if parser is not None:
                out["warnings"].extend(deprecated_flags(parser, args))
            if refusal is not None:
                stage = "environ"
                raise refusal
            if missing is not None:
                stage = "facts"
                raise missing

            def at(name: str) -> None:
                nonlocal stage
                stage = name

            out["resolved"] = adapter.check(args, parsed, at)
        seconds["check"] = round(time.monotonic() - t0 - seconds["import"], 2)
    except BaseException as e:  # every failure becomes a verdict
        seconds.setdefault("import", round(time.monotonic() - t0, 2))
        if stage != "import":
            seconds["check"] = round(time.monotonic() - t0 - seconds["import"], 2)
        out.update(judge(adapter, e, stage))
    if refusal is not None and stage != "environ" and bounded(refusal) not in out["warnings"]:
        out["warnings"].append(f"{adapter.engine} refuses to start with this environment: {refusal}")
    out["warnings"] = [w for w in unique([*out["warnings"], *heard.retired()]) if w != out["message"]][:WARNINGS_MAX]
    return out


def installed_version(engine: str) -> str | None:
    try:
        return metadata.version(engine)
    except Exception:  # no engine installed: the import stage says why
        return None


def unique(texts: list[str]) -> list[str]:
    """Each text once, bounded, in the order first said."""
    return list(dict.fromkeys(bounded(x) for x in texts))


def bounded(text: Any) -> str:
    """A text as the engine wrote it, without terminal colours, at most TEXT_MAX characters."""
    s = ANSI.sub("", str(text)).strip()
    return s if len(s) <= TEXT_MAX else s[:TEXT_MAX - 3] + "..."


# --- verdicts ------------------------------------------------------------------------------------

def judge(adapter: Adapter, e: BaseException, stage: str) -> dict[str, Any]:
    """The verdict for an exception raised at `stage` (review 2026-12-02 section 7.5)."""
    if isinstance(e, Inconclusive):
        return {"verdict": "inconclusive", "stage": stage, "error": type(e).__name__, "message": bounded(e)}
    where, source = innermost_engine_frame(e.__traceback__, adapter.engine)
    base = {"stage": stage, "error": type(e).__name__, "where": where}
    if isinstance(e, SystemExit):
        if e.code == 2:
            return {**base, "verdict": "rejected", "error": "usage", "message": usage_error()}
        return {**base, "verdict": "inconclusive", "message": f"the engine exited with status {e.code} while parsing"}
    message = bounded(validation_message(e) if type(e).__name__ == "ValidationError" else e)
    if re.search(r"trust[_-]remote[_-]code", message):
        return {**base, "verdict": "inconclusive",
                "message": f"the model needs its own code (trust_remote_code), which never runs in the engine "
                           f"check: {message}"}
    if "failed to be inspected" in message:
        # vLLM inspects the architecture in a subprocess of the same interpreter: its failure is
        # the environment's (a missing module, no driver), which the engine's log names.
        return {**base, "verdict": "inconclusive", "message": message}
    pydantic_refusal = stage == "config" and type(e).__name__ == "ValidationError"
    environ_refusal = stage == "environ" and isinstance(e, ValueError)
    if pydantic_refusal or environ_refusal or \
            (isinstance(e, (ValueError, AssertionError)) and raised_in(e.__traceback__, adapter)):
        if not message and isinstance(e, AssertionError):
            message = bounded(source)
        return {**base, "verdict": "rejected", "message": message}
    missing = MODEL_NOT_FOUND.search(message)
    if missing and stage != "import":
        return {**base, "verdict": "rejected", "message": f"model path not found: {missing.group(1)} ({message})"}
    return {**base, "verdict": "inconclusive", "message": message or bounded(source)}


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


class StderrTee:
    """Keeps what argparse writes to stderr, so its ``error:`` line can be quoted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, s: str) -> int:
        _usage.append(s)
        del _usage[:-200]
        return int(self.inner.write(s))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def usage_error() -> str:
    text = "".join(_usage)
    found = re.findall(r"^\S.*?error: (.*)$", text, re.M)
    return bounded(found[-1] if found else tail(text.strip(), TEXT_MAX))


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


def add_paths(paths: list[str]) -> None:
    """The unit's own search path (``--path``), ahead of the first site directory, as its
    interpreter would search them: after the standard library, before site-packages (appended
    after them, a venv's older engine would shadow a newer one on PYTHONPATH)."""
    at = next((i for i, p in enumerate(sys.path) if p.endswith(("site-packages", "dist-packages"))),
              len(sys.path))
    sys.path[at:at] = [p for p in paths if p not in sys.path]


def innermost_engine_frame(tb: TracebackType | None, package: str) -> tuple[str | None, str]:
    """``"pkg/x.py:LINE qualname"`` of the innermost engine frame, and that frame's source line."""
    where, source = None, ""
    for frame, lineno in traceback.walk_tb(tb):
        rel = engine_file(frame.f_code.co_filename, package)
        if rel:
            where = f"{rel}:{lineno} {frame.f_code.co_qualname}"
            source = linecache.getline(frame.f_code.co_filename, lineno).strip()
    return where, source


def raised_in(tb: TracebackType | None, adapter: Adapter) -> bool:
    """Whether the innermost frame (where the exception was raised) is one of the adapter's
    configuration sources."""
    last = None
    for frame, _ in traceback.walk_tb(tb):
        last = frame.f_code.co_filename
    rel = engine_file(last or "", adapter.engine)
    return rel is not None and rel.startswith(adapter.config_sources)


def plain(value: Any) -> Any:
    """A value as JSON carries it (an enum or an object as its text)."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


def run(adapter: Adapter) -> None:
    """The probe as a program: what the line after the adapter calls."""
    sys.stderr = StderrTee(sys.stderr)
    main(adapter, sys.argv[1:])
