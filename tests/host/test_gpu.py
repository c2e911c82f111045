"""The GPU gate: the parser on captured-looking output (pure), and the command, the wait and the
kill policy run for real through a local shell on this machine (which has no GPU)."""

from __future__ import annotations

import asyncio
import base64
import subprocess
import sys
from pathlib import Path

import pytest

from reconciler.errors import ObserveError
from reconciler.host import gpu
from reconciler.host.transport import LocalTransport
from reconciler.plan.facts import gpu as facts_gpu
from tests.clock import FakeClock
from tests.host.programs import answer

TOKEN = "tok"


def b64(s: str) -> str:
    return base64.b64encode(s.encode()).decode()


def holder_line(pid: int, comm: str, cgroup: str, *devices: str) -> str:
    return f"{TOKEN} H {pid} {b64(comm)} {b64(cgroup) if cgroup else '-'}  {' '.join(devices)}"


# What the gate prints on the H200 machine while a torch process holds 20 GiB (the numbers and
# device nodes of shared/TESTHOSTS.md, section 'A real GPU host'), framed as gpu_command frames it.
H200 = "\n".join([
    f"{TOKEN} BEGIN",
    holder_line(416, "python3", "0::/\n", "/dev/nvidia-caps", "/dev/nvidia-uvm", "/dev/nvidia0",
                "/dev/nvidiactl"),
    f"{TOKEN} SMI 1",
    f"{TOKEN} G 0, GPU-3f0c1b7e-8a51-4a0e-9d3e-2f1f0c6f3a11, 21007, 143771",
    f"{TOKEN} GRC 0",
    f"{TOKEN} A 416, python3, 20998, GPU-3f0c1b7e-8a51-4a0e-9d3e-2f1f0c6f3a11",
    f"{TOKEN} ARC 0",
    f"{TOKEN} END",
])


def test_parse_a_torch_process_on_the_h200():
    facts = facts_gpu.parse_gpu(H200, TOKEN)
    assert facts.has_nvidia_smi and facts.error is None and facts.observed_gpu_count == 1
    assert facts.gpus == [facts_gpu.Gpu(index=0, used_mib=21007, total_mib=143771,
                                  uuid="GPU-3f0c1b7e-8a51-4a0e-9d3e-2f1f0c6f3a11")]
    [h] = facts.holders
    assert (h.pid, h.comm, h.used_mib, h.gpus, h.unit) == (416, "python3", 20998, (0,), None)
    assert h.devices == ("/dev/nvidia-caps", "/dev/nvidia-uvm", "/dev/nvidia0", "/dev/nvidiactl")
    assert facts.summary() == ("1 GPU (0: 21007/143771 MiB); held by pid 416 (python3): 20998 MiB on GPU 0, "
                               "/dev/nvidia-caps /dev/nvidia-uvm /dev/nvidia0 /dev/nvidiactl")


def test_parse_after_the_process_exited():
    out = "\n".join([f"{TOKEN} BEGIN", f"{TOKEN} SMI 1", f"{TOKEN} G 0, GPU-a, 0, 143771",
                     f"{TOKEN} GRC 0", f"{TOKEN} A ", f"{TOKEN} ARC 0", f"{TOKEN} END"])
    facts = facts_gpu.parse_gpu(out, TOKEN)
    assert facts.holders == [] and facts.gpus[0].used_mib == 0
    assert facts.summary() == "1 GPU (0: 0/143771 MiB); no process holds /dev/nvidia*"
    assert gpu.released(facts, pids={416}, max_used_mib=1024)


def test_the_compute_capability_when_nvidia_smi_names_it_and_none_from_a_driver_without_the_field():
    out = "\n".join([f"{TOKEN} BEGIN", f"{TOKEN} SMI 1", f"{TOKEN} G 0, GPU-a, 0, 143771, 9.0",
                     f"{TOKEN} G 1, GPU-b, 10, 143771, [N/A]", f"{TOKEN} GRC 0", f"{TOKEN} ARC 0", f"{TOKEN} END"])
    facts = facts_gpu.parse_gpu(out, TOKEN)
    assert [g.compute_capability for g in facts.gpus] == ["9.0", None]
    from reconciler.preflight import Hardware
    assert [g.compute_capability for g in Hardware.of(facts).gpus] == [(9, 0), None]
    assert facts_gpu.parse_gpu(H200, TOKEN).gpus[0].compute_capability is None        # the 4-field answer


