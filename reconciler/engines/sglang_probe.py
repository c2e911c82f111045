"""Ask the installed SGLang whether it accepts a unit's arguments (a host program).

Copied to a host and run with the unit's own interpreter, so the answer comes from the exact
SGLang version the unit would start. It imports only the standard library and SGLang, and
makes the same calls the launcher makes before it touches a GPU or a weight::

    prepare_server_args(argv)     # argparse; on 0.5.1x also all validation (__post_init__)
    server_args.resolve_once()    # 0.5.2x: the resolution pipeline (where the checks moved)
    server_args.check_server_args()

Usage::

    PYTHON -I sglang_probe.py [--facts JSON] [--path DIR]... [--] ARGS...

ARGS are what follows ``-m sglang.launch_server`` or ``sglang serve`` in the unit's command
(a positional model, as ``sglang serve MODEL`` takes, becomes ``--model-path MODEL``).
The last line on stdout is ``RECONCILER-ENGINE {json}`` (see ``verdict()``); everything the
engine prints goes to stderr. Exit status 0 whenever that line was printed.

``--facts {"count": 4, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}``:
the host's GPUs, for a run with the GPUs hidden (``CUDA_VISIBLE_DEVICES=``). They are told to
SGLang through its own override point on 0.5.2x (``runtime_context.override_platform``) and
through the hardware probes ``sglang.srt.server_args`` imports on 0.5.1x; ``--device cuda`` is
added when the arguments name no device. The shim is pinned to the versions it was tested on
(``FACTS_SHIMS``): any other version with ``--facts`` is inconclusive, never a guess.

``--path DIR`` (repeatable): a directory the unit's interpreter would search (its PYTHONPATH,
its user site): the probe runs isolated (``python -I``: no ``PYTHON*`` variable is read, no
user site, no current directory), so it puts them on ``sys.path`` itself, in their order,
ahead of the site directories and behind the standard library, before the engine is imported.
``--trust-remote-code`` is taken out of ARGS: a model's own code never runs in the probe (the
verdict's ``note`` says so), and a refusal that only says remote code is needed is
inconclusive, never a refusal of the command line.
"""

from __future__ import annotations

import importlib.util
import json
import linecache
import os
import re
import sys
import time
import traceback
from types import TracebackType
from typing import Any

MARKER = "RECONCILER-ENGINE "
ENGINE = "sglang"
# Where the engine raises its own configuration errors: a ValueError or AssertionError raised
# in one of these files means the engine refuses the arguments (not that the probe broke).
CONFIG_SOURCES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/", "sglang/srt/configs/model_config.py")
# Tested engine versions -> how the host's GPU facts are told to that version.
FACTS_SHIMS = {"0.5.12": "server_args_globals", "0.5.23": "override_platform"}
# What the dry run shows: the resolved values that change how the server runs.
RESOLVED = ("mamba_scheduler_strategy", "mamba_radix_cache_strategy", "attention_backend", "page_size",
            "context_length", "speculative_algorithm", "disable_overlap_schedule", "tp_size")


class Inconclusive(Exception):
    """The probe could not ask the engine (its own setup failed), with the reason."""


def main(argv: list[str]) -> int:
    facts, paths, args = split_argv(argv)
    add_paths(paths)
    args, note = without_remote_code(args)
    real_stdout = os.dup(1)
    os.dup2(2, 1)              # the engine's chatter goes to stderr; stdout carries our line only
    os.environ["HF_HUB_OFFLINE"] = "1"        # a wrong model path must fail, never download
    os.environ["TRANSFORMERS_OFFLINE"] = "1"
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
    if argv and not argv[0].startswith("-"):
        # `sglang serve MODEL ...`: what its CLI does (cli/serve.py) before prepare_server_args
        argv = ["--model-path", argv[0], *argv[1:]]
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


def probe(facts: dict[str, Any] | None, args: list[str]) -> dict[str, Any]:
    seconds: dict[str, float] = {}
    out: dict[str, Any] = {"engine": ENGINE, "version": installed_version(), "verdict": "ok", "stage": None,
                           "error": None, "message": None, "where": None, "resolved": {}, "seconds": seconds}
    stage = "import"
    t0 = time.monotonic()
    try:
        if facts is not None:
            if out["version"] is None:
                importlib.import_module("sglang.srt.server_args")  # not installed: the import says why
            shim = FACTS_SHIMS.get(out["version"] or "")
            if shim is None:
                raise Inconclusive(f"no facts shim for sglang {out['version'] or '(unknown version)'}")
            if not any(a == "--device" or a.startswith("--device=") for a in args):
                args = [*args, "--device", "cuda"]
            if shim == "override_platform":
                from sglang.srt.runtime_context import override_platform
                override_platform(**platform_facts(facts)).install()
        from sglang.srt import server_args as sa_mod
        if facts is not None and FACTS_SHIMS[out["version"]] == "server_args_globals":
            patch_server_args_globals(sa_mod, facts)
        load_plugins = getattr(importlib.import_module("sglang.srt.plugins"), "load_plugins", None) \
            if importlib.util.find_spec("sglang.srt.plugins") else None
        if load_plugins is not None:
            load_plugins()          # as the launcher does, before it parses
        seconds["import"] = round(time.monotonic() - t0, 2)
        t1 = time.monotonic()
        stage = "parse"
        server_args = sa_mod.prepare_server_args(args)
        asked = {name: plain(getattr(server_args, name, None)) for name in RESOLVED}
        if hasattr(server_args, "resolve_once"):
            stage = "resolve"
            server_args.resolve_once()
        stage = "check"
        server_args.check_server_args()
        seconds["check"] = round(time.monotonic() - t1, 2)
        out["resolved"] = resolved(server_args, asked)
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


