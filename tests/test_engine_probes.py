"""The engine probe's own logic (reconciler/engines/), run as the host runs it (`python -I`, the
text `probe_text(server)`, the engine on `--path`) against small stub engine packages: the
verdict line is the last stdout line whatever the engine prints; each kind of failure gets the
verdict of review 2026-12-02 §7.5; hooks are found by what the package has (a release without
its platform hook is inconclusive, naming it, after its arguments were parsed); dead and
deprecated configuration comes from the engine's own registry, tables, parser and warnings.
The real engines are run in tests/e2e/test_e2e_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from reconciler.engines import probe_text
from reconciler.preflight import parse_verdict

FACTS = {"count": 4, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}

# An SGLang 0.5.2x-shaped server_args: argparse, then resolve_once / check_server_args.
SERVER_ARGS = '''
import argparse, atexit, logging, os, sys
print("engine chatter on stdout")
print("engine chatter on stderr", file=sys.stderr)
atexit.register(lambda: print("engine chatter at exit"))


class DeprecatedStoreTrueAction(argparse.Action):
    def __init__(self, option_strings, dest, nargs=0, **kw):
        super().__init__(option_strings, dest, nargs=0, **kw)

    def __call__(self, parser, namespace, values, option_string=None):
        setattr(namespace, self.dest, True)


class ServerArgs:
    mamba_radix_cache_strategy = "auto"     # as parsed: resolution turns it into extra_buffer

    def __init__(self, ns):
        self.ns = ns

    @staticmethod
    def add_cli_args(parser):
        parser.add_argument("--tp-size", type=int)
        parser.add_argument("--model-path")
        parser.add_argument("--device")
        parser.add_argument("--attention-backend", choices=["fa3", "triton"])
        parser.add_argument("--old-flag", action=DeprecatedStoreTrueAction,
                            help="Deprecated. Use --attention-backend triton instead.")
        parser.add_argument("--quiet-flag", action="store_true", help="Note: --quiet-flag is deprecated now.")
        parser.add_argument("--trust-remote-code", action="store_true")

    def resolve_once(self):
        mode = os.environ.get("FAKE_MODE", "ok")
        if mode == "assert":
            assert 1 + 1 == 3
        if mode == "value":
            raise ValueError("tp_size 3 does not divide 32 heads")
        if mode == "repo":
            raise OSError("Repo id must be in the form 'repo_name' or 'namespace/repo_name': "
                          "'/models/nope'. Use `repo_type` argument if needed.")
        if mode == "runtime":
            raise RuntimeError("No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) is available.")
        if mode == "remote":
            raise ValueError("The repository /models/m contains custom code which must be executed to correctly "
                             "load the model. Please pass the argument `trust_remote_code=True`.")
        if mode == "long":
            raise ValueError("x" * 20000)
        if self.ns.old_flag:
            logging.getLogger("sglang.srt.server_args").warning("--old-flag has been removed from the kernels")
        if os.environ.get("SGLANG_READ_DIRECT") is not None:
            logging.getLogger("sglang.srt.server_args").warning("SGLANG_READ_DIRECT has been removed: use --tp-size")

    def check_server_args(self):
        print("more chatter")

    def resolved_dict(self):
        capability = None
        try:
            from sglang.srt.runtime_context import get_platform
            capability = list(get_platform().device_capability)
        except ImportError:
            pass
        return {"attention_backend": "trtllm_mha" if capability == [10, 0] else "fa3", "tp_size": 4,
                "mamba_radix_cache_strategy": "extra_buffer", "context_length": 1024, "unrelated": 1}


def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve")
    ServerArgs.add_cli_args(parser)
    return ServerArgs(parser.parse_args(argv))
'''

# SGLang 0.5.2x's override point, as it declares its facts (a table; an unknown name is refused).
RUNTIME_CONTEXT = '''
_PLATFORM_PROBES = {"is_cuda": "is_cuda", "is_sm90": "is_sm90_supported"}
_PLATFORM_VALUES = {"device_sm": "get_device_sm", "device_capability": "get_device_capability"}
_facts = {}
IGNORE = __import__("os").environ.get("FAKE_IGNORE_FACTS") == "1"


class _Platform:
    def __getattr__(self, name):
        return _facts.get(name, {"is_cuda": False, "device_capability": (0, 0)}.get(name))


def get_platform():
    return _Platform()


class _Override:
    def __init__(self, **facts):
        unknown = set(facts) - set(_PLATFORM_PROBES) - set(_PLATFORM_VALUES)
        if unknown:
            raise ValueError(f"unknown platform fact(s): {sorted(unknown)}")
        self.facts = facts

    def install(self):
        if not IGNORE:
            _facts.update(self.facts)


def override_platform(**facts):
    return _Override(**facts)
'''

ENVIRON = '''
import os, warnings


class EnvField:
    def __init__(self, default):
        self.default = default

    def __set_name__(self, owner, name):
        self.name = name

    def get(self):
        return os.environ.get(self.name, self.default)


class EnvBoolWithAlias(EnvField):
    def __init__(self, default, deprecated_name):
        super().__init__(default)
        self.deprecated_name = deprecated_name


class Envs:
    SGLANG_KNOWN = EnvField("1")
    SGLANG_NEW_NAME = EnvBoolWithAlias("0", deprecated_name="SGLANG_ALIAS_NAME")


envs = Envs()


class _DeprecatedEnv:
    def __init__(self, replacement=None, note=None):
        self.replacement, self.note = replacement, note


_DEPRECATED_ENVS = {"SGLANG_OLD_TOGGLE": _DeprecatedEnv(note="Please use '--attention-backend' instead.")}
for key in [k for k in os.environ if k.startswith("SGL_")]:
    warnings.warn(f"Environment variable {key} is deprecated, please use {key.replace('SGL_', 'SGLANG_', 1)}")
'''


def stub(tmp_path: Path, name: str, version: str, files: dict[str, str]) -> Path:
    """A directory holding a dist-info for `name` `version` and the given package files (every
    folder on the way a package)."""
    site = tmp_path / "lib" / "python3.11" / "site-packages"     # where engine_file() knows an engine's files
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    for rel, text in files.items():
        path = site / rel
        for parent in [p for p in path.relative_to(site).parents if p != Path(".")]:
            (site / parent).mkdir(parents=True, exist_ok=True)
            (site / parent / "__init__.py").touch()
        path.write_text(textwrap.dedent(text))
    return site


def sglang(tmp_path: Path, version: str = "0.5.23", *, hook: bool = True, environ: bool = False) -> Path:
    files = {"sglang/srt/server_args.py": SERVER_ARGS}
    if hook:
        files["sglang/srt/runtime_context.py"] = RUNTIME_CONTEXT
    if environ:
        files["sglang/srt/environ.py"] = ENVIRON
    return stub(tmp_path, "sglang", version, files)


def probe(server: str, site: Path | None, args: list[str], facts: dict | None = None, mode: str = "ok",
          env: dict[str, str] | None = None, tmp_path: Path | None = None) -> tuple[list[str], dict]:
    """Run the probe as the host does (`python -I probe.py [--facts] [--path SITE] -- ARGS`)."""
    base = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "SGLANG_", "SGL_", "VLLM_", "HF_"))}
    base.update({"FAKE_MODE": mode, "VLLM_CACHE_ROOT": "/nonexistent-never-used", **(env or {})})
    script = (tmp_path or site.parents[2] if site else tmp_path) / f"{server}-probe.py"
    script.write_text(probe_text(server))
    opts = (["--facts", json.dumps(facts)] if facts is not None else []) + (["--path", str(site)] if site else [])
    res = subprocess.run([sys.executable, "-I", str(script), *opts, "--", *args], capture_output=True, text=True,
                         env=base, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("RECONCILER-ENGINE "), res.stdout
    return lines, json.loads(lines[-1].removeprefix("RECONCILER-ENGINE "))


def head(v: dict, *keys: str) -> dict:
    return {k: v[k] for k in keys}


def test_ok_prints_only_the_verdict_on_stdout_and_the_resolved_values(tmp_path):
    lines, v = probe("sglang", sglang(tmp_path), ["--tp-size", "4"])
    assert lines == [lines[-1]]          # the engine's chatter, even at exit, went to stderr or nowhere
    assert head(v, "engine", "version", "verdict", "stage", "error", "message", "where", "warnings", "notes",
                "facts") == {"engine": "sglang", "version": "0.5.23", "verdict": "ok", "stage": None, "error": None,
                             "message": None, "where": None, "warnings": [], "notes": [], "facts": None}
    assert v["resolved"] == {"attention_backend": "fa3", "tp_size": 4,
                             "mamba_radix_cache_strategy": ["auto", "extra_buffer"], "context_length": 1024}
    assert set(v["seconds"]) == {"import", "check"}


def test_a_positional_model_is_the_model_path_as_sglang_serve_takes_it(tmp_path):
    _, v = probe("sglang", sglang(tmp_path), ["/models/m", "--tp-size", "4"])
    assert v["verdict"] == "ok"
    _, v = probe("sglang", sglang(tmp_path / "2"), ["/models/m", "/x"])
    assert head(v, "verdict", "stage", "message") == {"verdict": "rejected", "stage": "parse",
                                                      "message": "unrecognized arguments: /x"}


def test_the_facts_go_through_the_override_point_the_release_declares_and_are_read_back(tmp_path):
    _, v = probe("sglang", sglang(tmp_path), ["--tp-size", "4"], facts=FACTS)
    assert v["verdict"] == "ok"
    # only the facts this release declares were given (is_sm100 and the rest would be refused)
    assert v["facts"] == {"hook": "sglang.srt.runtime_context.override_platform", "capability": [9, 0], "count": 4}
    _, v = probe("sglang", sglang(tmp_path / "b"), ["--tp-size", "4"], facts={**FACTS, "capability": [10, 0]})
    assert (v["facts"]["capability"], v["resolved"]["attention_backend"]) == ([10, 0], "trtllm_mha")


def test_facts_that_did_not_take_effect_are_inconclusive(tmp_path):
    _, v = probe("sglang", sglang(tmp_path), ["--tp-size", "4"], facts=FACTS, env={"FAKE_IGNORE_FACTS": "1"})
    assert head(v, "verdict", "stage", "error") == {"verdict": "inconclusive", "stage": "import",
                                                    "error": "Inconclusive"}
    assert v["message"] == ("sglang.srt.runtime_context.override_platform did not take effect: sglang reports "
                            "capability (0, 0), cuda False, not the host's (9, 0)")


def test_a_release_without_the_platform_hook_parses_first_then_is_inconclusive_naming_the_hook(tmp_path):
    site = sglang(tmp_path, "0.4.9", hook=False)
    _, v = probe("sglang", site, ["--tp-size", "4"], facts=FACTS)
    assert head(v, "version", "verdict", "stage", "error") == {"version": "0.4.9", "verdict": "inconclusive",
                                                                "stage": "facts", "error": "MissingHook"}
    assert v["message"] == ("sglang 0.4.9 has no platform hook: no sglang.srt.runtime_context.override_platform, "
                            "and none of the hardware probes sglang.srt.server_args imports (is_cuda, get_device_sm) "
                            "to answer; its own checks need the host's GPUs, which the probe hides")
    # the argument stage needs no facts: a bad choice on the same release is refused in its words
    _, v = probe("sglang", site, ["--attention-backend", "fa4"], facts=FACTS, tmp_path=tmp_path)
    assert head(v, "verdict", "stage", "error", "message") == {
        "verdict": "rejected", "stage": "parse", "error": "usage",
        "message": "argument --attention-backend: invalid choice: 'fa4' (choose from 'fa3', 'triton')"}


def test_a_release_with_only_the_hardware_probes_gets_them_answered(tmp_path):
    probes = SERVER_ARGS + "\nis_cuda = lambda: False\nget_device_sm = lambda: 0\nis_sm90_supported = lambda: False\n"
    site = stub(tmp_path, "sglang", "0.5.12", {"sglang/srt/server_args.py": probes})
    _, v = probe("sglang", site, ["--tp-size", "4"], facts=FACTS)
    assert v["verdict"] == "ok"
    assert v["facts"] == {"hook": "sglang.srt.server_args: is_cuda, is_sm90_supported, get_device_sm",
                          "capability": [9, 0], "count": 4}


@pytest.mark.parametrize(("mode", "args", "expected"), [
    ("ok", ["--tp-size", "4", "--bogus-flag", "1"],
     {"verdict": "rejected", "stage": "parse", "error": "usage", "message": "unrecognized arguments: --bogus-flag 1"}),
    ("ok", ["--tp-size", "four"],
     {"verdict": "rejected", "stage": "parse", "error": "usage",
      "message": "argument --tp-size: invalid int value: 'four'"}),
    ("value", [], {"verdict": "rejected", "stage": "resolve", "error": "ValueError",
                   "message": "tp_size 3 does not divide 32 heads"}),
    ("assert", [], {"verdict": "rejected", "stage": "resolve", "error": "AssertionError",
                    "message": "assert 1 + 1 == 3"}),
    ("repo", [], {"verdict": "rejected", "stage": "resolve", "error": "OSError",
                  "message": "model path not found: /models/nope (Repo id must be in the form 'repo_name' or "
                             "'namespace/repo_name': '/models/nope'. Use `repo_type` argument if needed.)"}),
    ("runtime", [], {"verdict": "inconclusive", "stage": "resolve", "error": "RuntimeError",
                     "message": "No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) is available."}),
])
def test_each_failure_gets_its_verdict(tmp_path, mode, args, expected):
    _, v = probe("sglang", sglang(tmp_path), args, mode=mode)
    assert head(v, *expected) == expected
    assert v["resolved"] == {}
    if expected["error"] in ("ValueError", "AssertionError"):
        line = next(i for i, ln in enumerate(SERVER_ARGS.splitlines(), 1)
                    if ("raise ValueError(\"tp_size" if mode == "value" else "assert 1 + 1") in ln)
        assert v["where"] == f"sglang/srt/server_args.py:{line} ServerArgs.resolve_once"


def test_trust_remote_code_is_left_out_and_a_refusal_for_it_is_inconclusive(tmp_path):
    _, v = probe("sglang", sglang(tmp_path), ["--tp-size", "4", "--trust-remote-code"])
    assert (v["verdict"], v["notes"]) == ("ok", ["--trust-remote-code left out: the model's own code never runs in "
                                                 "the engine check"])
    _, v = probe("sglang", sglang(tmp_path / "b"), ["--trust-remote-code"], mode="remote")
    assert head(v, "verdict", "stage", "error") == {"verdict": "inconclusive", "stage": "resolve",
                                                    "error": "ValueError"}
    assert v["message"].startswith("the model needs its own code (trust_remote_code), which never runs in the "
                                   "engine check: The repository /models/m contains custom code")


def test_a_long_message_is_kept_to_8_kib_not_cut_shorter(tmp_path):
    _, v = probe("sglang", sglang(tmp_path), [], mode="long")
    assert v["message"] == "x" * 8189 + "..."


def test_dead_variables_and_flags_are_named_from_the_engines_own_registry_tables_parser_and_warnings(tmp_path):
    site = sglang(tmp_path, environ=True)
    env = {"SGLANG_KNOWN": "1", "SGLANG_ALIAS_NAME": "1", "SGLANG_OLD_TOGGLE": "1", "SGLANG_READ_DIRECT": "1",
           "SGLANG_ENABLE_SPEC_V2": "1", "SGL_LEGACY": "1"}
    _, v = probe("sglang", site, ["--tp-size", "4", "--old-flag", "--quiet-flag"], env=env)
    assert v["verdict"] == "ok"
    assert v["warnings"] == [
        "Environment variable 'SGLANG_ALIAS_NAME' is deprecated; use 'SGLANG_NEW_NAME' instead. The alias will be "
        "removed in a future release.",
        "Environment variable SGLANG_OLD_TOGGLE is deprecated. Please use '--attention-backend' instead.",
        "SGLANG_ENABLE_SPEC_V2 is set, but sglang 0.5.23 does not know it (not in its environment registry, not "
        "named in its code): it has no effect there",
        "SGL_LEGACY is set, but sglang 0.5.23 does not know it (not in its environment registry, not named in its "
        "code): it has no effect there",
        "--old-flag: Deprecated. Use --attention-backend triton instead.",
        "Note: --quiet-flag is deprecated now.",
        "--old-flag has been removed from the kernels",
        "SGLANG_READ_DIRECT has been removed: use --tp-size",
        "Environment variable SGL_LEGACY is deprecated, please use SGLANG_LEGACY",
    ]


def test_a_refused_command_line_still_names_the_dead_variables(tmp_path):
    _, v = probe("sglang", sglang(tmp_path, environ=True), ["--bogus"], env={"SGLANG_GONE": "1"})
    assert (v["verdict"], v["message"]) == ("rejected", "unrecognized arguments: --bogus")
    assert v["warnings"] == ["SGLANG_GONE is set, but sglang 0.5.23 does not know it (not in its environment "
                             "registry, not named in its code): it has no effect there"]


VLLM_FILES = {
    "vllm/platforms/__init__.py": "current_platform = None\n",
    "vllm/platforms/interface.py": '''
        import os


        class DeviceCapability(tuple):
            def __new__(cls, major, minor):
                return super().__new__(cls, (major, minor))


        class Platform:
            @classmethod
            def validate_environ(cls, hard_fail):
                if os.environ.get("VLLM_USE_V2_MODEL_RUNNER", "1") != "1":
                    raise ValueError("VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been "
                                     "removed. Unset this variable.")
        ''',
    "vllm/platforms/cuda.py": '''
        from .interface import Platform


        class CudaPlatform(Platform):
            pass
        ''',
    "vllm/envs.py": '''
        environment_variables = {"VLLM_CACHE_ROOT": None, "VLLM_KNOWN": None}
        removed_environment_variables = {"VLLM_MARLIN_INPUT_DTYPE": "Use --quantization humming."}
        ''',
    "vllm/utils/argparse_utils.py": '''
        import argparse


        class FlexibleArgumentParser(argparse.ArgumentParser):
            pass
        ''',
    "vllm/entrypoints/common/cli_args.py": '''
        def make_arg_parser(parser):
            parser.add_argument("model_tag", nargs="?")
            parser.add_argument("--tensor-parallel-size", "-tp", type=int, default=1)
            parser.add_argument("--mamba-cache-mode", choices=["none", "align"],
                                help="--mamba-cache-mode is deprecated and will be removed in v0.34.0. It has no "
                                     "effect: Mamba prefix caching follows --enable-prefix-caching.")
            return parser


        def validate_parsed_serve_args(args):
            from vllm.platforms import current_platform
            if args.tensor_parallel_size > current_platform.device_count():
                raise ValueError(f"tensor parallel size {args.tensor_parallel_size} is more than the "
                                 f"{current_platform.device_count()} GPUs")
        ''',
    "vllm/__init__.py": '''
        class AsyncEngineArgs:
            @classmethod
            def from_cli_args(cls, args):
                return cls()

            def create_engine_config(self, usage_context=None):
                import types
                return types.SimpleNamespace(
                    speculative_config=None, model_config=types.SimpleNamespace(max_model_len=4096, architecture="X"),
                    parallel_config=types.SimpleNamespace(tensor_parallel_size=4),
                    cache_config=types.SimpleNamespace(mamba_cache_mode="none"))
        ''',
    "vllm/usage/usage_lib.py": "class UsageContext:\n    OPENAI_API_SERVER = 'api'\n",
}


def test_vllm_takes_the_facts_through_its_current_platform_and_checks_the_gpu_count(tmp_path):
    site = stub(tmp_path, "vllm", "0.35.0", VLLM_FILES)
    _, v = probe("vllm", site, ["/models/m", "-tp", "4"], facts=FACTS)
    assert (v["version"], v["verdict"], v["facts"]) == ("0.35.0", "ok", {"hook": "vllm.platforms.current_platform",
                                                                         "capability": [9, 0], "count": 4})
    _, v = probe("vllm", site, ["/models/m", "-tp", "8"], facts=FACTS, tmp_path=tmp_path)
    assert head(v, "verdict", "stage", "message") == {"verdict": "rejected", "stage": "parse",
                                                      "message": "tensor parallel size 8 is more than the 4 GPUs"}


def test_vllm_refuses_to_start_on_a_removed_variable_in_its_own_words_and_names_it_when_the_flags_fail(tmp_path):
    site = stub(tmp_path, "vllm", "0.34.0", VLLM_FILES)
    env = {"VLLM_USE_V2_MODEL_RUNNER": "0", "VLLM_MARLIN_INPUT_DTYPE": "int8", "VLLM_KNOWN": "1", "VLLM_TYPO": "1"}
    _, v = probe("vllm", site, ["/models/m", "--mamba-cache-mode", "align"], facts=FACTS, env=env)
    assert head(v, "verdict", "stage", "error", "message", "where") == {
        "verdict": "rejected", "stage": "environ", "error": "ValueError",
        "message": "VLLM_USE_V2_MODEL_RUNNER=0 is no longer supported: Model Runner V1 has been removed. Unset this "
                   "variable.", "where": "vllm/platforms/interface.py:14 Platform.validate_environ"}
    assert v["warnings"] == [
        "VLLM_MARLIN_INPUT_DTYPE has been removed. Use --quantization humming.",
        "VLLM_TYPO is set, but vllm 0.34.0 does not know it (not in its environment registry, not named in its "
        "code): it has no effect there",
        "--mamba-cache-mode is deprecated and will be removed in v0.34.0. It has no effect: Mamba prefix caching "
        "follows --enable-prefix-caching."]
    _, v = probe("vllm", site, ["/models/m", "--bogus"], facts=FACTS, env=env, tmp_path=tmp_path)
    assert head(v, "verdict", "stage", "message") == {"verdict": "rejected", "stage": "parse",
                                                      "message": "unrecognized arguments: --bogus"}
    assert v["warnings"][-1] == ("vllm refuses to start with this environment: VLLM_USE_V2_MODEL_RUNNER=0 is no "
                                 "longer supported: Model Runner V1 has been removed. Unset this variable.")


def test_a_vllm_without_its_platform_hook_is_inconclusive_naming_it(tmp_path):
    files = {k: v for k, v in VLLM_FILES.items() if k != "vllm/platforms/cuda.py"}
    _, v = probe("vllm", stub(tmp_path, "vllm", "0.9.0", files), ["/models/m"], facts=FACTS)
    assert head(v, "verdict", "stage", "error") == {"verdict": "inconclusive", "stage": "facts",
                                                    "error": "MissingHook"}
    assert v["message"] == ("vllm 0.9.0 has no platform hook: No module named 'vllm.platforms.cuda' (the probe "
                            "needs vllm.platforms.current_platform, vllm.platforms.cuda.CudaPlatform, "
                            "vllm.platforms.interface.DeviceCapability)")


@pytest.mark.parametrize(("server", "module"), [("sglang", "sglang"), ("vllm", "vllm")])
def test_no_engine_installed_is_inconclusive_with_the_import_error(tmp_path, server, module):
    _, v = probe(server, None, ["m"], facts=FACTS, tmp_path=tmp_path)
    assert head(v, "version", "verdict", "stage", "error") == {"version": None, "verdict": "inconclusive",
                                                                "stage": "import", "error": "ModuleNotFoundError"}
    assert v["message"] == f"No module named '{module}'"


def test_the_verdict_carries_the_engines_warnings_and_the_probes_notes_to_the_dry_run():
    line = "RECONCILER-ENGINE " + json.dumps({
        "engine": "sglang", "version": "0.5.23", "verdict": "ok", "resolved": {"tp_size": 4}, "seconds": {},
        "warnings": ["SGLANG_ENABLE_SPEC_V2 is set, but sglang 0.5.23 does not know it", 7],
        "notes": ["--trust-remote-code left out"]})
    v = parse_verdict("llm", "sglang", line)
    assert (v.warnings, v.notes) == (("SGLANG_ENABLE_SPEC_V2 is set, but sglang 0.5.23 does not know it",),
                                     ("--trust-remote-code left out",))
    assert v.note() == ("llm: sglang 0.5.23 accepts the command line: tp 4; sglang 0.5.23 warns: "
                        "SGLANG_ENABLE_SPEC_V2 is set, but sglang 0.5.23 does not know it (--trust-remote-code left "
                        "out)")
    refused = parse_verdict("llm", "vllm", "RECONCILER-ENGINE " + json.dumps(
        {"engine": "vllm", "version": "0.34.0", "verdict": "rejected", "error": "usage", "message": "bad",
         "warnings": ["VLLM_X has been removed."]}))
    assert refused.block().endswith("the unit was written for; vllm 0.34.0 warns: VLLM_X has been removed.")


def test_path_options_go_ahead_of_the_site_directories_behind_the_standard_library(monkeypatch):
    """A unit's PYTHONPATH comes before its site-packages: the probe, isolated (-I), puts its
    --path directories there itself, so it asks the engine the unit would import."""
    from reconciler.engines import probe as program
    monkeypatch.setattr(sys, "path", ["/usr/lib/python311.zip", "/usr/lib/python3.11",
                                      "/usr/lib/python3.11/lib-dynload", "/v/lib/python3.11/site-packages"])
    program.add_paths(["/a", "/b", "/usr/lib/python3.11"])
    assert sys.path == ["/usr/lib/python311.zip", "/usr/lib/python3.11", "/usr/lib/python3.11/lib-dynload",
                        "/a", "/b", "/v/lib/python3.11/site-packages"]


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("short", 10, "short"),
    ("a bbbb cccc", 8, "cccc"),            # "bbb cccc" would keep a piece of a word
    ("a bbbb cccc", 9, "bbbb cccc"),       # the cut falls after a space: every word whole
    ("a bbbb cccc", 10, "bbbb cccc"),      # the cut falls on a space
    ("xxxxxxxxxxxxxxxxxxxx", 5, ""),       # one word, longer than the limit: nothing of it
])
def test_a_usage_text_cut_from_the_front_keeps_whole_words(text, limit, expected):
    from reconciler.engines import probe as program
    assert program.tail(text, limit) == expected
