"""The engine probes' own logic (reconciler/engines/), against a small fake engine package: the
verdict line is the last stdout line whatever the engine prints, and each kind of failure gets
the verdict of review 2026-12-02 §7.5. The real engines are run in tests/e2e/test_e2e_engine.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

PROBES = Path(__file__).resolve().parent.parent / "reconciler" / "engines"
FACTS = {"count": 4, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}

FAKE_SERVER_ARGS = '''
import argparse, atexit, os, sys
print("engine chatter on stdout")
print("engine chatter on stderr", file=sys.stderr)
atexit.register(lambda: print("engine chatter at exit"))


class ServerArgs:
    mamba_radix_cache_strategy = "auto"     # as parsed: resolution turns it into extra_buffer

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
            raise ValueError("The repository /models/custom contains custom code which must be executed to "
                             "correctly load the model. Please pass the argument `trust_remote_code=True`.")
        if mode == "args":
            raise ValueError("argv: " + " ".join(sys.argv[1:]) + " path: " + " ".join(sys.path))

    def check_server_args(self):
        print("more chatter")

    def resolved_dict(self):
        return {"attention_backend": "fa3", "tp_size": 4, "mamba_radix_cache_strategy": "extra_buffer",
                "context_length": 1024, "unrelated": 1}


def prepare_server_args(argv):
    parser = argparse.ArgumentParser(prog="sglang serve")
    parser.add_argument("--tp-size", type=int)
    parser.add_argument("--model-path")
    args = parser.parse_args(argv)
    print("parsed", vars(args), file=sys.stderr)
    return ServerArgs()
'''


def line_of(text: str) -> int:
    """The line number of `text` in the fake server_args.py."""
    return next(i for i, line in enumerate(FAKE_SERVER_ARGS.splitlines(), 1) if text in line)


def fake_engine(tmp_path: Path, name: str, version: str) -> Path:
    """A site-packages dir with a dist-info for `name` `version` (and, for sglang, a fake
    sglang.srt.server_args with the launcher's calls)."""
    site = tmp_path / "lib" / "python3.11" / "site-packages"
    info = site / f"{name}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n")
    if name == "sglang":
        (site / "sglang" / "srt").mkdir(parents=True)
        (site / "sglang" / "__init__.py").write_text("")
        (site / "sglang" / "srt" / "__init__.py").write_text("")
        (site / "sglang" / "srt" / "server_args.py").write_text(FAKE_SERVER_ARGS)
    return site


def probe(script: str, site: Path | None, args: list[str], facts: dict | None = None,
          mode: str = "ok") -> tuple[list[str], dict]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "HF_HUB_OFFLINE")}
    env.update({"FAKE_MODE": mode, "VLLM_CACHE_ROOT": "/nonexistent-never-used"})
    opts = ["--facts", json.dumps(facts)] if facts is not None else []
    if site is not None:
        opts += ["--path", str(site)]      # isolated, as the host program runs it: the probe adds the path
    res = subprocess.run([sys.executable, "-I", str(PROBES / script), *opts, "--", *args], capture_output=True,
                         text=True, env=env, timeout=60)
    assert res.returncode == 0, res.stderr
    lines = res.stdout.splitlines()
    assert lines[-1].startswith("RECONCILER-ENGINE "), res.stdout
    return lines, json.loads(lines[-1].removeprefix("RECONCILER-ENGINE "))


def test_ok_prints_only_the_verdict_on_stdout_and_the_resolved_values(tmp_path):
    lines, v = probe("sglang_probe.py", fake_engine(tmp_path, "sglang", "0.5.23"), ["--tp-size", "4"])
    assert lines == [lines[-1]]          # the engine's chatter, even at exit, went to stderr or nowhere
    assert {k: v[k] for k in ("engine", "version", "verdict", "stage", "error", "message", "where")} == \
        {"engine": "sglang", "version": "0.5.23", "verdict": "ok", "stage": None, "error": None, "message": None,
         "where": None}
    assert v["resolved"] == {"attention_backend": "fa3", "tp_size": 4,
                             "mamba_radix_cache_strategy": ["auto", "extra_buffer"], "context_length": 1024}
    assert set(v["seconds"]) == {"import", "check"}


