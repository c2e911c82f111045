"""The scalar field types of the desired-state TOML files: each value checked by a validator of
our own (tables.Check), so that a wrong value reads "expected an integer 1-65535, got '22'",
and so that no type is ever coerced (TOML already has real integers, floats and
strings). schema.py (the files' tables) and schema_drain.py (drain and smoke) build on these.

The values of `env` may be secrets: their validators never put the value in a message.
"""

from __future__ import annotations

import base64
import binascii
import ipaddress
import math
import re
import struct
from typing import Annotated, Any
from urllib.parse import urlsplit

from ..errors import describe, kind_of
from ..redact import redact
from .tables import Check, Invalid

# `\Z`, never `$`: `$` matches before a final newline too ("svc\n" would pass), and callers
# elsewhere use these with .match.
SERVICE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,99}\Z")
HOST_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,62}\Z")
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")
VAR_NAME = re.compile(r"^[A-Za-z0-9_]+\Z")  # what the {vars.<name>} placeholder can spell
LABEL = re.compile(r"^[A-Za-z0-9_.-]+\Z")
USER = re.compile(r"^[A-Za-z_][A-Za-z0-9_.-]{0,31}\Z")
_HOSTNAME_LABEL = re.compile(r"^[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\Z")
_KEY_TYPE = re.compile(r"^[a-z0-9][a-z0-9@.-]*\Z")
_BASE64 = re.compile(r"^[A-Za-z0-9+/]+={0,2}\Z")
# Control characters other than tab: a newline in a value would let it escape its line in
# the unit file or the env file.
_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_WHITESPACE_OR_CONTROL = re.compile(r"[\s\x00-\x1f\x7f]")


def _fail(expected: str, value: object, *, secret: bool = False, hint: str = "") -> Invalid:
    # A value that is shown is redacted before describe() cuts it: a token cut short would no
    # longer be recognized (a URL's password in a health URL, a token in a model.fetch line).
    got = kind_of(value) if secret else describe(redact(value) if isinstance(value, str) else value)
    return Invalid(f"expected {expected}, got {got}{hint}")


def _quote_hint(value: object) -> str:
    return " (write it in quotes)" if isinstance(value, int | float) and not isinstance(value, bool) else ""


# ---- numbers --------------------------------------------------------------------------------


def _int_in(lo: int, hi: int | None, expected: str) -> Check:
    def check(value: Any) -> int:
        if isinstance(value, bool) or not isinstance(value, int) or value < lo or (hi is not None and value > hi):
            raise _fail(expected, value)
        return value

    return Check(check)


def _seconds(*, allow_zero: bool) -> Check:
    expected = "a number of seconds >= 0" if allow_zero else "a number of seconds > 0"

    def check(value: Any) -> float:
        if (isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value) or value < 0
                or (value == 0 and not allow_zero)):
            raise _fail(expected, value)
        return float(value)

    return Check(check)


def _max_unavailable(value: Any) -> int | str:
    # A count, or a percentage of the group's hosts. Integer percentages only: "12.5%" would
    # suggest a precision that rounding to whole hosts does not have.
    if isinstance(value, int) and not isinstance(value, bool) and value >= 1:
        return value
    m = _PERCENT.fullmatch(value) if isinstance(value, str) else None
    if m and 1 <= int(m.group(1)) <= 100:
        return f"{int(m.group(1))}%"
    raise _fail('an integer >= 1 or a percentage 1-100 like "25%"', value)


_PERCENT = re.compile(r"^([0-9]{1,3})%\Z")
_DURATION_PART = re.compile(r"([0-9]+(?:\.[0-9]+)?)(d|h|m|s)")
_DURATION_UNITS = {"d": 86400.0, "h": 3600.0, "m": 60.0, "s": 1.0}


def parse_duration(text: str) -> float | None:
    """Seconds in a duration such as "90s", "30m", "2h", "1d" or "1h30m" (a bare number is
    seconds); None when it is not one. Shared by fleet.toml [pull] and `reconcile pull --interval`."""
    text = text.strip()
    try:
        value = float(text)
    except ValueError:
        pass
    else:
        return value if math.isfinite(value) and value >= 0 else None
    if not text or _DURATION_PART.sub("", text):
        return None
    return sum(float(n) * _DURATION_UNITS[u] for n, u in _DURATION_PART.findall(text))


