"""The desired state after loading: validated, merged and rendered, ready for the planner.

load.py turns the TOML files of a revision into these objects (and rejects bad input there);
everything downstream (plan, apply, health, reports) reads only these. They are plain frozen
dataclasses: no I/O, no validation left to do.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import msgspec


class HealthSpec(msgspec.Struct, frozen=True):
    """How to tell that a service is healthy (used by the health checker)."""

    http: str | None = None          # e.g. http://127.0.0.1:30000/health, probed from the host itself
    startup_timeout: float = 1200.0  # seconds a model may take to load before we give up
    interval: float = 2.0            # seconds between HTTP probes
    stable_for: float = 30.0         # after the first success, a crash within this window still fails
    expect_status: int = 200
    body_contains: str | None = None
    ca_pem: str | None = None        # PEM CA bundle that an https:// health URL is verified against


class RolloutPolicy(msgspec.Struct, frozen=True):
    """How a change to a shared service definition spreads over the hosts that use it
    (docs/rollouts.md): `canary` hosts first, alone (0: no canary wave), then waves of at most
    `max_unavailable` hosts, a count (int >= 1) or a percentage ("25%"). min_available: the
    hosts of the group that must stay ready (serving), counting hosts already down; None: no
    such floor. A rollout takes a host only while the others keep it.
    """

    canary: int = 1
    max_unavailable: int | str = "25%"
    min_available: int | None = None      # hosts of the group that stay ready throughout (plan/budget.py)

    def bound(self, members: int) -> int:
        """max_unavailable as a number of hosts, for a group of `members` hosts (>= 1)."""
        if isinstance(self.max_unavailable, str):
            percent = int(self.max_unavailable.rstrip("%"))
            return max(1, members * percent // 100)
        return max(1, self.max_unavailable)

    def describe(self) -> str:
        """The policy as TOML would spell it: 'canary = 1, max_unavailable = "25%"'."""
        mu = f'"{self.max_unavailable}"' if isinstance(self.max_unavailable, str) else str(self.max_unavailable)
        floor = f", min_available = {self.min_available}" if self.min_available is not None else ""
        return f"canary = {self.canary}, max_unavailable = {mu}{floor}"


class NotifySpec(msgspec.Struct, frozen=True):
    """Where rollout events go: a webhook URL (POST), in generic JSON or Slack's shape.

    The URL may hold a token (Slack's does): it is never printed whole.
    """

    webhook: str
    format: str = "json"             # "json" | "slack"
    timeout: float = 5.0             # seconds per request; a slow webhook never holds a deploy


class ModelSpec(msgspec.Struct, frozen=True):
    """The model a service serves: its hub id and where it lives on the host."""

    id: str
    path: str
    architecture: str | None = None  # optional declared architecture (pre-flight rules)
    fetch: str | None = None         # shell command that downloads the model into path
    fetch_timeout: float = 3600.0
    size_gb: float | None = None     # declared checkpoint size (free-space check before a fetch)


@dataclass(frozen=True)
class SecretSpec:
    """One secret of a service. Never its value: for an age secret, the encrypted bytes from the
    repo and, once the controller decrypted it (secrets.py), a keyed digest of the value; for a
    file reference, the path on the host.

    env: delivered as an environment variable (root-only EnvironmentFile=) instead of a systemd
    credential. problem: why it cannot be delivered (it blocks its service, nothing written)."""

    name: str
    source: str                      # "age" | "file"
    path: str                        # repo path (age) or host path (file)
    env: bool = False
    ciphertext: bytes = field(default=b"", repr=False, compare=False)
    digest: str = ""                 # HMAC of the value (age, once decrypted)
    problem: str | None = None

    def describe(self) -> str:
        how = "environment" if self.env else "credential"
        return f"{self.name} ({self.source} {self.path}, as {how})"


CALL_TIMEOUT = 30.0        # seconds a drain's call may take, unless it says
DRAIN_TIMEOUT = 120.0      # seconds a drain waits for in-flight work, unless it says
DRAIN_INTERVAL = 1.0       # seconds between in-flight reads, unless it says


class CallSpec(msgspec.Struct, frozen=True):
    """One call of a drain (leave, rejoin, serving), rendered: an HTTP request made from the host
    (as the health probe), a command run on the controller (argv, never a shell; `input` its
    stdin), a shell line run on the host, or one line to HAProxy's runtime API on its socket."""

    kind: str                        # "http" | "controller" | "host" | "haproxy"
    target: str = ""                 # http: the URL; host: the shell line; haproxy: the socket
    argv: tuple[str, ...] = ()       # controller: the command's words
    input: str | None = None         # controller: its stdin; haproxy: the runtime API line
    method: str = "POST"             # http
    body: str | None = None          # http
    expect_status: int | None = None  # http: None = any 2xx
    server: str | None = None        # haproxy: "<backend>/<server>", whose state `serving` reads
    timeout: float = CALL_TIMEOUT

    def describe(self) -> str:
        """One line for a plan or a dry run: what is called, where."""
        if self.kind == "http":
            return f"{self.method} {self.target} (from the host)"
        if self.kind == "controller":
            words = " ".join(self.argv)
            return f"run on the controller: {words}" + (f" <<< {self.input.strip()!r}" if self.input else "")
        if self.kind == "host":
            return f"run on the host: {self.target}"
        return f"HAProxy {self.target}: {self.input}"


class InflightSpec(msgspec.Struct, frozen=True):
    """Where the server's in-flight work is read (from the host, as the health probe): `metric`
    summed over its label sets in the Prometheus text at `url`, or (metric None) the number `url`
    answers."""

    url: str
    metric: str | None = None


class DrainSpec(msgspec.Struct, frozen=True):
    """How a host leaves rotation before its server stops, and rejoins once the new one is ready
    and judged (plan/drain.py has the steps). Without `inflight`, the drain waits `timeout`."""

    leave: CallSpec
    rejoin: CallSpec
    serving: CallSpec | None = None  # whether the balancer sends the host traffic (None: not asked)
    inflight: InflightSpec | None = None
    timeout: float = DRAIN_TIMEOUT   # the drain timeout: at most this long for in-flight work to reach 0
    interval: float = DRAIN_INTERVAL  # seconds between in-flight reads


class SmokeCheck(msgspec.Struct, frozen=True):
    """One greedy completion: a prompt (/v1/completions) or one user message
    (/v1/chat/completions), and the text its answer must hold (`match`: contains, prefix, exact)."""

    kind: str                        # "completion" | "chat"
    text: str
    expect: str
    match: str = "contains"
    max_tokens: int = 16


class SmokeSpec(msgspec.Struct, frozen=True):
    """The answers that judge a new server before it rejoins (plan/smoke.py judges them). url:
    the server's base URL; model: the name asked for (None: the first /v1/models lists); ttft:
    the longest time to the first token (None: not measured); timeout: per answer."""

    url: str
    checks: tuple[SmokeCheck, ...]
    model: str | None = None
    ttft: float | None = None
    timeout: float = 60.0


@dataclass(frozen=True)
class ServiceSpec:
    """One systemd service on one host, fully rendered.

    unit_text is the final content of /etc/systemd/system/<name>.service (placeholders such as
    {model.path} and {host.address} already substituted). env holds the variables the service
    gets through a drop-in; values may be secret and never appear in logs or exceptions.
    """

    name: str
    unit_text: str
    env: dict[str, str] = field(default_factory=dict)
    health: HealthSpec = field(default_factory=HealthSpec)
    model: ModelSpec | None = None
    source: str = ""                 # repo file(s) it was defined in, for messages
    definition: str | None = None    # name of the shared services/<definition>.toml, if any
    gpu_policy: str = "report"       # stray GPU holders before a start: "report" or "kill"
    engine_check: str = "hidden"     # the engine's own check before a start: "hidden", "visible" or "off"
    rollout: RolloutPolicy = field(default_factory=RolloutPolicy)   # used when definition is set
    # adopt and allow_dropins: desired-state/README.md, "Units and drop-ins that are not ours".
    adopt: bool = False
    allow_dropins: tuple[str, ...] = ()
    secrets: tuple[SecretSpec, ...] = ()
    # Issue 42: how the host leaves and rejoins rotation around a restart, and the answers that
    # judge the new server. Neither is in the content hash: changing them restarts nothing.
    drain: DrainSpec | None = None
    smoke: SmokeSpec | None = None

    def allows_dropin(self, path: str) -> bool:
        """True when a drop-in at `path` (not the reconciler's own) may stay."""
        return path in self.allow_dropins or path.rsplit("/", 1)[-1] in self.allow_dropins

    def content_hash(self) -> str:
        """A stable digest of everything that, when changed, requires a restart (computed once:
        the spec is frozen, and a run asks for it a dozen times per service)."""
        cached: str | None = self.__dict__.get("_content_hash")
        if cached is not None:
            return cached
        h = hashlib.sha256()
        h.update(self.unit_text.encode())
        for k in sorted(self.env):
            h.update(b"\0" + k.encode() + b"=" + self.env[k].encode())
        for s in sorted(self.secrets, key=lambda s: s.name):
            # the reference and, for an age secret, the keyed digest of its value (never the value)
            h.update(f"\0secret {s.name} {s.source} {s.path} {s.env} {s.digest}".encode())
        digest = h.hexdigest()[:16]
        object.__setattr__(self, "_content_hash", digest)
        return digest


class SSHSpec(msgspec.Struct, frozen=True):
    """How to reach a host. known_hosts holds the text of the repo's known_hosts file."""

    address: str
    port: int = 22
    user: str = "root"
    host_key: str | None = None      # pinned public key line "ssh-ed25519 AAAA..."
    known_hosts: str | None = None   # content of the fleet's known_hosts file, if any
    known_hosts_file: str | None = None  # its path in the repo, for messages


class HostSpec(msgspec.Struct, frozen=True):
    """One host: how to reach it and the services it should run."""

    name: str
    ssh: SSHSpec
    services: dict[str, ServiceSpec] = msgspec.field(default_factory=dict)
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    source: str = ""                 # hosts/<name>.toml


class PullWave(msgspec.Struct, frozen=True):
    """One wave of pull mode (fleet.toml [pull] waves; README "Pull mode"): the hosts whose
    labels carry every one of `labels` ({}: every host no earlier wave took) deploy a commit
    once it is `after` seconds old (its committer time) and no earlier wave has failed it."""

    name: str
    labels: dict[str, str] = msgspec.field(default_factory=dict)
    after: float = 0.0

    def matches(self, labels: dict[str, str]) -> bool:
        return all(labels.get(k) == v for k, v in self.labels.items())


class FleetSettings(msgspec.Struct, frozen=True):
    """Fleet-wide settings from fleet.toml that are not per-host defaults."""

    concurrency: int = 20
    notify: NotifySpec | None = None
    pull_waves: tuple[PullWave, ...] = ()     # [pull] waves, in order; () : no waves in pull mode


class DesiredState(msgspec.Struct, frozen=True):
    """The whole fleet at one git revision."""

    revision: str
    hosts: dict[str, HostSpec]
    settings: FleetSettings = msgspec.field(default_factory=FleetSettings)

    @property
    def short(self) -> str:
        return self.revision[:7]
