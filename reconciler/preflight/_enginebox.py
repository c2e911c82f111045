"""The engine probe's box (pure): which environment it gets, under which systemd properties it
runs, and when it does not run at all. What each part lets through: docs/engine-check.md, "The
box"; here, with the lists, why.

The probe starts the unit's interpreter and imports the unit's engine: code that the revision
(the interpreter it names, its environment) and the host (the packages installed there) choose.
So it gets no more than the engine's argument checks need, and never more than the unit has.
`ENV_DENY` keeps out search paths and loaders (`*PLUGIN*`: NCCL's network and tuner plugins;
`HF_MODULES_CACHE`: transformers puts it on `sys.path`) and anything secret-looking (the check
needs no secret); reconciler/sh/engine-probe.sh holds the same lists, for the unit's
EnvironmentFile=s it filters on the host. The probe's own settings (`OWN`) come after the
unit's: a later assignment wins in systemd, and each is at least as strict as any value a unit
may give.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping, Sequence
from fnmatch import fnmatchcase

ENV_PREFIXES = ("SGLANG_", "SGL_", "VLLM_", "CUDA_", "HF_", "HUGGING_FACE_", "TRANSFORMERS_", "TORCH_",
                "TORCHINDUCTOR_", "PYTORCH_", "TRITON_", "NCCL_", "NVIDIA_", "FLASHINFER_")
ENV_NAMES = ("OMP_NUM_THREADS", "MKL_NUM_THREADS")
ENV_DENY = ("*PATH*", "*PLUGIN*", "*TOKEN*", "*KEY*", "*SECRET*", "*PASSWORD*", "*PASSWD*", "*CREDENTIAL*",
            "HF_MODULES_CACHE")
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*\Z")

# The unit's identity and sandbox, copied to the probe as `systemd-run -p` properties.
IDENTITY_KEYS = ("User", "Group", "SupplementaryGroups", "DynamicUser")
SANDBOX_KEYS = (
    "ProtectSystem", "ProtectHome", "PrivateTmp", "PrivateDevices", "PrivateNetwork", "PrivateUsers", "PrivateIPC",
    "PrivateMounts", "ProtectKernelTunables", "ProtectKernelModules", "ProtectKernelLogs", "ProtectControlGroups",
    "ProtectClock", "ProtectHostname", "ProtectProc", "ProcSubset", "ReadOnlyPaths", "ReadWritePaths",
    "InaccessiblePaths", "ExecPaths", "NoExecPaths", "TemporaryFileSystem", "BindPaths", "BindReadOnlyPaths",
    "CapabilityBoundingSet", "NoNewPrivileges", "RestrictNamespaces", "RestrictSUIDSGID", "RestrictRealtime",
    "RestrictAddressFamilies", "LockPersonality", "MemoryDenyWriteExecute", "SystemCallFilter",
    "SystemCallArchitectures", "SystemCallErrorNumber", "DevicePolicy", "DeviceAllow", "UMask", "KeyringMode",
    "RemoveIPC", "IPAddressDeny", "IPAddressAllow")
# A unit that runs in another root: the host program's paths are not the unit's there.
ELSEWHERE_KEYS = ("RootDirectory", "RootImage")
UNIT_KEYS = IDENTITY_KEYS + SANDBOX_KEYS + ELSEWHERE_KEYS + ("WorkingDirectory",)
# The probe's own settings, after the unit's. No capabilities at all, no network, the whole
# file system read-only but for its own /tmp, no way to gain privileges.
OWN = ("PrivateNetwork=yes", "NoNewPrivileges=yes", "ProtectSystem=strict", "PrivateTmp=yes",
       "CapabilityBoundingSet=", "AmbientCapabilities=", "RestrictSUIDSGID=yes", "LockPersonality=yes",
       "ProtectKernelTunables=yes", "ProtectKernelModules=yes", "ProtectKernelLogs=yes", "ProtectControlGroups=yes",
       "ProtectClock=yes", "ProtectHostname=yes", "RestrictRealtime=yes", "RestrictNamespaces=yes",
       "SystemCallArchitectures=native", "KeyringMode=private", "ProtectProc=invisible", "UMask=0077",
       "PrivateIPC=yes", "RemoveIPC=yes")
# ProtectHome=: read-only, unless the unit's own is stricter (yes, tmpfs: /home not readable).
_HOME_STRICTER = ("yes", "true", "on", "1", "tmpfs")
# Where the unit has no system-call filter of its own: the set systemd recommends for services,
# a call outside it failing with EPERM instead of killing the probe. (Never added to a unit's
# own filter: two allow-lists are merged into their union, which would widen the unit's.)
SYSCALLS = ("SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM")
LIMIT_FSIZE = "1M"       # any file the probe writes, its stdout and stderr included
TASKS_MAX = 512          # processes and threads
_ROOT = ("", "root", "0")
_TRUE = ("yes", "true", "on", "1")


def allowed_name(name: str) -> bool:
    """Whether a variable may reach the probe: one of the engine's own, never a path, a loader
    or a secret-looking one."""
    if not _NAME.match(name) or any(fnmatchcase(name, p) for p in ENV_DENY):
        return False
    return name in ENV_NAMES or name.startswith(ENV_PREFIXES)


def probe_env(env: Mapping[str, str]) -> dict[str, str]:
    """The service's environment as the probe gets it: allowed names only."""
    return {k: v for k, v in env.items() if allowed_name(k)}