def _duration(value: Any) -> float:
    if isinstance(value, int | float) and not isinstance(value, bool):
        seconds = float(value) if math.isfinite(value) and value >= 0 else None
    else:
        seconds = parse_duration(value) if isinstance(value, str) else None
    if seconds is None:
        raise _fail('a duration like "30m", "2h", "90s" or "1h30m", or a number of seconds >= 0', value)
    return seconds


Port = Annotated[int, _int_in(1, 65535, "an integer 1-65535")]
Canary = Annotated[int, _int_in(0, None, "an integer >= 0")]
MaxUnavailable = Annotated[int | str, Check(_max_unavailable)]
Concurrency = Annotated[int, _int_in(1, None, "an integer >= 1")]
HttpStatus = Annotated[int, _int_in(100, 599, "an HTTP status code 100-599")]
PositiveSeconds = Annotated[float, _seconds(allow_zero=False)]
NonNegativeSeconds = Annotated[float, _seconds(allow_zero=True)]
Duration = Annotated[float, Check(_duration)]


# ---- strings --------------------------------------------------------------------------------


def _pattern(regex: re.Pattern[str], expected: str) -> Check:
    def check(value: Any) -> str:
        if not isinstance(value, str) or not regex.fullmatch(value):
            raise _fail(expected, value)
        return value

    return Check(check)


def _env_value(value: Any) -> str:
    # Secret-safe: only the kind of a wrong value is ever named, never the value.
    if not isinstance(value, str):
        raise _fail("a string", value, secret=True, hint=_quote_hint(value))
    if _CONTROL.search(value):
        raise Invalid("expected a single-line string: the value contains a newline or another control "
            "character (only tab is allowed); the value is not shown",
        )
    return value


