"""sd_notify for the daemon: READY, STOPPING, STATUS and the watchdog, a few lines on the socket.

`reconciler.service` runs `reconcile watch` with Type=notify and WatchdogSec=: systemd starts
deploys only once the daemon said READY=1, and restarts it when the pings stop. The pings come
from a task on the daemon's own event loop, so a loop that is wedged (a blocking call that never
returns, a deadlock) stops them, and systemd restarts the daemon. Outside systemd (no
$NOTIFY_SOCKET) every call does nothing.
"""

from __future__ import annotations

import contextlib
import os
import socket


def notify(message: str) -> None:
    """Send one sd_notify message; nothing when not run by systemd with a notify socket."""
    path = os.environ.get("NOTIFY_SOCKET")
    if not path:
        return
    addr = "\0" + path[1:] if path.startswith("@") else path
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as s:
        s.connect(addr)
        s.sendall(message.encode())


def watchdog_interval() -> float | None:
    """Seconds between pings (half of WatchdogSec=), or None when systemd set no watchdog."""
    usec = os.environ.get("WATCHDOG_USEC")
    pid = os.environ.get("WATCHDOG_PID")
    if not usec or (pid and pid != str(os.getpid())):
        return None
    try:
        return max(0.5, int(usec) / 1e6 / 2)
    except ValueError:
        return None
