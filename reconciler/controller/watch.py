"""What `reconcile watch` watches to see a push within a second (watchfiles): the branch ref of a
local repo (and packed-refs), and the trigger file the post-receive hook touches. Each change
only asks for a run; the daemon decides what a run does.

The trigger file is used only when it is safe to (trigger.prepare_trigger); a refused one is
said, and pushes are then seen through the branch ref alone. A URL repo has neither: the timer
and the hook's own ask are all there is.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

from .. import redact
from ..desired import source
from .config import ControllerConfig
from .trigger import prepare_trigger


def watch_paths(cfg: ControllerConfig) -> tuple[list[Path], set[str]]:
    """The folders to watch and the files in them whose changes ask for a run: the trigger file
    (the config's, else <repo>/reconciler.trigger of a local repo; made ready here, or said to be
    refused) and a local repo's branch ref and packed-refs."""
    paths: list[Path] = []
    names: set[str] = set()
    gitdir = None if source.is_url(cfg.repo) else Path(source.open_repo(cfg.repo).path)
    trigger = Path(cfg.trigger_file) if cfg.trigger_file else gitdir and gitdir / "reconciler.trigger"
    if trigger:
        trigger.parent.mkdir(parents=True, exist_ok=True)
        refused = prepare_trigger(trigger)
        if refused:
            print(redact.redact(f"reconciler: not using the trigger file {trigger}: {refused}; pushes are "
                                f"seen through the branch ref only"), flush=True)
        else:
            paths.append(trigger.parent)
            names.add(str(trigger))
    if gitdir is not None:
        paths.append(gitdir)
        names |= {str(gitdir / "refs" / "heads" / cfg.branch), str(gitdir / "packed-refs")}
    return paths, names


async def watch(paths: list[Path], names: set[str], stopping: asyncio.Event, ask: Callable[[str], None]) -> None:
    """Ask for a run at each change of `names` under `paths` ("push" for a ref, "trigger" for the
    trigger file) until `stopping` is set; nothing to watch returns at once."""
    from watchfiles import awatch
    if not paths:
        return
    async for changes in awatch(*paths, watch_filter=lambda _c, p: p in names, debounce=50, step=10,
                                stop_event=stopping, recursive=True):
        ask("push" if any("refs" in p for _, p in changes) else "trigger")
