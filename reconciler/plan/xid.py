"""PURE: the kernel log's Xid reports, read as the driver writes them, for the host's own GPUs.

NVIDIA's driver reports a GPU error as a kernel message `NVRM: Xid (PCI:0000:3b:00): 79, pid=...,
...` (older drivers: no `PCI:`). Which entries count (the kernel's own message, for a GPU
nvidia-smi lists on this host: gpuhealth.gpu_buses) is docs/health.md's ("Sick GPUs") and
security review N7's: gpu.sh reads `journalctl -k -o json`, so a message journald spread over
lines (it turns the kernel's escaped newlines back into newlines) is still one, and user-chosen
text a kernel message quotes (the segfault report's file name, exec's NULL-argv warning's
path) is never at its start.

Each report is classified by NVIDIA's Xid catalog (XID_FAULTS, XID_SIGNS). The reader is total:
any text gives a value, numbers and lengths bounded (a 400-digit Xid code is not a code, an
entry longer than the kernel writes is not the kernel's).
"""

from __future__ import annotations

import re
from collections.abc import Collection, Iterable, Mapping

from .lenient import json_or_none

XID_SOURCE = "https://docs.nvidia.com/deploy/xid-errors/analyzing-xid-catalog.html"

# NVIDIA's Xid catalog for Ampere and newer (XID_SOURCE; its "Resolution Bucket (Immediate
# Action)" column): the Xids the reconciler blames on the host, faults and signs as
# docs/health.md ("Sick GPUs") sorts them (an application that died of a sign died of the
# hardware); every other Xid is the application's: it says nothing about the host.
XID_FAULTS: Mapping[int, str] = {
    46: "GPU stopped processing (RESET_GPU)",
    48: "double-bit ECC error (WORKFLOW_XID_48)",
    62: "internal micro-controller halt (RESET_GPU)",
    64: "GPU memory remapping failure (RESET_GPU)",
    74: "NVLink error (WORKFLOW_NVLINK_ERR)",
    79: "GPU has fallen off the bus (RESTART_BM)",
    95: "uncontained memory error (RESET_GPU)",
    109: "context switch timeout (RESET_GPU)",
    110: "security fault (RESET_GPU)",
    119: "GSP RPC timeout (RESET_GPU)",
    120: "GSP error (RESET_GPU)",
    136: "link training failed (RESET_GPU)",
    140: "ECC unrecovered error (RESET_GPU)",
    143: "GPU initialization error (RESET_GPU)",
    **{x: "NVLink5 error (WORKFLOW_NVLINK5_ERR)" for x in range(144, 151)},
    151: "key rotation error (RESTART_VM)",
    155: "NVLink SW-defined error (RESET_GPU)",
    156: "resource retirement event (RESET_GPU)",
    158: "GPU fatal timeout (RESET_GPU)",
}
XID_SIGNS: Mapping[int, str] = {
    63: "GPU memory row-remapping event",
    92: "high single-bit ECC error rate",
    94: "contained memory error (RESTART_APP)",
}
# The driver's Xid report, from the start of the kernel's message: `NVRM: Xid (PCI:0000:3b:00): 79,
# ...` (older drivers: no `PCI:`). A user-chosen name can open a kernel message only as a task's
# comm (at most 15 bytes: `python3[4242]: segfault ...`), too short to hold this.
_XID = re.compile(r"NVRM: Xid \((?:PCI:)?(?P<bus>[0-9A-Fa-f]{4,8}:[0-9A-Fa-f]{2}:[0-9A-Fa-f]{2})\): "
                  r"(?P<code>[0-9]{1,4})(?:,|$)")
XID_LINES = 20          # the last kernel log Xid entries of the window that gpu.sh sends (and we read)
# The longest journal entry read as one (journalctl -o json: the kernel writes at most 2 KiB a
# message, which JSON escapes may make six times longer) and the longest message read as the kernel's.
MAX_ENTRY = 16384
MAX_MESSAGE = 2048
_CONTROL = re.compile(r"[\x00-\x1f\x7f]")


def bus_key(bus: str) -> str:
    """A PCI bus id as one key: `0000:3B:00` (the kernel's Xid) and `00000000:3b:00` (nvidia-smi's,
    without the function) are the same GPU: `00000000:3b:00`."""
    domain, _, rest = bus.partition(":")
    return f"{domain.lower():0>8}:{rest.lower()}"


def kernel_message(entry: str) -> str | None:
    """The message of one journal entry as `journalctl -o json` prints it (one entry a line), when
    the entry is the kernel's own (transport kernel, facility kern); else None (pure, total)."""
    data = json_or_none(entry, MAX_ENTRY)
    if not isinstance(data, dict):
        return None
    message = data.get("MESSAGE")
    if not isinstance(message, str) or len(message) > MAX_MESSAGE or data.get("_TRANSPORT") != "kernel" \
            or data.get("SYSLOG_FACILITY", "0") != "0":
        return None
    return message


def xid_health(lines: Iterable[str], buses: Collection[str] = ()) -> tuple[list[str], list[str]]:
    """Faults and signs among kernel log entries (pure, total): each entry whose message is the
    driver's `NVRM: Xid (PCI:<bus>): N, ...` for a GPU of `buses` (gpu_buses: the host's, as
    nvidia-smi lists them), classified by XID_FAULTS / XID_SIGNS and quoted (control characters
    shown as `?`) with what the catalog says. The last XID_LINES entries are read."""
    mine = {bus_key(b) for b in buses}
    faults: list[str] = []
    signs: list[str] = []
    for entry in list(lines)[-XID_LINES:]:
        message = kernel_message(entry)
        m = _XID.match(message) if message is not None else None
        if message is None or m is None or bus_key(m.group("bus")) not in mine:
            continue
        code, quote = int(m.group("code")), _CONTROL.sub("?", message.strip())
        if code in XID_FAULTS:
            faults.append(f"{quote} [Xid {code}: {XID_FAULTS[code]}]")
        elif code in XID_SIGNS:
            signs.append(f"{quote} [Xid {code}: {XID_SIGNS[code]}]")
    return faults, signs
