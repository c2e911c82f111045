"""A service's health check: the parts the schema cannot check alone.

The URL is checked after its placeholders are rendered ({host.address}, {vars.port}), since
only then is it a URL; the CA bundle is a file in the repo, read and checked as PEM here (its
text travels in the HealthSpec, so the probe never reads git).
"""

from __future__ import annotations

from urllib.parse import urlsplit

from .collect import Problems
from .merge import At
from .placeholders import PLACEHOLDER
from .repo import SnapshotLike


def check_health_url(url: str) -> str | None:
    """Why a rendered health URL is unusable, or None."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError:
        return "the port is not a number 1-65535"
    if parts.scheme not in ("http", "https") or not parts.hostname:
        return "it needs http:// or https:// and a host"
    if port is None or port == 0:
        return "it needs an explicit port, like http://{host.address}:30000/health"
    return None


def url_problem(url: str, expected: str = "expected an http(s) URL with a host and port") -> str | None:
    """A rendered URL's problem in words (what was expected, what it renders to, why it is
    unusable), or None: a usable URL, or one still holding a placeholder (render reports those)."""
    why = None if PLACEHOLDER.search(url) else check_health_url(url)
    return f"{expected}, got {url!r}: {why}" if why else None


def read_ca_bundle(snap: SnapshotLike, problems: Problems, path: str, at: At) -> str | None:
    """The PEM text of a health CA bundle, or None with a problem naming file and key."""
    data = snap.read(path)
    if data is None:
        problems.add(at.file, at.key, f"file {path!r} not found in the repository")
        return None
    try:
        text = data.decode("ascii")
    except UnicodeDecodeError:
        problems.add(at.file, at.key, f"{path!r} is not a PEM file (not ASCII)")
        return None
    from .tls import check_ca_pem  # only where a CA is set: it imports cryptography
    why = check_ca_pem(text)
    if why:
        problems.add(at.file, at.key, f"{path!r} is not a usable CA bundle: {why}")
        return None
    return text
