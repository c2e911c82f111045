"""The server command line of a rendered unit: Command and parse_command (pure).

The last ExecStart= of the unit's [Service] section, after systemd's prefixes, line
continuations and ${VAR}/$VAR expansion (_unitfile.py), split into flags (canonical names: every alias of a
flag reads as one name) and env, with the server kind (sglang or vllm) detected from the entry
point. Also which GPUs a server claims (`gpu_claim`).
"""

from __future__ import annotations

import functools
import re
import shlex
from collections.abc import Mapping
from typing import Literal

import msgspec

from ..desired.spec import ServiceSpec
from ._unitfile import ENV_ASSIGNMENT, SYSTEMD_EXEC_PREFIX, environment_lines, expand, unit_entries

Server = Literal["sglang", "vllm"]

DEFAULT_PORT: dict[str, int] = {"sglang": 30000, "vllm": 8000}
# vLLM binds every interface when --host is not given; SGLang binds 127.0.0.1.
DEFAULT_HOST: dict[str, str] = {"sglang": "127.0.0.1", "vllm": "0.0.0.0"}
WILDCARD_HOSTS = frozenset({"0.0.0.0", "::", "[::]", "", "*"})

# Alternative spellings, mapped to one canonical name per server so that rules can name either.
# SGLang: python/sglang/srt/server_args.py (aliases=[...]); vLLM: vllm/engine/arg_utils.py.
_ALIASES: dict[str, dict[str, tuple[str, ...]]] = {
    "sglang": {
        "--model-path": ("--model",),
        "--tp-size": ("--tp", "--tensor-parallel-size"),
        "--dp-size": ("--dp", "--data-parallel-size"),
        "--pp-size": ("--pipeline-parallel-size",),
        "--ep-size": ("--ep", "--expert-parallel-size"),
        "--speculative-algorithm": ("--speculative-algo",),
    },
    "vllm": {
        "--model": (),
        "--tensor-parallel-size": ("-tp",),
        "--pipeline-parallel-size": ("-pp",),
        "--data-parallel-size": ("-dp",),
        "--quantization": ("-q",),
    },
}
_CANONICAL: dict[str, dict[str, str]] = {
    server: {alias: name for name, aliases in table.items() for alias in (name, *aliases)}
    for server, table in _ALIASES.items()
}
# Flags that take no value: without this list `--trust-remote-code MODEL` would read MODEL as
# the flag's value. Any other flag followed by a non-flag token takes that token.
_BOOLEAN_FLAGS: dict[str, frozenset[str]] = {
    "sglang": frozenset({
        "--trust-remote-code", "--enable-dp-attention", "--enable-dp-lm-head",
        "--disable-radix-cache", "--disable-cuda-graph", "--disable-overlap-schedule",
        "--enable-torch-compile", "--enable-metrics", "--enable-mixed-chunk", "--enable-p2p-check",
        "--disable-custom-all-reduce", "--skip-server-warmup", "--enable-multimodal",
        "--enable-cache-report", "--skip-tokenizer-init", "--enable-ep-moe",
    }),
    "vllm": frozenset({
        "--trust-remote-code", "--enforce-eager", "--enable-prefix-caching",
        "--no-enable-prefix-caching", "--enable-chunked-prefill", "--no-enable-chunked-prefill",
        "--enable-expert-parallel", "--enable-auto-tool-choice", "--disable-log-requests",
        "--disable-log-stats", "--disable-custom-all-reduce", "--headless",
    }),
}
PARALLEL_FLAGS: dict[str, tuple[str, str, str]] = {
    # (tensor, pipeline, data) flag names after canonicalisation
    "sglang": ("--tp-size", "--pp-size", "--dp-size"),
    "vllm": ("--tensor-parallel-size", "--pipeline-parallel-size", "--data-parallel-size"),
}
_PYTHON = re.compile(r"^python[0-9.]*\Z")
_SHELLS = frozenset({"sh", "bash", "dash", "zsh"})


