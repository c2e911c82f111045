"""End-to-end: a sick GPU is the host's fault, not the commit's (issue 35, item 5), within bounds
(issue 39, item 4: security review N7), on real hosts.

GPU hosts (the stand-in nvidia-smi) share a definition, the first the canary. A new revision's
start trips a fault on a host's GPU as a real one would show it: the stand-in's `nvidia-smi -q`
reports a volatile uncorrectable ECC error and the driver's Xid 48 line reaches the host's kernel
log (`journalctl -k`). The failed start is GpuFault on that host, with the line quoted, and the
revision is not judged there. On a later wave's host that is an excuse, once: the rollout goes on
and the host deploys the same revision once its GPU reads healthy. On the canary, or on a second
host at the same revision, it is not: a revision can provoke a GPU fault, so the rollout halts
and the revision is quarantined on the hosts it left untouched. And only the driver's own report
counts: a kernel message that quotes one (a user's file name in a segfault report), or one for a
GPU that is not the host's, marks nothing.
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


def gpu_fleet(fleet, repo, hosts: list[fleetlib.Host]) -> str:
    """GPU hosts (the first the canary) running the service at a first revision; its hash."""
    for h in hosts:
        fleet.ssh(h, fleetlib.gpu_host(2))
        # The driver's first line, so the host's kernel log is journald's to read (tests.fleet)
        fleet.ssh(h, fleetlib.kernel_log("NVRM: loading NVIDIA UNIX x86_64 Kernel Module  565.57.01"))
    write_shared(repo, hosts, load="0.5")
    c1 = repo.commit("qwen3.5 on GPU hosts")
    run_cli("--repo", str(repo.path), check_codes=(0,))
    return c1


def assert_gpu_fault(fleet, out: dict, h: fleetlib.Host, c1: str, c2: str) -> None:
    """The host's start of c2 failed with its GPU sick: GpuFault, both lines quoted; not judged there."""
    r = host_out(out, h)
    assert (r["status"], r["reason"]) == ("failed", "GpuFault"), r
    assert ECC in r["message"], r["message"]
    deploy = next(e for e in r["events"] if e["action"] == "deploy")
    assert deploy["outcome"]["reason"] == "GpuFault" and deploy["outcome"]["quote"] == ECC
    assert "StartFailed" in deploy["outcome"]["message"] or "CrashLoop" in deploy["outcome"]["message"]
    # The host is marked, the fault lines quoted: nvidia-smi's ECC count and the kernel's Xid 48
    mark = json.loads(fleet.ssh(h, f"cat {FAULT_FILE}"))
    assert (mark["quote"], mark["service"], mark["revision"]) == (ECC, SERVICE, c2)
    assert any(line.startswith(XID_48) and "[Xid 48: double-bit ECC error" in line for line in mark["lines"])
    # The revision is not judged there: not last good, its deploy pending; the unit is stopped
    rec = record(fleet, h)
    assert rec["last_good_revision"] == c1
    assert rec["pending"]["revision"] == c2 and rec["pending"]["unjudged"].startswith("GpuFault")
    assert fleet.show(h, SERVICE, "ActiveState")["ActiveState"] in ("inactive", "failed")


@pytest.mark.timeout(240)
def test_a_later_hosts_sick_gpu_is_the_hosts_fault_and_the_rollout_goes_on(fleet, repo):
    canary, sick = fleet.hosts[:2]
    c1 = gpu_fleet(fleet, repo, [canary, sick])

    fleet.ssh(sick, f"cat > {TRIP} <<'EOF'\n{trip_script()}EOF")
    write_shared(repo, [canary, sick], load="0.6")
    c2 = repo.commit("a new revision")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    assert_gpu_fault(fleet, out, sick, c1, c2)
    assert record(fleet, sick)["quarantine"] is None
    # ... one host's GPU fault is an excuse: the canary ran it healthy, the rollout is done
    [ro] = out["rollouts"]
    assert (ro["status"], ro["halted"], ro["excused"], ro["untouched"]) == ("done", None, [sick.name], []), ro
    assert host_out(out, canary)["status"] == "converged"
    good = record(fleet, canary)
    assert good["last_good_revision"] == c2 and good["quarantine"] is None and good["pending"] is None
    assert fleet.show(canary, SERVICE, "SubState")["SubState"] == "running"

    # status --live: the host's GpuFault, the line quoted
    _, live = run_json("status", "--live", "--repo", str(repo.path), check_codes=(0,))
    row = next(x for x in live if x["host"] == sick.name and x["service"] == SERVICE)
    assert row["last_event"].startswith(f"GpuFault: GPU fault ({SERVICE} {c2[:7]} failed to start): {ECC}")
    assert row["quote"] == ECC
    assert next(x for x in live if x["host"] == canary.name)["gpu_fault"] is None

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