def _single_line(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail("a string", value, hint=_quote_hint(value))
    if _CONTROL.search(value):
        raise _fail("a single-line string without control characters (tab is allowed)", value)
    return value


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise _fail("a string", value)
    if "\x00" in value:
        raise Invalid("expected text: the string contains a NUL character")
    return value


def _no_space(expected: str, *, absolute: bool = False) -> Check:
    def check(value: Any) -> str:
        if (not isinstance(value, str) or not value or _WHITESPACE_OR_CONTROL.search(value)
                or (absolute and not value.startswith("/"))):
            raise _fail(expected, value)
        return value

    return Check(check)


def _address(value: Any) -> str:
    expected = "an IP address or hostname"
    if not isinstance(value, str) or not value:
        raise _fail(expected, value)
    try:
        ipaddress.ip_address(value)
        return value
    except ValueError:
        pass
    labels = value.rstrip(".").split(".") if len(value) <= 253 else []
    if not labels or not all(_HOSTNAME_LABEL.fullmatch(label) for label in labels):
        raise _fail(expected, value)
    if labels[-1].isdigit():  # "127.0.0.999" is a broken IP address, not a hostname
        raise _fail(expected, value)
    return value


def _repo_path(value: Any) -> str:
    if (not isinstance(value, str) or not value or value.startswith("/") or "\\" in value
            or any(part in ("", ".", "..") for part in value.split("/")) or _WHITESPACE_OR_CONTROL.search(value)):
        raise _fail("a path inside the repository like 'units/x.service'", value)
    return value


def host_key_problem(line: str) -> str | None:
    """Why a public key line like "ssh-ed25519 AAAA... [comment]" is malformed, or None."""
    fields = line.split()
    if len(fields) < 2 or not _KEY_TYPE.fullmatch(fields[0]) or not _BASE64.fullmatch(fields[1]):
        return "it is not '<key type> <base64 key>'"
    try:
        blob = base64.b64decode(fields[1], validate=True)
        (length,) = struct.unpack(">I", blob[:4])
        embedded = blob[4 : 4 + length].decode("ascii")
    except (binascii.Error, struct.error, UnicodeDecodeError):
        return "the key is not valid base64 of an SSH public key"
    if embedded != fields[0]:
        return f"the key data is of type {embedded!r}, not {fields[0]!r}"
    return None


def _host_key(value: Any) -> str:
    expected = "a public key line like 'ssh-ed25519 AAAA...' (as in a .pub file)"
    if not isinstance(value, str) or _CONTROL.search(value):
        raise _fail(expected, value)
    why = host_key_problem(value)
    if why:
        raise Invalid(f"expected {expected}: {why}")
    return value.strip()


def _http_template(value: Any) -> str:
    if (not isinstance(value, str) or _WHITESPACE_OR_CONTROL.search(value)
            or not value.startswith(("http://", "https://"))):
        raise _fail("an http:// or https:// URL (placeholders allowed)", value)
    return value


def _webhook(value: Any) -> str:
    expected = "an http:// or https:// URL with a host, like 'http://127.0.0.1:9000/hooks/deploys'"
    if not isinstance(value, str) or _WHITESPACE_OR_CONTROL.search(value):
        raise _fail("an http:// or https:// URL", value, secret=True)
    try:
        parts = urlsplit(value)
        parts.port  # noqa: B018 -- raises ValueError for a bad port
    except ValueError:
        raise _fail(expected, value, secret=True) from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        # The URL may carry a token (Slack's does): name its kind, never its text.
        raise Invalid(f"expected {expected}; the value is not shown")
    return value


def _boolean(value: Any) -> bool:
    if not isinstance(value, bool):
        raise _fail("true or false", value)
    return value


_DROPIN = re.compile(r"^(/(etc|run)/systemd/[A-Za-z0-9_.@/-]+/)?[A-Za-z0-9_.@-]+\.conf\Z")


def _dropin(value: Any) -> str:
    expected = ("a drop-in file name like '10-numa.conf', or its absolute path under /etc/systemd or "
                "/run/systemd")
    if not isinstance(value, str) or not _DROPIN.fullmatch(value) or "/../" in value:
        raise _fail(expected, value)
    return value


_SERVICE_NAME_TEXT = ("a service name: letters, digits, '_' and '-', starting with a letter or digit, at most "
                      "100 characters (no dots, no '@', no '.service' suffix)")
# The reconciler's own units on a host (reconciler-confirm-<service>, reconciler-rearm-switches,
# reconciler-pull ...): a service of such a name would be stopped or deleted by them.
RESERVED_PREFIX = "reconciler-"


def _service_name(value: Any) -> str:
    if not isinstance(value, str) or not SERVICE_NAME.fullmatch(value):
        raise _fail(_SERVICE_NAME_TEXT, value)
    if value.lower().startswith(RESERVED_PREFIX):
        raise Invalid(f"{describe(value)} starts with {RESERVED_PREFIX!r}: names starting with it are reserved for "
            "the reconciler's own units on the host (reconciler-confirm-<service>, reconciler-rearm-switches, "
            "reconciler-pull); rename the service")
    return value


ServiceName = Annotated[str, Check(_service_name)]
# A shared definition's name (services/<name>.toml) is never a unit's name: not reserved.
DefinitionName = Annotated[str, _pattern(SERVICE_NAME, _SERVICE_NAME_TEXT)]
EnvKey = Annotated[
    str, _pattern(ENV_KEY, "an environment variable name: letters, digits and '_', not starting with a digit")
]
EnvValue = Annotated[str, Check(_env_value)]
VarName = Annotated[str, _pattern(VAR_NAME, "a var name: letters, digits and '_'")]
VarValue = Annotated[str, Check(_single_line)]
LabelText = Annotated[str, _pattern(LABEL, "letters, digits, '_', '.' and '-'")]
User = Annotated[str, _pattern(USER, "a user name like 'root'")]
Address = Annotated[str, Check(_address)]
HostKey = Annotated[str, Check(_host_key)]
RepoPath = Annotated[str, Check(_repo_path)]
UnitText = Annotated[str, Check(_text)]
SingleLine = Annotated[str, Check(_single_line)]
ModelId = Annotated[str, _no_space("a model id without whitespace, like 'Qwen/Qwen3-8B'")]
ModelPath = Annotated[str, _no_space("an absolute path without whitespace, like '/models/Qwen3-8B'", absolute=True)]
HttpTemplate = Annotated[str, Check(_http_template)]
Webhook = Annotated[str, Check(_webhook)]
NotifyFormat = Annotated[str, _pattern(re.compile(r"json|slack"), "'json' or 'slack'")]
Boolean = Annotated[bool, Check(_boolean)]
DropIn = Annotated[str, Check(_dropin)]

AbsPath = Annotated[str, _no_space("an absolute path without whitespace, like '/etc/credstore/hf_token'",
                                   absolute=True)]