class Command(msgspec.Struct, frozen=True):
    """A model server's command line as systemd will run it.

    flags maps canonical flag names to their value (None: a flag given without a value; a flag
    given several times keeps the last value; a flag with several values keeps them joined by
    spaces). env is what the process gets: the unit's Environment= lines, then the service's env
    (the reconciler's drop-in, read after the unit), then `env VAR=...` on the command line.
    """

    server: Server | None
    argv: tuple[str, ...] = ()
    server_args: tuple[str, ...] = ()    # the words the server's own argument parser gets
    flags: Mapping[str, str | None] = msgspec.field(default_factory=dict)
    positionals: tuple[str, ...] = ()
    env: Mapping[str, str] = msgspec.field(default_factory=dict)
    error: str | None = None          # why the command line could not be read, if it could not

    def canonical(self, flag: str) -> str:
        """The canonical spelling of a flag for this server (`--tp` -> `--tp-size`)."""
        flag = _normalise_flag(flag)
        return _CANONICAL.get(self.server or "", {}).get(flag, flag)

    def has(self, flag: str) -> bool:
        """Whether the flag (or one of its aliases) is given."""
        return self.canonical(flag) in self.flags

    def value(self, flag: str) -> str | None:
        """The flag's value; None when it is absent or given without a value."""
        return self.flags.get(self.canonical(flag))

    def int_value(self, flag: str, default: int) -> int | None:
        """The flag as an integer: default when absent, None when it is not an integer."""
        if not self.has(flag):
            return default
        raw = self.value(flag)
        try:
            return int(raw) if raw is not None else None
        except ValueError:
            return None

    @property
    def model(self) -> str | None:
        """The model path or id the server loads."""
        if self.server == "vllm":
            return self.positionals[0] if self.positionals else self.value("--model")
        if self.server == "sglang":
            return self.value("--model-path")
        return None

    @property
    def port(self) -> int | None:
        """The HTTP port: --port, else the server's default; None when unknown."""
        if self.server is None:
            return None
        return self.int_value("--port", DEFAULT_PORT[self.server])

    @property
    def host(self) -> str:
        """The address the HTTP server binds: --host, else the server's default."""
        value = self.value("--host") if self.server else None
        return value if value is not None else DEFAULT_HOST.get(self.server or "", "")

    @property
    def visible_devices(self) -> list[str] | None:
        """CUDA_VISIBLE_DEVICES as a list of device ids; None when unset (all GPUs).

        CUDA stops at the first invalid id (e.g. -1), so the list does too.
        """
        raw = self.env.get("CUDA_VISIBLE_DEVICES")
        if raw is None:
            return None
        ids: list[str] = []
        for part in raw.split(","):
            part = part.strip()
            if not part or part.startswith("-"):
                break
            ids.append(part)
        return ids

    def world_size(self) -> int | None:
        """How many GPUs the server process group uses, or None when a size is not a number.

        SGLang: tp x pp x dp, except that with --enable-dp-attention the dp groups live inside
        the tp ranks (tp GPUs in all). vLLM: tp x pp x dp (`world_size_across_dp`).
        """
        if self.server is None:
            return None
        tp_flag, pp_flag, dp_flag = PARALLEL_FLAGS[self.server]
        tp, pp, dp = (self.int_value(tp_flag, 1), self.int_value(pp_flag, 1),
                      self.int_value(dp_flag, 1))
        if tp is None or pp is None or dp is None:
            return None
        if self.server == "sglang" and self.has("--enable-dp-attention"):
            dp = 1
        return tp * pp * dp


def _normalise_flag(flag: str) -> str:
    # vLLM accepts --tensor_parallel_size for --tensor-parallel-size; treat both alike.
    if flag.startswith("--"):
        return "--" + flag[2:].replace("_", "-")
    return flag