def test_parse_many_gpus_units_and_processes_seen_only_by_nvidia_smi():
    out = "\n".join([
        f"{TOKEN} BEGIN",
        holder_line(1200, "python3", "0::/system.slice/sglang-qwen.service\n", "/dev/nvidia0", "/dev/nvidiactl"),
        holder_line(1201, "sglang::schedul", "0::/system.slice/sglang-qwen.service\n", "/dev/nvidia1"),
        holder_line(99, "nvidia-persiste", "0::/system.slice/nvidia-persistenced.service\n", "/dev/nvidiactl"),
        f"{TOKEN} SMI 1",
        f"{TOKEN} G 0, GPU-a, 70000, 143771",
        f"{TOKEN} G 1, GPU-b, 70100, 143771",
        f"{TOKEN} G 2, GPU-c, [N/A], [N/A]",
        f"{TOKEN} GRC 0",
        f"{TOKEN} A 1201, sglang::scheduler_TP0, 69000, GPU-a",
        f"{TOKEN} A 1201, sglang::scheduler_TP0, 69100, GPU-b",
        f"{TOKEN} A 5555, /usr/bin/python3, 512, GPU-c",     # another PID namespace: no /proc entry
        f"{TOKEN} ARC 0",
        f"{TOKEN} END",
    ])
    facts = facts_gpu.parse_gpu(out, TOKEN)
    assert [g.index for g in facts.gpus] == [0, 1, 2]
    assert facts.gpus[2].used_mib is None and facts.gpus[2].total_mib is None
    by_pid = {h.pid: h for h in facts.holders}
    assert sorted(by_pid) == [99, 1200, 1201, 5555]
    assert by_pid[1201].used_mib == 138100 and by_pid[1201].gpus == (0, 1)        # summed
    assert by_pid[1201].unit == "sglang-qwen.service"
    assert by_pid[1200].used_mib is None                                          # /proc only
    assert (by_pid[5555].comm, by_pid[5555].devices, by_pid[5555].used_mib) == ("python3", (), 512)


def test_parse_process_names_with_commas_and_the_three_column_format():
    out = "\n".join([f"{TOKEN} BEGIN", f"{TOKEN} SMI 1",
                     f"{TOKEN} G 0, 100, 81559",                        # index,memory.used,memory.total
                     f"{TOKEN} GRC 0",
                     f"{TOKEN} A 7, weird,name, 300, GPU-z", f"{TOKEN} ARC 0", f"{TOKEN} END"])
    facts = facts_gpu.parse_gpu(out, TOKEN)
    assert facts.gpus == [facts_gpu.Gpu(index=0, used_mib=100, total_mib=81559)]
    assert (facts.holders[0].comm, facts.holders[0].used_mib) == ("weird,name", 300)


def test_parse_nvidia_smi_failing():
    msg = ("NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
           "Make sure that the latest NVIDIA driver is installed and running.")
    out = "\n".join([f"{TOKEN} BEGIN", f"{TOKEN} SMI 1", f"{TOKEN} G {msg}", f"{TOKEN} GRC 9",
                     f"{TOKEN} A {msg}", f"{TOKEN} ARC 9", f"{TOKEN} END"])
    facts = facts_gpu.parse_gpu(out, TOKEN)
    assert facts.has_nvidia_smi and facts.gpus == [] and facts.error
    assert facts.summary().startswith("nvidia-smi failed: NVIDIA-SMI has failed because")
    assert facts.observed_gpu_count is None


def test_parse_no_nvidia_smi_reports_no_gpus():
    facts = facts_gpu.parse_gpu(f"{TOKEN} BEGIN\n{TOKEN} SMI 0\n{TOKEN} END\n", TOKEN)
    assert (facts.has_nvidia_smi, facts.gpus, facts.holders, facts.error) == (False, [], [], None)
    assert facts.summary() == "no GPUs (nvidia-smi not found); no process holds /dev/nvidia*"
    assert facts.observed_gpu_count is None


