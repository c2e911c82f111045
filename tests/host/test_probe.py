"""The HTTP health probe against real servers on 127.0.0.1 (plain and TLS, with a throwaway CA).

`LocalTransport.open_connection` is `asyncio.open_connection`, the same shape as the SSH
direct-tcpip channel the probe uses on a real host; the last test runs that channel for real
(an in-process asyncssh server on 127.0.0.1 and `SSHTransport`).
"""

from __future__ import annotations

import asyncio
import datetime
import ipaddress
import socket
import ssl
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path

import asyncssh
import pytest
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID

from reconciler.desired.tls import check_ca_pem
from reconciler.host.probe import http_probe
from reconciler.host.transport import LocalTransport, SSHTransport

LOOPBACK = "127.0.0.1"
Handler = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@asynccontextmanager
async def serving(handler: Handler, tls: ssl.SSLContext | None = None) -> AsyncIterator[int]:
    """A server on 127.0.0.1 and an ephemeral port; yields the port."""
    async def guarded(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await handler(reader, writer)
        except (ConnectionError, asyncio.IncompleteReadError, ssl.SSLError):
            pass   # the probe hung up early: that is what some tests are about
        except asyncio.CancelledError:
            pass   # the test is over (asyncio 3.11 logs a handler task that ends cancelled)
        finally:
            writer.close()

    server = await asyncio.start_server(guarded, LOOPBACK, 0, ssl=tls)
    try:
        yield server.sockets[0].getsockname()[1]
    finally:
        server.close()


def respond(status: str, body: bytes, *, headers: str = "") -> Handler:
    async def handler(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 {status}\r\nContent-Length: {len(body)}\r\n{headers}\r\n".encode() + body)
        await writer.drain()
    return handler


def probe(url: str, handler: Handler | None = None, tls: ssl.SSLContext | None = None, *,
          timeout: float = 1.0, ca_pem: str | None = None, max_body: int = 65536) -> tuple[int | None, str]:
    """http_probe through LocalTransport; with a handler, `{port}` in url is its server's port."""
    async def main() -> tuple[int | None, str]:
        if handler is None:
            return await http_probe(LocalTransport(), url, timeout=timeout, ca_pem=ca_pem, max_body=max_body)
        async with serving(handler, tls) as port:
            return await http_probe(LocalTransport(), url.format(port=port), timeout=timeout, ca_pem=ca_pem,
                                    max_body=max_body)
    return asyncio.run(main())


def test_plain_200_with_body():
    assert probe("http://127.0.0.1:{port}/health", respond("200 OK", b'{"status": "ok"}')) == \
        (200, '{"status": "ok"}')


def test_503_is_a_status_not_an_error():
    assert probe("http://127.0.0.1:{port}/health", respond("503 Service Unavailable", b"loading")) == \
        (503, "loading")


def test_redirect_is_not_followed():
    assert probe("http://127.0.0.1:{port}/health",
                 respond("302 Found", b"", headers="Location: /elsewhere\r\n")) == (302, "")


def test_chunked_body_is_reassembled():
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for part in (b'{"status":', b' "ok", ', b'"model": "qwen"}'):
            writer.write(b"%x\r\n%s\r\n" % (len(part), part))
            await writer.drain()
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    assert probe("http://127.0.0.1:{port}/", chunked) == (200, '{"status": "ok", "model": "qwen"}')


def test_huge_body_read_is_bounded():
    declared = 1 << 30
    sent = 0

    async def endless(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        nonlocal sent
        await reader.readuntil(b"\r\n\r\n")
        writer.write(f"HTTP/1.1 200 OK\r\nContent-Length: {declared}\r\n\r\n".encode())
        block = b"x" * (1 << 20)
        while sent < declared:
            writer.write(block)
            await writer.drain()   # blocks once the probe stops reading
            sent += len(block)

    status, body = probe("http://127.0.0.1:{port}/", endless, max_body=1000, timeout=2.0)
    assert (status, body) == (200, "x" * 1000)   # at max_body, not at the timeout (that would be ReadTimeout)
    assert sent < 64 << 20      # the probe hung up; only socket buffers' worth went out


def test_refused_port():
    with socket.socket() as s:     # a port that was free a moment ago and has no listener
        s.bind((LOOPBACK, 0))
        port = s.getsockname()[1]
    assert probe(f"http://127.0.0.1:{port}/health", timeout=1.0) == (None, "connect: ConnectionRefusedError")


def test_server_that_never_answers_times_out():
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await asyncio.Event().wait()

    assert probe("http://127.0.0.1:{port}/health", silent, timeout=0.2) == (None, "read: ReadTimeout")


def test_server_that_hangs_up_is_a_read_error():
    async def rude(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")

    status, why = probe("http://127.0.0.1:{port}/health", rude, timeout=1.0)
    assert status is None and why.startswith("read: RemoteProtocolError"), why


def test_bad_url_is_an_answer_not_an_exception():
    assert probe("ftp://127.0.0.1:1/health", timeout=1.0)[0] is None


# -- TLS, with a throwaway CA ---------------------------------------------------------------


@dataclass(frozen=True)
class PKI:
    ca_pem: str
    other_ca_pem: str
    server_ip: ssl.SSLContext        # certificate for IP 127.0.0.1, signed by ca
    server_named: ssl.SSLContext     # certificate for model.internal only, signed by ca
    leaf_pem: str                    # a server certificate issued by ca: not a trust anchor


def _name(cn: str) -> x509.Name:
    return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, cn)])


def _ca(cn: str) -> tuple[ec.EllipticCurvePrivateKey, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(cn)).issuer_name(_name(cn))
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
            .add_extension(x509.KeyUsage(digital_signature=True, key_cert_sign=True, crl_sign=True,
                                         content_commitment=False, key_encipherment=False, data_encipherment=False,
                                         key_agreement=False, encipher_only=False, decipher_only=False), critical=True)
            .sign(key, hashes.SHA256()))
    return key, cert


