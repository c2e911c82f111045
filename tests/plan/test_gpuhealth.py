"""The GPUs' health, read without a CUDA context: the parsers on real `nvidia-smi -q` text, kernel
log Xid lines and `dcgmi health -c` output, and the decisions (pure)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest

from reconciler.plan.gpuhealth import (
    MARK_EXPIRES,
    GpuFault,
    GpuHealth,
    blames_gpu,
    dcgm_health,
    gpu_buses,
    in_force,
    mark_note,
    recorded_after,
    smi_health,
    start_fault,
    xid_health,
    xid_since,
)

# `nvidia-smi -q` of an A100-SXM4-80GB on driver 555.42.02 (a public capture), the sections gpu.sh
# keeps and the lines around them: a healthy GPU.
A100_555 = """
==============NVSMI LOG==============

Timestamp                                 : Thu Nov 14 10:45:47 2024
Driver Version                            : 555.42.02
CUDA Version                              : 12.5

Attached GPUs                             : 4
GPU 00000000:68:00.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    GPU UUID                              : GPU-31515c3d-1414-7c2c-004a-f86a898946ac
    GPU Reset Status
        Reset Required                    : No
        Drain and Reset Recommended       : No
    GSP Firmware Version                  : 555.42.02
    ECC Mode
        Current                           : Enabled
        Pending                           : Enabled
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable Parity     : 0
            SRAM Uncorrectable SEC-DED    : 0
            DRAM Correctable              : 0
            DRAM Uncorrectable            : 0
            SRAM Threshold Exceeded       : No
        Aggregate Uncorrectable SRAM Sources
            SRAM L2                       : 0
            SRAM SM                       : 0
            SRAM Microcontroller          : 0
            SRAM PCIE                     : 0
            SRAM Other                    : 0
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 0
        Uncorrectable Error               : 0
        Pending                           : No
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 640 bank(s)
            High                          : 0 bank(s)
            Partial                       : 0 bank(s)
            Low                           : 0 bank(s)
            None                          : 0 bank(s)
    Temperature
        GPU Current Temp                  : 25 C
"""

# An A100 on driver 510.73.08 after an Xid 63 (a public capture): correctable DRAM errors and a
# row remap pending, which takes effect at the next GPU reset.
A100_510_REMAP_PENDING = """
Attached GPUs                             : 8
GPU 00000000:10:1C.0
    Product Name                          : NVIDIA A100-SXM4-80GB
    ECC Errors
        Volatile
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
        Aggregate
            SRAM Correctable              : 0
            SRAM Uncorrectable            : 0
            DRAM Correctable              : 177
            DRAM Uncorrectable            : 0
    Retired Pages
        Single Bit ECC                    : N/A
        Double Bit ECC                    : N/A
        Pending Page Blacklist            : N/A
    Remapped Rows
        Correctable Error                 : 1
        Uncorrectable Error               : 0
        Pending                           : Yes
        Remapping Failure Occurred        : No
        Bank Remap Availability Histogram
            Max                           : 639 bank(s)
            High                          : 1 bank(s)
"""

# A V100 on a 575-series driver (a public capture): the older ECC layout (single/double bit per
# memory) and the newer reset fields ("deprecated") beside "GPU Recovery Action".
V100_575 = """
GPU 00000001:00:00.0
    Product Name                          : Tesla V100-SXM2-16GB
    GPU Reset Status
        Reset Required                    : Requested functionality has been deprecated
        Drain and Reset Recommended       : Requested functionality has been deprecated
    GPU Recovery Action                   : {action}
    ECC Errors
        Volatile
            Single Bit
                Device Memory             : 0
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : N/A
                Total                     : 0
            Double Bit
                Device Memory             : {dbe}
                Register File             : 0
                L1 Cache                  : 0
                L2 Cache                  : 0
                Texture Memory            : N/A
                Texture Shared            : N/A
                CBU                       : 0
                Total                     : {dbe}
        Aggregate
            Single Bit
                Total                     : 0
            Double Bit
                Total                     : 7
    Retired Pages
        Single Bit ECC                    : 0
        Double Bit ECC                    : 0
        Pending Page Blacklist            : {pending}
    Remapped Rows                         : N/A
