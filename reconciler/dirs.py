"""Where the controller keeps its own files on this machine (no reconciler imports here)."""

from __future__ import annotations

import os
from pathlib import Path


def default_state_dir() -> Path:
    """$RECONCILER_STATE_DIR, else $XDG_STATE_HOME/reconciler, else ~/.local/state/reconciler."""
    env = os.environ.get("RECONCILER_STATE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_STATE_HOME") or str(Path.home() / ".local" / "state")
    return Path(base) / "reconciler"


def default_cache_dir() -> Path:
    """Where URL repos are mirrored: $RECONCILER_CACHE_DIR or the user's cache dir."""
    env = os.environ.get("RECONCILER_CACHE_DIR")
    if env:
        return Path(env)
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "reconciler"
