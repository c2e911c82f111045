"""L1 of the 2026-12-02 review: a pushed webhook URL (fleet.toml) reaches only public addresses
unless the controller's own config allows a network; no redirect is followed; of an answer only
its status code reaches the run's output."""

from __future__ import annotations

import asyncio
import http.server
import socket
import threading
from collections.abc import Iterator
from typing import ClassVar

import pytest

from reconciler.controller.config import load_config
from reconciler.desired.spec import NotifySpec
from reconciler.errors import ConfigError
from reconciler.host import notify
from reconciler.host.notify import ALLOW_ENV, Notifier, WebhookRefused, check_address


@pytest.fixture(autouse=True)
def _no_allowance(monkeypatch: pytest.MonkeyPatch) -> None:
    """Each test starts as a controller with no webhook_allow (and puts back what it changes)."""
    monkeypatch.delenv(ALLOW_ENV, raising=False)
    monkeypatch.setattr(notify, "_allowed", None)


class Answer(http.server.BaseHTTPRequestHandler):
    """Answers every POST with `status`, a reason phrase of the target's choosing and `headers`."""

    hits: ClassVar[list[str]]
    hosts: ClassVar[list[str]]
    status: ClassVar[int] = 200
    headers_out: ClassVar[dict[str, str]] = {}

    def do_POST(self) -> None:  # http.server's naming
        self.rfile.read(int(self.headers["Content-Length"]))
        type(self).hits.append(self.path)
        type(self).hosts.append(self.headers["Host"])
        self.send_response(type(self).status, "TARGET-CHOSEN-REASON secret=hunter2")
        for k, v in type(self).headers_out.items():
            self.send_header(k, v)
        self.end_headers()

    do_GET = do_POST

    def log_message(self, *args: object) -> None:
        pass


def serve(status: int = 200, **headers: str) -> tuple[http.server.ThreadingHTTPServer, type[Answer]]:
    handler = type("A", (Answer,), {"hits": [], "hosts": [], "status": status, "headers_out": headers})
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, handler


@pytest.fixture
def target() -> Iterator[tuple[str, type[Answer]]]:
    server, handler = serve()
    yield f"http://127.0.0.1:{server.server_address[1]}/hook", handler
    server.shutdown()


def deliver(url: str) -> Notifier:
    async def run() -> Notifier:
        n = Notifier(NotifySpec(url, timeout=5))
        n.send("rollout.start", service="m")
        await n.close(10)
        return n
    return asyncio.run(run())


def test_a_loopback_webhook_is_refused_unless_the_controller_allows_it(target, monkeypatch):
    url, handler = target
    refused = deliver(url)
    assert handler.hits == []
    assert refused.failures == [
        f"webhook {notify.where(url)}: rollout.start not delivered: WebhookRefused: 127.0.0.1 is a loopback "
        f"address; a webhook reaches it only when the controller's config allows its network (webhook_allow, "
        f"or ${ALLOW_ENV} for `reconcile`)"]
    monkeypatch.setenv(ALLOW_ENV, "127.20.0.0/16, 127.0.0.1/32")       # the `reconcile` command's allowance
    assert deliver(url).failures == [] and handler.hits == ["/hook"]


def test_the_daemons_config_allows_a_network(target, tmp_path, monkeypatch):
    url, handler = target
    cfg = tmp_path / "config.toml"
    cfg.write_text('webhook_allow = ["127.0.0.0/8"]\n')
    notify.allow(load_config(cfg).webhook_allow)
    assert deliver(url).failures == [] and handler.hits == ["/hook"]


def test_a_name_is_judged_by_every_address_it_resolves_to(target):
    url, handler = target
    n = deliver(url.replace("127.0.0.1", "localhost"))
    assert handler.hits == [] and len(n.failures) == 1 and "WebhookRefused" in n.failures[0]


