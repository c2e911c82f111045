"""Redaction by value and by pattern: what the controller writes anywhere never holds a secret.

Every secret value the controller decrypts is registered here (secrets.py), and everything it
prints, logs, stores or sends goes through `redact`, in one pass at the edge and before anything
cuts, folds or flattens the text (a token cut in half no longer matches): the terminal and log
output (a RedactingWriter under rich's Console), --json, the state store, git notes, webhook
bodies, the daemon's run logs (and so the push stream), error messages.

What is masked:

* A registered value wherever it appears: in either Unicode normal form (NFC or NFD), in any
  letter case, and with its runs of whitespace matched by any run of whitespace (text that was
  flattened or re-wrapped). Each line of a multi-line value counts as a value of its own.
  Not masked, because masking it would turn ordinary text into `***` and tell whoever can put
  text in an output whether it equals a secret (an oracle): a value shorter than 4 characters,
  a plain word of letters only shorter than 8 characters ("second", "admin"), and a number of
  digits only shorter than 6. Such a secret is too weak to protect anyway.
* Token formats, registered or not (TOKEN_KINDS): Hugging Face (hf_, 8 or more characters that
  are not a plain word shorter than 16: `hf_transfer` is a module), OpenAI-style (sk-...), GitHub
  (ghp_/gho_/ghu_/ghs_/ghr_..., github_pat_...), GitLab (glpat-...), Slack (xoxa-/xoxb-/xoxp-...),
  AWS access key ids (AKIA.../ASIA...) and a 40-character AWS secret key on a line that names it,
  JWTs (eyJ...), the credentials after `Bearer` and in an `Authorization:` header.
* The password of a URL: everything from `scheme://user:` up to the LAST `@` of the word, so a
  password holding `/` or `@` is masked whole (a URL with a port and an `@` in its path,
  `http://h:5000/img@sha256:...`, is masked too: showing too little beats leaking).
* The value of a `key=value` setting (or a JSON `"key": "value"`, or `--flag value`) whose key
  ends in password, passwd, passphrase, secret, token, _key, credentials, auth, bearer or dsn,
  unless the value is a `$VARIABLE` or a `{placeholder}` (max_tokens=, a name that only contains
  one of them, is left alone: server logs are full of those).

`redact_data` never rewrites the keys of a mapping; `clip` is how a text from a host is bounded
(redacted whole, then cut); `escape_controls` is the other rule for text that reaches a reader
(no control character drives the operator's terminal).
"""

from __future__ import annotations

import io
import re
import unicodedata
from collections.abc import Iterable
from typing import IO, Any

MASK = "***"
_MIN = 4              # shorter values are too likely to be ordinary text to be masked by value
_MIN_WORD = 8         # a plain word of letters shorter than this is not masked by value
_MIN_NUMBER = 6       # a number of digits shorter than this is not masked by value

# The registered values (each stripped). Tests may add to and discard from it: the registry
# of matchers (_Registry, below) is made again whenever the set differs from its own.
_values: set[str] = set()
_Matcher = tuple[tuple[str, ...], re.Pattern[str]]
_matchers: dict[str, _Matcher] = {}          # made once per value

# Not a plain word: a run of up to 15 lowercase letters (or a capitalized word) is English or an
# identifier (hf_transfer, "Bearer credentials"), not a random credential.
_NOT_A_WORD = r"(?![a-z]{1,15}(?![\w.~+/=-])|[A-Z][a-z]{1,14}(?![\w.~+/=-]))"

# A quote around a key or a value, escaped too: JSON inside an env file's "..." is \"key\": \"value\".
_QUOTE = r"(?:\\?[\"'])"

# A character of a value: not a space, a quote or a separator; a backslash only with the
# character it escapes, so a match never ends on the `\` of an escaped closing quote (masking
# `x\` of `KEY=\"x\"` in JSON text would leave the quote bare and the document broken).
_VALUE = r"(?:[^\s\"',;&\\]|\\[^\s\"'])"

