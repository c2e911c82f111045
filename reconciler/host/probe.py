"""The HTTP health probe: httpx over a byte stream the host opens for us.

A model server usually listens on the host only (or on a private address), so the probe does
not dial it from here: the transport's `open_connection(host, port)` is an SSH direct-tcpip
channel, and the request leaves from the host itself. The server need not be exposed, and the
probe sees what a client on the host would see.

httpx does the HTTP (chunked bodies, framing, status lines) through a small httpcore network
backend whose `connect_tcp` asks the transport for that channel, and whose `start_tls` runs
real TLS over it (anyio's `TLSStream`, i.e. `ssl.MemoryBIO`). `https://` is verified against a
configurable CA bundle (`ca_pem`, e.g. a fleet's private CA) or the system's default CAs, with
SNI and the hostname check against the URL's host: a self-signed health endpoint needs its CA
in the desired state, never `verify=False`.

The probe never raises for a network failure: a refused connection is how a model server says
"still loading". It returns `(status, body)` or `(None, "<phase>: <why>")` with phase one of
`url`, `connect`, `tls`, `read`. Redirects are not followed, the body read stops at `max_body`
bytes, and one deadline bounds the whole exchange.
"""

from __future__ import annotations

import asyncio
import contextlib
import ssl
import time
from collections.abc import AsyncIterable, AsyncIterator, Iterable

import anyio
import anyio.abc
import httpcore
import httpx
from anyio.streams.tls import TLSAttribute, TLSStream

from ..desired.tls import ssl_context as _ssl_context
from ..desired.tls import ssl_reason as _ssl_reason
from .transport import Transport

__all__ = ["http_probe", "http_request"]

_HEADERS = {
    "User-Agent": "reconciler-health-probe",
    "Accept-Encoding": "identity",  # the body bound counts bytes on the wire, not inflated ones
    "Connection": "close",
}


async def http_request(t: Transport, url: str, *, method: str = "GET", body: str | None = None,
                       content_type: str = "application/json", timeout: float = 5.0, ca_pem: str | None = None,
                       max_body: int = 65536, lines: list[tuple[float, str]] | None = None) -> tuple[int | None, str]:
    """A request from the host behind `t` (a GET: the health probe, `http_probe`; a drain's call,
    a smoke test's completion): `(status, body)` or `(None, short error)`.

    `timeout` bounds the whole exchange (connect, TLS, request, body); past `max_body` bytes of
    body the rest is left unread and the connection closed. `ca_pem`: the PEM text of the CA
    bundle that `https://` must chain to (None: the system's default CAs). `lines`: read the
    answer line by line into it, each with the seconds since the request was sent (a streamed
    completion's time to its first token).
    """
    backend = _ChannelBackend(t)
    try:
        ssl_context = _ssl_context(ca_pem) if url.lower().startswith("https:") else None
    except (ssl.SSLError, ValueError, TypeError) as e:
        return None, f"tls: ca_pem is not a usable CA bundle: {_ssl_reason(e)}"
    data = body.encode() if body is not None else None
    headers = {"Content-Type": content_type} if data is not None else None
    try:
        async with asyncio.timeout(timeout):
            pool = httpcore.AsyncConnectionPool(ssl_context=ssl_context, network_backend=backend,
                                                max_connections=1, retries=0, http1=True, http2=False)
            client = httpx.AsyncClient(transport=_PoolTransport(pool), timeout=timeout, follow_redirects=False,
                                       trust_env=False, headers=_HEADERS)
            sent = time.monotonic()
            async with client, client.stream(method, url, content=data, headers=headers) as response:
                if lines is not None:
                    # A streamed answer (server-sent events): each line with the seconds since the request went
                    read = 0
                    async for line in response.aiter_lines():
                        lines.append((time.monotonic() - sent, line))
                        read += len(line)
                        if read >= max_body:
                            break
                    return response.status_code, "\n".join(text for _, text in lines)
                got, limit = bytearray(), max(max_body, 0)
                async for chunk in response.aiter_raw():
                    got += chunk[:limit - len(got)]
                    if len(got) >= limit:
                        break
                return response.status_code, got.decode("utf-8", errors="replace")
    except TimeoutError:
        return None, f"{backend.phase}: {'ReadTimeout' if backend.phase == 'read' else 'ConnectTimeout'}"
    except Exception as e:  # a network failure is an answer, not a bug in the caller
        return None, _describe(backend, e)


http_probe = http_request       # the health probe's GET


def _describe(backend: _ChannelBackend, e: Exception) -> str:
    """One short line for a failed probe; the root cause says more than httpx's wrapper."""
    phase, root = backend.phase, backend.cause or e
    if isinstance(e, (httpx.InvalidURL, httpx.UnsupportedProtocol, httpcore.UnsupportedProtocol)):
        return f"url: {e}"
    if isinstance(root, ssl.SSLCertVerificationError):
        return f"tls: certificate verify failed: {root.verify_message}"
    if isinstance(root, ssl.SSLError):
        return f"tls: {_ssl_reason(root)}"
    if isinstance(e, (httpx.TimeoutException, httpcore.TimeoutException)):
        return f"{phase}: {type(e).__name__}"
    if phase == "connect":
        reason = getattr(root, "reason", None)  # asyncssh.ChannelOpenError says why the host refused
        return f"connect: {type(root).__name__}" + (f" ({reason})" if reason else "")
    detail = str(e)
    return f"{phase}: {type(e).__name__}" + (f": {detail[:200]}" if detail else "")


