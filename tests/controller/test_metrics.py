"""The metrics endpoint's server (review M2, L2): a port someone else holds is said and the
metrics stay off (the daemon still starts); at most MAX_SCRAPES requests at once, idle clients
dropped. prometheus-client's WSGI app on a real socket, 127.0.0.1, an ephemeral port."""

from __future__ import annotations

import socket
import time
import urllib.error
import urllib.request

import pytest

from reconciler.controller import metrics as metrics_mod
from reconciler.controller.metrics import Metrics

pytestmark = pytest.mark.timeout(60)


def test_metrics_on_a_taken_port_are_said_and_left_off(capsys):
    with socket.create_server(("127.0.0.1", 0)) as taken:      # another process got there first
        port = taken.getsockname()[1]
        assert Metrics().serve(f"127.0.0.1:{port}") is None
    assert (f"reconciler: metrics off: cannot listen on 127.0.0.1:{port}: Address already in use: another process "
            "listens there") in capsys.readouterr().out


def test_metrics_serve_a_few_at_once_and_drop_idle_clients(monkeypatch):
    monkeypatch.setattr(metrics_mod._Quiet, "timeout", 0.5)
    m = Metrics()
    server = m.serve("127.0.0.1:0")
    assert server is not None
    port = server.server_address[1]
    url = f"http://127.0.0.1:{port}/metrics"
    try:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(metrics_mod.MAX_SCRAPES)]
        with pytest.raises(urllib.error.HTTPError) as busy:          # every slot holds an idle client
            urllib.request.urlopen(url, timeout=10)
        assert busy.value.code == 503
        for s in idle:                                               # dropped by the server after 0.5 s
            assert s.recv(100) == b""
            s.close()
        deadline = time.monotonic() + 10
        while True:                                                  # the slots free as their threads end
            try:
                body = urllib.request.urlopen(url, timeout=10).read().decode()
                break
            except urllib.error.HTTPError as e:
                assert e.code == 503 and time.monotonic() < deadline
                time.sleep(0.05)
        assert "reconciler_runs_total" in body
    finally:
        server.shutdown()
        server.server_close()