# (what it is, pattern, hints). A named group `head` is kept: only what follows it is masked.
# A pattern runs only on text that holds one of its hints (lowercase, looked for in the text
# lowercased): a substring test costs a tenth of a regex scan, and most lines hold none.
_Kind = tuple[str, re.Pattern[str], tuple[str, ...]]
TOKEN_KINDS: tuple[_Kind, ...] = (
    ("a Hugging Face token", re.compile(rf"\bhf_{_NOT_A_WORD}[A-Za-z0-9]{{8,}}"), ("hf_",)),
    ("an API key (sk-...)", re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"), ("sk-",)),
    ("a GitHub token", re.compile(r"\b(?:gh[pousr]_[A-Za-z0-9]{20,}|github_pat_[A-Za-z0-9_]{20,})"),
     ("gh", "github_pat_")),
    ("a GitLab token", re.compile(r"\bglpat-[A-Za-z0-9_.-]{16,}"), ("glpat-",)),
    ("a Slack token", re.compile(r"\bxox[abposre]-[A-Za-z0-9-]{10,}"), ("xox",)),
    ("an AWS access key id", re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{16}\b"), ("akia", "asia", "aroa", "aida")),
    ("an AWS secret key", re.compile(
        rf"(?P<head>(?i:aws_?secret_?(?:access_?)?key){_QUOTE}?[ \t]*[:=][ \t]*(?:{_QUOTE}[ \t]*)?)"
        r"[A-Za-z0-9/+]{40}(?![A-Za-z0-9/+])"), ("aws",)),
    ("a JWT", re.compile(r"\beyJ[A-Za-z0-9_-]{8,}(?:\.[A-Za-z0-9_-]+)+\.?"), ("eyj",)),
    ("a bearer token", re.compile(rf"(?P<head>\b(?i:bearer)[ \t]+){_NOT_A_WORD}[A-Za-z0-9._~+/-]{{8,}}=*"),
     ("bearer",)),
    ("an Authorization header", re.compile(
        rf"(?P<head>\b(?i:(?:proxy-)?authorization){_QUOTE}?[ \t]*[:=][ \t]*{_QUOTE}?"
        r"(?:(?i:basic|bearer|token|digest)[ \t]+)?)(?!(?i:basic|bearer|token|digest)\b)"
        rf"{_VALUE}{{4,}}"),
     ("authorization",)),
    # The password of a URL: up to the last `@` of the word (it may hold `/` and `@` itself).
    ("a URL with a password", re.compile(r"(?P<head>\b[a-z][a-z0-9+.-]*://[^\s/:@]*:)\S+(?=@)", re.I), ("://",)),
)

# A setting whose key ends in a secret's name: `KEY=VALUE`, `"key": "value"`, `--api-key VALUE`.
# Matched on the text lowercased (ASCII only, so that every position stays where it was): the
# same pattern case-insensitive is ten times slower, and runs on every line printed.
_SETTING_KIND = "a password or token setting"
_SECRET_KEY = r"(?:passw(?:or)?d|passphrase|secret|token|apikey|(?<=[_-])key|credentials?|auth|bearer|dsn)"
_SETTING = re.compile(
    rf"(?:(?<=-){_SECRET_KEY}(?P<flag>[ \t]+)"
    rf"|{_SECRET_KEY}(?P<head>{_QUOTE}?[ \t]*=[ \t]*(?:{_QUOTE}[ \t]*)?|{_QUOTE}[ \t]*:[ \t]*{_QUOTE}[ \t]*))"
    rf"(?![$%{{-]){_VALUE}{{4,}}")
_ASCII_LOWER = str.maketrans("ABCDEFGHIJKLMNOPQRSTUVWXYZ", "abcdefghijklmnopqrstuvwxyz")

# An environment variable whose name says it holds a secret (its value is masked in diffs,
# whatever it is): ...TOKEN, ...SECRET, ...PASSWORD, ...API_KEY, *_KEY, *_DSN, DATABASE_URL, AUTH...
_SECRET_NAME = re.compile(
    r"TOKEN|SECRET|PASSW|PASSPHRASE|API_?KEY|PRIVATE|CREDENTIAL|AUTH|BEARER|COOKIE"
    r"|(?:^|_)(?:KEYS?|PWD|DSN|SALT)(?:_|$)"
    r"|(?:^|_)(?:DATABASE|DB|REDIS|MONGO(?:DB)?|AMQP|RABBITMQ|BROKER|POSTGRES(?:QL)?|PG|MYSQL)_UR[LI]$", re.I)

# C0 controls but tab and newline, DEL, and the C1 controls (U+0080-U+009F: CSI is one of them).
_CONTROLS = re.compile(r"[\x00-\x08\x0b-\x1f\x7f-\x9f]")


def maskable(value: str) -> bool:
    """Whether a registered value is masked by value: not one too short or too common (see the
    module docstring: masking it would be an oracle)."""
    v = value.strip()
    if len(v) < _MIN:
        return False
    if v.isalpha() and len(v) < _MIN_WORD:
        return False
    return not (v.isascii() and v.isdigit() and len(v) < _MIN_NUMBER)


def register(value: str | bytes) -> None:
    """Mask this value (and each of its lines) wherever it would be printed from now on, unless
    it is too short or too common to mask (`maskable`)."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    for part in {text, *text.splitlines()}:
        if maskable(part):
            _values.add(part.strip())


def _matcher(value: str) -> _Matcher:
    """How one registered value is found: a pattern for its forms (NFC and NFD, as registered
    and casefolded, since "ß".upper() is "SS", which IGNORECASE alone misses; any run of
    whitespace for each of its runs), and hints, a piece of each form casefolded, one of which
    a text casefolded holds wherever the pattern matches it."""
    forms = {unicodedata.normalize(nf, x) for nf in ("NFC", "NFD") for x in (value, value.casefold())}
    alternatives = sorted({r"\s+".join(re.escape(piece) for piece in f.split()) for f in forms}, key=lambda a: -len(a))
    hints = tuple({max(f.split(), key=len).casefold() for f in forms})
    return hints, re.compile("|".join(alternatives), re.IGNORECASE)


class _Registry:
    """The matchers of the registered values, longest value first (so that a value that holds
    another is masked whole), and an index from the first three characters of each hint to the
    matchers that have it: with hundreds of values (a long-running daemon's every secret), a
    line costs a lookup per character instead of a substring test per value."""

    DIRECT = 64          # up to this many hints, a substring test each is cheaper than the index

    def __init__(self, values: frozenset[str]):
        self.values = values
        for v in values - _matchers.keys():
            _matchers[v] = _matcher(v)
        self.matchers = [_matchers[v] for v in sorted(values, key=lambda v: (-len(v), v))]
        self.short: set[int] = set()             # matchers with a hint shorter than 3
        self.index: dict[str, set[int]] = {}
        for i, (hints, _pattern) in enumerate(self.matchers):
            for h in hints:
                if len(h) < 3:
                    self.short.add(i)
                else:
                    self.index.setdefault(h[:3], set()).add(i)
        self.direct = sum(len(hints) for hints, _p in self.matchers) <= self.DIRECT
        self.memo: dict[str, str] = {}          # short texts as redacted by these values (redact)

    def candidates(self, folded: str) -> list[_Matcher]:
        """The matchers whose hint the casefolded text holds."""
        if self.direct:
            chosen: Iterable[int] = range(len(self.matchers))
        else:
            found = set(self.short)
            for i in range(len(folded) - 2):
                found.update(self.index.get(folded[i:i + 3], ()))
            chosen = sorted(found)
        return [m for m in (self.matchers[i] for i in chosen) if any(h in folded for h in m[0])]


_built = _Registry(frozenset())


def _registry() -> _Registry:
    """The registry's matchers, made again when the registered values changed."""
    global _built
    if _built.values != _values:
        _built = _Registry(frozenset(_values))
    return _built


def looks_secret(value: str) -> str | None:
    """What kind of secret a literal looks like (for `validate`'s warning), or None."""
    low = _lower(value)
    for what, p, hints in TOKEN_KINDS:
        if any(h in low for h in hints) and p.search(value):
            return what
    return _SETTING_KIND if _SETTING.search(low) else None


def secret_name(name: str) -> bool:
    """Whether an environment variable's name says its value is a secret (HF_TOKEN, OPENAI_KEY,
    DB_PASSWORD, SENTRY_DSN, DATABASE_URL, AUTH ...): its value is masked in diffs whatever it
    looks like."""
    return _SECRET_NAME.search(name) is not None


def _lower(text: str) -> str:
    """The text with ASCII letters lowercased, every character where it was."""
    return text.lower() if text.isascii() else text.translate(_ASCII_LOWER)


def _mask_settings(text: str) -> str:
    """The values of secret settings masked (see _SETTING), the rest of the text as it was."""
    out: list[str] = []
    position = 0
    for m in _SETTING.finditer(_lower(text)):
        out += [text[position:m.end("flag") if m.group("flag") else m.end("head")], MASK]
        position = m.end()
    return "".join([*out, text[position:]]) if out else text


def _masked(m: re.Match[str]) -> str:
    return (m.groupdict().get("head") or "") + MASK


# Short texts already redacted are kept by the registry that redacted them (a value registered
# since makes a new one): a run redacts the same host and service names, states and details many
# times over (its report, the store, the daemon's metrics labels: a thousand host names a round).
_MEMO_TEXT = 200            # characters: longer texts (journal lines, diffs) are rarely repeated
_MEMO_MAX = 4096


def redact(text: str) -> str:
    """The text with every registered value and every token-like pattern masked."""
    if not text:
        return text
    registry = _registry()
    if len(text) > _MEMO_TEXT:
        return _redacted(registry, text)
    memo = registry.memo
    out = memo.get(text)
    if out is None:
        if len(memo) >= _MEMO_MAX:
            memo.clear()
        out = memo[text] = _redacted(registry, text)
    return out


def _redacted(registry: _Registry, text: str) -> str:
    if registry.matchers:
        # A regex only for the values whose hint the text holds: one pattern of every value,
        # case-insensitive, costs a millisecond a line with a thousand values registered.
        for _hints, pattern in registry.candidates(text.casefold()):
            text = pattern.sub(MASK, text)
    low = _lower(text)
    for _what, p, hints in TOKEN_KINDS:
        if any(h in low for h in hints):
            text = p.sub(_masked, text)
    return _mask_settings(text)


def redact_data(data: Any) -> Any:
    """A copy of JSON-like data (dicts, lists, tuples, strings) with every string value redacted,
    for --json, webhook bodies and the store, before serializing (a value escaped by JSON would
    no longer match the text registered). Keys are kept as they are: they are names (hosts,
    services, env names, fields of a JSON document), and a consumer of the JSON looks them up."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {k: redact_data(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_data(v) for v in data]
    return data


def clip(text: str, limit: int, *, tail: bool = False) -> str:
    """The text redacted whole, then cut to at most `limit` characters (never the other way round:
    a secret cut in half no longer matches). Its start, the cut marked with an ellipsis; or,
    `tail`, its end, from the first whole word after the cut: the word the cut went through is
    dropped (its end would be all that is left of it, which no pattern matches any more)."""
    text = redact(text)
    if len(text) <= limit:
        return text
    if limit < 1:
        return ""
    if not tail:
        return text[:limit - 1] + "\u2026"
    kept = text[len(text) - limit:]
    if not text[len(text) - limit - 1].isspace():
        word = _WORD_END.search(kept)
        kept = kept[word.end():] if word is not None else ""
    return kept


_WORD_END = re.compile(r"\s")


def escape_controls(text: str) -> str:
    """The text with every control character but newline and tab written as a visible escape
    (ESC as `\\x1b`): text from a run (journal lines, host records, commit subjects) must not
    set the title, hide lines or write the clipboard of the terminal it is shown on."""
    return _CONTROLS.sub(lambda m: f"\\x{ord(m.group()):02x}", text)


class RedactingWriter(io.TextIOBase):
    """A text stream that masks secrets before they reach the one it wraps."""

    def __init__(self, inner: IO[str]):
        self.inner = inner

    def write(self, s: str) -> int:
        self.inner.write(redact(s))
        return len(s)

    def flush(self) -> None:
        self.inner.flush()

    def isatty(self) -> bool:
        return self.inner.isatty()

    def fileno(self) -> int:
        return self.inner.fileno()
