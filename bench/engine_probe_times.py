"""Probe time per engine: the engine check's probe (reconciler.engines.probe_text) run the way a host
runs it (`python -I probe.py --facts ... -- ARGS`, GPUs hidden, the libcuda stand-in, nice 19) with
each real engine environment tests/engines.py built, on the incident's model (config.json only).

    .venv/bin/python -m bench.engine_probe_times [--repeat 3] [--env sglang-0.5.20 ...]

Prints, per environment, the wall time of each run (a cold interpreter each time, the modules'
bytecode already compiled by the build's warm-up) and the probe's own split (import, check), then
the median. One run at a time: on a 2-core machine two at once share the cores and both slow down.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from tests import engines

MODEL = str(engines.MODELS / "Qwen3.5-122B-A10B")
ARGS = {"sglang": ["--model-path", MODEL, "--tp-size", "4", "--speculative-algo", "NEXTN",
                   "--speculative-num-steps", "3", "--speculative-eagle-topk", "1",
                   "--speculative-num-draft-tokens", "4"],
        "vllm": [MODEL, "--tensor-parallel-size", "4"]}


def run_once(root: Path, env: str, script: Path, cache: str) -> tuple[float, dict]:
    cmd = ["nice", "-n", "19", *engines.probe_command(root, env, script, ARGS[engines.engine_of(env)])]
    envvars = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "VLLM_CACHE_ROOT": cache,
               "LD_LIBRARY_PATH": str(root / "libcuda")}
    t0 = time.monotonic()
    res = subprocess.run(cmd, capture_output=True, text=True, env=envvars, timeout=600)
    wall = time.monotonic() - t0
    last = res.stdout.strip().splitlines()[-1] if res.stdout.strip() else ""
    if not last.startswith("RECONCILER-ENGINE "):
        raise SystemExit(f"{env}: no verdict ({res.returncode}): {res.stderr[-1000:]}")
    return wall, json.loads(last.removeprefix("RECONCILER-ENGINE "))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--env", action="append", help="an environment of tests/engines.txt (default: all)")
    opts = ap.parse_args(argv)
    root = engines.built()
    if root is None:
        print(f"the engine environments are not built ({engines.root()}): bash .ci/setup --engines", file=sys.stderr)
        return 1
    print(f"# engine probe time, {opts.repeat} runs each, one at a time; {os.cpu_count()} cores; root {root.name}")
    print(f"{'environment':<16} {'verdict':<8} {'wall s (each)':<24} {'median':>7}  import/check s (median run)")
    with tempfile.TemporaryDirectory(prefix="probe-times-") as tmp:
        scripts = engines.write_probes(Path(tmp) / "probes")
        for env in opts.env or engines.environments():
            runs = [run_once(root, env, scripts[engines.engine_of(env)], tmp) for _ in range(opts.repeat)]
            walls = [w for w, _ in runs]
            mid = sorted(runs, key=lambda r: r[0])[len(runs) // 2][1]
            split = f"{mid['seconds'].get('import', '-')}/{mid['seconds'].get('check', '-')}"
            print(f"{env:<16} {mid['verdict']:<8} {' '.join(f'{w:.1f}' for w in walls):<24} "
                  f"{statistics.median(walls):>7.1f}  {split}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
