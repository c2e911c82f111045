#!/usr/bin/env python3
"""A MINIMAL SGLang pre-flight probe for bench/engine_probe_device.py (not the product's probe).

Written to the contract of issue 35 so the H200 run could go ahead while the product's probe
(reconciler/engines/: now one program, `reconciler.engines.probe_text("sglang")` written to a file)
was being written; the harness prefers that one when it is given (--probe FILE). It follows
review 2026-12-02-engine-preflight §2 exactly:

    PYTHON engine_probe_sglang_min.py [--facts JSON] [--] ENGINE_ARGV...

--facts {"count":N,"name":str,"capability":[9,0],"memory_mib":int} injects the host's facts
(through sglang.srt.runtime_context.override_platform on 0.5.2x, else by setting the probe
functions sglang.srt.server_args imported) and appends --device cuda when the argv has none.
Without --facts nothing is injected: the engine reads the hardware itself. The last stdout line
is ``RECONCILER-ENGINE {json}`` with verdict ok | rejected | inconclusive, message, resolved,
seconds.
"""

from __future__ import annotations

import contextlib
import importlib.util
import io
import json
import sys
import time
import traceback
from typing import Any

T0 = time.monotonic()
REJECT_PLACES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/", "sglang/srt/configs/model_config.py")


def emit(verdict: str, message: str, resolved: dict[str, Any]) -> None:
    line = {"verdict": verdict, "message": message, "resolved": resolved,
            "seconds": round(time.monotonic() - T0, 3)}
    print("RECONCILER-ENGINE " + json.dumps(line, sort_keys=True), flush=True)


def split_args(argv: list[str]) -> tuple[dict[str, Any] | None, list[str]]:
    facts = None
    if argv[:1] == ["--facts"]:
        facts = json.loads(argv[1])
        argv = argv[2:]
    if argv[:1] == ["--"]:
        argv = argv[1:]
    return facts, argv


def install_facts(facts: dict[str, Any]) -> str:
    major, minor = (int(x) for x in facts["capability"])
    sm = major * 10 + minor
    flash = importlib.util.find_spec("flashinfer") is not None
    values = {"is_cuda": True, "is_hip": False, "is_npu": False, "is_musa": False,
              "is_sm90": sm == 90, "is_sm100": sm == 100, "is_sm120": sm == 120,
              "is_blackwell": major >= 10, "is_hopper_with_cuda_12_3": sm == 90,
              "device_sm": sm, "device_capability": (major, minor), "has_flashinfer": flash}
    try:
        from sglang.srt.runtime_context import override_platform
    except ImportError:
        override_platform = None
    if override_platform is not None:
        values["is_sm100_or_sm110"] = major in (10, 11)
        values["is_sm110"] = sm == 110
        values["is_xpu"] = False
        values["is_mps"] = False
        override_platform(**values).install()
        return "override_platform"
    from sglang.srt import server_args as sa_mod
    names = {"is_cuda": "is_cuda", "is_hip": "is_hip", "is_npu": "is_npu", "is_musa": "is_musa",
             "is_sm90": "is_sm90_supported", "is_sm100": "is_sm100_supported",
             "is_sm120": "is_sm120_supported", "is_blackwell": "is_blackwell_supported",
             "is_hopper_with_cuda_12_3": "is_hopper_with_cuda_12_3", "device_sm": "get_device_sm",
             "has_flashinfer": "is_flashinfer_available"}
    for fact, attr in names.items():
        value = values[fact]
        setattr(sa_mod, attr, lambda *_a, _v=value, **_k: _v)
    return "server_args globals"


def innermost_engine_frame(exc: BaseException) -> tuple[str, str]:
    frames = [f for f in traceback.extract_tb(exc.__traceback__) if "sglang" in f.filename]
    if not frames:
        return "", ""
    f = frames[-1]
    where = f"{f.filename.split('site-packages/')[-1]}:{f.lineno} {f.name}"
    return where, (f.line or "")


def main() -> None:
    facts, argv = split_args(sys.argv[1:])
    resolved: dict[str, Any] = {"facts": "injected" if facts else "engine"}
    try:
        import sglang
        resolved["version"] = getattr(sglang, "__version__", "?")
        if facts:
            resolved["override"] = install_facts(facts)
            if not any(a == "--device" or a.startswith("--device=") for a in argv):
                argv = [*argv, "--device", "cuda"]
        from sglang.srt.server_args import prepare_server_args
    except Exception as exc:  # the probe's environment is wrong, not the unit
        emit("inconclusive", f"{type(exc).__name__}: {exc}", resolved)
        return
    err = io.StringIO()
    try:
        with contextlib.redirect_stderr(err):
            sa = prepare_server_args(argv)
        if hasattr(sa, "resolve_once"):
            sa.resolve_once()
        sa.check_server_args()
    except SystemExit as exc:
        lines = [ln for ln in err.getvalue().splitlines() if "error:" in ln]
        sys.stderr.write(err.getvalue())
        emit("rejected", lines[-1] if lines else f"argparse exit {exc.code}", resolved)
        return
    except Exception as exc:
        sys.stderr.write(err.getvalue())
        where, src = innermost_engine_frame(exc)
        resolved["where"] = where
        msg = f"{type(exc).__name__}: {exc}" if str(exc) else f"{type(exc).__name__} at {src}"
        engine_error = any(p in where for p in REJECT_PLACES) and isinstance(exc, (ValueError, AssertionError))
        emit("rejected" if engine_error else "inconclusive", msg, resolved)
        return
    sys.stderr.write(err.getvalue())
    values = sa.resolved_dict() if hasattr(sa, "resolved_dict") else vars(sa)
    for name in ("mamba_scheduler_strategy", "mamba_radix_cache_strategy", "attention_backend",
                 "page_size", "context_length", "tp_size", "device", "speculative_algorithm",
                 "disable_overlap_schedule", "mem_fraction_static", "cuda_graph_max_bs"):
        if name in values:
            value = values[name]
            resolved[name] = value if isinstance(value, (int, float, str, bool, type(None))) else str(value)
    emit("ok", "", resolved)


if __name__ == "__main__":
    main()
