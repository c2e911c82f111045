"""The engine probe's SGLang adapter: the calls SGLang's launcher makes before it touches a GPU
or a weight, and where this SGLang keeps its hooks (found by what it has, not by its version).

    ServerArgs.add_cli_args(parser); parser.parse_args(argv)   # the argument stage (no facts)
    prepare_server_args(argv)       # argparse; on 0.5.1x also all validation (__post_init__)
    server_args.resolve_once()      # 0.5.2x: the resolution pipeline (where the checks moved)
    server_args.check_server_args()

The host's GPU facts go through ``sglang.srt.runtime_context.override_platform`` where it
exists (0.5.2x; only the facts it declares), else through the hardware probes that
``sglang.srt.server_args`` imported (0.5.1x: ``is_cuda``, ``get_device_sm``, ...); either way the
probe reads back the capability SGLang now reports and is inconclusive when it is not the one
told. A release with neither is inconclusive, naming both. SGLang's argument stage reads no GPU
count (bench/results/engine_probe_h200.txt), so the count is passed on as told.

Sent to the host after probe.py, in one text (``probe_text``): it uses probe.py's names and
must not import anything itself that probe.py does not (no ``from __future__`` here).
"""

import argparse
import ast
import importlib
import importlib.util
import os
import re
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .probe import Inconclusive, MissingHook, Registry, installed_version, plain

# Where the engine raises its own configuration errors: a ValueError or AssertionError raised
# in one of these files means the engine refuses the arguments (not that the probe broke).
SGLANG_CONFIG_SOURCES = ("sglang/srt/server_args.py", "sglang/srt/arg_groups/",
                         "sglang/srt/configs/model_config.py")
# What the dry run shows: the resolved values that change how the server runs.
SGLANG_RESOLVED = ("mamba_scheduler_strategy", "mamba_radix_cache_strategy", "attention_backend", "page_size",
                   "context_length", "speculative_algorithm", "disable_overlap_schedule", "tp_size")
OVERRIDE_HOOK = "sglang.srt.runtime_context.override_platform"
PROBES_HOOK = "the hardware probes sglang.srt.server_args imports (is_cuda, get_device_sm)"


class SGLang:
    engine = "sglang"
    prefixes = ("SGLANG_", "SGL_")
    packages = ("sglang", "sgl_")
    config_sources = SGLANG_CONFIG_SOURCES

    def __init__(self) -> None:
        self.server_args: Any = None
        self.extra_args: list[str] = []

    def setup(self) -> None:
        return None

    def normalize(self, args: list[str]) -> list[str]:
        if args and not args[0].startswith("-"):
            # `sglang serve MODEL ...`: what its CLI does (cli/serve.py) before prepare_server_args
            return ["--model-path", args[0], *args[1:]]
        return args

    def install_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        self.extra_args = ["--device", "cuda"]   # unless the unit names one (check() looks)
        told = platform_facts(facts)
        capability = tuple(told["device_capability"])
        if importlib.util.find_spec("sglang.srt.runtime_context") is not None:
            rc = importlib.import_module("sglang.srt.runtime_context")
            if callable(getattr(rc, "override_platform", None)):
                install_override(rc, told)
                platform = rc.get_platform()
                seen = tuple(platform.device_capability)
                if seen != capability or platform.is_cuda is not True:
                    raise Inconclusive(f"{OVERRIDE_HOOK} did not take effect: sglang reports capability {seen}, "
                                       f"cuda {platform.is_cuda}, not the host's {capability}")
                return {"hook": OVERRIDE_HOOK, "capability": list(seen), "count": int(facts["count"])}
        sa = self.load()
        answers = probe_answers(told)
        present = [name for name in answers if callable(getattr(sa, name, None))]
        if "is_cuda" not in present or "get_device_sm" not in present:
            raise MissingHook(f"sglang {installed_version('sglang') or ''} has no platform hook: no "
                              f"{OVERRIDE_HOOK}, and none of {PROBES_HOOK} to answer; its own checks need the "
                              "host's GPUs, which the probe hides")
        for name in present:
            setattr(sa, name, (lambda v: lambda *a, **k: v)(answers[name]))
        if sa.get_device_sm() != told["device_sm"] or sa.is_cuda() is not True:
            raise Inconclusive("the hardware probes of sglang.srt.server_args did not take the host's facts")
        return {"hook": f"sglang.srt.server_args: {', '.join(present)}", "capability": list(capability),
                "count": int(facts["count"])}

    def load(self) -> Any:
        if self.server_args is None:
            self.server_args = importlib.import_module("sglang.srt.server_args")
            if importlib.util.find_spec("sglang.srt.plugins") is not None:
                load_plugins = getattr(importlib.import_module("sglang.srt.plugins"), "load_plugins", None)
                if load_plugins is not None:
                    load_plugins()          # as the launcher does, before it parses
        return self.server_args

    def registry(self) -> "Registry | None":
        if importlib.util.find_spec("sglang.srt.environ") is None:
            return None
        environ = importlib.import_module("sglang.srt.environ")
        holder = getattr(environ, "Envs", None) or type(getattr(environ, "envs", None))
        reg = Registry()
        for value in vars(holder).values():
            name = getattr(value, "name", None)
            if isinstance(name, str) and callable(getattr(value, "get", None)):
                reg.known.add(name)
                old = getattr(value, "deprecated_name", None)
                if isinstance(old, str):
                    reg.deprecated[old] = (f"Environment variable '{old}' is deprecated; use '{name}' instead. "
                                           "The alias will be removed in a future release.")
        for old, entry in (getattr(environ, "_DEPRECATED_ENVS", None) or {}).items():
            text = f"Environment variable {old} is deprecated."
            if getattr(entry, "replacement", None):
                text += f" Please use {entry.replacement} instead."
            if getattr(entry, "note", None):
                text += f" {entry.note}"
            reg.deprecated[old] = text
        return reg

    def environ_refusal(self) -> BaseException | None:
        return None              # SGLang starts on any variable (it ignores those it does not know)

    def parser(self) -> argparse.ArgumentParser | None:
        sa = self.load()
        add = getattr(getattr(sa, "ServerArgs", None), "add_cli_args", None)
        if add is None:
            return None          # prepare_server_args parses in the check stage
        parser = argparse.ArgumentParser(prog="sglang serve")
        add(parser)
        return parser

    def check(self, args: list[str], parsed: argparse.Namespace | None, at: Callable[[str], None]) -> dict[str, Any]:
        sa = self.load()
        at("parse")
        named = any(a == "--device" or a.startswith("--device=") for a in args)
        server_args = sa.prepare_server_args(args if named else [*args, *self.extra_args])
        asked = {name: plain(getattr(server_args, name, None)) for name in SGLANG_RESOLVED}
        if hasattr(server_args, "resolve_once"):
            at("resolve")
            server_args.resolve_once()
        at("check")
        server_args.check_server_args()
        return resolved(server_args, asked)