def _is_flag(token: str) -> bool:
    return len(token) > 1 and token.startswith("-") and not re.match(r"^-\d", token)


def _locate_server(tokens: list[str], env: dict[str, str]) -> tuple[Server | None, list[str]]:
    """Find the server entry point; return its kind and the tokens after it.

    Understands `env VAR=x ...`, `sh -c "exec ..."`, `python3 [-u ...] -m module`,
    `sglang serve` and `vllm serve`. Adds env assignments it meets to env.
    """
    i = 0
    while i < len(tokens):
        tok = tokens[i]
        base = tok.rsplit("/", 1)[-1]
        m = ENV_ASSIGNMENT.match(tok)
        if m:
            # Before the server's entry point, VAR=value is an assignment (`env A=1 python ...`,
            # `sh -c "A=1 exec python ..."`); the server process sees it.
            env[m.group(1)] = m.group(2)
            i += 1
            continue
        if base in ("env", "exec", "nohup", "numactl", "taskset"):
            i += 1
            continue
        if base in _SHELLS:
            # sh -c "script" (or -lc, -ec): the script, usually `exec python -m ...`, is the
            # command.
            c = next((j for j in range(i + 1, len(tokens))
                      if re.match(r"^-[a-z]*c[a-z]*$", tokens[j])), None)
            if c is not None and c + 1 < len(tokens):
                try:
                    inner = shlex.split(tokens[c + 1])
                except ValueError:
                    return None, []
                return _locate_server(inner, env)
            return None, []
        if _PYTHON.match(base):
            return _python_entry(tokens[i + 1:])
        if base == "sglang" and tokens[i + 1:i + 2] == ["serve"]:
            return "sglang", tokens[i + 2:]
        if base == "vllm" and tokens[i + 1:i + 2] == ["serve"]:
            return "vllm", tokens[i + 2:]
        if base in ("sglang", "vllm"):
            return None, []
        i += 1          # a wrapper (numactl, taskset, ...) or one of its options
    return None, []


def _python_entry(args: list[str]) -> tuple[Server | None, list[str]]:
    """`python3 [options] -m module ...` or `python3 [options] path/to/sglang/launch_server.py`."""
    j = 0
    while j < len(args):
        tok = args[j]
        if tok == "-m":
            module, rest = (args[j + 1] if j + 1 < len(args) else ""), args[j + 2:]
            if module == "sglang.launch_server":
                return "sglang", rest
            if module == "vllm.entrypoints.openai.api_server":
                return "vllm", rest
            if module == "sglang" and rest[:1] == ["serve"]:
                return "sglang", rest[1:]
            if module in ("vllm", "vllm.entrypoints.cli.main") and rest[:1] == ["serve"]:
                return "vllm", rest[1:]
            return None, []
        if tok in ("-X", "-W"):
            j += 2                   # options of python itself that take a value
        elif tok.startswith("-"):
            j += 1
        else:                        # a script: python stops reading its own options here
            if tok.endswith("sglang/launch_server.py"):
                return "sglang", args[j + 1:]
            if tok.endswith("vllm/entrypoints/openai/api_server.py"):
                return "vllm", args[j + 1:]
            return None, []
    return None, []


def _parse_flags(server: Server, args: list[str]) -> tuple[dict[str, str | None], list[str]]:
    canonical = _CANONICAL[server]
    booleans = _BOOLEAN_FLAGS[server]
    flags: dict[str, str | None] = {}
    positionals: list[str] = []
    last: str | None = None          # the flag whose value the previous token was
    i = 0
    while i < len(args):
        tok = args[i]
        if tok == "--":
            positionals.extend(args[i + 1:])
            break
        if _is_flag(tok):
            name, eq, val = tok.partition("=")
            name = canonical.get(_normalise_flag(name), _normalise_flag(name))
            last = None
            if eq:
                flags[name] = val
            elif name in booleans or i + 1 >= len(args) or _is_flag(args[i + 1]):
                flags[name] = None
            else:
                flags[name] = args[i + 1]
                last = name
                i += 1
        elif last is not None and server == "sglang":
            # SGLang has no positionals: extra words belong to a multi-value flag
            # (--cuda-graph-bs 1 2 4).
            flags[last] = f"{flags[last]} {tok}"
        else:
            positionals.append(tok)
            last = None
        i += 1
    return flags, positionals