@pytest.mark.timeout(240)
def test_a_revision_that_faults_the_canary_halts_the_rollout(fleet, repo):
    """A revision can provoke a GPU fault (NVIDIA: an Xid may be "a user application problem"):
    the canary's is no excuse. The rollout halts there; the revision is quarantined on the hosts
    it left untouched, which keep running the old one."""
    sick, *rest = fleet.hosts[:3]
    c1 = gpu_fleet(fleet, repo, [sick, *rest])
    ids = {h.name: fleet.show(h, SERVICE, "InvocationID")["InvocationID"] for h in rest}

    fleet.ssh(sick, f"cat > {TRIP} <<'EOF'\n{trip_script()}EOF")
    write_shared(repo, [sick, *rest], load="0.6")
    c2 = repo.commit("a revision that faults the GPU it starts on")
    res = run_cli("--repo", str(repo.path), check_codes=(4,))
    # The report says where it halted and why this GPU fault counted
    out = res.stdout
    why = (f"the canary's start failed while its GPUs were sick ({ECC}): a revision can provoke a GPU fault, "
           f"so a canary's is no excuse")
    assert f"halted at {sick.name} (wave 1, canary): GpuFault\n    journal: {ECC}\n    {why}\n" in out, out
    assert f"not restarted, quarantined at {c2[:7]}: {', '.join(h.name for h in rest)}" in out
    assert "not counted against it" not in out
    # The canary: GpuFault, its revision not judged there; marked
    rec = record(fleet, sick)
    assert rec["last_good_revision"] == c1 and rec["pending"]["unjudged"].startswith("GpuFault")
    mark = json.loads(fleet.ssh(sick, f"cat {FAULT_FILE}"))
    assert (mark["quote"], mark["service"], mark["revision"]) == (ECC, SERVICE, c2)
    assert any(line.startswith(XID_48) for line in mark["lines"])
    # The others: quarantined, never restarted, running the old revision
    for h in rest:
        q = record(fleet, h)["quarantine"]
        assert (q["revision"], q["reason"], q["halted_at"], q["cause"], q["quote"]) == (
            c2, "RolloutHalted", sick.name, "GpuFault", ECC)
        assert record(fleet, h)["last_good_revision"] == c1
        assert fleet.show(h, SERVICE, "InvocationID")["InvocationID"] == ids[h.name]     # never restarted
    status = {r["host"]: r for r in json.loads(run_cli("status", "--json", check_codes=(0,)).stdout)}
    assert "halted here" in status[sick.name]["last_event"]
    for h in rest:
        assert f"rollout halted at canary {sick.name}: GpuFault" in status[h.name]["last_event"]

    # The GPU is reset: the mark goes, and the halted revision is not tried there again: the host
    # runs its last good one (the group's halt covers it)
    fleet.ssh(sick, f"rm -f {TRIP} /etc/fake-gpu-faults")
    code, out = run_json("--repo", str(repo.path), check_codes=(3,))
    assert not fleet.exists(sick, FAULT_FILE)
    rec = record(fleet, sick)
    assert (rec["last_good_revision"], rec["pending"]) == (c1, None), rec
    q = rec["quarantine"]
    assert (q["revision"], q["reason"], q["halted_at"], q["cause"]) == (c2, "RolloutHalted", sick.name, "GpuFault")
    assert fleet.show(sick, SERVICE, "SubState")["SubState"] == "running"
    assert {r["host"]: r["status"] for r in out["hosts"]} == {
        sick.name: "rolled-back", **{h.name: "quarantined" for h in rest}}


