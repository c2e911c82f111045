"""PURE: the files the reconciler writes for a service (unit, env drop-in and env file, secrets
drop-in), rendered from the desired state; how the host's copies compare; diffs with secrets
masked. Values of secrets never appear here: only paths and keyed versions."""

from __future__ import annotations

import difflib
import re
from collections.abc import Mapping

from ..desired.spec import HostSpec, ServiceSpec
from ..redact import MASK, redact, secret_name
from .facts import ServiceFacts
from .layout import UNIT_DIR, cred_env_path, cred_path, env_path, envfile_path, secrets_path, unit_path
from .model import Block, Reason
from .records import ServiceRecord

ENV_HEADER = "# Managed by reconciler from git; edits on this host are reverted.\n"


def render_env_dropin(service: str) -> str:
    """The env drop-in: it names the service's env file (the same text whatever the env is, so a
    change of env alone changes no unit file and needs no daemon-reload)."""
    return f"{ENV_HEADER}[Service]\nEnvironmentFile={envfile_path(service)}\n"


def _env_quote(value: str) -> str:
    # systemd.exec(5), EnvironmentFile=: in double quotes, a backslash keeps any of \ " ` $ as it
    # is; every other character (a newline too) is the value's own; nothing is expanded.
    return '"' + re.sub(r'([\\"`$])', r"\\\1", value) + '"'


def render_env_file(env: Mapping[str, str]) -> str:
    """The env file: one NAME="value" line per variable, read by systemd at every start."""
    return ENV_HEADER + "".join(f"{key}={_env_quote(env[key])}\n" for key in sorted(env))


_ENV_FILE_LINE = re.compile(r'^([A-Za-z_][A-Za-z0-9_]*)=(.*)$')


def parse_env_file(text: str | None) -> dict[str, str]:
    """Best-effort reading of an env file (ours or hand-edited) for reasons and diffs."""
    out: dict[str, str] = {}
    for line in (text or "").splitlines():
        m = _ENV_FILE_LINE.match(line.strip())
        if m:
            value = m.group(2)
            if len(value) >= 2 and value[0] == value[-1] == '"':
                value = re.sub(r"\\(.)", r"\1", value[1:-1])
            elif len(value) >= 2 and value[0] == value[-1] == "'":
                value = value[1:-1]
            out[m.group(1)] = value
    return out


def legacy_env_dropin(env: Mapping[str, str]) -> str:
    """The env drop-in as a reconciler before the env file wrote it (Environment= lines): a host
    that has exactly this for the desired env runs the desired env already."""
    lines = [ENV_HEADER, "[Service]\n"]
    for key in sorted(env):
        value = env[key].replace("\\", "\\\\").replace('"', '\\"').replace("%", "%%")
        lines.append(f'Environment="{key}={value}"\n')
    return "".join(lines)


_ENV_LINE = re.compile(r'^Environment="([^=]+)=(.*)"$')


def parse_env(text: str | None) -> dict[str, str]:
    """Best-effort reading of Environment= lines (an env drop-in an older reconciler wrote, or a
    hand-edited one) for reasons."""
    return {m.group(1): m.group(2) for line in (text or "").splitlines() if (m := _ENV_LINE.match(line.strip()))}


def render_secrets(svc: ServiceSpec) -> str | None:
    """The secrets drop-in: where systemd finds each secret, never a value. A credential is
    loaded by systemd at start into $CREDENTIALS_DIRECTORY/NAME (only the service's user can read
    it); the secrets wanted as environment variables come from one root-only EnvironmentFile=.
    Never Environment=: every local user can read that through `systemctl show`."""
    if not svc.secrets:
        return None
    lines = [ENV_HEADER, "# Secrets, by path only: the values are in root-only files.\n", "[Service]\n"]
    for s in sorted(svc.secrets, key=lambda s: s.name):
        if not s.env:
            src = s.path if s.source == "file" else cred_path(svc.name, s.name)
            lines.append(f"LoadCredential={s.name}:{src}\n")
    if any(s.env for s in svc.secrets):
        lines.append(f"EnvironmentFile={cred_env_path(svc.name)}\n")
    return "".join(lines)


def desired_files(svc: ServiceSpec) -> dict[str, str | None]:
    """Path -> content for one service; None means the file must not exist."""
    return {unit_path(svc.name): svc.unit_text,
            env_path(svc.name): render_env_dropin(svc.name) if svc.env else None,
            envfile_path(svc.name): render_env_file(svc.env) if svc.env else None,
            secrets_path(svc.name): render_secrets(svc)}


def needs_reload(path: str) -> bool:
    """A file systemd loads (a unit or a drop-in): replacing it takes a daemon-reload. The env
    file is read at every start and takes none."""
    return path.startswith(f"{UNIT_DIR}/")


def own_files(name: str) -> frozenset[str]:
    """The files the reconciler writes for a service (everything else is someone else's)."""
    return frozenset({unit_path(name), env_path(name), envfile_path(name), secrets_path(name)})


def secret_files(host: HostSpec) -> list[str]:
    """The files whose keyed hash the observation reads: each referenced file, and the
    reconciler's own copies of the age secrets and of the environment file."""
    out: set[str] = set()
    for svc in host.services.values():
        for s in svc.secrets:
            out.add(s.path if s.source == "file" else cred_path(svc.name, s.name))
        if any(s.env for s in svc.secrets):
            out.add(cred_env_path(svc.name))
    return sorted(out)