def test_parse_refuses_truncated_or_forged_output():
    with pytest.raises(ObserveError):
        facts_gpu.parse_gpu(f"{TOKEN} BEGIN\n{TOKEN} SMI 1\n", TOKEN)               # no END
    with pytest.raises(ObserveError):
        facts_gpu.parse_gpu(f"{TOKEN} H x y\n{TOKEN} END\n", TOKEN)
    # Lines without the token (a process name printing "END", a login banner) are ignored.
    facts = facts_gpu.parse_gpu(f"banner\nEND\nother SMI 1\n{TOKEN} SMI 0\n{TOKEN} END\n", TOKEN)
    assert not facts.has_nvidia_smi


def test_parse_values_sent_as_they_are():
    """The host sends a comm or cgroup of one printable-ASCII line as '@' + the line (no base64
    process); anything else in base64. Both read the same."""
    cgroup = b64("0::/system.slice/x.service\n")
    out = "\n".join([
        f"{TOKEN} BEGIN",
        f"{TOKEN} H 1200 @python3 @0::/system.slice/sglang-qwen.service /dev/nvidia0",
        f"{TOKEN} H 1201 @@odd @0::/ /dev/nvidia1",                     # a comm starting with '@'
        f"{TOKEN} H 1202 {b64('my proc')} {cgroup} /dev/nvidia1",
        f"{TOKEN} SMI 1", f"{TOKEN} G 0, GPU-a, 100, 81559", f"{TOKEN} GRC 0",
        f"{TOKEN} A 5555, python3, 512, GPU-a", f"{TOKEN} ARC 0",
        f"{TOKEN} C 5555 @0::/system.slice/vllm.service",
        f"{TOKEN} END"])
    by_pid = {h.pid: h for h in facts_gpu.parse_gpu(out, TOKEN).holders}
    assert (by_pid[1200].comm, by_pid[1200].unit) == ("python3", "sglang-qwen.service")
    assert (by_pid[1201].comm, by_pid[1201].unit) == ("@odd", None)
    assert (by_pid[1202].comm, by_pid[1202].unit) == ("my proc", "x.service")
    assert by_pid[5555].unit == "vllm.service"


def test_proc_scan_reads_any_process_name(tmp_path: Path):
    """Names of every kind (spaces, UTF-8, a newline, a leading '@') come back as they are."""
    prefix = str(tmp_path / "nvidia")
    names = ["my proc", "caf\u00e9", "a\nb", "@x", "plain"]
    procs = []
    try:
        for name in names:
            code = ("import ctypes, time\n"
                    f"ctypes.CDLL(None).prctl(15, ctypes.c_char_p({name.encode()!r}), 0, 0, 0)\n"
                    f"a = open({prefix + '0'!r}, 'w')\n"
                    "print('ready', flush=True); time.sleep(60)\n")
            p = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
            assert p.stdout is not None and p.stdout.readline() == "ready\n"
            procs.append(p)
        facts = asyncio.run(gpu.gpu_facts(LocalTransport(), device_prefix=prefix))
        assert {h.pid: h.comm for h in facts.holders} == {p.pid: n for p, n in zip(procs, names, strict=True)}
        assert all(h.devices == (prefix + "0",) for h in facts.holders)
    finally:
        for p in procs:
            p.kill()
            p.wait()


@pytest.mark.parametrize("cgroup, unit", [
    ("0::/system.slice/sglang-qwen.service\n", "sglang-qwen.service"),
    ("0::/system.slice/sglang-qwen.service/payload\n", "sglang-qwen.service"),
    ("12:pids:/system.slice/vllm.service\n1:name=systemd:/system.slice/vllm.service\n", "vllm.service"),
    ("0::/user.slice/user-0.slice/session-3.scope\n", "session-3.scope"),
    ("0::/\n", None),
    ("", None),
])
def test_unit_of_cgroup(cgroup: str, unit: str | None):
    assert facts_gpu.unit_of_cgroup(cgroup) == unit


def test_released_is_pids_gone_and_memory_below_threshold():
    facts = facts_gpu.parse_gpu(H200, TOKEN)
    assert not gpu.released(facts, pids={416}, max_used_mib=1024)            # still a holder
    assert not gpu.released(facts, pids={1}, max_used_mib=1024)              # memory in use
    assert gpu.released(facts, pids={1}, max_used_mib=30000)
    assert gpu.released(facts, pids=None, max_used_mib=1024, gpus={1})       # only GPU 1 matters
    assert [g.index for g in facts.used_over(1024)] == [0]