def test_an_allowed_name_is_reached_at_its_checked_address_under_its_own_name(target, monkeypatch):
    # The transport connects to the address it checked (the URL rewritten to it); the request
    # still names the host as the URL did.
    url, handler = target
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.0/8, ::1/128")
    named = url.replace("127.0.0.1", "localhost")
    assert deliver(named).failures == [] and handler.hits == ["/hook"]
    assert handler.hosts == [named.split("/")[2]]


def test_a_redirect_is_not_followed(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.1/32")
    inner, inner_handler = serve()
    outer, outer_handler = serve(302, Location=f"http://127.0.0.1:{inner.server_address[1]}/inner")
    try:
        n = deliver(f"http://127.0.0.1:{outer.server_address[1]}/outer")
    finally:
        inner.shutdown()
        outer.shutdown()
    assert outer_handler.hits == ["/outer"] and inner_handler.hits == []
    assert n.failures == [f"webhook http://127.0.0.1:{outer.server_address[1]}: rollout.start not delivered: HTTP 302"]


def test_only_the_status_code_of_an_answer_is_shown(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.1/32")
    server, _handler = serve(500)
    try:
        n = deliver(f"http://127.0.0.1:{server.server_address[1]}/hook")
    finally:
        server.shutdown()
    assert n.failures == [f"webhook http://127.0.0.1:{server.server_address[1]}: rollout.start not delivered: HTTP 500"]


def test_a_malformed_answer_is_named_by_its_kind_not_its_text(monkeypatch):
    monkeypatch.setenv(ALLOW_ENV, "127.0.0.1/32")
    with socket.socket() as srv:
        srv.bind(("127.0.0.1", 0))
        srv.listen()
        port = srv.getsockname()[1]

        def answer() -> None:
            conn, _ = srv.accept()
            with conn:
                conn.settimeout(10)
                conn.recv(65536)
                conn.sendall(b"SSH-2.0-OpenSSH_9.2 banner-of-a-service-on-that-port\r\n")
                conn.shutdown(socket.SHUT_WR)      # the answer ends; what the client still sends is read,
                while conn.recv(65536):            # so a body that came late is no reset (a ReadError)
                    pass

        threading.Thread(target=answer, daemon=True).start()
        n = deliver(f"http://127.0.0.1:{port}/x")
    assert n.failures == [f"webhook http://127.0.0.1:{port}: rollout.start not delivered: "
                          f"RemoteProtocolError (the answer is not shown)"]


@pytest.mark.parametrize("address", ["127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254",
                                     "100.64.0.1", "0.0.0.0", "224.0.0.1", "::1", "fe80::1", "fd00::1",
                                     "::ffff:127.0.0.1", "::ffff:169.254.169.254"])
def test_addresses_that_are_not_public_are_refused(address):
    with pytest.raises(WebhookRefused):
        check_address(address)


@pytest.mark.parametrize("address", ["8.8.8.8", "1.1.1.1", "2001:4860:4860::8888"])
def test_public_addresses_pass(address):
    check_address(address)            # raises nothing (and connects nowhere)


def test_an_allowed_network_lets_its_addresses_pass_and_no_others():
    notify.allow(["127.20.0.0/16"])
    check_address("127.20.3.4")
    with pytest.raises(WebhookRefused):
        check_address("127.21.0.1")


def test_a_bad_network_in_the_config_names_the_file_and_key(tmp_path):
    cfg = tmp_path / "config.toml"
    cfg.write_text('webhook_allow = ["127.0.0.0/33"]\n')
    with pytest.raises(ConfigError) as e:
        load_config(cfg)
    (problem,) = e.value.problems
    assert (problem.file, problem.key) == (str(cfg), "webhook_allow")
    assert "'127.0.0.0/33' is not a network" in problem.message


def test_the_env_list_is_split_like_labels(tmp_path, monkeypatch):
    monkeypatch.setenv("RECONCILER_WEBHOOK_ALLOW", "127.0.0.0/8, 127.7.0.0/24")
    assert load_config(tmp_path / "absent.toml").webhook_allow == ["127.0.0.0/8", "127.7.0.0/24"]
