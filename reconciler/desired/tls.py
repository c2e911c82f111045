"""PEM CA bundles for https health checks: checked when the desired state is loaded (pure: no
host, no network), and the TLS context the probe verifies with."""

from __future__ import annotations

import ssl
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from cryptography import x509


def check_ca_pem(pem: str) -> str | None:
    """Why `pem` is not a usable PEM CA bundle for `http_probe`, or None when it is."""
    if "-----BEGIN CERTIFICATE-----" not in pem:
        return "no PEM certificate in it (expected -----BEGIN CERTIFICATE-----)"
    from cryptography import x509  # only here: the probe itself needs no X.509 parsing
    try:
        ssl_context(pem)   # exactly what the probe will load
        certs = x509.load_pem_x509_certificates(pem.encode())
    except (ssl.SSLError, ValueError, TypeError) as e:
        return f"not a PEM certificate bundle: {ssl_reason(e)}"
    for cert in certs:
        # OpenSSL trusts a CA or a self-signed certificate pinned as is, never a bare leaf
        # issued by someone else (the usual mistake: the server's certificate, not its CA's).
        if cert.issuer != cert.subject and not _is_ca(cert):
            return (f"{cert.subject.rfc4514_string()} is a server certificate issued by "
                    f"{cert.issuer.rfc4514_string()}: give that CA's certificate instead")
    return None


def _is_ca(cert: x509.Certificate) -> bool:
    from cryptography import x509
    try:
        return cert.extensions.get_extension_for_class(x509.BasicConstraints).value.ca
    except x509.ExtensionNotFound:
        return False


def ssl_context(ca_pem: str | None) -> ssl.SSLContext:
    # create_default_context: CERT_REQUIRED, check_hostname, modern protocols. With cadata it
    # trusts exactly that bundle; without (None), the system's default CA paths.
    return ssl.create_default_context(cadata=ca_pem)


def ssl_reason(e: BaseException) -> str:
    return str(getattr(e, "reason", None) or e) or type(e).__name__