def install_override(rc: Any, told: dict[str, Any]) -> None:
    """``override_platform`` with the facts this SGLang declares (its table where it has one;
    else the names its own refusal says it does not know are left out, once)."""
    declared = set(getattr(rc, "_PLATFORM_PROBES", {})) | set(getattr(rc, "_PLATFORM_VALUES", {}))
    given = {k: v for k, v in told.items() if k in declared} if declared else dict(told)
    try:
        rc.override_platform(**given).install()
    except ValueError as e:
        m = re.search(r"unknown platform fact\(s\): (\[.*\])", str(e))
        if not m:
            raise Inconclusive(f"{OVERRIDE_HOOK} refused the host's facts: {e}") from e
        unknown = set(ast.literal_eval(m.group(1)))
        rc.override_platform(**{k: v for k, v in given.items() if k not in unknown}).install()


def platform_facts(facts: dict[str, Any]) -> dict[str, Any]:
    """The platform facts (SGLang 0.5.2x's names) for the host's GPUs, as its own probes
    (``sglang.srt.utils.common``) would answer them with the GPUs visible."""
    major, minor = (int(x) for x in facts["capability"])
    return {"is_cuda": True, "is_hip": False, "is_npu": False, "is_xpu": False, "is_musa": False, "is_mps": False,
            "is_sm90": major == 9, "is_hopper_with_cuda_12_3": major == 9, "is_sm100": major == 10,
            "is_sm110": major == 11, "is_sm100_or_sm110": major in (10, 11), "is_sm120": major == 12,
            "is_blackwell": major in (10, 11, 12), "has_amx": False, "has_flashinfer": flashinfer_present(),
            "device_sm": major * 10 + minor, "device_capability": (major, minor)}


def probe_answers(told: dict[str, Any]) -> dict[str, Any]:
    """The same facts under the names of the probe functions (0.5.1x imports them by these)."""
    return {"is_cuda": True, "is_hip": False, "is_npu": False, "is_musa": False, "is_xpu": False, "is_mps": False,
            "is_sm90_supported": told["is_sm90"], "is_sm100_supported": told["is_sm100"],
            "is_sm120_supported": told["is_sm120"], "is_blackwell_supported": told["is_blackwell"],
            "is_hopper_with_cuda_12_3": told["is_hopper_with_cuda_12_3"], "get_device_sm": told["device_sm"],
            "is_flashinfer_available": told["has_flashinfer"]}


def flashinfer_present() -> bool:
    """What SGLang's ``is_flashinfer_available()`` says on a GPU host: installed and not disabled."""
    enabled = os.environ.get("SGLANG_IS_FLASHINFER_AVAILABLE", "true").lower() in ("1", "true", "yes")
    return enabled and importlib.util.find_spec("flashinfer") is not None


def resolved(server_args: Any, asked: dict[str, Any]) -> dict[str, Any]:
    """The values in SGLANG_RESOLVED after resolution: 0.5.2x keeps the user's input on the record
    and the resolved values apart (``resolved_dict()``); 0.5.1x resolves in place, while parsing.
    A value that resolution changed (0.5.2x: `auto` -> `extra_buffer`, NEXTN -> EAGLE) comes as
    the pair [asked, resolved]; `asked` holds the values as parsed, before resolution."""
    values = server_args.resolved_dict() if hasattr(server_args, "resolved_dict") else vars(server_args)
    out: dict[str, Any] = {}
    for name in SGLANG_RESOLVED:
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
