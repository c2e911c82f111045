"""End-to-end: a sick GPU is the host's fault, not the commit's (issue 35, item 5), on real hosts.

Two GPU hosts (the stand-in nvidia-smi) share a definition, the first the canary. A new revision's
start trips a fault on the canary's GPU as a real one would show it: the stand-in's `nvidia-smi
-q` reports a volatile uncorrectable ECC error and the driver's Xid 48 line reaches the host's
kernel log (`journalctl -k`). The failed start is GpuFault on that host, with the line quoted; the
revision is not quarantined and the rollout goes on: the second host deploys it and runs it
healthy. The canary stays blocked while its GPU reads sick, and deploys the same revision once
it reads healthy again.
"""

from __future__ import annotations

import json

import pytest

from tests import fleet as fleetlib
from tests.conftest import STANDIN_UNIT, WITHOUT_INCIDENT_RULE, DesiredRepo, fleet_known_hosts, run_cli, run_json

pytestmark = pytest.mark.fleet

SERVICE = "sglang-qwen"
QWEN35 = "Qwen3.5-122B-A10B"
FAULT_FILE = "/var/lib/reconciler/gpu-fault.json"
# What a start on a sick GPU meets (the host's /etc/fake-gpu-trip; the unit runs it when present)
TRIP = "/etc/fake-gpu-trip"
UNIT = STANDIN_UNIT.replace("[Service]\n", f"[Service]\nExecStartPre=/bin/sh -c '[ ! -e {TRIP} ] || "
                                           f"exec /bin/sh {TRIP}'\n", 1)
XID_48 = ("NVRM: Xid (PCI:0000:18:00): 48, pid=4242, name=python3, An uncorrectable double bit error (DBE) "
          "has been detected on GPU in the framebuffer at partition 0.")
ECC = "GPU 00000000:18:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2"
CUDA = "RuntimeError: CUDA error: uncorrectable ECC error encountered"


def trip_script() -> str:
    """The GPU turns sick at the first start that touches it: the stand-in's ECC count and the
    driver's Xid line; every start fails with CUDA's error while it is sick."""
    return (f"grep -q ecc-uncorrectable /etc/fake-gpu-faults 2>/dev/null || {{ "
            f"echo '0 ecc-uncorrectable 2' >> /etc/fake-gpu-faults; {fleetlib.kernel_log(XID_48, wait=False)}; }}\n"
            f"echo '{CUDA}' >&2\nexit 1\n")


def write_shared(repo: DesiredRepo, hosts: list[fleetlib.Host], load: str) -> None:
    repo.write("fleet.toml", '[ssh]\nknown_hosts = "known_hosts"\n\n[rollout]\ncanary = 1\nmax_unavailable = 1\n')
    repo.write("known_hosts", fleet_known_hosts(hosts))
    repo.write("units/standin.service", UNIT)
    repo.write("services/qwen.toml", "\n".join([
        'unit_file = "units/standin.service"',
        f'model = {{ id = "Qwen/{QWEN35}", path = "/models/{QWEN35}" }}',
        'vars = { port = "30000", args = "" }',
        f'env = {{ STANDIN_LOAD_SECONDS = "{load}" }}',
        'health = { http = "http://{host.address}:{vars.port}/health", startup_timeout = 10, '
        'stable_for = 1, interval = 0.5 }', ""]))
    for i, h in enumerate(hosts):
        labels = 'labels = { canary = "true" }\n' if i == 0 else ""
        repo.write(f"hosts/{h.name}.toml", f'address = "{h.address}"\n{labels}\n[services.{SERVICE}]\nuse = "qwen"\n')
    for rel, text in WITHOUT_INCIDENT_RULE.items():
        repo.write(rel, text)


def record(fleet, h) -> dict:
    return json.loads(fleet.ssh(h, f"cat /var/lib/reconciler/services/{SERVICE}.json"))


def host_out(out: dict, h: fleetlib.Host) -> dict:
    return next(r for r in out["hosts"] if r["host"] == h.name)


