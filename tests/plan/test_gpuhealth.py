"""The GPUs' health, read without a CUDA context: the parsers on real `nvidia-smi -q` text, kernel
log Xid lines and `dcgmi health -c` output, and the decisions (pure)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from reconciler.plan.gpuhealth import (
    GpuFault,
    GpuHealth,
    blames_gpu,
    dcgm_health,
    in_force,
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


# Kernel log lines as `journalctl -k -o short-unix` prints them (the messages are real drivers'
# forms, from NVIDIA's documentation and public bug reports).
XID_79 = ("1796288718.801337 gpu-01 kernel: NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, "
          "GPU has fallen off the bus.")
XID_48 = ("1796288719.000001 gpu-01 kernel: NVRM: Xid (PCI:0000:3b:00): 48, pid=1234, name=python3, "
          "An uncorrectable double bit error (DBE) has been detected on GPU in the framebuffer at partition 1.")
XID_63 = ("1796288720.5 gpu-01 kernel: NVRM: Xid (PCI:0000:10:1c): 63, pid=1896, Row Remapper: New row marked "
          "for remapping, reset gpu to activate.")
XID_94 = "1796288721.5 gpu-01 kernel: NVRM: Xid (PCI:0000:3b:00): 94, pid=4242, name=python3, Contained: SM (0x1)."
XID_119 = "1796288722.5 gpu-01 kernel: NVRM: Xid (PCI:0000:3b:00): 119, pid=4242, name=python3, Timeout after 6s"
XID_13 = "1796288723.5 gpu-01 kernel: NVRM: Xid (0000:01:00): 13, 0005 00000000 0000502d 00000104 00000000 00000100"
XID_31 = "1796288724.5 gpu-01 kernel: NVRM: Xid (0000:01:00): 31, Ch 0000000b, engmask 00000120, intr 10000000"
XID_43 = "1796288725.5 gpu-01 kernel: NVRM: Xid (PCI:0000:3b:00): 43, pid=4242, name=python3, Ch 00000008"
NOT_XID = "1796288726.5 gpu-01 kernel: NVRM: GPU at PCI:0000:3b:00: GPU-0b11d014-1685-04bd-26ed-5fc0bc1c44ae"


def test_xids_by_nvidias_catalog_hardware_memory_signs_and_the_applications():
    faults, signs = xid_health([XID_79, XID_48, XID_63, XID_94, XID_119, XID_13, XID_31, XID_43, NOT_XID])
    assert faults == [
        "NVRM: Xid (PCI:0000:3b:00): 79, pid=1234, name=python3, GPU has fallen off the bus. "
        "[Xid 79: GPU has fallen off the bus (RESTART_BM)]",
        XID_48[XID_48.index("NVRM"):] + " [Xid 48: double-bit ECC error (WORKFLOW_XID_48)]",
        XID_119[XID_119.index("NVRM"):] + " [Xid 119: GSP RPC timeout (RESET_GPU)]"]
    assert signs == [XID_63[XID_63.index("NVRM"):] + " [Xid 63: GPU memory row-remapping event]",
                     XID_94[XID_94.index("NVRM"):] + " [Xid 94: contained memory error (RESTART_APP)]"]


@pytest.mark.parametrize("line", [XID_13, XID_31, XID_43, NOT_XID])
def test_application_xids_say_nothing_about_the_host(line: str):
    assert xid_health([line]) == ([], [])


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


@pytest.mark.parametrize(("recorded", "reading", "retry", "want"), [
    (None, None, False, None),                      # nothing read (nothing starts): nothing blocked
    (MARK, None, False, None),                      # ... the record stays, the first plan is a first look
    (None, HEALTHY, False, None),
    (MARK, HEALTHY, False, None),                   # cleared by the next healthy reading
    (MARK, UNREAD, False, MARK),                    # only a healthy reading clears it
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