UNOBSERVED = "?"


def secret_versions(svc: ServiceSpec, observed: Mapping[str, str | None]) -> dict[str, str | None]:
    """NAME -> the version of the value to deliver, never the value: the controller's keyed
    digest of an age secret, the host's keyed hash of a referenced file (None: the file is not
    on the host, or the secret cannot be decrypted; UNOBSERVED: not read in this run)."""
    out: dict[str, str | None] = {}
    for s in svc.secrets:
        if s.source == "age":
            out[s.name] = f"age:{s.digest}" if s.digest else None
        else:
            h = observed.get(s.path, UNOBSERVED)
            out[s.name] = f"file:{h}" if h else None
    return out


def secret_blocks(svc: ServiceSpec, observed: Mapping[str, str | None]) -> tuple[Block, ...]:
    """Secrets that cannot be delivered: the service is blocked and nothing is written."""
    out: list[Block] = []
    for s in sorted(svc.secrets, key=lambda s: s.name):
        if s.problem:
            out.append(Block(Reason.SECRET_UNDECRYPTABLE, f"secret {s.name}: {s.problem}"))
        elif s.source == "file" and s.path in observed and observed[s.path] is None:
            out.append(Block(Reason.SECRET_MISSING, f"secret {s.name}: {s.path} does not exist on the host (a "
                                                    f"referenced secret is provisioned there by other means); "
                                                    f"nothing written"))
    return tuple(out)


def secret_changes(svc: ServiceSpec, rec: ServiceRecord,
                   observed: Mapping[str, str | None]) -> tuple[tuple[str, str], ...]:
    """(NAME, what) for each secret whose delivered value is not the one wanted: added, changed,
    removed, or the reconciler's own copy missing on the host. Never a value."""
    want = secret_versions(svc, observed)
    out: list[tuple[str, str]] = []
    for name, v in sorted(want.items()):
        have = rec.secrets.get(name)
        if have is None:
            out.append((name, "added"))
        elif v != have and not (v is not None and v.endswith(UNOBSERVED)):
            out.append((name, "changed"))
    out += [(name, "removed") for name in sorted(set(rec.secrets) - set(want))]
    seen = {n for n, _ in out}
    for s in sorted(svc.secrets, key=lambda s: s.name):
        own = cred_path(svc.name, s.name) if s.source == "age" else cred_env_path(svc.name) if s.env else None
        if s.name not in seen and own is not None and own in observed and observed[own] is None:
            out.append((s.name, "missing on the host"))
    return tuple(out)


def describe_secret_changes(changes: tuple[tuple[str, str], ...]) -> str:
    """'secret API_KEY changed, HF_TOKEN added': names only."""
    return "secret " + ", ".join(f"{n} {what}" for n, what in changes)


# A line of a diff that sets something: [sign] NAME=rest (an env file's line, a unit's directive).
_SETTING_LINE = re.compile(r'^(?P<sign>[-+ ]?)(?P<name>[A-Za-z_][A-Za-z0-9_]*)=(?P<rest>.*)$', re.M)
# Each NAME= of an Environment= line: at its start, or after a space or a quote.
_ASSIGNMENT = re.compile(r'(?:^|(?<=[\s"\']))([A-Za-z_][A-Za-z0-9_]*)=')


def mask_secrets(text: str) -> str:
    """Hide the values of secret-named variables (redact.secret_name: ...TOKEN, ...PASSWORD,
    *_KEY, *_DSN, DATABASE_URL ...) in a diff, whatever the values look like: an env file's
    NAME="value" line, or an Environment= line, where every NAME= is judged (not only the
    first): from the first secret one on, the rest of the line is masked."""
    def repl(m: re.Match[str]) -> str:
        sign, name, rest = m.group("sign"), m.group("name"), m.group("rest")
        if name != "Environment":
            return f'{sign}{name}="{MASK}"' if secret_name(name) else m.group(0)
        first = next((a for a in _ASSIGNMENT.finditer(rest) if secret_name(a.group(1))), None)
        if first is None:
            return m.group(0)
        closing = '"' if rest.startswith('"') else ""
        return f"{sign}{name}={rest[:first.end()]}{MASK}{closing}"
    return _SETTING_LINE.sub(repl, text)


def unified_diff(path: str, old: str | None, new: str | None, host: str, short_rev: str) -> str:
    """A unified diff of one file, host version -> revision version, secrets masked: by the
    variable's name (mask_secrets), and every registered value and token-like text (redact),
    so that the diff is safe wherever it goes (--json, the journal, the push stream)."""
    diff = difflib.unified_diff(
        (old or "").splitlines(keepends=True), (new or "").splitlines(keepends=True),
        fromfile=f"{host}:{path}" if old is not None else "/dev/null",
        tofile=f"{short_rev}:{path}" if new is not None else "/dev/null")
    return redact(mask_secrets("".join(line if line.endswith("\n") else line + "\n" for line in diff)))


def has_install(unit_text: str) -> bool:
    return re.search(r"^\s*\[Install\]\s*$", unit_text, re.M) is not None


def foreign_dropins(svc: ServiceSpec, f: ServiceFacts | None) -> dict[str, str]:
    """Drop-ins for the service that the reconciler did not write and that are not allowed."""
    if f is None:
        return {}
    return {p: c for p, c in sorted(f.dropins.items()) if p not in own_files(svc.name) and not svc.allows_dropin(p)}
