"""The reconciler's own configuration (the controller, not the fleet): one documented place,
/etc/reconciler/config.toml (or $RECONCILER_CONFIG). Every key, its default and what it does:
systemd/config.toml.example (tests/controller/test_config_example.py keeps both in step).

Every key can be overridden by an environment variable RECONCILER_<KEY> (e.g.
RECONCILER_REPO, RECONCILER_INTERVAL), except that the trust keys' (RECONCILER_REQUIRE_SIGNED,
_ALLOWED_SIGNERS, _ALLOW_INSECURE_TRANSPORT) may only make the policy stricter: one that would
loosen the file, or not take effect, is an error (trustvars.py). Signing policy lives here, on the control host, and not
in the desired-state repo, so a push cannot switch it off; the daemon, the git hooks and
`reconcile` run as root all read it (desired/trust.py TrustPolicy). So does the age identity that
decrypts the repo's secrets: the repo holds only what is encrypted to its public key. And so do
the forge's address and token: a push cannot send the token anywhere else.

`web` and `metrics` listen on loopback unless the config says otherwise in so many words
(`web_public`, `metrics_public`): neither has a login or TLS, so a bind to every interface by
mistake would publish the fleet's hosts, labels and journal lines. The same check holds for the
`--web`/`--metrics` options of `reconcile watch` (load_config's overrides).

Under systemd, the keys may come as credentials (LoadCredential=id_ed25519:... and
age.key:..., see systemd/reconciler.service): a credential of that name in
$CREDENTIALS_DIRECTORY is used instead of the identity (age_identity) path, so the files in
/etc/reconciler can stay root's alone. The networks a pushed webhook URL may reach besides public
addresses (webhook_allow, host/notify.py) are set here too.
"""

from __future__ import annotations

import errno
import ipaddress
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, ValidationError, ValidationInfo, field_validator, model_validator

from ..desired.trust import TrustPolicy
from ..errors import ConfigError, Problem
from . import trustvars

SERVED = {"web": "the fleet page", "metrics": "the Prometheus metrics"}


def parse_address(address: str) -> tuple[str, int]:
    """host:port, [v6]:port or :port (loopback) -> (host, port). ValueError says what is wrong."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) < 65536:
        raise ValueError(f"{address!r}: expected host:port, e.g. 127.0.0.1:9188")
    return host.strip("[]") or "127.0.0.1", int(port)


def cannot_listen(address: str, e: Exception) -> str:
    """Why a server could not listen on `address`, in words for the log. A port already in use
    is said as what it may be: another local process that got there first (and that whoever
    opens a tunnel to the port now talks to)."""
    if isinstance(e, OSError) and e.errno == errno.EADDRINUSE:
        return (f"cannot listen on {address}: {e.strerror}: another process listens there, and tunnels to "
                f"this port reach it, not this daemon")
    why = e.strerror if isinstance(e, OSError) and e.strerror else str(e)
    return f"cannot listen on {address}: {why}"


def public_note(key: str, host: str) -> str:
    """What the start-up log line adds when `key` (web, metrics) listens beyond loopback: the
    config allowed it (<key>_public), and whoever reads the log should know what it means."""
    if is_loopback(host):
        return ""
    return f" (PUBLIC: {key}_public = true; open to the network, with no login and over plain HTTP)"


def is_loopback(host: str) -> bool:
    """True for a loopback address (127.0.0.0/8, ::1) or the name localhost: only local users reach it."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
# systemd credentials (LoadCredential=) that stand in for a key's path: (config key, credential name)
CREDENTIALS = (("identity", "id_ed25519"), ("age_identity", "age.key"))