""".replace(" Bit\n", " Bit            \n")      # nvidia-smi pads these section names with blanks


# `nvidia-smi -q` of the H200 machine (driver 580.159.04), captured with a process holding 100 GiB
# on it (only the serial number, UUID and PDI zeroed): no "GPU Reset Status" section any more,
# "GPU Recovery Action" and the ECC section's repair lines instead.
H200_580 = (Path(__file__).parent / "samples" / "nvidia-smi-q-h200-580.txt").read_text()


def test_the_h200_as_driver_580_shows_it_is_healthy_then_sick():
    assert smi_health(H200_580) == ([], [])
    sick = H200_580
    for field, now in (("GPU Recovery Action", "Reset"), ("Unrepairable Memory", "Yes"),
                       ("TPC Repair Pending", "Yes")):
        sick = re.sub(rf"({field} +: )\S+", rf"\g<1>{now}", sick, count=1)
    assert smi_health(sick) == (
        ["GPU 00000000:00:06.0: GPU Recovery Action: Reset",
         "GPU 00000000:00:06.0: ECC Errors / Unrepairable Memory: Yes"],
        ["GPU 00000000:00:06.0: ECC Errors / TPC Repair Pending: Yes (it waits for a GPU reset)"])


def test_a_healthy_a100_has_no_fault_and_no_note():
    assert smi_health(A100_555) == ([], [])


def test_a_pending_row_remap_is_a_note_not_a_fault():
    """NVIDIA: with the row-remapping pending flag set, "new workloads can be launched" (REMAP_SOURCE);
    the flag may be weeks old, so it neither blocks a start nor explains a failed one."""
    faults, notes = smi_health(A100_510_REMAP_PENDING)
    assert faults == []
    assert notes == ["GPU 00000000:10:1C.0: Remapped Rows / Pending: Yes (it waits for a GPU reset)"]


def test_an_older_gpu_healthy_then_with_a_volatile_double_bit_error_and_a_page_to_retire():
    assert smi_health(V100_575.format(action="None", dbe=0, pending="No")) == ([], [])
    faults, notes = smi_health(V100_575.format(action="None", dbe=2, pending="Yes"))
    assert faults == ["GPU 00000001:00:00.0: ECC Errors / Volatile / Double Bit / Total: 2",
                      "GPU 00000001:00:00.0: Retired Pages / Pending Page Blacklist: Yes"]
    assert notes == []     # the aggregate (lifetime) count of 7 is history, not a fault now


@pytest.mark.parametrize("action", ["Reset", "GPU_RESET", "Reboot", "Drain P2P", "Drain and Reset"])
def test_any_gpu_recovery_action_but_none_is_a_fault(action: str):
    faults, _ = smi_health(V100_575.format(action=action, dbe=0, pending="No"))
    assert faults == [f"GPU 00000001:00:00.0: GPU Recovery Action: {action}"]


def test_the_volatile_uncorrectable_counts_remap_failure_and_reset_status_of_a_newer_gpu():
    text = (A100_555.replace("            DRAM Uncorrectable            : 0\n        Aggregate",
                             "            DRAM Uncorrectable            : 3\n        Aggregate", 1)
            .replace("Remapping Failure Occurred        : No", "Remapping Failure Occurred        : Yes")
            .replace("Reset Required                    : No", "Reset Required                    : Yes"))
    faults, _ = smi_health(text)
    assert faults == ["GPU 00000000:68:00.0: GPU Reset Status / Reset Required: Yes",
                      "GPU 00000000:68:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 3",
                      "GPU 00000000:68:00.0: Remapped Rows / Remapping Failure Occurred: Yes"]


def test_a_gpu_that_nvidia_smi_calls_lost():
    text = ("Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  Reboot the system to "
            "recover this GPU\n" + A100_555)
    faults, _ = smi_health(text)
    assert faults == ["nvidia-smi: Unable to determine the device handle for GPU0000:3B:00.0: GPU is lost.  "
                      "Reboot the system to recover this GPU"]


def entry(message: str, **fields: object) -> str:
    """A kernel log entry as `journalctl -k -o json` prints it (one line; systemd 252's fields)."""
    return json.dumps({"__CURSOR": "s=ac1c;i=51", "__REALTIME_TIMESTAMP": "1796288718801337", "_TRANSPORT": "kernel",
                       "SYSLOG_FACILITY": "0", "SYSLOG_IDENTIFIER": "kernel", "PRIORITY": "3", "_HOSTNAME": "gpu-01",
                       "MESSAGE": message, **fields}, separators=(",", ":"))


# The driver's Xid reports (real drivers' forms, from NVIDIA's documentation and public bug
# reports; 13 and 31 from an older driver, without `PCI:`), on the GPUs of BUSES.
XID_79 = "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus."
XID_48 = ("NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, An uncorrectable double bit error (DBE) has "
          "been detected on GPU in the framebuffer at partition 1.")
XID_63 = "NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked for remapping, reset gpu to activate."
XID_94 = "NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, name=python3, Contained: SM (0x1)."
XID_119 = "NVRM: Xid (PCI:0000:3b:00): 119, pid=4242, name=python3, Timeout after 6s"
XID_13 = "NVRM: Xid (0000:01:00): 13, 0005 00000000 0000502d 00000104 00000000 00000100"
XID_31 = "NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120, intr 10000000"
XID_43 = "NVRM: Xid (PCI:0000:3b:00): 43, pid=4242, name=python3, Ch 00000008"
NOT_XID = "NVRM: GPU at PCI:0000:3b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae"
# nvidia-smi -q's GPU headers, as gpu.sh keeps them (00000000:3B:00.0 is 0000:3b:00 of the kernel's)
SMI_GPUS = ["GPU 00000000:3B:00.0", "    ECC Errors", "GPU 00000000:10:1C.0", "GPU 00000000:01:00.0"]
BUSES = gpu_buses(SMI_GPUS)


def test_the_gpus_bus_ids_are_nvidia_smis_headers_and_a_gpu_it_calls_lost():
    assert {"00000000:3b:00", "00000000:10:1c", "00000000:01:00"} == BUSES
    lost = ["Unable to determine the device handle for GPU0000:41:00.0: GPU is lost.  Reboot the system to recover "
            "this GPU", "GPU 00000000:18:00.0"]
    assert gpu_buses(lost) == {"00000000:41:00", "00000000:18:00"}
    # The H200's own report, as gpu.sh keeps it (its header, the health sections)
    assert gpu_buses(H200_580.splitlines()) == {"00000000:00:06"}
    # An indented line (a field's value, a process name under Processes) names no GPU
    assert gpu_buses(["    Name : GPU 00000000:99:00.0 GPU is lost", "GPU is lost"]) == frozenset()


def test_xids_by_nvidias_catalog_hardware_memory_signs_and_the_applications():
    lines = [entry(x) for x in (XID_79, XID_48, XID_63, XID_94, XID_119, XID_13, XID_31, XID_43, NOT_XID)]
    faults, signs = xid_health(lines, BUSES)
    assert faults == [f"{XID_79} [Xid 79: GPU has fallen off the bus (RESTART_BM)]",
                      f"{XID_48} [Xid 48: double-bit ECC error (WORKFLOW_XID_48)]",
                      f"{XID_119} [Xid 119: GSP RPC timeout (RESET_GPU)]"]
    assert signs == [f"{XID_63} [Xid 63: GPU memory row-remapping event]",
                     f"{XID_94} [Xid 94: contained memory error (RESTART_APP)]"]


@pytest.mark.parametrize("message", [XID_13, XID_31, XID_43, NOT_XID])
def test_application_xids_say_nothing_about_the_host(message: str):
    assert xid_health([entry(message)], BUSES) == ([], [])


SEGFAULT = "python3[4242]: segfault at 0 ip 00007f3a5c0d1000 sp 00007ffd2a7b8e40 error 4 in {name}[7f3a5c000000+1000]"


@pytest.mark.parametrize(("why", "line"), [
    # A local user's file named as a report, in the kernel's segfault report (security review E6)
    ("quoted in a segfault", entry(SEGFAULT.format(name="NVRM: Xid (PCI:0000:3b:00): 79, x"))),
    # ... with a newline in the name: journald turns the kernel's \x0a back into one
    ("after a newline", entry(SEGFAULT.format(name="a\nNVRM: Xid (PCI:0000:3b:00): 79, x"))),
    ("exec's NULL-argv warning", entry("process 'NVRM: Xid (PCI:0000:3b:00): 79, x' launched '/bin/x' with NULL "
                                       "argv: empty string added")),
    ("a comm as long as a comm gets", entry("NVRM: Xid (PCI:[4242]: segfault at 0 ip 0 sp 0 error 4")),
    ("a GPU that is not this host's", entry("NVRM: Xid (PCI:0000:41:00): 79, pid=1, GPU has fallen off the bus.")),
    ("not the kernel's transport", entry(XID_79, _TRANSPORT="syslog")),
    ("a userspace write to /dev/kmsg", entry(XID_79, SYSLOG_FACILITY="1")),
    ("no transport", json.dumps({"MESSAGE": XID_79})),
    ("the short format", f"1796288718.801337 gpu-01 kernel: {XID_79}"),
    ("a 400-digit code", entry("NVRM: Xid (PCI:0000:3b:00): " + "7" * 400 + ", x")),
    ("a code without its comma", entry("NVRM: Xid (PCI:0000:3b:00): 79x, x")),
    ("longer than the kernel writes", entry(XID_79 + " " + "x" * 2100)),
    ("binary (journalctl's array of bytes)", entry("", MESSAGE=list(XID_79.encode()))),
    ("deeply nested", "[" * 5000 + "]" * 5000),
    ("not JSON", '{"MESSAGE":"NVRM: Xid (PCI:0000:3b:00): 79, x"'),
    ("a number too long for int()", '{"MESSAGE": ' + "9" * 5000 + "}"),
])
def test_only_the_drivers_own_report_for_this_hosts_gpus_counts(why: str, line: str):
    assert xid_health([line], BUSES) == ([], []), why
    assert xid_health([line, entry(XID_79)], BUSES) == ([f"{XID_79} [Xid 79: GPU has fallen off the bus (RESTART_BM)]"],
                                                        [])


def test_no_gpus_known_no_xid_counts_and_a_quote_shows_no_control_characters():
    assert xid_health([entry(XID_79)]) == ([], [])
    comm = "NVRM: Xid (PCI:0000:3b:00): 48, pid=7, name=py\x1b[2Jthon, DBE"
    assert xid_health([entry(comm)], BUSES)[0] == [
        "NVRM: Xid (PCI:0000:3b:00): 48, pid=7, name=py?[2Jthon, DBE [Xid 48: double-bit ECC error (WORKFLOW_XID_48)]"]


def test_the_last_twenty_entries_are_read():
    lines = [entry(XID_79.replace("pid=1234", f"pid={i}")) for i in range(25)]
    faults, _ = xid_health(lines, BUSES)
    assert len(faults) == 20 and "pid=5," in faults[0] and "pid=24," in faults[-1]


# `dcgmi health -c` as dcgmi/Health.cpp prints it (DcgmiOutputTree): a header, the overall
# health, then per incident its entity and the systems' errors.
DCGM_HEALTHY = """+---------------------------+------------------------------------------------------------+
| Health Monitor Report                                                                  |
+===========================+============================================================+
| Overall Health            | Healthy                                                    |
+---------------------------+------------------------------------------------------------+
"""
DCGM_FAILURE = """+---------------------------+------------------------------------------------------------+
| Health Monitor Report                                                                  |
+===========================+============================================================+
| Overall Health            | Failure                                                    |
| GPU                       |                                                            |
| -> 2                      | Failure                                                    |
|    -> Errors              |                                                            |
|       -> Memory system    | Failure                                                    |
|                           | A volatile double-bit ECC error has occurred on GPU 2.     |
+---------------------------+------------------------------------------------------------+
"""


def test_dcgm_healthy_failure_warning_and_no_watches():
    assert dcgm_health(DCGM_HEALTHY) == ([], [])
    assert dcgm_health(DCGM_FAILURE) == (
        ["dcgmi health: Overall Health Failure: A volatile double-bit ECC error has occurred on GPU 2."], [])
    warn = DCGM_FAILURE.replace("Failure", "Warning")
    assert dcgm_health(warn) == (
        [], ["dcgmi health: Overall Health Warning: A volatile double-bit ECC error has occurred on GPU 2."])
    assert dcgm_health("Error: Health watches not enabled. Please enable watches. \n") == (
        [], ["dcgmi health: Error: Health watches not enabled. Please enable watches."])


# ---- the decisions ------------------------------------------------------------------------------------

ECC = "GPU 00000000:18:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2"
SICK = GpuHealth(read=True, faults=(ECC,), now=500)
HEALTHY = GpuHealth(read=True, now=600)
UNREAD = GpuHealth(read=False, notes=("nvidia-smi -q exited 9",), now=600)
MARK = GpuFault(quote=ECC, at=400, lines=(ECC,), service="m", revision="c2" * 20)
# nvidia-smi -q still failing a day after the mark, and a second before that
UNREAD_DAY = GpuHealth(read=False, notes=("nvidia-smi -q exited 9: NVIDIA-SMI has failed",), now=400 + MARK_EXPIRES)
UNREAD_LATE = GpuHealth(read=False, notes=("nvidia-smi -q exited 9",), now=400 + MARK_EXPIRES - 1)


@pytest.mark.parametrize(("recorded", "reading", "retry", "want"), [
    (None, None, False, None),                      # nothing read (nothing starts): nothing blocked
    (MARK, None, False, None),                      # ... the record stays, the first plan is a first look
    (None, HEALTHY, False, None),
    (MARK, HEALTHY, False, None),                   # cleared by the next healthy reading
    (MARK, UNREAD, False, MARK),                    # only a healthy reading clears it ...
    (MARK, UNREAD_LATE, False, MARK),
    (MARK, UNREAD_DAY, False, None),                # ... or a day with no reading at all (expired)
    (MARK, GpuHealth(read=False, now=0), False, MARK),   # no clock read: it stays
    (None, UNREAD, False, None),
    (MARK, SICK, False, MARK),                      # the same fault: the record (and its start) stays
    (None, SICK, False, GpuFault(quote=ECC, at=500, lines=(ECC,))),   # seen before a start
    (MARK, SICK, True, None),                       # --retry passes over it once
])
def test_the_fault_in_force(recorded, reading, retry, want):
    assert in_force(recorded, reading, retry=retry) == want


@pytest.mark.parametrize(("recorded", "reading", "want"), [
    (MARK, HEALTHY, None),                          # cleared
    (MARK, UNREAD, MARK),                           # kept
    (MARK, UNREAD_DAY, None),                       # expired: the file goes
    (MARK, None, MARK),
    (None, SICK, GpuFault(quote=ECC, at=500, lines=(ECC,))),
    (None, HEALTHY, None),
])
def test_what_gpu_fault_json_holds_after_a_reading(recorded, reading, want):
    assert recorded_after(recorded, reading) == want


@pytest.mark.parametrize(("reason", "healthy", "reading", "blamed"), [
    ("CrashLoop", False, SICK, True),
    ("StartFailed", False, GpuHealth(read=True, signs=("Xid 94 ...",)), True),    # a sign explains a failure
    ("CrashLoop", False, GpuHealth(read=True, notes=("Remapped Rows / Pending: Yes",)), False),   # a note never
    ("StartTimeout", False, SICK, True),
    ("CrashLoop", False, HEALTHY, False),           # the commit's: quarantined as ever
    ("CrashLoop", False, None, False),
    ("UnitNotLoaded", False, SICK, False),          # systemd refused the unit: no GPU explains that
    ("Healthy", True, SICK, False),
])
def test_a_failed_start_is_the_gpus_only_when_a_fault_coincides(reason, healthy, reading, blamed):
    assert blames_gpu(reason, healthy, reading) is blamed


def test_the_start_fault_quotes_the_first_finding_and_names_the_start():
    reading = GpuHealth(read=True, faults=(ECC, "xid"), signs=("sign",), now=700)
    f = start_fault(reading, "m", "c2" * 20)
    assert f == GpuFault(quote=ECC, at=700, lines=(ECC, "xid", "sign"), service="m", revision="c2" * 20)
    assert f.why() == f"GPU fault (m c2c2c2c failed to start): {ECC}"
    assert GpuFault.parse(f.dumps()) == f
    assert GpuFault.parse("{") == GpuFault(quote="unreadable gpu-fault.json")


def test_the_kernel_log_is_read_since_the_recorded_fault_else_since_the_last_apply():
    assert xid_since(MARK, 1000) == 401
    assert xid_since(None, 1000) == 1000
    assert xid_since(None, 0) == 0


@pytest.mark.parametrize(("recorded", "kept", "reading", "note"), [
    (MARK, MARK, SICK, None),
    (None, None, HEALTHY, None),
    (None, GpuFault(quote=ECC, at=500), SICK, f"GPU fault recorded: {ECC}"),
    (MARK, None, HEALTHY, f"GPU fault cleared: the GPUs read healthy (was: {ECC})"),
    (MARK, None, UNREAD_DAY, "GPU fault mark expired: no reading has confirmed or cleared it for 24 h (nvidia-smi "
                             f"-q exited 9: NVIDIA-SMI has failed); starts are allowed again (was: {ECC})"),
])
def test_what_the_report_says_of_a_change_of_the_mark(recorded, kept, reading, note):
    assert mark_note(recorded, kept, reading) == note


@pytest.mark.parametrize("text", ["", "{", "[]", "null", '{"quote": ""}', '{"quote": 7}', "[" * 5000,
                                  '{"quote": "q", "at": ' + "9" * 5000 + "}", '{"quote": "' + "q" * 9000 + '"}'])
def test_a_mark_that_is_no_record_of_ours_still_marks_the_host(text):
    assert GpuFault.parse(text) == GpuFault(quote="unreadable gpu-fault.json")


def test_a_marks_numbers_and_lengths_are_bounded():
    f = GpuFault.parse('{"quote": "q", "at": 1e400, "lines": ["a", 1, "b", "c", "d", "e", "f"], "service": true, '
                       '"revision": "' + "r" * 65 + '"}')
    assert f == GpuFault(quote="q", at=0, lines=("a", "b", "c", "d"))
    assert GpuFault.parse('{"quote": "q", "at": 1099511627776}').at == 0