def unit_settings(entries: Iterable[tuple[str, str]]) -> tuple[tuple[str, str], ...]:
    """The [Service] entries the probe's box is made from, in the unit's order."""
    return tuple((k, v) for k, v in entries if k in UNIT_KEYS)


def _last(entries: Sequence[tuple[str, str]], key: str) -> str | None:
    return next((v for k, v in reversed(entries) if k == key), None)


def runs_as_root(entries: Sequence[tuple[str, str]]) -> bool:
    """Whether the unit would run as root: no User= (and no DynamicUser=), or User=root."""
    user = _last(entries, "User") or ""
    dynamic = (_last(entries, "DynamicUser") or "").lower() in _TRUE
    return user in _ROOT and not dynamic


def elsewhere(entries: Sequence[tuple[str, str]]) -> str | None:
    """Why the probe cannot run as the unit would (it runs in another root), or None."""
    for key in ELSEWHERE_KEYS:
        if value := _last(entries, key):
            return f"the unit runs in {key}={value}, where the engine check does not look"
    return None


def _not_root(value: str) -> str:
    return " ".join(w for w in value.split() if w not in ("root", "0"))


def probe_properties(entries: Sequence[tuple[str, str]], mode: str) -> list[str]:
    """The probe's `systemd-run -p` properties, in order: the unit's identity (DynamicUser=yes
    for one that would run as root) and sandbox, its working directory, then the probe's own
    settings, last so that they win."""
    out: list[str] = []
    root = runs_as_root(entries)
    for key, value in entries:
        if key in ("Group", "SupplementaryGroups") and root:
            value = _not_root(value)
            if not value:
                continue
        if key == "User" and root:
            continue
        if key in IDENTITY_KEYS or key in SANDBOX_KEYS:
            out.append(f"{key}={value}")
    if root:
        out.append("DynamicUser=yes")
    workdir = _last(entries, "WorkingDirectory")
    if workdir and workdir.lstrip("-") not in ("", "~"):
        out.append(f"WorkingDirectory=-{workdir.lstrip('-')}")
    home = (_last(entries, "ProtectHome") or "").lower()
    out += [*OWN, f"ProtectHome={home if home in _HOME_STRICTER else 'read-only'}"]
    if _last(entries, "SystemCallFilter") is None:
        out += SYSCALLS
    if mode == "hidden":
        out.append("PrivateDevices=yes")
    out += [f"LimitFSIZE={LIMIT_FSIZE}", f"TasksMax={TASKS_MAX}"]
    return out
