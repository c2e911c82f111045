"""The reconciler's own configuration (the controller, not the fleet): one documented place.

    /etc/reconciler/config.toml   (or $RECONCILER_CONFIG)

    repo = "/srv/git/fleet.git"          # path or URL of the desired-state repo
    branch = "main"                      # the branch that deploys
    path = ""                            # sub-directory holding fleet.toml and hosts/
    identity = "/etc/reconciler/id_ed25519"   # SSH client key (never in the repo)
    state_dir = "/var/lib/reconciler-controller"
    cache_dir = "/var/cache/reconciler"
    interval = 60                        # seconds between periodic reconciles (fleet.toml may override)
    trigger_file = ""                    # touched by the post-receive hook (default: <repo>/reconciler.trigger)
    metrics = "127.0.0.1:9187"           # Prometheus endpoint ("" = off)
    allow_rewind = false                 # deploy a revision that does not descend from the last applied
    lock_wait = 30                       # seconds to wait for another run's lock on a host (then: Locked)
    require_signed = false               # only deploy commits signed by a key in allowed_signers
    allowed_signers = "/etc/reconciler/allowed_signers"   # ssh-keygen -Y verify format
    age_identity = "/etc/reconciler/age.key"  # decrypts the repo's age secrets (reconcile secrets keygen)

Every key can be overridden by an environment variable RECONCILER_<KEY> (e.g.
RECONCILER_REPO, RECONCILER_INTERVAL). Signing policy lives here, on the control host, and not
in the desired-state repo, so a push cannot switch it off. So does the age identity that
decrypts the repo's secrets: the repo holds only what is encrypted to its public key.
"""

from __future__ import annotations

import os
import tomllib
from pathlib import Path

from pydantic import BaseModel, ConfigDict, ValidationError

from .errors import ConfigError, Problem

DEFAULT_PATH = Path("/etc/reconciler/config.toml")


class ControllerConfig(BaseModel):
    """Validated controller settings (see the module docstring for each key)."""

    model_config = ConfigDict(extra="forbid")

    repo: str = "."
    branch: str = "main"
    path: str = ""
    identity: str | None = None
    state_dir: str | None = None
    cache_dir: str | None = None
    interval: float | None = None
    trigger_file: str | None = None
    metrics: str = "127.0.0.1:9187"
    allow_rewind: bool = False
    require_signed: bool = False
    lock_wait: float = 30.0
    allowed_signers: str | None = None
    age_identity: str | None = None


def config_path() -> Path:
    return Path(os.environ.get("RECONCILER_CONFIG") or DEFAULT_PATH)


def load_config(path: Path | None = None) -> ControllerConfig:
    """Read the config file (absent = defaults), then apply RECONCILER_* overrides."""
    p = path or config_path()
    data: dict = {}
    if p.exists():
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([Problem(str(p), "", f"TOML syntax error: {e}")]) from None
    for key in ControllerConfig.model_fields:
        env = os.environ.get(f"RECONCILER_{key.upper()}")
        if env is not None and env != "":
            data[key] = env
    try:
        return ControllerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError([Problem(str(p), ".".join(str(x) for x in err["loc"]), err["msg"])
                           for err in e.errors()]) from None