def _server_ctx(tmp: Path, tag: str, ca_key: ec.EllipticCurvePrivateKey, ca: x509.Certificate,
                san: x509.GeneralName) -> tuple[ssl.SSLContext, x509.Certificate]:
    key = ec.generate_private_key(ec.SECP256R1())
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(_name(f"server-{tag}")).issuer_name(ca.subject)
            .public_key(key.public_key()).serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(hours=1)).not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
            .add_extension(x509.SubjectAlternativeName([san]), critical=False)
            .sign(ca_key, hashes.SHA256()))
    certfile, keyfile = tmp / f"{tag}.crt", tmp / f"{tag}.key"
    certfile.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    keyfile.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                          serialization.NoEncryption()))
    ctx = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ctx.load_cert_chain(certfile, keyfile)
    return ctx, cert


@pytest.fixture(scope="module")
def pki(tmp_path_factory: pytest.TempPathFactory) -> PKI:
    tmp = tmp_path_factory.mktemp("pki")
    ca_key, ca = _ca("reconciler test CA")
    _, other = _ca("some other CA")
    ip_ctx, leaf = _server_ctx(tmp, "ip", ca_key, ca, x509.IPAddress(ipaddress.ip_address(LOOPBACK)))
    named_ctx, _ = _server_ctx(tmp, "named", ca_key, ca, x509.DNSName("model.internal"))
    pem = lambda c: c.public_bytes(serialization.Encoding.PEM).decode()  # noqa: E731
    return PKI(pem(ca), pem(other), ip_ctx, named_ctx, pem(leaf))


OK = respond("200 OK", b"ok")


def test_https_verified_against_the_given_ca(pki: PKI):
    assert probe("https://127.0.0.1:{port}/health", OK, pki.server_ip, ca_pem=pki.ca_pem, timeout=2.0) == (200, "ok")


def test_https_chunked_and_bounded(pki: PKI):
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"400\r\n" + b"y" * 0x400 + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    assert probe("https://127.0.0.1:{port}/", chunked, pki.server_ip, ca_pem=pki.ca_pem,
                 max_body=3000, timeout=2.0) == (200, "y" * 3000)


def test_https_fails_without_the_ca(pki: PKI):
    # None: the system's default CAs, which do not know the throwaway CA.
    status, why = probe("https://127.0.0.1:{port}/health", OK, pki.server_ip, timeout=2.0)
    assert status is None and why.startswith("tls: certificate verify failed"), why


