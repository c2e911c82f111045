"""Placeholders in the text a user writes: {host.name} {host.address} {service.name} {model.id}
{model.path} {vars.<name>}.

They are substituted in the unit text, env values, vars, health.http and model.fetch. Only
these four namespaces are placeholders: any other brace (systemd's ${VAR}, %i, JSON) passes
through untouched. An unknown one is left in place and reported, saying what is known instead.
Rendering here is pure; the loader turns the unknowns into problems naming file and key.
"""

from __future__ import annotations

import re
from urllib.parse import urlsplit

import msgspec

PLACEHOLDER = re.compile(r"\{(host|service|model|vars)\.([A-Za-z0-9_]+)\}")


def origin(url: str | None) -> str | None:
    """scheme://host:port of a rendered URL (None without one or when it has placeholders left):
    where a drain's /metrics and a smoke test's /v1 are (desired/drain.py), and each engine's
    readiness reads (plan/ready.py, which a run that only watches loads without any schema)."""
    if not url or PLACEHOLDER.search(url):
        return None
    parts = urlsplit(url)
    return f"{parts.scheme}://{parts.netloc}" if parts.scheme and parts.netloc else None


class Values(msgspec.Struct, frozen=True):
    """The values placeholders may name. vars is None while the vars themselves are rendered;
    model is None for a service without a model."""

    host: dict[str, str]
    service: dict[str, str]
    model: dict[str, str] | None
    vars: dict[str, str] | None


def render(text: str, ctx: Values) -> tuple[str, list[tuple[int, str]]]:
    """Substitute placeholders; return the text and [(line, why)] for each unknown one."""
    unknown: list[tuple[int, str]] = []

    def substitute(m: re.Match[str]) -> str:
        space, name = m.group(1), m.group(2)
        table = {"host": ctx.host, "service": ctx.service, "model": ctx.model, "vars": ctx.vars}[space]
        if table is not None and name in table:
            return table[name]
        line = text.count("\n", 0, m.start()) + 1
        unknown.append((line, _unknown_placeholder(m.group(0), space, table)))
        return m.group(0)

    return PLACEHOLDER.sub(substitute, text), unknown


def _unknown_placeholder(found: str, space: str, table: dict[str, str] | None) -> str:
    if space == "vars" and table is None:
        return f"placeholder {found} in a var: vars cannot refer to other vars"
    if space == "model" and table is None:
        return f"placeholder {found} but the service has no model (set model.id and model.path)"
    if space == "vars":
        have = ", ".join(sorted(table or {})) or "none"
        return f"unknown placeholder {found}: no such var (vars set: {have})"
    known = ", ".join(f"{{{space}.{k}}}" for k in (table or {}))
    return f"unknown placeholder {found} (known: {known})"