def parse_command(svc: ServiceSpec) -> Command:
    """The model server command of a service: the last ExecStart= of its unit, parsed (pure).

    systemd prefixes (-, @, +, !, :) are dropped (with @ the next word is argv[0] and is
    skipped), continuation lines are joined, ${VAR}/$VAR are expanded from the unit's
    Environment= lines and the service's env. A unit without a recognised server gives a
    Command whose server is None (no server rules apply to it).

    Parsed once per unit text and env (PARSED): a start's pre-flight reads its command four
    times (the rules, the engine check, the version read, the readiness probes), at about
    0.2 ms a parse. A Command is frozen, and nothing changes its mappings.
    """
    return _parse(svc.unit_text, tuple(svc.env.items()))


PARSED = 1024      # the commands kept: a unit text and env each (a daemon's fleet of hosts, each its own)


@functools.lru_cache(maxsize=PARSED)
def _parse(unit_text: str, service_env: tuple[tuple[str, str], ...]) -> Command:
    entries = unit_entries(unit_text)
    env = environment_lines(entries)
    env.update(service_env)          # the reconciler's env file: EnvironmentFile= wins over Environment=
    exec_start: str | None = None
    for key, value in entries:
        if key == "ExecStart":
            exec_start = value or None   # an empty ExecStart= resets the list
    if exec_start is None:
        return Command(server=None, env=env, error="no ExecStart= in [Service]")
    m = SYSTEMD_EXEC_PREFIX.match(exec_start)
    prefix = m.group(0) if m else ""
    try:
        tokens = shlex.split(exec_start[len(prefix):])
    except ValueError as e:
        return Command(server=None, env=env, error=f"ExecStart= cannot be split: {e}")
    if "@" in prefix and len(tokens) > 1:
        tokens = [tokens[0], *tokens[2:]]
    tokens = expand(tokens, env)
    server, args = _locate_server(tokens, env)
    if server is None:
        return Command(server=None, argv=tuple(tokens), env=env)
    flags, positionals = _parse_flags(server, args)
    return Command(server=server, argv=tuple(tokens), server_args=tuple(args), flags=flags,
                   positionals=tuple(positionals), env=env)


def gpu_positions(cmd: Command, world: int) -> list[int] | None:
    """The device positions SGLang uses when placed with --base-gpu-id/--gpu-id-step; else None."""
    if cmd.server != "sglang" or not (cmd.has("--base-gpu-id") or cmd.has("--gpu-id-step")):
        return None
    base = cmd.int_value("--base-gpu-id", 0)
    step = cmd.int_value("--gpu-id-step", 1)
    if base is None or step is None or base < 0 or step < 1:
        return None
    return [base + i * step for i in range(world)]


def gpu_claim(cmd: Command) -> frozenset[str] | None:
    """The GPUs a server claims: device ids, or None for every GPU of the host.

    CUDA_VISIBLE_DEVICES when set; unset means all GPUs, except for SGLang placed explicitly
    with --base-gpu-id/--gpu-id-step (its documented way to run several servers on one host),
    which claims exactly the positions it will use.
    """
    world = cmd.world_size() or 1
    visible = cmd.visible_devices
    positions = gpu_positions(cmd, world)
    if positions is not None:
        if visible is None:
            return frozenset(str(p) for p in positions)
        return frozenset(visible[p] for p in positions if p < len(visible))
    if visible is None:
        return None                  # every GPU of the host
    return frozenset(visible)