def test_https_fails_with_another_ca(pki: PKI):
    status, why = probe("https://127.0.0.1:{port}/health", OK, pki.server_ip, ca_pem=pki.other_ca_pem, timeout=2.0)
    assert status is None and why.startswith("tls: certificate verify failed"), why


def test_https_fails_on_a_hostname_mismatch(pki: PKI):
    # Signed by the trusted CA, but for model.internal: the URL's host (127.0.0.1) must match.
    status, why = probe("https://127.0.0.1:{port}/health", OK, pki.server_named, ca_pem=pki.ca_pem, timeout=2.0)
    assert status is None and why.startswith("tls: certificate verify failed") and "mismatch" in why, why


def test_https_to_a_plain_http_server_is_a_tls_error(pki: PKI):
    async def plain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.read(100)     # a TLS ClientHello is no HTTP request
        writer.write(b"HTTP/1.1 400 Bad Request\r\nContent-Length: 0\r\n\r\n")
        await writer.drain()

    status, why = probe("https://127.0.0.1:{port}/health", plain, None, ca_pem=pki.ca_pem, timeout=2.0)
    assert status is None and why.startswith("tls: "), why


def test_unusable_ca_pem_is_an_answer(pki: PKI):
    status, why = probe("https://127.0.0.1:1/health", ca_pem="not a pem", timeout=1.0)
    assert status is None and why.startswith("tls: ca_pem is not a usable CA bundle"), why


def test_check_ca_pem(pki: PKI):
    assert check_ca_pem(pki.ca_pem) is None
    assert check_ca_pem(pki.ca_pem + pki.other_ca_pem) is None
    assert "no PEM certificate" in (check_ca_pem("") or "")
    assert "no PEM certificate" in (check_ca_pem("hello") or "")
    broken = "-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n"
    assert "not a PEM certificate bundle" in (check_ca_pem(broken) or "")
    assert "give that CA's certificate instead" in (check_ca_pem(pki.leaf_pem) or "")


class _Forwarder(asyncssh.SSHServer):
    """An SSH server that lets anyone in and opens direct-tcpip channels (to 127.0.0.1 only)."""

    def begin_auth(self, username: str) -> bool:
        return False

    def connection_requested(self, dest_host: str, dest_port: int, orig_host: str, orig_port: int) -> bool:
        return dest_host == LOOPBACK


def test_https_through_an_ssh_direct_tcpip_channel(pki: PKI):
    async def chunked(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await reader.readuntil(b"\r\n\r\n")
        writer.write(b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n")
        for _ in range(100):
            writer.write(b"400\r\n" + b"z" * 0x400 + b"\r\n")
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def main() -> list[tuple[int | None, str]]:
        sshd = await asyncssh.listen(LOOPBACK, 0, server_factory=_Forwarder,
                                     server_host_keys=[asyncssh.generate_private_key("ssh-ed25519")])
        try:
            async with asyncssh.connect(LOOPBACK, sshd.sockets[0].getsockname()[1], known_hosts=None,
                                        username="probe", client_keys=None, agent_path=None, config=[]) as conn:
                t = SSHTransport("h", conn)
                async with serving(chunked, pki.server_ip) as port:
                    url = f"https://127.0.0.1:{port}/health"
                    got = [await http_probe(t, url, ca_pem=pki.ca_pem, max_body=5000, timeout=2.0),
                           await http_probe(t, url, ca_pem=pki.other_ca_pem, timeout=2.0)]
                with socket.socket() as s:
                    s.bind((LOOPBACK, 0))
                    free = s.getsockname()[1]
                got.append(await http_probe(t, f"http://127.0.0.1:{free}/health", timeout=2.0))
                return got
        finally:
            sshd.close()

    ok, other_ca, refused = asyncio.run(main())
    assert ok == (200, "z" * 5000)
    assert other_ca[0] is None and other_ca[1].startswith("tls: certificate verify failed"), other_ca
    assert refused[0] is None and refused[1].startswith("connect: ChannelOpenError"), refused