# ---- for real, on this machine (no GPU, no nvidia-smi) ----------------------------------------


def test_gpu_facts_on_a_machine_without_gpus():
    facts = asyncio.run(gpu.gpu_facts(LocalTransport()))
    assert not facts.has_nvidia_smi and facts.gpus == [] and facts.error is None
    assert facts.summary().startswith("no GPUs (nvidia-smi not found)")
    clock = FakeClock()
    ok, after, waited = asyncio.run(gpu.wait_released(LocalTransport(), pids={1}, timeout=5, clock=clock))
    assert ok and after.gpus == [] and waited == 0 and clock.slept == []     # released at the first look


class Holding:
    """A real process holding files named like device nodes (the /proc scan is the real one;
    only the path prefix differs, since /dev/nvidia* cannot exist without the driver)."""

    def __init__(self, tmp: Path, ignore_term: bool = False):
        self.prefix = str(tmp / "nvidia")
        code = ("import signal, sys, time\n"
                + ("signal.signal(signal.SIGTERM, signal.SIG_IGN)\n" if ignore_term else "")
                + f"a = open({self.prefix + '0'!r}, 'w'); c = open({self.prefix + 'ctl'!r}, 'w')\n"
                + "print('ready', flush=True); time.sleep(60)\n")
        self.proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None and self.proc.stdout.readline() == "ready\n"

    def facts(self) -> facts_gpu.GpuFacts:
        return asyncio.run(gpu.gpu_facts(LocalTransport(), device_prefix=self.prefix))

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


@pytest.fixture
def holding(tmp_path: Path):
    procs: list[Holding] = []

    def start(ignore_term: bool = False) -> Holding:
        h = Holding(tmp_path, ignore_term)
        procs.append(h)
        return h

    yield start
    for h in procs:
        h.stop()


def test_proc_scan_finds_the_holder_with_its_devices(holding):
    h = holding()
    facts = h.facts()
    held = facts.holder(h.proc.pid)
    assert held is not None
    assert held.devices == (h.prefix + "0", h.prefix + "ctl")
    assert held.comm.startswith("python")
    assert [x.pid for x in facts.holders] == [h.proc.pid]       # nobody else holds these files


def test_report_policy_never_kills_and_kill_policy_terminates(holding):
    h = holding()
    strays = h.facts().holders
    outcome = asyncio.run(gpu.kill_strays(LocalTransport(), strays, "report"))
    assert [o.outcome for o in outcome] == ["reported"] and h.proc.poll() is None
    # virtual grace (tests/clock.py): polls cost no wait; many of them give the process time to go
    outcome = asyncio.run(gpu.kill_strays(LocalTransport(), strays, "kill", grace=5, poll=0.01, clock=FakeClock()))
    assert [o.outcome for o in outcome] == ["terminated"]
    assert h.proc.wait(timeout=5) == -15
    ok, facts, _ = asyncio.run(gpu.wait_released(
        LocalTransport(), pids={h.proc.pid}, timeout=5, device_prefix=h.prefix, clock=FakeClock()))
    assert ok and facts.holders == []


def test_kill_policy_escalates_to_sigkill(holding):
    h = holding(ignore_term=True)
    strays = h.facts().holders
    clock = FakeClock()
    outcome = asyncio.run(gpu.kill_strays(LocalTransport(), strays, "kill", grace=0.5, poll=0.125, clock=clock))
    assert [o.outcome for o in outcome] == ["killed"]
    assert h.proc.wait(timeout=5) == -9
    assert clock.slept[:4] == [0.125] * 4 and clock.elapsed() >= 0.5    # SIGKILL only once the grace was out


def test_kill_leaves_a_reused_pid_alone(holding):
    h = holding()
    [held] = h.facts().holders
    imposter = facts_gpu.Holder(pid=held.pid, comm="not-" + held.comm, devices=held.devices)
    outcome = asyncio.run(gpu.kill_strays(LocalTransport(), [imposter], "kill", grace=0.5))
    assert [o.outcome for o in outcome] == ["gone"] and h.proc.poll() is None