@pytest.mark.timeout(240)
def test_a_start_that_fails_on_a_sick_gpu_is_the_hosts_fault_not_the_revisions(fleet, repo):
    sick, well = fleet.hosts[:2]
    for h in (sick, well):
        fleet.ssh(h, fleetlib.gpu_host(2))
    # The driver's first line, so the sick host's kernel log is journald's to read (tests.fleet)
    fleet.ssh(sick, fleetlib.kernel_log("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  565.57.01"))
    write_shared(repo, [sick, well], load="0.5")
    c1 = repo.commit("qwen3.5 on two GPU hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))

    fleet.ssh(sick, f"cat > {TRIP} <<'EOF'\n{trip_script()}EOF")
    write_shared(repo, [sick, well], load="0.6")
    c2 = repo.commit("a new revision")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, sick)
    assert (r["status"], r["reason"]) == ("failed", "GpuFault"), r
    assert ECC in r["message"], r["message"]
    deploy = next(e for e in r["events"] if e["action"] == "deploy")
    assert deploy["outcome"]["reason"] == "GpuFault" and deploy["outcome"]["quote"] == ECC
    assert "StartFailed" in deploy["outcome"]["message"] or "CrashLoop" in deploy["outcome"]["message"]
    # The host is marked, the fault lines quoted: nvidia-smi's ECC count and the kernel's Xid 48
    mark = json.loads(fleet.ssh(sick, f"cat {FAULT_FILE}"))
    assert (mark["quote"], mark["service"], mark["revision"]) == (ECC, SERVICE, c2)
    assert any(line.startswith(XID_48) and "[Xid 48: double-bit ECC error" in line for line in mark["lines"])
    # The revision is not judged there: not quarantined, not last good; the unit is stopped
    rec = record(fleet, sick)
    assert rec["quarantine"] is None and rec["last_good_revision"] == c1
    assert rec["pending"]["revision"] == c2 and rec["pending"]["unjudged"].startswith("GpuFault")
    assert fleet.show(sick, SERVICE, "ActiveState")["ActiveState"] in ("inactive", "failed")
    # ... and the rollout went on: the second host deploys it and runs it healthy
    [ro] = out["rollouts"]
    assert ro["status"] == "done" and ro["halted"] is None and ro["excused"] == [sick.name], ro
    assert host_out(out, well)["status"] == "converged"
    good = record(fleet, well)
    assert good["last_good_revision"] == c2 and good["quarantine"] is None and good["pending"] is None
    assert fleet.show(well, SERVICE, "SubState")["SubState"] == "running"

    # status --live: the host's GpuFault, the line quoted
    _, live = run_json("status", "--live", "--repo", str(repo.path), check_codes=(0,))
    row = next(x for x in live if x["host"] == sick.name and x["service"] == SERVICE)
    assert row["last_event"].startswith(f"GpuFault: GPU fault ({SERVICE} {c2[:7]} failed to start): {ECC}")
    assert row["quote"] == ECC
    assert next(x for x in live if x["host"] == well.name)["gpu_fault"] is None

    # Still sick: nothing starts there (blocked, the line quoted), and the revision stays unjudged
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, sick)
    assert (r["status"], r["reason"]) == ("failed", "GpuFault") and ECC in r["message"]
    assert not [e for e in r["events"] if e["outcome"]]
    assert record(fleet, sick)["quarantine"] is None

    # The GPU is reset (the faults gone): the next healthy reading clears the mark, and the host
    # deploys the same revision
    fleet.ssh(sick, f"rm -f {TRIP} /etc/fake-gpu-faults")
    code, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, sick)["status"] == "converged"
    assert not fleet.exists(sick, FAULT_FILE)
    rec = record(fleet, sick)
    assert rec["last_good_revision"] == c2 and rec["pending"] is None and rec["quarantine"] is None
    assert any("GPU fault cleared" in n for n in host_out(out, sick)["notes"])


@pytest.mark.timeout(180)
def test_a_gpu_fault_seen_before_a_start_blocks_the_host_without_judging_the_revision(fleet, repo):
    """The stand-in's GPU 1 says it needs a reset before anything starts: nothing is started or
    written on that host (GpuFault, the field quoted), and it deploys once the GPU reads healthy."""
    h = fleet.hosts[0]
    fleet.ssh(h, fleetlib.gpu_host(2))
    fleet.ssh(h, fleetlib.gpu_faults("1 reset-required"))
    write_shared(repo, [h], load="0.5")
    c1 = repo.commit("qwen3.5 on a GPU host")
    _, out = run_json("--repo", str(repo.path), check_codes=(4,))
    r = host_out(out, h)
    reset = "GPU 00000000:2A:00.0: GPU Reset Status / Reset Required: Yes"
    assert (r["status"], r["reason"]) == ("failed", "GpuFault") and reset in r["message"], r
    assert fleet.no_records(h) and not fleet.exists(h, f"/etc/systemd/system/{SERVICE}.service")
    mark = json.loads(fleet.ssh(h, f"cat {FAULT_FILE}"))
    assert (mark["quote"], mark["service"], mark["revision"]) == (reset, None, None)

    fleet.ssh(h, fleetlib.gpu_faults())          # reset: healthy again
    _, out = run_json("--repo", str(repo.path), check_codes=(0,))
    assert host_out(out, h)["status"] == "converged" and not fleet.exists(h, FAULT_FILE)
    assert record(fleet, h)["last_good_revision"] == c1