def test_a_positional_model_is_the_model_path_as_sglang_serve_takes_it(tmp_path):
    _, v = probe("sglang_probe.py", fake_engine(tmp_path, "sglang", "0.5.23"), ["/models/m", "--tp-size", "4"])
    assert v["verdict"] == "ok"
    _, v = probe("sglang_probe.py", fake_engine(tmp_path / "2", "sglang", "0.5.23"), ["/models/m", "/x"])
    assert (v["verdict"], v["message"]) == ("rejected", "unrecognized arguments: /x")


@pytest.mark.parametrize(("mode", "args", "expected"), [
    ("ok", ["--tp-size", "4", "--bogus-flag", "1"],
     {"verdict": "rejected", "stage": "parse", "error": "usage", "message": "unrecognized arguments: --bogus-flag 1"}),
    ("ok", ["--tp-size", "four"],
     {"verdict": "rejected", "stage": "parse", "error": "usage",
      "message": "argument --tp-size: invalid int value: 'four'"}),
    ("value", [], {"verdict": "rejected", "stage": "resolve", "error": "ValueError",
                   "message": "tp_size 3 does not divide 32 heads",
                   "where": f"sglang/srt/server_args.py:{line_of('raise ValueError')} ServerArgs.resolve_once"}),
    ("assert", [], {"verdict": "rejected", "stage": "resolve", "error": "AssertionError",
                    "message": "assert 1 + 1 == 3",
                    "where": f"sglang/srt/server_args.py:{line_of('assert 1 + 1')} ServerArgs.resolve_once"}),
    ("repo", [], {"verdict": "rejected", "stage": "resolve", "error": "OSError",
                  "message": "model path not found: /models/nope (Repo id must be in the form 'repo_name' or "
                             "'namespace/repo_name': '/models/nope'. Use `repo_type` argument if needed.)"}),
    ("runtime", [], {"verdict": "inconclusive", "stage": "resolve", "error": "RuntimeError",
                     "message": "No accelerator (CUDA, XPU, HPU, NPU, MUSA, MPS) is available."}),
])
def test_each_failure_gets_its_verdict(tmp_path, mode, args, expected):
    _, v = probe("sglang_probe.py", fake_engine(tmp_path, "sglang", "0.5.23"), args, mode=mode)
    assert {k: v[k] for k in expected} == expected
    assert v["resolved"] == {}


@pytest.mark.parametrize(("script", "name", "version"), [("sglang_probe.py", "sglang", "0.5.99"),
                                                         ("vllm_probe.py", "vllm", "0.34.0")])
def test_facts_for_a_version_the_shim_was_not_tested_on_are_inconclusive(tmp_path, script, name, version):
    _, v = probe(script, fake_engine(tmp_path, name, version), ["--tp-size", "4"], facts=FACTS)
    assert (v["engine"], v["version"], v["verdict"], v["stage"], v["error"], v["message"]) == \
        (name, version, "inconclusive", "import", "Inconclusive", f"no facts shim for {name} {version}")


@pytest.mark.parametrize(("script", "module"), [("sglang_probe.py", "sglang"), ("vllm_probe.py", "vllm")])
def test_no_engine_installed_is_inconclusive_with_the_import_error(script, module):
    _, v = probe(script, None, ["m"], facts=FACTS)
    assert (v["version"], v["verdict"], v["stage"], v["error"]) == (None, "inconclusive", "import",
                                                                    "ModuleNotFoundError")
    assert v["message"] == f"No module named '{module}'"


