"""The CLI's progress view (loop/report.PhaseView) while an engine loads: a health watch over a
scripted host (tests/host/test_progress.py's LoadingHost, on a virtual clock) tells the view
each change of the engine's progress. On a pipe or in CI (and in the daemon's run log, which a
push with `-o reconcile.wait` streams) each change is a line of its own; on a terminal it is
the description of the service's bar."""

from __future__ import annotations

import asyncio
import io
import re

from rich.console import Console

from reconciler.desired.spec import HealthSpec
from reconciler.host.health import SystemdWatch, watch_service
from reconciler.loop.report import PhaseView, PlainConsole
from tests.host.test_progress import POLL, LoadingHost

BATCHES = [["[TP0] Load weight begin. avail mem=78.50 GB"],
           ["Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01, 1.0s/it]"],
           ["\rLoading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00, 1.0s/it]",
            "[TP0] Load weight end. elapsed=2.00 s"],
           ["[TP0] Capture cuda graph begin. avail mem=6.41 GB", "[TP0] Capture cuda graph bs [1, 2, 4, 8]"],
           ["[TP0] The server is fired up and ready to roll!"]]


def watched(view: PhaseView) -> str:
    t = LoadingHost(BATCHES, loading=4.5)

    async def main():
        return await watch_service(t, "m", HealthSpec(stable_for=0.5, startup_timeout=1800), baseline_restarts=0,
                                   since_epoch=0, baseline_invocation="old", systemd=SystemdWatch(t, POLL, t.clock),
                                   on_phase=lambda s, p, e, to: view("gpu-1", s, p, e, to))
    with view:
        return asyncio.run(main()).reason


def test_on_a_pipe_each_change_of_the_engines_progress_is_a_line():
    buf = io.StringIO()
    assert watched(PhaseView(PlainConsole(buf, 160))) == "Healthy"      # what `reconcile | tee` prints
    lines = [re.sub(r"^\[ *[\d.]+s\] ", "", line) for line in buf.getvalue().splitlines()]
    assert lines == ["gpu-1 m: starting", "gpu-1 m: loading weights",
                     "gpu-1 m: loading weights: 1/2 checkpoint shards (50%)",
                     "gpu-1 m: weights loaded (2 checkpoint shards)",
                     "gpu-1 m: capturing CUDA graphs (4 batch sizes)", "gpu-1 m: engine ready",
                     "gpu-1 m: healthy, checking it stays stable for 0.5s", "gpu-1 m: healthy"]
    # each line with the seconds into the health wait: the second read, a second after the first
    assert re.match(r"\[ +1\.1s\] gpu-1 m: loading weights: 1/2", buf.getvalue().splitlines()[2])


def test_the_daemons_run_log_which_a_push_streams_has_the_same_lines():
    buf = io.StringIO()
    log = Console(file=buf, highlight=False, force_terminal=False, width=160)      # daemon.py's run log
    watched(PhaseView(log, plans=log))
    text = buf.getvalue()
    assert "gpu-1 m: loading weights: 1/2 checkpoint shards (50%)\n" in text
    assert "gpu-1 m: capturing CUDA graphs (4 batch sizes)\n" in text and "gpu-1 m: engine ready\n" in text


def test_on_a_terminal_the_bar_of_the_service_says_where_the_engine_is():
    seen: list[str] = []
    view = PhaseView(Console(file=io.StringIO(), force_terminal=True, width=160))
    assert view.progress is not None
    update = view.progress.update

    def spy(task, **kw):        # every description the bar was given, in order
        if "description" in kw:
            seen.append(kw["description"])
        update(task, **kw)
    view.progress.update = spy          # type: ignore[method-assign]
    watched(view)
    assert "gpu-1 m: loading weights: 1/2 checkpoint shards (50%)" in seen
    assert seen.index("gpu-1 m: loading weights") < seen.index("gpu-1 m: engine ready") < seen.index("gpu-1 m: healthy")