def test_the_service_itself_is_not_a_stray(holding):
    h = holding()
    assert [x.pid for x in h.facts().holders] == [h.proc.pid]


def test_wait_released_times_out_while_held(holding):
    h = holding()
    clock = FakeClock()
    ok, facts, waited = asyncio.run(gpu.wait_released(
        LocalTransport(), pids={h.proc.pid}, timeout=0.5, poll=0.125, device_prefix=h.prefix, clock=clock))
    assert not ok and facts.holder(h.proc.pid) is not None
    assert waited == 0.5 and clock.slept == [0.125] * 4         # five looks, the last at the timeout


def test_wait_released_sees_the_release(holding):
    h = holding()
    clock = FakeClock()
    stopped: list[float] = []

    async def scenario() -> tuple[bool, float]:
        async def stop_later() -> None:
            await clock.sleep(0.5)
            h.proc.terminate()
            h.proc.wait(timeout=5)          # gone before the next look (the loop waits with it)
            stopped.append(clock.elapsed())
        stopper = asyncio.ensure_future(stop_later())
        ok, _, waited = await gpu.wait_released(LocalTransport(), pids={h.proc.pid}, timeout=10,
                                                poll=0.125, device_prefix=h.prefix, clock=clock)
        await stopper
        return ok, waited

    ok, waited = asyncio.run(scenario())
    assert stopped == [0.5] and ok and waited == 0.5       # seen at the first look after the stop


def test_unknown_policy_is_refused():
    with pytest.raises(ValueError, match="unknown stray-process policy"):
        asyncio.run(gpu.kill_strays(LocalTransport(), [], "nuke"))


def test_gpu_module_needs_only_the_standard_library():
    """bench/gpu_gate_device.py runs on a GPU machine without pydantic or asyncssh: the GPU gate
    and the local transport it runs on load without them."""
    code = ("import sys; sys.modules['asyncssh'] = None; sys.modules['pydantic'] = None\n"
            "import reconciler.host.gpu, reconciler.host.transport, reconciler.errors\n")
    root = Path(__file__).resolve().parents[2]
    subprocess.run([sys.executable, "-c", code], cwd=root, check=True)


def test_bench_script_dry_run_without_third_party_packages():
    root = Path(__file__).resolve().parents[2]
    code = ("import sys, runpy; sys.modules['asyncssh'] = None; sys.modules['pydantic'] = None\n"
            "sys.argv = ['gpu_gate_device.py', '--dry']\n"
            "runpy.run_path('bench/gpu_gate_device.py', run_name='__main__')\n")
    res = subprocess.run([sys.executable, "-c", code], cwd=root, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert "transport=Local" in res.stdout      # reconciler.transport no longer needs asyncssh to load
    assert "before   no GPUs (nvidia-smi not found)" in res.stdout



def test_no_device_node_and_no_nvidia_smi_skips_the_proc_scan(tmp_path: Path):
    """Where no device node exists (and no nvidia-smi), no process can hold one: the scan of every
    process's fds (ls | awk) is skipped. Once a node exists, it runs again."""
    prefix = str(tmp_path / "nvidia")
    bin_dir, marker = tmp_path / "bin", tmp_path / "ls-ran"
    bin_dir.mkdir()
    (bin_dir / "ls").write_text(f"#!/bin/sh\n: > {marker}\nexec /bin/ls \"$@\"\n")
    (bin_dir / "ls").chmod(0o755)
    path = f"{bin_dir}:/usr/sbin:/usr/bin:/sbin:/bin"

    def run() -> list[facts_gpu.Holder]:
        return answer(facts_gpu.GpuRead(device_prefix=prefix), path=path, shell_="bash").holders

    assert run() == [] and not marker.exists()
    (tmp_path / "nvidia0").write_text("")
    held = subprocess.Popen([sys.executable, "-c", f"import time; f = open({prefix + '0'!r}); "
                             "print('ready', flush=True); time.sleep(60)"], stdout=subprocess.PIPE, text=True)
    try:
        assert held.stdout is not None and held.stdout.readline() == "ready\n"     # it holds the node now
        assert any(h.pid == held.pid for h in run()), "the holder was not found"
        assert marker.exists()
    finally:
        held.kill()
        held.wait()