def test_the_probe_takes_trust_remote_code_out_and_says_so(tmp_path):
    """No model code runs in the probe: --trust-remote-code never reaches the engine, and the
    verdict's note says it was left out."""
    site = fake_engine(tmp_path, "sglang", "0.5.23")
    _, v = probe("sglang_probe.py", site, ["--tp-size", "4", "--trust-remote-code"])
    assert v["verdict"] == "ok"
    assert v["note"] == "--trust-remote-code left out: the model's own code never runs in the check"
    _, v = probe("sglang_probe.py", site, ["--tp-size", "4"])
    assert "note" not in v
    # the fake engine's argparse knows no --trust-remote-code: had it been passed, a usage error
    _, v = probe("sglang_probe.py", site, ["--tp-size", "4", "--trust-remote-code=true"])
    assert (v["verdict"], v["note"]) == ("ok", "--trust-remote-code left out: the model's own code never runs in "
                                               "the check")


@pytest.mark.parametrize("script", ["sglang_probe.py", "vllm_probe.py"])
def test_a_refusal_that_only_asks_for_remote_code_is_inconclusive(tmp_path, script):
    probe_mod = load(script)
    err = ValueError("The repository /models/custom contains custom code which must be executed to correctly load "
                     "the model. Please pass the argument `trust_remote_code=True`.")
    v = probe_mod.judge(err, "config")
    assert (v["verdict"], v["error"]) == ("inconclusive", "ValueError")
    assert v["message"].endswith("(the check runs no model code)")
    _, v = probe("sglang_probe.py", fake_engine(tmp_path, "sglang", "0.5.23"), [], mode="remote")
    assert (v["verdict"], v["stage"]) == ("inconclusive", "resolve")


def test_path_options_go_ahead_of_the_site_directories_behind_the_standard_library(tmp_path):
    """A unit's PYTHONPATH comes before its site-packages: the probe, isolated (-I), puts its
    --path directories there itself, so it asks the engine the unit would import."""
    site = fake_engine(tmp_path, "sglang", "0.5.23")
    extra = tmp_path / "extra"
    extra.mkdir()
    _, v = probe("sglang_probe.py", site, ["--tp-size", "4"], mode="args")
    path = v["message"].split(" path: ")[1].split()
    assert path.index(str(site)) < next(i for i, p in enumerate(path) if p.endswith(("site-packages", "dist-packages"))
                                        and p != str(site))
    assert path.index(str(site)) > next(i for i, p in enumerate(path) if p.endswith("lib-dynload"))


@pytest.mark.parametrize("script", ["sglang_probe.py", "vllm_probe.py"])
def test_the_options_of_the_probe_in_any_order(script):
    probe_mod = load(script)
    facts, paths, args = probe_mod.split_argv(["--path", "/a", "--facts", "{}", "--path", "/b", "--", "--tp", "1"])
    assert (facts, paths, args) == ({}, ["/a", "/b"], ["--tp", "1"])
    assert probe_mod.split_argv(["--", "--path", "/a"])[1:] == ([], ["--path", "/a"])


@pytest.mark.parametrize(("text", "limit", "expected"), [
    ("short", 10, "short"),
    ("a bbbb cccc", 8, "cccc"),            # "bbb cccc" would keep a piece of a word
    ("a bbbb cccc", 9, "bbbb cccc"),       # the cut falls after a space: every word whole
    ("a bbbb cccc", 10, "bbbb cccc"),      # the cut falls on a space
    ("xxxxxxxxxxxxxxxxxxxx", 5, ""),       # one word, longer than the limit: nothing of it
])
def test_a_usage_text_cut_from_the_front_keeps_whole_words(text, limit, expected):
    assert load("sglang_probe.py").tail(text, limit) == expected
    assert load("vllm_probe.py").tail(text, limit) == expected


def load(script: str):
    """A probe as a module (it is a host program, not a package module)."""
    import importlib.util
    spec = importlib.util.spec_from_file_location(script.removesuffix(".py"), PROBES / script)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module
