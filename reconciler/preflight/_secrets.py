"""Secrets in the desired state, judged without a host (pure, given a way to read repo files).

* `env_secret_warnings`: a literal in `env` that looks like a secret (any format the redactor
  masks: a Hugging Face, OpenAI, GitHub, GitLab or Slack token, an AWS key, a JWT, a URL with a
  password, a password= setting: `redact.looks_secret`) is a warning that
  names the file and key where it is set and points to the service's `secrets` table. Env is
  written as `Environment=` lines, which every local user on the host can read (`systemctl
  show`). The warning never holds the value.
* `argv_secret_warnings`: a secret the unit puts on the server's command line (`$NAME` or
  `${NAME}` in an Exec line, or `$(cat ...NAME)`), where every local user reads it with `ps`.
* `secret_problems`: the age secrets of an already decrypted state (secrets.Decryptor) that the
  controller could not decrypt, as Problems naming file and key (`reconcile validate
  --age-identity`).
* `secret_file`: where `reconcile secrets encrypt NAME` puts a secret by default.

Which file a key comes from: a service's env and secrets merge key by key from its shared
definition (services/<use>.toml) and the host file, the host winning. With `read` (the revision's
files, e.g. Snapshot.read) the host file is looked up; without it, a key of a service that uses
a definition is named in the host file.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from ..desired.spec import DesiredState, HostSpec, ServiceSpec
from ..errors import Problem
from ..redact import looks_secret

Read = Callable[[str], bytes | None]


def dotted(*parts: object) -> str:
    """problems.dotted, imported when a message needs it."""
    from ..desired.problems import dotted as key
    return key(*parts)


def secret_file(name: str) -> str:
    """The repo path of an encrypted secret by default: HF_TOKEN -> secrets/hf-token.age."""
    return f"secrets/{name.lower().replace('_', '-')}.age"


def read_toml(read: Read | None, path: str) -> Mapping[str, Any]:
    """A repo file's TOML tables; empty where it cannot be read (the loader said why)."""
    import tomllib  # here: a run that validates nothing parses no TOML
    data = read(path) if read is not None else None
    try:
        return tomllib.loads(data.decode()) if data is not None else {}
    except (UnicodeDecodeError, tomllib.TOMLDecodeError, RecursionError):
        return {}


class _Origins:
    """Where a service's env or secrets key is set: the host file or the shared definition."""

    def __init__(self, read: Read | None):
        self.read = read
        self.table = functools.cache(functools.partial(read_toml, read))     # each file parsed once

    def of(self, host: HostSpec, svc: ServiceSpec, section: str, key: str) -> tuple[str, str, bool]:
        """(file, dotted key, whether the file is the shared definition)."""
        host_file = host.source or f"hosts/{host.name}.toml"
        in_host = (host_file, dotted("services", svc.name, section, key), False)
        if svc.definition is None or self.read is None:
            return in_host
        table: Any = self.table(host_file)
        for part in ("services", svc.name, section):
            table = table.get(part) if isinstance(table, Mapping) else None
        if isinstance(table, Mapping) and key in table:
            return in_host
        return f"services/{svc.definition}.toml", dotted(section, key), True


def env_secret_warnings(state: DesiredState, read: Read | None = None) -> list[str]:
    """One warning per env key whose value looks like a secret: file, key, what it looks like,
    and the `secrets` entry to use instead. A shared definition's key is named once, with the
    hosts that use it. Never the value."""
    origins = _Origins(read)
    found: dict[tuple[str, str], tuple[str, str, str, bool, list[str]]] = {}
    for host_name, host in sorted(state.hosts.items()):
        for svc_name, svc in sorted(host.services.items()):
            for key, value in sorted(svc.env.items()):
                kind = looks_secret(value)
                if kind is None:
                    continue
                file, where, shared = origins.of(host, svc, "env", key)
                entry = found.setdefault((file, where), (key, svc_name, kind, shared, []))
                entry[4].append(host_name)
    warnings = []
    for (file, where), (key, svc_name, kind, shared, hosts) in found.items():
        table = "[secrets]" if shared else f"[{dotted('services', svc_name, 'secrets')}]"
        used = f" (in service {svc_name} on hosts {', '.join(hosts)})" if shared else ""
        warnings.append(
            f"{file}: {where}: warning: the value looks like {kind}, and env is readable by every local "
            f"user on the host (systemctl show). Move it to secrets: `reconcile secrets encrypt {key}`, "
            f'remove it from env and add {table} {key} = {{ age = "{secret_file(key)}", env = true }}{used}')
    return warnings


_EXEC = re.compile(r"^\s*Exec[A-Za-z]*\s*=(.*)$", re.M)


def argv_secret_warnings(state: DesiredState) -> list[str]:
    """One warning per service whose unit expands one of its secrets into a command line: systemd
    substitutes $NAME / ${NAME} from the environment into the arguments, and /proc/PID/cmdline is
    readable by every local user. The server should read the environment variable or the
    credential file itself (e.g. vLLM's VLLM_API_KEY, huggingface_hub's HF_TOKEN, or a
    --...-file %d/NAME option)."""
    out: dict[tuple[str, str, str], list[str]] = {}
    for host_name, host in sorted(state.hosts.items()):
        for svc_name, svc in sorted(host.services.items()):
            execs = " ".join(m.group(1) for m in _EXEC.finditer(svc.unit_text))
            for sec in sorted(svc.secrets, key=lambda x: x.name):
                n = re.escape(sec.name)
                if re.search(rf"\$\{{{n}\}}|\${n}\b|\$\(cat [^)]*\b{n}\)", execs):
                    where = svc.source or host.source or f"hosts/{host_name}.toml"
                    out.setdefault((where, svc_name, sec.name), []).append(host_name)
    return [f"{where}: {dotted('services', svc, 'unit')}: warning: the unit puts secret {name} on the "
            f"server's command line (hosts {', '.join(hosts)}), where every local user reads it (ps, "
            f"/proc/PID/cmdline). Have the server read it from its environment or from "
            f"$CREDENTIALS_DIRECTORY/{name} itself"
            for (where, svc, name), hosts in sorted(out.items())]


def secret_warnings(state: DesiredState, read: Read | None = None) -> list[str]:
    """Every warning about how the desired state handles secrets (never a value)."""
    return env_secret_warnings(state, read) + argv_secret_warnings(state)


def secret_problems(state: DesiredState, read: Read | None = None) -> list[Problem]:
    """The secrets of a decrypted state that cannot be delivered (SecretSpec.problem), each
    named by the file and key that declare it (a shared definition's once)."""
    origins = _Origins(read)
    problems: dict[tuple[str, str], Problem] = {}
    for _host_name, host in sorted(state.hosts.items()):
        for _svc_name, svc in sorted(host.services.items()):
            for s in svc.secrets:
                if s.problem is None:
                    continue
                file, where, _shared = origins.of(host, svc, "secrets", s.name)
                problems.setdefault((file, where), Problem(file, where, s.problem))
    return list(problems.values())
