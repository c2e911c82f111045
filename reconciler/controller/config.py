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
    web = "127.0.0.1:9188"               # the read-only fleet page ("" = off); loopback: open it through ssh -L
    allow_rewind = false                 # deploy a revision that does not descend from the last applied
    lock_wait = 30                       # seconds to wait for another run's lock on a host (then: Locked)
    require_signed = false               # only deploy commits signed by a key in allowed_signers
    allowed_signers = "/etc/reconciler/allowed_signers"   # ssh-keygen -Y verify format
    age_identity = "/etc/reconciler/age.key"  # decrypts the repo's age secrets (reconcile secrets keygen)
    notes = true                         # record each run's outcome as git notes (refs/notes/reconciler)
    forge_url = ""                       # commit statuses on a forge: API base (https://api.github.com, or
                                         #   https://GITEA/api/v1); "" = off. See forge.py.
    forge_repo = ""                      # owner/name on the forge
    forge_token_file = ""                # the forge token: a file (0600, the daemon's) ...
    forge_token_env = ""                 # ... or the name of an environment variable holding it
    forge_target_url = ""                # optional link on each status; {sha} {short} {host} are filled in
    forge_timeout = 5                    # seconds per request
    labels = []                          # only hosts carrying every KEY=VALUE here (a shard of the
                                         #   fleet: ["shard=a"]); env: RECONCILER_LABELS="shard=a,gpu=h200"
    notes_pushers = []                   # users who may push refs/notes/reconciler* (pull-mode hosts' own
                                         #   account; the pre-receive hook refuses everyone else)
    webhook_allow = []                   # non-public networks fleet.toml's [notify] webhook may reach
                                         #   (["10.20.0.0/16"]); loopback, private, link-local: refused
                                         #   otherwise. env: RECONCILER_WEBHOOK_ALLOW="10.20.0.0/16,..."

Every key can be overridden by an environment variable RECONCILER_<KEY> (e.g.
RECONCILER_REPO, RECONCILER_INTERVAL). Under systemd, the keys may come as credentials
(LoadCredential=id_ed25519:... and age.key:..., see systemd/reconciler.service): a credential of
that name in $CREDENTIALS_DIRECTORY is used instead of the identity (age_identity) path, so the
files in /etc/reconciler can stay root's alone. Signing policy lives here, on the control host, and not
in the desired-state repo, so a push cannot switch it off. So does the age identity that
decrypts the repo's secrets: the repo holds only what is encrypted to its public key. And so do
the forge's address and token: a push cannot send the token anywhere else. And so do the networks
a pushed webhook URL may reach besides public addresses (webhook_allow, host/notify.py).
"""

from __future__ import annotations

import ipaddress
import os
import tomllib
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, field_validator, model_validator

from ..errors import ConfigError, Problem

DEFAULT_PATH = Path("/etc/reconciler/config.toml")
# systemd credentials (LoadCredential=) that stand in for a key's path: (config key, credential name)
CREDENTIALS = (("identity", "id_ed25519"), ("age_identity", "age.key"))


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
    web: str = "127.0.0.1:9188"
    allow_rewind: bool = False
    require_signed: bool = False
    lock_wait: float = 30.0
    allowed_signers: str | None = None
    age_identity: str | None = None
    notes: bool = True
    forge_url: str | None = None
    forge_repo: str | None = None
    forge_token_file: str | None = None
    forge_token_env: str | None = None
    forge_target_url: str | None = None
    forge_timeout: float = 5.0
    labels: list[str] = []
    notes_pushers: list[str] = []
    webhook_allow: list[str] = []

    @field_validator("labels", "notes_pushers", "webhook_allow", mode="before")
    @classmethod
    def _label_list(cls, v: object) -> object:
        """A list, or (from RECONCILER_LABELS, _NOTES_PUSHERS, _WEBHOOK_ALLOW) one string of items
        split by commas."""
        if isinstance(v, str):
            return [x.strip() for x in v.replace(" ", ",").split(",") if x.strip()]
        return v

    @field_validator("webhook_allow")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        """Each item an address or a CIDR network (10.20.0.0/16, fd00::/8)."""
        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not a network: an address or CIDR, like 10.20.0.0/16") from None
        return v

    @field_validator("forge_url", "forge_target_url")
    @classmethod
    def _http_url(cls, v: str | None) -> str | None:
        if not v:
            return None
        try:
            u = urlsplit(v)
        except ValueError:
            u = None
        if u is None or u.scheme not in ("http", "https") or not u.hostname or any(c.isspace() for c in v):
            raise ValueError("expected an http:// or https:// URL with a host (the value is not shown)")
        return v

    @field_validator("forge_repo", "forge_token_file", "forge_token_env")
    @classmethod
    def _empty_is_none(cls, v: str | None) -> str | None:
        return v or None

    @model_validator(mode="after")
    def _forge_complete(self) -> ControllerConfig:
        if self.forge_url is None:
            return self
        if not self.forge_repo or self.forge_repo.count("/") != 1 or not all(self.forge_repo.split("/")):
            raise ValueError("forge_url is set: forge_repo must be the repository on the forge as owner/name")
        if bool(self.forge_token_file) == bool(self.forge_token_env):
            raise ValueError("forge_url is set: give the token as exactly one of forge_token_file (a file) or "
                             "forge_token_env (the name of an environment variable), never in the config itself")
        return self


def config_path() -> Path:
    return Path(os.environ.get("RECONCILER_CONFIG") or DEFAULT_PATH)


def _credentials() -> dict[str, str]:
    """The keys systemd passed as credentials ($CREDENTIALS_DIRECTORY), as config values."""
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if not creds:
        return {}
    return {key: str(Path(creds) / name) for key, name in CREDENTIALS if (Path(creds) / name).is_file()}


def load_config(path: Path | None = None) -> ControllerConfig:
    """Read the config file (absent = defaults), then apply RECONCILER_* overrides, then the
    keys systemd passed as credentials."""
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
    data.update(_credentials())
    try:
        return ControllerConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError([Problem(str(p), ".".join(str(x) for x in err["loc"]), err["msg"])
                           for err in e.errors()]) from None
