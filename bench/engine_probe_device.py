#!/usr/bin/env python3
"""Issue 35 item 2: does the engine probe disturb a GPU that a loaded server holds?

Run ON the GPU machine (python3 with torch, nvidia-smi); bench/results/engine_probe_h200.txt
has the commands. --rehearse: no GPU (fake nvidia-smi, a CPU holder). A HOLDER (--holder) takes
--hold-frac of the card (or all but --full-leave-mib) and loops over bf16 products, logging each
step's latency and checksums; beside it the probe runs per engine in mode a (GPUs visible,
nothing injected), a+stub (the same with a stand-in sgl_kernel) and b (CUDA_VISIBLE_DEVICES=
and --facts from nvidia-smi) under HF_HUB_OFFLINE=1 timeout 180 nice -n 19, measuring wall time,
the verdict, peak RSS (wait4), new GPU processes (compute-apps every --poll-ms), memory.used and
whether torch initialised CUDA in the probe (--wrap). Standard library and torch only.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import signal
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve()
SEED = ["--tp-size", "1", "--speculative-algo", "NEXTN", "--speculative-num-steps", "3",
        "--speculative-eagle-topk", "1", "--speculative-num-draft-tokens", "4"]


# ---------------------------------------------------------------- holder (a loaded server)
def holder(args: argparse.Namespace) -> None:
    import torch
    dev = "cpu" if args.rehearse else "cuda:0"
    n = 512 if args.rehearse else 8192
    out = open(args.log, "a", buffering=1)  # noqa: SIM115 (open for the process's life)
    def log(kind: str, text: str) -> None:
        out.write(f"{time.time():.4f} {kind} {text}\n")
    def stop(*_: object) -> None:
        raise KeyboardInterrupt
    signal.signal(signal.SIGTERM, stop)
    words = fsum = None
    try:
        g = torch.Generator(device=dev).manual_seed(35)
        a = torch.randn(n, n, generator=g, device=dev).to(torch.bfloat16)
        b = torch.randn(n, n, generator=g, device=dev).to(torch.bfloat16)
        c = torch.empty(n, n, dtype=torch.bfloat16, device=dev)      # every buffer a step uses,
        cf = torch.empty(n, n, dtype=torch.float32, device=dev)      # allocated once: the loop
        total_c = torch.empty((), dtype=torch.float32, device=dev)   # allocates nothing (a full
        def product_sum() -> float:                                   # card would refuse it)
            torch.matmul(a, b, out=c)
            cf.copy_(c)
            torch.sum(cf, dim=(0, 1), out=total_c)
            return float(total_c)
        ref = product_sum()
        pattern = torch.randint(-2**62, 2**62, (2**24,), generator=g, device=dev, dtype=torch.int64)
        fsum_out = torch.empty((), dtype=torch.int64, device=dev)
        if args.rehearse:
            filler = torch.empty(64 * 2**20, dtype=torch.uint8)
            total = 143771 * 2**20
        else:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
            leave = args.leave_mib * 2**20 if args.leave_mib else int(total * (1 - args.frac))
            filler = torch.empty(max(free - leave, 2**20) // 8 * 8, dtype=torch.uint8, device=dev)
        words = filler.view(torch.int64)
        for chunk in words.split(pattern.numel()):
            chunk.copy_(pattern[: chunk.numel()])
        def filler_sum() -> int:
            torch.sum(words, dim=0, out=fsum_out)
            return int(fsum_out)
        fsum = filler_sum()
        del pattern                            # its block stays in torch's cache: no empty_cache
        if not args.rehearse:
            torch.cuda.synchronize()
            free, total = torch.cuda.mem_get_info()
        else:
            free = total - filler.numel()
        log("READY", f"filler_mib={filler.numel() >> 20} free_mib={free >> 20} "
                     f"total_mib={total >> 20} ref={ref:.6e} fsum={fsum}")
        last_verify = time.monotonic()
        while True:
            t0 = time.perf_counter()
            bad = 0
            for _ in range(10):
                if product_sum() != ref:
                    bad += 1
            ms = (time.perf_counter() - t0) * 1000
            log("STEP", f"{ms:.3f} {bad}")
            if args.rehearse:
                time.sleep(0.2)                    # leave the CPU to the probe
            if time.monotonic() - last_verify >= 1.0:
                s = filler_sum()
                log("VERIFY", "ok" if s == fsum else f"BAD {s}")
                last_verify = time.monotonic()
    except KeyboardInterrupt:
        ok = words is not None and filler_sum() == fsum
        log("END", f"final_verify={'ok' if ok else 'BAD'}")
    except Exception as exc:  # a CUDA error is what we look for
        log("ERROR", f"{type(exc).__name__}: {exc}".replace("\n", " | "))
        raise


# ---------------------------------------------------------------- wrapper around the probe
def wrap(argv: list[str]) -> None:
    """Run the probe as __main__; at exit say whether torch initialised CUDA in this process."""
    import atexit
    import runpy

    def report() -> None:
        torch = sys.modules.get("torch")
        init = bool(torch is not None and torch.cuda.is_initialized())
        sys.stderr.write(f"HARNESS-CUDA {json.dumps({'torch': torch is not None, 'cuda_initialized': init})}\n")
        sys.stderr.flush()
    atexit.register(report)
    real_exit = os._exit

    def exit_now(code: int) -> None:             # a probe that ends with os._exit skips atexit
        report()
        real_exit(code)
    os._exit = exit_now  # type: ignore[assignment]
    sys.argv = argv
    sys.path[0] = str(Path(argv[0]).resolve().parent)    # as `python PROBE` would have it
    runpy.run_path(argv[0], run_name="__main__")


# ---------------------------------------------------------------- nvidia-smi
class Smi:
    def __init__(self, rehearse: bool) -> None:
        self.rehearse = rehearse

    def _q(self, *args: str) -> list[list[str]]:
        r = subprocess.run(["nvidia-smi", *args], capture_output=True, text=True, timeout=30)
        return [[x.strip() for x in ln.split(",")] for ln in r.stdout.splitlines() if ln.strip()]

    def gpus(self) -> list[list[str]]:
        if self.rehearse:
            return [["NVIDIA H200 (rehearsal)", "9.0", "143771", "0", "fake"]]
        return self._q("--query-gpu=name,compute_cap,memory.total,memory.used,driver_version",
                       "--format=csv,noheader,nounits")

    def used_mib(self) -> int:
        return 0 if self.rehearse else int(self._q("--query-gpu=memory.used",
                                                   "--format=csv,noheader,nounits")[0][0])

    def apps(self) -> dict[int, int]:
        if self.rehearse:
            return {}
        rows = self._q("--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits")
        return {int(r[0]): int(r[1]) if r[1].isdigit() else -1 for r in rows if r[0].isdigit()}

    def facts(self) -> dict[str, Any]:
        g = self.gpus()
        major, minor = (int(x) for x in g[0][1].split("."))
        return {"count": len(g), "name": g[0][0], "capability": [major, minor],
                "memory_mib": int(g[0][2])}


class Poller(threading.Thread):
    """Samples compute-apps and memory.used every poll_ms while a probe runs."""

    def __init__(self, smi: Smi, known: set[int], poll_ms: int) -> None:
        super().__init__(daemon=True)
        self.smi, self.known, self.poll = smi, known, poll_ms / 1000
        self.stop = threading.Event()
        self.samples = 0
        self.max_used = 0
        self.new_pids: dict[int, int] = {}

    def run(self) -> None:
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                for pid, mib in self.smi.apps().items():
                    if pid not in self.known:
                        self.new_pids[pid] = max(self.new_pids.get(pid, 0), mib)
                self.max_used = max(self.max_used, self.smi.used_mib())
                self.samples += 1
            except (subprocess.SubprocessError, OSError, ValueError, IndexError):
                pass
            self.stop.wait(max(0.0, self.poll - (time.monotonic() - t0)))


# ---------------------------------------------------------------- one probe run
@dataclass
class Run:
    label: str
    engine: str
    mode: str
    holder: str
    wall: float = 0.0
    rc: int = 0
    rss_mib: float = 0.0
    verdict: dict[str, Any] = field(default_factory=dict)
    cuda: dict[str, Any] = field(default_factory=dict)
    new_pids: dict[int, int] = field(default_factory=dict)
    used_delta: int = 0
    samples: int = 0
    t0: float = 0.0
    t1: float = 0.0
    tail: str = ""


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args = args
        self.smi = Smi(args.rehearse)
        self.out = open(args.out, "w", buffering=1)  # noqa: SIM115 (open for the run)
        self.t_start = time.monotonic()
        self.holder_proc: subprocess.Popen[bytes] | None = None
        self.holder_log = str(Path(args.out).with_name("holder.log"))
        self.runs: list[Run] = []
        self.windows: list[tuple[str, float, float]] = []

    def say(self, text: str) -> None:
        line = f"[{time.monotonic() - self.t_start:7.2f}s] {text}"
        print(line, flush=True)
        self.out.write(line + "\n")

    def late(self) -> bool:
        return time.monotonic() - self.t_start > self.args.budget_s

    # -- holder
    def start_holder(self, leave_mib: int) -> None:
        cmd = [sys.executable, str(HERE), "--holder", "--log", self.holder_log,
               "--frac", str(self.args.hold_frac), "--leave-mib", str(leave_mib)]
        if self.args.rehearse:
            cmd.append("--rehearse")
        mark = self._holder_lines()
        self.holder_proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            for ln in self._holder_lines()[len(mark):]:
                if " READY " in ln or " ERROR " in ln:
                    self.say(f"holder   pid {self.holder_proc.pid}: {ln.split(' ', 1)[1]}")
                    self.say(f"gpu      memory.used {self.smi.used_mib()} MiB; apps {self.smi.apps()}")
                    return
            if self.holder_proc.poll() is not None:
                break
            time.sleep(0.2)
        raise SystemExit(f"holder did not get ready (rc {self.holder_proc.poll()})")

    def stop_holder(self) -> None:
        if self.holder_proc and self.holder_proc.poll() is None:
            self.holder_proc.send_signal(signal.SIGTERM)
            try:
                self.holder_proc.wait(60)
            except subprocess.TimeoutExpired:
                self.holder_proc.kill()
                self.holder_proc.wait()
        tail = [ln for ln in self._holder_lines() if " END " in ln or " ERROR " in ln][-1:]
        self.say(f"holder   stopped rc={self.holder_proc.returncode if self.holder_proc else None} "
                 f"{tail[0].split(' ', 1)[1] if tail else '(no END line)'}")

    def _holder_lines(self) -> list[str]:
        try:
            return Path(self.holder_log).read_text().splitlines()
        except FileNotFoundError:
            return []

    def idle(self, label: str) -> None:
        t0 = time.time()
        time.sleep(self.args.window_s)
        self.windows.append((label, t0, time.time()))

    # -- probe
    def probe(self, label: str, engine: str, site: str, mode: str, argv: list[str],
              facts: dict[str, Any] | None, holder: str) -> Run:
        run = Run(label, engine, mode, holder)
        env = dict(os.environ, PYTHONPATH=site, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1",
                   PYTHONUNBUFFERED="1")
        if mode == "b":
            env["CUDA_VISIBLE_DEVICES"] = ""
        if mode == "a+stub":
            env["PYTHONPATH"] = f"{self.args.stub}:{site}"
        cmd = ["timeout", "180", "nice", "-n", "19", sys.executable, str(HERE), "--wrap",
               self.args.probe]
        if facts is not None:
            cmd += ["--facts", json.dumps(facts)]
        cmd += ["--", *argv]
        known = set(self.smi.apps())
        base = self.smi.used_mib()
        poller = Poller(self.smi, known, self.args.poll_ms)
        poller.start()
        run.t0 = time.time()
        t0 = time.perf_counter()
        p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        chunks: list[bytes] = []
        reader = threading.Thread(target=lambda: chunks.append(p.stdout.read() if p.stdout else b""))
        reader.start()
        _, status, usage = os.wait4(p.pid, 0)
        run.wall = time.perf_counter() - t0
        run.t1 = time.time()
        p.returncode = os.waitstatus_to_exitcode(status)
        reader.join()
        poller.stop.set()
        poller.join()
        run.rc = p.returncode
        run.rss_mib = usage.ru_maxrss / 1024
        run.new_pids = poller.new_pids
        run.samples = poller.samples
        run.used_delta = max(0, poller.max_used - base) if poller.samples else -1
        text = b"".join(chunks).decode(errors="replace")
        for ln in text.splitlines():
            if ln.startswith("RECONCILER-ENGINE "):
                run.verdict = json.loads(ln.split(" ", 1)[1])
            elif ln.startswith("HARNESS-CUDA "):
                run.cuda = json.loads(ln.split(" ", 1)[1])
        run.tail = "\n".join(text.splitlines()[-6:])
        v = run.verdict
        self.say(f"probe    {label:<26} {engine} mode {mode} [{holder}] rc={run.rc} "
                 f"wall={run.wall:.2f}s rss={run.rss_mib:.0f}MiB "
                 f"cuda_init={run.cuda.get('cuda_initialized')} new_gpu_pids={run.new_pids} "
                 f"used_delta={run.used_delta}MiB samples={run.samples}")
        self.say(f"         verdict={v.get('verdict')} seconds={v.get('seconds')} "
                 f"message={str(v.get('message'))[:300]!r} where={v.get('where')}")
        self.say(f"         resolved={json.dumps(v.get('resolved'), sort_keys=True)[:400]}")
        if not v:
            self.say("         NO VERDICT LINE; output tail:\n" + run.tail)
        self.runs.append(run)
        return run

    # -- holder statistics
    def steps(self) -> list[tuple[float, float, int]]:
        out = []
        for ln in self._holder_lines():
            parts = ln.split()
            if len(parts) == 4 and parts[1] == "STEP":
                out.append((float(parts[0]), float(parts[2]), int(parts[3])))
        return out

    def window_stats(self, t0: float, t1: float) -> str:
        ms = [m for t, m, _ in self.steps() if t0 <= t <= t1]
        bad = sum(b for t, _, b in self.steps() if t0 <= t <= t1)
        if not ms:
            return "no steps"
        ms.sort()
        p99 = ms[min(len(ms) - 1, int(len(ms) * 0.99))]
        return (f"steps={len(ms)} median={statistics.median(ms):.2f}ms p99={p99:.2f}ms "
                f"max={ms[-1]:.2f}ms bad_products={bad}")

    def holder_health(self, t0: float, t1: float) -> str:
        lines = [ln.split() for ln in self._holder_lines()]
        verify = [x for x in lines if len(x) >= 3 and x[1] == "VERIFY" and t0 <= float(x[0]) <= t1]
        bad = [x for x in verify if x[2] != "ok"]
        errors = [" ".join(x[1:])[:160] for x in lines
                  if len(x) >= 2 and x[1] == "ERROR" and float(x[0]) <= t1]
        return f"filler_checks={len(verify)} bad={len(bad)} errors={errors or 'none'}"


def batch(b: Bench, engine: str, site: str, mode: str, label: str, argv: list[str],
          facts: dict[str, Any] | None, holder: str, repeats: int) -> None:
    if b.late():
        b.say(f"skip     {label} {engine} mode {mode}: over the time budget")
        return
    if holder == "none":
        b.probe(label, engine, site, mode, argv, facts, holder)
        return
    b.idle(f"{engine} {label} before")
    runs = [b.probe(label, engine, site, mode, argv, facts, holder) for _ in range(repeats)]
    b.windows.append((f"{engine} {label} during", runs[0].t0, runs[-1].t1))
    b.idle(f"{engine} {label} after")




def write_stub(folder: str) -> None:
    pkg = Path(folder) / "sgl_kernel"
    pkg.mkdir(parents=True, exist_ok=True)
    (pkg / "__init__.py").write_text((HERE.parent / "sgl_kernel_stub.py").read_text())


def versions(site: str) -> str:
    """Installed versions seen through `site` (metadata only: nothing is imported)."""
    code = ("import importlib.metadata as m\n"
            "for n in ('sglang', 'torch', 'transformers', 'tokenizers', 'triton', 'torchvision'):\n"
            "    try: print(n + '=' + m.version(n), end=' ')\n"
            "    except m.PackageNotFoundError: print(n + '=absent', end=' ')\n")
    r = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=site),
                       capture_output=True, text=True, timeout=60)
    return r.stdout.strip() or r.stderr.strip()[-200:]


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--holder", action="store_true")
    ap.add_argument("--log", default="")
    ap.add_argument("--frac", type=float, default=0.85)
    ap.add_argument("--leave-mib", type=int, default=0)
    ap.add_argument("--rehearse", action="store_true", help="no GPU: fake nvidia-smi, CPU holder")
    ap.add_argument("--probe", default="")
    ap.add_argument("--model", default="")
    ap.add_argument("--engine", action="append", default=[], help="NAME=PYTHONPATH")
    ap.add_argument("--out", default="engine_probe.txt")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--hold-frac", type=float, default=0.85)
    ap.add_argument("--full-leave-mib", type=int, default=256)
    ap.add_argument("--poll-ms", type=int, default=100)
    ap.add_argument("--window-s", type=float, default=3.0)
    ap.add_argument("--budget-s", type=float, default=480.0)
    ap.add_argument("--skip-main", action="store_true", help="leave out phase 1's a/b repeats")
    ap.add_argument("--stub", default="", help="a dir with a stand-in sgl_kernel: adds mode a+stub")
    ap.add_argument("--stub-repeats", type=int, default=2)
    ap.add_argument("--facts-cases", action="store_true", help="tp4 with facts x4, sm100 facts")
    if sys.argv[1:2] == ["--wrap"]:
        wrap(sys.argv[2:])
        return
    args = ap.parse_args()
    if args.holder:
        holder(args)
        return
    b = Bench(args)
    b.say(f"command  {shlex.join([Path(sys.executable).name, *sys.argv])}")
    b.say(f"host     {os.uname().nodename} {os.uname().release} cpus={os.cpu_count()}")
    # no torch in this process: a child's ru_maxrss starts at its parent's RSS at fork time
    b.say(f"python   {sys.version.split()[0]}; image: {versions('')}")
    for row in b.smi.gpus():
        b.say(f"gpu      name={row[0]} compute_cap={row[1]} memory.total={row[2]}MiB "
              f"memory.used={row[3]}MiB driver={row[4]}")
    facts = b.smi.facts()
    b.say(f"facts    {json.dumps(facts)}  (nvidia-smi, no CUDA context)")
    engines = [e.split("=", 1) for e in args.engine]
    for name, site in engines:
        b.say(f"engine   {name}: PYTHONPATH={site} {versions(site)}")
    seed = ["--model-path", args.model, *SEED]
    tp4 = ["--tp-size", "4", *SEED[2:]]
    a_modes = ["a", "a+stub"] if args.stub else ["a"]
    if args.stub:
        write_stub(args.stub)
        b.say(f"stub     mode a+stub: a stand-in sgl_kernel in {args.stub} first on PYTHONPATH")
    b.start_holder(0)
    try:                                   # 1: the question itself, the holder at --hold-frac
        if not args.skip_main:
            for name, site in engines:
                batch(b, name, site, "a", "seed tp1", seed, None, "85%", args.repeats)
                batch(b, name, site, "b", "seed tp1", seed, facts, "85%", args.repeats)
        if args.stub:
            for name, site in engines:
                batch(b, name, site, "a+stub", "seed tp1", seed, None, "85%", args.stub_repeats)
    finally:
        b.stop_holder()
    if not b.late():                       # 2: a nearly full card
        b.start_holder(args.full_leave_mib)
        try:
            for name, site in engines:
                for mode in [*a_modes, "b"]:
                    batch(b, name, site, mode, "seed tp1 FULL", seed, facts if mode == "b" else None, "full", 1)
        finally:
            b.stop_holder()
    if args.facts_cases and not b.late():  # 3: do the facts decide? (no holder needed)
        for name, site in engines:
            tp4 = ["--model-path", args.model, "--tp-size", "4", *SEED[2:]]
            for mode in a_modes:
                batch(b, name, site, mode, "seed tp4", tp4, None, "none", 1)
            batch(b, name, site, "b", "seed tp4 facts x4", tp4, dict(facts, count=4), "none", 1)
            batch(b, name, site, "b", "seed tp1 facts sm100", seed, dict(facts, capability=[10, 0]), "none", 1)
    b.say(f"gpu      at the end: memory.used {b.smi.used_mib()} MiB; apps {b.smi.apps()}; "
          f"this harness's own max RSS {resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024:.0f} MiB "
          "(the floor of every probe's rss: ru_maxrss carries over a fork)")
    report(b)


def report(b: Bench) -> None:
    b.say("")
    b.say("== holder step latency (10 bf16 8192^3 products per step) and health, by window")
    for label, t0, t1 in b.windows:
        b.say(f"  {label:<48} {b.window_stats(t0, t1)}; {b.holder_health(t0, t1)}")
    b.say("")
    b.say("== probe runs")
    b.say(f"  {'engine':<14} {'mode':<6} {'case':<22} {'holder':<6} {'verdict':<12} {'wall s':>7} "
          f"{'rss MiB':>8} {'gpu MiB':>8} {'Δused':>6} cuda_init")
    for r in b.runs:
        gpu = max(r.new_pids.values()) if r.new_pids else 0
        b.say(f"  {r.engine:<14} {r.mode:<6} {r.label:<22} {r.holder:<6} "
              f"{r.verdict.get('verdict')!s:<12} {r.wall:7.2f} {r.rss_mib:8.0f} {gpu:8d} "
              f"{r.used_delta:6d} {r.cuda.get('cuda_initialized')}")
    b.say("")
    for mode in ("a", "a+stub", "b"):
        rs = [r for r in b.runs if r.mode == mode]
        if not rs:
            continue
        ctx = [r for r in rs if r.new_pids]
        b.say(f"summary  mode {mode}: runs={len(rs)} wall median={statistics.median(r.wall for r in rs):.2f}s "
              f"max rss={max(r.rss_mib for r in rs):.0f}MiB runs with a GPU context={len(ctx)} "
              f"max gpu MiB={max((max(r.new_pids.values()) for r in ctx), default=0)} "
              f"max Δused={max(r.used_delta for r in rs)}MiB "
              f"cuda_initialized={sum(bool(r.cuda.get('cuda_initialized')) for r in rs)}/{len(rs)}")


if __name__ == "__main__":
    main()