def platform_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """``override_platform`` keywords (SGLang 0.5.2x) for the host's GPUs, as its own probes
    (``sglang.srt.utils.common``) would answer them with the GPUs visible."""
    major, minor = (int(x) for x in facts["capability"])
    return {"is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False, "is_mps": False,
            "is_sm90": major == 9, "is_hopper_with_cuda_12_3": major == 9, "is_sm100": major == 10,
            "is_sm110": major == 11, "is_sm100_or_sm110": major in (10, 11), "is_sm120": major == 12,
            "is_blackwell": major in (10, 11, 12), "has_amx": False, "has_flashinfer": flashinfer_present(),
            "device_sm": major * 10 + minor, "device_capability": (major, minor)}


def flashinfer_present() -> bool:
    """What SGLang's ``is_flashinfer_available()`` says on a GPU host: installed and not disabled."""
    enabled = os.environ.get("SGLANG_IS_FLASHINFER_AVAILABLE", "true").lower() in ("1", "true", "yes")
    return enabled and importlib.util.find_spec("flashinfer") is not None


def patch_server_args_globals(module: Any, facts: dict[str, Any]) -> None:
    """SGLang 0.5.1x has no override point: its validation calls hardware probes it imported
    into ``sglang.srt.server_args``; answer those with the host's facts."""
    f = platform_facts(facts)
    answers = {"is_cuda": f["is_cuda"], "is_hip": False, "is_npu": False, "is_musa": False,
               "is_sm90_supported": f["is_sm90"], "is_sm100_supported": f["is_sm100"],
               "is_sm120_supported": f["is_sm120"], "is_blackwell_supported": f["is_blackwell"],
               "is_hopper_with_cuda_12_3": f["is_hopper_with_cuda_12_3"], "get_device_sm": f["device_sm"],
               "is_flashinfer_available": f["has_flashinfer"]}
    missing = [name for name in answers if not hasattr(module, name)]
    if missing:
        raise Inconclusive(f"facts shim does not fit this sglang: server_args has no {', '.join(missing)}")
    for name, value in answers.items():
        setattr(module, name, (lambda v: lambda *a, **k: v)(value))


def resolved(server_args: Any, asked: dict[str, Any]) -> dict[str, Any]:
    """The values in RESOLVED after resolution: 0.5.2x keeps the user's input on the record and
    the resolved values apart (``resolved_dict()``); 0.5.1x resolves in place, while parsing.
    A value that resolution changed (0.5.2x: `auto` -> `extra_buffer`, NEXTN -> EAGLE) comes as
    the pair [asked, resolved]; `asked` holds the values as parsed, before resolution."""
    values = server_args.resolved_dict() if hasattr(server_args, "resolved_dict") else vars(server_args)
    out: dict[str, Any] = {}
    for name in RESOLVED:
        if name in values:
            value = plain(values[name])
            before = asked.get(name)
            out[name] = [before, value] if before is not None and before != value else value
    if out.get("context_length") is None:       # not set by the unit: the model's own length
        try:
            if hasattr(server_args, "get_model_config"):                  # 0.5.1x
                model_config = server_args.get_model_config()
            else:                                                         # 0.5.2x
                from sglang.srt.arg_groups.model_override_base import model_config_of
                model_config = model_config_of(server_args)
            out["context_length"] = int(model_config.context_len)
        except Exception:  # the derived length is a nicety, not the verdict
            pass
    return out


def plain(value: Any) -> Any:
    """A value as JSON carries it (an enum or an object as its text)."""
    return value if isinstance(value, (str, int, float, bool, type(None))) else str(value)


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
    message = str(e).strip()
    if isinstance(e, (ValueError, AssertionError)) and raised_in(e.__traceback__, CONFIG_SOURCES):
        if not message and isinstance(e, AssertionError):
            message = source
        return {**base, "verdict": "rejected", "message": message}
    missing = re.search(r"Repo id must be in the form .*?: '([^']+)'", message)
    if missing and stage != "import":
        return {**base, "verdict": "rejected", "message": f"model path not found: {missing.group(1)} ({message})"}
    return {**base, "verdict": "inconclusive", "message": message or source}


_usage: list[str] = []


class _StderrTee:
    """Keeps what argparse writes to stderr, so its ``error:`` line can be quoted."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def write(self, s: str) -> int:
        _usage.append(s)
        return self.inner.write(s)

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
    """``sglang/...py`` for a file of the engine package, else None."""
    m = re.search(r"(?:^|/)(sglang/.+)$", path)
    return m.group(1) if m and ("-packages/" in path or "/lib/python" in path) else None


def innermost_engine_frame(tb: TracebackType | None) -> tuple[str | None, str]:
    """``"sglang/x.py:LINE qualname"`` of the innermost engine frame, and that frame's source line."""
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