@pytest.mark.timeout(300)
def test_a_second_host_faulted_by_the_same_revision_halts_the_rollout(fleet, repo):
    """The canary runs it; a later wave's host faults (excused, the rollout goes on); the next
    host faults too: two GPU faults at one revision are no longer the hosts' luck."""
    canary, first, second, last = fleet.hosts[:4]
    c1 = gpu_fleet(fleet, repo, [canary, first, second, last])
    for h in (first, second):
        fleet.ssh(h, f"cat > {TRIP} <<'EOF'\n{trip_script()}EOF")
    write_shared(repo, [canary, first, second, last], load="0.6")
    c2 = repo.commit("a revision that faults GPUs")
    code, out = run_json("--repo", str(repo.path), check_codes=(4,))
    for h in (first, second):
        assert_gpu_fault(fleet, out, h, c1, c2)
    [ro] = out["rollouts"]
    why = (f"GPU faults on 2 hosts at this revision ({first.name}: {ECC}; {second.name}: {ECC}): a revision that "
           f"provokes GPU faults is not excused twice")
    assert (ro["status"], ro["excused"], ro["untouched"]) == ("halted", [first.name], [last.name]), ro
    assert ro["halted"] == {"host": second.name, "wave": 3, "reason": "GpuFault", "message": why, "quote": ECC}
    assert record(fleet, canary)["last_good_revision"] == c2
    q = record(fleet, last)["quarantine"]
    assert (q["revision"], q["reason"], q["halted_at"], q["cause"]) == (c2, "RolloutHalted", second.name, "GpuFault")
    assert record(fleet, last)["last_good_revision"] == c1


FORGED_XID = ("python3[4242]: segfault at 0 ip 00007f3a5c0d1000 sp 00007ffd2a7b8e40 error 4 in "
              "NVRM: Xid (PCI:0000:18:00): 79, x[7f3a5c000000+1000]")
NOT_OURS_XID = "NVRM: Xid (PCI:0000:99:00): 79, pid=4242, name=python3, GPU has fallen off the bus."
OUR_XID = "NVRM: Xid (PCI:0000:2a:00): 79, pid=4242, name=python3, GPU has fallen off the bus."


@pytest.mark.timeout(240)
def test_a_forged_xid_marks_nothing(fleet, repo):
    """A local user's file named as an Xid report, quoted by the kernel's segfault report, and a
    real-looking report for a GPU that is not the host's: the host is not marked, each deploy goes
    on. The driver's report for one of its GPUs, in the same window, does mark it."""
    h = fleet.hosts[0]
    gpu_fleet(fleet, repo, [h])
    for i, (line, code) in enumerate([(FORGED_XID, 0), (NOT_OURS_XID, 0), (OUR_XID, 4)]):
        fleet.ssh(h, fleetlib.kernel_log(line))          # after the last apply: the reading's window
        write_shared(repo, [h], load=f"0.{6 + i}")
        c = repo.commit(f"revision {i + 2}")
        _, out = run_json("--repo", str(repo.path), check_codes=(code,))
        r = host_out(out, h)
        if code == 0:
            assert r["status"] == "converged" and not fleet.exists(h, FAULT_FILE), (line, r)
            assert record(fleet, h)["last_good_revision"] == c
        else:
            quote = f"{OUR_XID} [Xid 79: GPU has fallen off the bus (RESTART_BM)]"
            assert (r["status"], r["reason"]) == ("failed", "GpuFault") and quote in r["message"], r
            mark = json.loads(fleet.ssh(h, f"cat {FAULT_FILE}"))
            assert (mark["quote"], mark["service"], mark["revision"]) == (quote, None, None)


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