class ControllerConfig(BaseModel):
    """Validated controller settings (systemd/config.toml.example says what each key does)."""

    model_config = ConfigDict(extra="forbid")

    repo: str = "."
    branch: str = "main"
    path: str = ""
    identity: str | None = None
    state_dir: str | None = None
    cache_dir: str | None = None
    interval: float | None = None
    trigger_file: str | None = None
    # Before metrics and web: their validator reads these (pydantic validates in this order).
    metrics_public: bool = False
    web_public: bool = False
    metrics: str = "127.0.0.1:9187"
    web: str = "127.0.0.1:9188"
    allow_rewind: bool = False
    require_signed: bool = False
    lock_wait: float = 30.0
    allowed_signers: str | None = None
    allow_insecure_transport: bool = False
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
    drain_programs: list[str] = []

    @field_validator("labels", "notes_pushers", "webhook_allow", "drain_programs", mode="before")
    @classmethod
    def _label_list(cls, v: object) -> object:
        """A list, or (from RECONCILER_LABELS, _NOTES_PUSHERS, _WEBHOOK_ALLOW, _DRAIN_PROGRAMS) one
        string of items split by commas."""
        if isinstance(v, str):
            return [x.strip() for x in v.replace(" ", ",").split(",") if x.strip()]
        return v

    @field_validator("metrics", "web")
    @classmethod
    def _bind(cls, v: str, info: ValidationInfo) -> str:
        """A host:port to listen on ("" = off); not loopback only when <key>_public says so: neither
        server has a login or TLS."""
        if not v:
            return v
        host, _ = parse_address(v)
        key = str(info.field_name)
        if not is_loopback(host) and not info.data.get(f"{key}_public"):
            raise ValueError(f"{v!r} is not a loopback address: {SERVED[key]} would be served to the network, "
                             f"with no login and over plain HTTP; set {key}_public = true in the controller "
                             f"config if that is what you want (or reach it through ssh -L)")
        return v

    @field_validator("webhook_allow")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        """Each item an address or a CIDR network (127.0.0.0/8, ::1/128)."""
        for item in v:
            try:
                ipaddress.ip_network(item, strict=False)
            except ValueError:
                raise ValueError(f"{item!r} is not a network: an address or CIDR, like 127.0.0.0/8") from None
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

    def trust_policy(self, origin: str = "the controller's config.toml") -> TrustPolicy:
        """require_signed, allowed_signers and allow_insecure_transport as the policy every
        door reads."""
        return TrustPolicy.of(require_signed=self.require_signed, allowed_signers=self.allowed_signers,
                              insecure_transport=self.allow_insecure_transport, origin=origin)


def _credentials() -> dict[str, str]:
    """The keys systemd passed as credentials ($CREDENTIALS_DIRECTORY), as config values."""
    creds = os.environ.get("CREDENTIALS_DIRECTORY")
    if not creds:
        return {}
    return {key: str(Path(creds) / name) for key, name in CREDENTIALS if (Path(creds) / name).is_file()}


def load_config(path: Path | None = None, overrides: Mapping[str, object] | None = None, *,
                environ: Mapping[str, str] | None = None) -> ControllerConfig:
    """Read the config file (absent = defaults), apply RECONCILER_* overrides, the keys systemd
    passed as credentials, then the command line's (`reconcile watch --web ...`), and validate the
    result once: an override meets the same rules as the file. A problem names where its value
    came from: the option, the environment variable, or the file and key. A trust variable that
    would loosen the file's policy, or verify nothing, is a problem too (trustvars.problems).
    `environ`: the variables to read (the process's by default)."""
    p = path or trustvars.config_path()
    data: dict[str, object] = {}
    if p.exists():
        try:
            data = tomllib.loads(p.read_text())
        except tomllib.TOMLDecodeError as e:
            raise ConfigError([Problem(str(p), "", f"TOML syntax error: {e}")]) from None
    environ = os.environ if environ is None else environ
    env, bad = trustvars.read(environ)
    bad += trustvars.problems(env, file=trustvars.of_file(data) if p.exists() else None, file_name=str(p))
    if bad:
        raise ConfigError(bad)
    origin: dict[str, tuple[str, str]] = {}
    for key in ControllerConfig.model_fields:
        env_value = environ.get(f"RECONCILER_{key.upper()}")
        if env_value is not None and env_value != "":
            data[key] = env_value
            origin[key] = ("environment", f"RECONCILER_{key.upper()}")
    data.update(_credentials())
    for key, value in (overrides or {}).items():
        data[key] = value
        origin[key] = ("command line", "--label" if key == "labels" else "--" + key.replace("_", "-"))
    try:
        return ControllerConfig.model_validate(data)
    except ValidationError as e:
        problems = []
        for err in e.errors():
            key = ".".join(str(x) for x in err["loc"])
            where, name = origin.get(key.split(".", 1)[0], (str(p), key))
            problems.append(Problem(where, name, err["msg"]))
        raise ConfigError(problems) from None
