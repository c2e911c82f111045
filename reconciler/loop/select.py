"""PURE: which hosts a run is limited to (--host, --label), in natural order."""

from __future__ import annotations

from ..desired.spec import DesiredState, HostSpec
from ..errors import SourceError
from ..plan.rollout import natural_key
from .options import RunOptions


def selected(state: DesiredState, opts: RunOptions) -> dict[str, HostSpec]:
    """The hosts a run is limited to, in natural order (every host without --host or --label)."""
    names = select_hosts(state, list(opts.hosts) or None, list(opts.labels) or None)
    return {n: state.hosts[n] for n in names or sorted(state.hosts, key=natural_key)}


def select_hosts(state: DesiredState, names: list[str] | None, labels: list[str] | None) -> list[str] | None:
    """The hosts a run is limited to: any of `names` (--host) and, of those, the ones carrying
    every label KEY=VALUE (--label, repeatable: AND). None: no selector, every host.

    Raises SourceError (exit 1, nothing applied) for an unknown name, a malformed label or a
    selection that matches no host, so a typo never turns into "nothing to do".
    """
    if not names and not labels:
        return None
    unknown = sorted(set(names or []) - set(state.hosts))
    if unknown:
        raise SourceError(f"unknown host(s) {', '.join(unknown)} at {state.short} "
                          f"(known: {', '.join(sorted(state.hosts, key=natural_key))})")
    wanted = _wanted_labels(labels or [])
    chosen = [n for n, h in sorted(state.hosts.items(), key=lambda kv: natural_key(kv[0]))
              if (not names or n in names) and all(h.labels.get(k) == v for k, v in wanted.items())]
    if not chosen:
        raise _no_match(state, names, wanted)
    return chosen


def _wanted_labels(labels: list[str]) -> dict[str, str]:
    """The --label KEY=VALUE selectors as key -> value. Raises SourceError for a malformed one, or
    for a key given twice with different values (no host could match both)."""
    from ..desired.fields import LABEL
    wanted: dict[str, str] = {}
    for item in labels:
        key, sep, value = item.partition("=")
        if not sep or not LABEL.match(key) or not LABEL.match(value):
            raise SourceError(f"--label expects KEY=VALUE (letters, digits, '_', '.', '-'), got {item!r}")
        if wanted.get(key, value) != value:
            raise SourceError(f"--label {key}= given twice with different values: no host can match both")
        wanted[key] = value
    return wanted


def _no_match(state: DesiredState, names: list[str] | None, wanted: dict[str, str]) -> SourceError:
    """The error of a selection that matches no host: what was asked, and the labels in use."""
    have = sorted({f"{k}={v}" for h in state.hosts.values() for k, v in h.labels.items()})
    return SourceError(f"no host matches {' '.join('--label ' + k + '=' + v for k, v in wanted.items())}"
                       + (f" among {', '.join(sorted(names or []))}" if names else "")
                       + f" at {state.short} (labels in use: {', '.join(have) or 'none'})")
