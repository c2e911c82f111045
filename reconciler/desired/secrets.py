"""Secrets encrypted in git with age, decrypted only by the controller.

An `age` secret is a file in the desired-state repo encrypted to the controller's age public
key (the format is age's: `age`, `rage` and SOPS's age keys interoperate). The controller holds
the identity (a key file named in its config, `age_identity`, never in the repo). Decrypting
happens here, at the edge, after loading: the value goes into the vault (by its digest, for the
executor to deliver) and into the redaction registry, and the service's SecretSpec gets a keyed
digest (HMAC-SHA256 under a key derived from the identity) so a changed value is a changed
service without the value ever being stored. A secret that cannot be decrypted blocks its
service (SecretUndecryptable), with the reason, and nothing is written.

`keygen` and `encrypt` are what `reconcile secrets keygen|encrypt` run for the operator.
"""

from __future__ import annotations

import hashlib
import hmac
import os
from collections.abc import Callable
from pathlib import Path

from .. import redact
from ..values import replace
from .spec import DesiredState, HostSpec, SecretSpec, ServiceSpec

# Decrypted values by digest, for the executor only (never printed, never stored): the one
# place a value lives in the controller, like redact's registry of values to mask.
_VAULT: dict[str, bytes] = {}


def value(digest: str) -> bytes | None:
    """The decrypted value with this digest (for the executor delivering it), or None."""
    return _VAULT.get(digest)


def _identity(path: str | None) -> tuple[object | None, str | None]:
    if not path:
        return None, ("no age identity: set age_identity in /etc/reconciler/config.toml (reconcile watch) or "
                      "pass --age-identity / $RECONCILER_AGE_IDENTITY (reconcile)")
    try:
        from pyrage import x25519
        text = Path(path).read_text()
    except OSError as e:
        return None, f"cannot read the age identity {path}: {e.strerror}"
    keys = [ln.strip() for ln in text.splitlines() if ln.strip().startswith("AGE-SECRET-KEY-")]
    if not keys:
        return None, f"{path} holds no age identity (AGE-SECRET-KEY-1...)"
    try:
        return x25519.Identity.from_str(keys[0]), None
    except Exception:           # pyrage raises its own IdentityError; never echo the key
        return None, f"{path}: not a valid age identity"


def _hmac_key(identity: object) -> bytes:
    return hashlib.sha256(b"reconciler secret digest\0" + str(identity).encode()).digest()


def digest(key: bytes, value: bytes) -> str:
    return hmac.new(key, value, hashlib.sha256).hexdigest()[:32]


class Decryptor:
    """Decrypts the age secrets of rendered desired states with one identity (cached per file)."""

    def __init__(self, identity_path: str | None):
        self.identity, self.problem = _identity(identity_path)
        self.key = _hmac_key(self.identity) if self.identity is not None else b""
        self._seen: dict[bytes, tuple[str, str | None]] = {}     # ciphertext -> (digest, problem)

    def secret(self, s: SecretSpec) -> SecretSpec:
        if s.source != "age":
            return s
        if self.identity is None:
            return replace(s, problem=f"cannot decrypt {s.path}: {self.problem}")
        if s.ciphertext not in self._seen:
            import pyrage
            try:
                clear = pyrage.decrypt(s.ciphertext, [self.identity])
            except Exception:       # DecryptError: wrong recipient, corrupt file
                self._seen[s.ciphertext] = ("", f"cannot decrypt {s.path} with this controller's age identity "
                                                "(encrypted to another key, or damaged)")
            else:
                d = digest(self.key, clear)
                _VAULT[d] = clear
                redact.register(clear)
                self._seen[s.ciphertext] = (d, None)
        d, problem = self._seen[s.ciphertext]
        return replace(s, digest=d, problem=problem)

    def service(self, svc: ServiceSpec) -> ServiceSpec:
        if not svc.secrets:
            return svc
        return replace(svc, secrets=tuple(self.secret(s) for s in svc.secrets))

    def host(self, h: HostSpec) -> HostSpec:
        return replace(h, services={n: self.service(s) for n, s in h.services.items()})

    def state(self, state: DesiredState) -> DesiredState:
        return replace(state, hosts={n: self.host(h) for n, h in state.hosts.items()})

    def render_at(self, render: Callable[[str], DesiredState | None]) -> Callable[[str], DesiredState | None]:
        """render_at with the age secrets of every revision decrypted too (for rollbacks)."""
        def at(rev: str) -> DesiredState | None:
            state = render(rev)
            return self.state(state) if state is not None else None
        return at


def identity_path(explicit: str | None = None) -> str | None:
    """--age-identity, else $RECONCILER_AGE_IDENTITY."""
    return explicit or os.environ.get("RECONCILER_AGE_IDENTITY") or None


def keygen(path: Path) -> str:
    """Write a new age identity to `path` (0600, refusing to overwrite); return its public key."""
    from pyrage import x25519
    ident = x25519.Identity.generate()
    public = str(ident.to_public())
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"# reconciler controller identity; public key: {public}\n{ident}\n")
    return public


def encrypt(value: bytes, recipients: list[str]) -> bytes:
    """Encrypt a value to age recipients (age1... public keys), ASCII-armored for git."""
    import pyrage
    from pyrage import x25519
    keys = [x25519.Recipient.from_str(r.strip()) for r in recipients if r.strip()]
    if not keys:
        raise ValueError("no age recipient: put the controller's public key (age1...) in secrets/recipients.txt")
    return bytes(pyrage.encrypt(value, keys, armored=True))