class _ChannelBackend(httpcore.AsyncNetworkBackend):
    """httpcore's network: every TCP connection is `Transport.open_connection` on the host."""

    def __init__(self, t: Transport) -> None:
        self._t = t
        self.phase = "connect"   # how far the exchange got, for the error message
        # What failed under httpcore's exception: its pool re-raises `from None`, so the chain
        # does not keep it.
        self.cause: BaseException | None = None

    async def connect_tcp(self, host: str, port: int, timeout: float | None = None,
                          local_address: str | None = None,
                          socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                          ) -> httpcore.AsyncNetworkStream:
        try:
            with anyio.fail_after(timeout):
                reader, writer = await self._t.open_connection(host, port)
        except TimeoutError as e:
            raise httpcore.ConnectTimeout(f"connect to {host}:{port}") from e
        except Exception as e:  # OSError locally; asyncssh.ChannelOpenError through SSH
            self.cause = e
            raise httpcore.ConnectError(f"connect to {host}:{port}: {e}") from e
        self.phase = "read"
        return _Stream(_StreamPair(reader, writer), self)

    async def connect_unix_socket(self, path: str, timeout: float | None = None,
                                  socket_options: Iterable[httpcore.SOCKET_OPTION] | None = None,
                                  ) -> httpcore.AsyncNetworkStream:
        raise httpcore.ConnectError("unix sockets are not probed")

    async def sleep(self, seconds: float) -> None:
        await asyncio.sleep(seconds)


class _StreamPair(anyio.abc.ByteStream):
    """An asyncio (or asyncssh) reader/writer pair as an anyio byte stream, for TLSStream."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader, self._writer = reader, writer

    async def receive(self, max_bytes: int = 65536) -> bytes:
        data = await self._reader.read(max_bytes)
        if not data:
            raise anyio.EndOfStream
        return data

    async def send(self, item: bytes) -> None:
        self._writer.write(item)
        await self._writer.drain()

    async def send_eof(self) -> None:
        if self._writer.can_write_eof():
            self._writer.write_eof()

    async def aclose(self) -> None:
        self._writer.close()
        with contextlib.suppress(Exception):   # already gone: nothing left to close
            await asyncio.wait_for(self._writer.wait_closed(), 1.0)


class _Stream(httpcore.AsyncNetworkStream):
    """httpcore's view of one connection, plain or TLS, with httpcore's exceptions."""

    def __init__(self, stream: anyio.abc.ByteStream, backend: _ChannelBackend) -> None:
        self._stream = stream
        self._backend = backend

    async def read(self, max_bytes: int, timeout: float | None = None) -> bytes:
        try:
            with anyio.fail_after(timeout):
                return await self._stream.receive(max_bytes)
        except anyio.EndOfStream:
            return b""
        except TimeoutError as e:
            raise httpcore.ReadTimeout("no data") from e
        except Exception as e:
            self._backend.cause = e
            raise httpcore.ReadError(str(e)) from e

    async def write(self, buffer: bytes, timeout: float | None = None) -> None:
        if not buffer:
            return
        try:
            with anyio.fail_after(timeout):
                await self._stream.send(buffer)
        except TimeoutError as e:
            raise httpcore.WriteTimeout("write blocked") from e
        except Exception as e:
            self._backend.cause = e
            raise httpcore.WriteError(str(e)) from e

    async def aclose(self) -> None:
        await self._stream.aclose()

    async def start_tls(self, ssl_context: ssl.SSLContext, server_hostname: str | None = None,
                        timeout: float | None = None) -> httpcore.AsyncNetworkStream:
        self._backend.phase = "tls"
        try:
            with anyio.fail_after(timeout):
                # standard_compatible=False: many servers close without close_notify.
                tls = await TLSStream.wrap(self._stream, hostname=server_hostname,
                                           ssl_context=ssl_context, standard_compatible=False)
        except BaseException as e:
            await self.aclose()   # on cancellation too: httpcore never closes a stream whose start_tls failed
            if isinstance(e, TimeoutError):
                raise httpcore.ConnectTimeout("TLS handshake") from e
            if isinstance(e, Exception):
                self._backend.cause = e
                raise httpcore.ConnectError(f"TLS handshake: {e}") from e
            raise
        self._backend.phase = "read"
        return _Stream(tls, self._backend)

    def get_extra_info(self, info: str) -> object:
        if info == "ssl_object":   # httpcore reads the negotiated ALPN protocol from it
            return self._stream.extra(TLSAttribute.ssl_object, None)
        return None


class _PoolTransport(httpx.AsyncBaseTransport):
    """httpx on top of an httpcore pool with our network backend.

    What httpx.AsyncHTTPTransport does, minus its own pool (it takes no network backend).
    httpcore's exceptions are left as they are: `_describe` reads both families.
    """

    def __init__(self, pool: httpcore.AsyncConnectionPool) -> None:
        self._pool = pool

    async def handle_async_request(self, request: httpx.Request) -> httpx.Response:
        assert isinstance(request.stream, httpx.AsyncByteStream)
        req = httpcore.Request(
            method=request.method,
            url=httpcore.URL(scheme=request.url.raw_scheme, host=request.url.raw_host,
                             port=request.url.port, target=request.url.raw_path),
            headers=request.headers.raw, content=request.stream, extensions=request.extensions)
        resp = await self._pool.handle_async_request(req)
        assert isinstance(resp.stream, AsyncIterable)
        return httpx.Response(status_code=resp.status, headers=resp.headers,
                              stream=_Body(resp.stream), extensions=resp.extensions)

    async def aclose(self) -> None:
        await self._pool.aclose()


class _Body(httpx.AsyncByteStream):
    def __init__(self, stream: AsyncIterable[bytes]) -> None:
        self._stream = stream

    async def __aiter__(self) -> AsyncIterator[bytes]:
        async for part in self._stream:
            yield part

    async def aclose(self) -> None:
        aclose = getattr(self._stream, "aclose", None)
        if aclose is not None:
            await aclose()
