"""Redaction by value: what the controller writes anywhere never holds a secret.

Every secret value the controller decrypts is registered here (secrets.py), and everything it
prints, logs, stores or sends goes through `redact`: the terminal and log output (a
RedactingWriter under rich's Console), --json, the state store, webhook bodies, the daemon's run
logs (and so the push stream). Token-like patterns are masked even when no secret declared
them: Hugging Face (hf_...), OpenAI-style (sk-...), GitHub (ghp_/gho_/ghu_/ghs_/ghr_...), and
the password of a URL (scheme://user:PASSWORD@host).
"""

from __future__ import annotations

import io
import re
from typing import IO, Any

MASK = "***"
_MIN = 4            # shorter values are too likely to be ordinary words to be masked by value
_values: set[str] = set()
_PATTERNS = (
    re.compile(r"\bhf_[A-Za-z0-9]{16,}"),
    re.compile(r"\bsk-[A-Za-z0-9_-]{16,}"),
    re.compile(r"\bgh[pousr]_[A-Za-z0-9]{20,}"),
)
_URL_PASSWORD = re.compile(r"(?P<head>[a-z][a-z0-9+.-]*://[^/\s:@]*:)[^/\s@]+(?=@)", re.I)


def register(value: str | bytes) -> None:
    """Mask this value (and each of its lines) wherever it would be printed from now on."""
    text = value.decode(errors="replace") if isinstance(value, bytes) else value
    for part in {text, text.strip(), *text.splitlines()}:
        if len(part.strip()) >= _MIN:
            _values.add(part.strip())


def looks_secret(value: str) -> str | None:
    """What kind of token a literal looks like (for `validate`'s warning), or None."""
    if _URL_PASSWORD.search(value):
        return "a URL with a password"
    for p, what in zip(_PATTERNS, ("a Hugging Face token", "an API key (sk-...)", "a GitHub token"), strict=True):
        if p.search(value):
            return what
    return None


def redact(text: str) -> str:
    """The text with every registered value and every token-like pattern masked."""
    if not text:
        return text
    for v in sorted(_values, key=len, reverse=True):
        if v in text:
            text = text.replace(v, MASK)
    for p in _PATTERNS:
        text = p.sub(MASK, text)
    return _URL_PASSWORD.sub(lambda m: m.group("head") + MASK, text)


def redact_data(data: Any) -> Any:
    """A copy of JSON-like data (dicts, lists, tuples, strings) with every string redacted, keys
    included: for --json, webhook bodies and the store, before serializing (a value escaped by
    JSON would no longer match the text registered)."""
    if isinstance(data, str):
        return redact(data)
    if isinstance(data, dict):
        return {redact(k) if isinstance(k, str) else k: redact_data(v) for k, v in data.items()}
    if isinstance(data, list | tuple):
        return [redact_data(v) for v in data]
    return data


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
