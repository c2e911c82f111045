"""Fetching a model onto a host before anything is stopped (`model.fetch`): pre-flight finds a
model missing or incomplete, the plan says FETCH, and this runs the service's own fetch command
in the model directory, with a disk-space check first and progress ticks while it runs."""

from __future__ import annotations

import asyncio
import shlex
import time
from collections.abc import Callable

from ..desired.spec import ModelSpec
from ..errors import CommandError
from ..host.transport import Transport
from ..preflight import ModelFacts

Progress = Callable[[str, str, float, float], None]   # service, phase, elapsed, timeout


async def fetch_model(t: Transport, service: str, model: ModelSpec, facts: ModelFacts | None,
                      on_phase: Progress | None = None) -> str | None:
    """Run model.fetch on the host (before anything is stopped). Returns why it failed, or None.

    Checks free disk space first when the size is known (model.size_gb, or the index's
    total_size), then runs the command in the model directory with model.fetch_timeout.
    """
    need = model.size_gb * 1e9 if model.size_gb else (facts.total_size if facts else None)
    free = facts.free_bytes if facts else None
    if need and free is not None and free < need:
        return (f"model-fetch: not enough disk for {model.id} at {model.path}: needs {need / 1e9:.1f} GB, "
                f"{free / 1e9:.1f} GB free")
    cmd = f"mkdir -p {shlex.quote(model.path)} && cd {shlex.quote(model.path)} && {model.fetch}"
    started = time.monotonic()

    async def tick() -> None:
        while True:
            if on_phase:
                on_phase(service, f"fetching {model.id}", time.monotonic() - started, model.fetch_timeout)
            await asyncio.sleep(1.0)
    ticker = asyncio.create_task(tick())
    try:
        res = await t.run(cmd, timeout=model.fetch_timeout, what=f"fetch {model.id}")
    except CommandError as e:
        return f"model-fetch: {model.fetch!r} did not finish within {model.fetch_timeout:.0f}s: {e.stderr}"
    finally:
        ticker.cancel()
    if not res.ok:
        tail = (res.stderr or res.stdout).strip().splitlines()[-3:]
        return f"model-fetch: {model.fetch!r} failed (exit {res.exit_status}): {' / '.join(tail)}"
    return None
