"""Fault injection, for the tests that kill the controller in the middle of a deploy.

`RECONCILER_FAULT=point[,point...]` makes the process SIGKILL itself (nothing cleaned up, as a
crash or a power loss would) when it reaches one of these points of a host's run:

    mid-apply          the apply script cut short after the intent and the first file written
    before-apply       the plan is known, nothing applied
    after-apply        applied and started, no health watch yet
    in-watch           the deploy's health watch has begun
    after-verdict      a verdict was recorded on the host, nothing done after it
    in-rollback-watch  the rollback's health watch has begun

On the host side, `pause-after-temp`, `pause-after-rename` and `pause-before-reload` make the
apply script sleep RECONCILER_FAULT_PAUSE seconds (default 5) at that point of its file writes,
so a test can cut or blackhole the connection, or kill the controller, right there.

For the containment of a health watch's exception (review N5), `progress-raises`: reading a
journal line with a count longer than the progress parser takes raises OverflowError, as E4's
line did before counts were bounded (reconciler/host/progress.py); that service's watch then
comes to no verdict, and the run goes on.

And for the daemon's watchdog test, `block-loop`: once the file /run/reconciler-block-loop
exists, the daemon's event loop blocks (as a wedged loop would) and systemd must restart it.

Unset in normal use: `hit()` is then one environment lookup.
"""

from __future__ import annotations

import os
import signal


def armed(point: str) -> bool:
    """True when the environment asks for a fault at `point`."""
    return point in os.environ.get("RECONCILER_FAULT", "").split(",")


BLOCK_FILE = "/run/reconciler-block-loop"
_PAUSES = {"pause-after-temp": "RC_PAUSE_AFTER_TEMP", "pause-after-rename": "RC_PAUSE_AFTER_RENAME",
           "pause-before-reload": "RC_PAUSE_BEFORE_RELOAD"}


def host_pauses() -> dict[str, str]:
    """The apply script's pauses the environment asks for (none normally): each one's variable
    and RECONCILER_FAULT_PAUSE as a plain number of seconds (default 5)."""
    seconds = os.environ.get("RECONCILER_FAULT_PAUSE", "5")
    if not seconds.replace(".", "", 1).isdigit():
        seconds = "5"
    return {var: seconds for point, var in _PAUSES.items() if armed(point)}


def block_loop_if_asked() -> None:
    """With RECONCILER_FAULT=block-loop and BLOCK_FILE present: block the calling event loop."""
    import time
    if armed("block-loop") and os.path.exists(BLOCK_FILE):
        time.sleep(10**6)


def hit(point: str) -> None:
    """Kill this process at `point` when the environment asks for it."""
    if armed(point):
        os.kill(os.getpid(), signal.SIGKILL)
