"""The real engine packages for the engine-probe tests: one environment per engine release,
built once, cached.

What is installed, and why, is tests/engines.txt (exact versions). Built from a wheelhouse
(CACHE/engine-wheels, kept between builds) into CACHE/engine-envs/<key>, where key is a hash of
that file, this module's build steps and the libcuda stand-in's source::

    <key>/base/                 the packages all share (torch, the nvidia-* libraries, triton,
                                transformers, ...), installed once
    <key>/sglang-0.5.12/ ...    one per section of tests/engines.txt: a venv of the test hosts'
    <key>/vllm-0.34.0/          /usr/bin/python3 (Debian 12, 3.11), its own packages in
                                lib/python3.11/site-packages, and a .pth file that adds ../base
                                (a relative path: valid wherever <key> is)
    <key>/libcuda/libcuda.so.1  the project's stand-in for the NVIDIA driver library
                                (tests/hostpkg/libcuda/libcuda.c)

CACHE is RECONCILER_ENGINES_CACHE, else RECONCILER_FLEET_CACHE, else /var/cache/reconciler-testfleet
(an empty RECONCILER_ENGINES_CACHE times a cold build without touching the fleet's own cache).
Several checkouts on one machine may pin different engines: a build removes only the other
builds no checkout has used for three days (each build() touches its own `.used`).

Every test host sees <key> read-only at /opt/engines (tests/fleet.py), and the stand-in at
/usr/lib/x86_64-linux-gnu/libcuda.so.1, where the driver puts it on Debian. The build ends by
running each engine's probe (reconciler/engines/) once on a small model with the test hosts'
facts: that proves the environment answers, and compiles the modules the probe imports (the
hosts see the environments read-only, where Python cannot write its bytecode cache).

    python -m tests.engines build      # idempotent; prints the root (.ci/setup --engines runs it)
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
CACHE = Path(os.environ.get("RECONCILER_ENGINES_CACHE")
             or os.environ.get("RECONCILER_FLEET_CACHE", "/var/cache/reconciler-testfleet"))
PINS = HERE / "engines.txt"
LIBCUDA_SRC = HERE / "hostpkg" / "libcuda" / "libcuda.c"
MODELS = HERE / "models"
# The test hosts' interpreter (Debian 12's); the environments are venvs of it.
HOST_PYTHON = "/usr/bin/python3"
PYVER = "3.11"
# Bump when the build steps below change.
BUILD_VERSION = "3"
# A build no checkout has used for this long is removed by the next build of other pins.
STALE_SECONDS = 3 * 24 * 3600
# Where the test hosts see the environments, and the libcuda stand-in.
HOST_ROOT = "/opt/engines"
HOST_LIBCUDA = "/usr/lib/x86_64-linux-gnu/libcuda.so.1"
# The hardware the probes are told about: one SM90 host with 4 H200-like GPUs.
H200_FACTS = {"count": 4, "name": "NVIDIA H200", "capability": [9, 0], "memory_mib": 143771}


class EnginesError(RuntimeError):
    """The engine environments could not be built; the message says why."""


def pins() -> dict[str, list[str]]:
    """tests/engines.txt: section -> ["name==version", ...]."""
    out: dict[str, list[str]] = {}
    section = None
    for raw in PINS.read_text().splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        if line.startswith("[") and line.endswith("]"):
            section = line[1:-1]
            out[section] = []
        elif section is None or "==" not in line:
            raise EnginesError(f"tests/engines.txt: {raw!r}: expected [section] or name==version")
        else:
            out[section].append(line)
    return out


def environments() -> list[str]:
    """The names of the engine environments (every section but [base])."""
    return [s for s in pins() if s != "base"]


def key() -> str:
    h = hashlib.sha256()
    for part in (PINS.read_bytes(), LIBCUDA_SRC.read_bytes(), BUILD_VERSION.encode()):
        h.update(part)
    return h.hexdigest()[:12]


def root() -> Path:
    """Where the environments for the current pins live (built or not)."""
    return CACHE / "engine-envs" / key()


def wheelhouse() -> Path:
    return CACHE / "engine-wheels"


def built() -> Path | None:
    """The root when it is completely built, else None."""
    r = root()
    return r if (r / ".complete").exists() else None


def engine_of(env: str) -> str:
    """The engine an environment runs: `sglang-0.5.20` -> sglang."""
    return env.split("-", 1)[0]


def write_probes(dest: Path) -> dict[str, Path]:
    """The probe program of each engine (reconciler.engines.probe_text, as the host gets it) in
    `dest`: {engine: path}."""
    from reconciler.engines import ADAPTERS, probe_text
    dest.mkdir(parents=True, exist_ok=True)
    out = {}
    for engine in ADAPTERS:
        out[engine] = dest / f"{engine}_probe.py"
        out[engine].write_text(probe_text(engine))
    return out


def host_binds() -> list[str]:
    """systemd-nspawn arguments that give a test host the engines (none when not built)."""
    r = built()
    if r is None:
        return []
    return [f"--bind-ro={r}:{HOST_ROOT}", f"--bind-ro={r / 'libcuda' / 'libcuda.so.1'}:{HOST_LIBCUDA}"]


def _run(cmd: list[str], **kw) -> subprocess.CompletedProcess:
    res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    if res.returncode != 0:
        raise EnginesError(f"{' '.join(cmd[:6])} ... failed ({res.returncode}): "
                           f"{(res.stderr or res.stdout).strip()[-2000:]}")
    return res


def _pip() -> list[str]:
    return [sys.executable, "-m", "pip", "-q", "--disable-pip-version-check"]


def download(specs: list[str], dest: Path) -> None:
    """The wheels (no dependencies) into the wheelhouse; pip skips what is already there."""
    _run([*_pip(), "download", "--no-deps", "--only-binary", ":all:", "-d", str(dest), *specs])


def install(specs: list[str], target: Path) -> None:
    """Install exactly `specs` from the wheelhouse into `target` (a site-packages dir)."""
    _run([*_pip(), "install", "--no-deps", "--no-index", "--find-links", str(wheelhouse()), "--no-compile",
          "--target", str(target), *specs])


def site_packages(env: Path) -> Path:
    return env / "lib" / f"python{PYVER}" / "site-packages"


def make_env(env: Path, specs: list[str]) -> None:
    _run([HOST_PYTHON, "-m", "venv", "--without-pip", str(env)])
    sp = site_packages(env)
    install(specs, sp)
    (sp / "_reconciler_engines_base.pth").write_text(os.path.relpath(env.parent / "base", sp) + "\n")


def build_libcuda(out: Path) -> None:
    out.mkdir(parents=True, exist_ok=True)
    if shutil.which("gcc") is None:
        raise EnginesError("gcc not found: .ci/setup installs it (the libcuda stand-in is compiled)")
    _run(["gcc", "-O2", "-shared", "-fPIC", "-Wall", "-Wl,-soname,libcuda.so.1",
          "-o", str(out / "libcuda.so.1"), str(LIBCUDA_SRC)])


def probe_command(r: Path, env: str, script: Path, args: list[str], facts: dict | None = H200_FACTS) -> list[str]:
    """The probe `script` of `env`'s engine, run isolated with that environment's interpreter under `r`."""
    return [str(r / env / "bin" / "python"), "-I", str(script),
            *(["--facts", json.dumps(facts)] if facts is not None else []), "--", *args]


def warm_up(r: Path, env: str) -> dict:
    """Run the probe once on the small dense model (must be ok): the environment works, and
    Python writes the bytecode of every module the probe imports while the tree is writable."""
    model = str(MODELS / "Qwen3-8B")
    args = [model] if env.startswith("vllm") else ["--model-path", model]
    with tempfile.TemporaryDirectory(prefix="engines-warm-") as tmp:
        script = write_probes(Path(tmp) / "probes")[engine_of(env)]
        envvars = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "HF_HUB_OFFLINE": "1", "HOME": tmp,
                   "VLLM_CACHE_ROOT": tmp, "LD_LIBRARY_PATH": str(r / "libcuda")}
        envvars.pop("PYTHONDONTWRITEBYTECODE", None)        # writing the bytecode is the point
        res = subprocess.run(probe_command(r, env, script, args), capture_output=True, text=True, env=envvars,
                             timeout=600)
    lines = res.stdout.strip().splitlines()
    if not lines or not lines[-1].startswith("RECONCILER-ENGINE "):
        raise EnginesError(f"{env}: the probe printed no verdict ({res.returncode}): {res.stderr[-2000:]}")
    verdict = json.loads(lines[-1].split(" ", 1)[1])
    if verdict["verdict"] != "ok":
        raise EnginesError(f"{env}: the probe's warm-up on Qwen3-8B was not ok: {verdict}")
    return verdict


def build() -> Path:
    """Build (once per tests/engines.txt) the environments; return their root."""
    r = root()
    if (r / ".complete").exists():
        (r / ".used").touch()
        return r
    if not Path(HOST_PYTHON).exists():
        raise EnginesError(f"{HOST_PYTHON} not found (the environments are venvs of the test hosts' python)")
    ver = _run([HOST_PYTHON, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"]).stdout.strip()
    if ver != PYVER:
        raise EnginesError(f"{HOST_PYTHON} is Python {ver}; the test hosts run {PYVER}")
    t0 = time.monotonic()
    p = pins()
    wheelhouse().mkdir(parents=True, exist_ok=True)
    tmp = r.with_name(r.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    print(f"engines: building {', '.join(environments())} into {r}", file=sys.stderr)
    # One pip download per section: --no-deps resolves nothing, but two versions of one name
    # (transformers in [base] and [sglang-0.5.12]) cannot share one call.
    with ThreadPoolExecutor(4) as pool:
        list(pool.map(lambda s: download(p[s], wheelhouse()), p))
        t1 = time.monotonic()
        jobs = [pool.submit(install, p["base"], tmp / "base"), pool.submit(build_libcuda, tmp / "libcuda")]
        jobs += [pool.submit(make_env, tmp / env, p[env]) for env in environments()]
        for j in jobs:
            j.result()
        t2 = time.monotonic()
        verdicts = list(pool.map(lambda env: warm_up(tmp, env), environments()))
    for env, v in zip(environments(), verdicts, strict=True):
        if v["version"] != env.split("-", 1)[1]:
            raise EnginesError(f"{env}: the probe found {v['engine']} {v['version']}")
    (tmp / ".complete").write_text(json.dumps({"key": key(), "download_s": round(t1 - t0, 1),
                                               "install_s": round(t2 - t1, 1),
                                               "warm_up_s": round(time.monotonic() - t2, 1)}) + "\n")
    shutil.rmtree(r, ignore_errors=True)
    tmp.rename(r)
    (r / ".used").touch()
    remove_stale(r)
    print(f"engines: built in {time.monotonic() - t0:.0f}s ({(r / '.complete').read_text().strip()})",
          file=sys.stderr)
    return r


def remove_stale(r: Path) -> None:
    """Other pins' builds (7 GB each) and broken attempts that no checkout used for STALE_SECONDS."""
    now = time.time()
    for other in r.parent.iterdir():
        if other == r:
            continue
        used = max((p.stat().st_mtime for p in (other / ".used", other) if p.exists()), default=0.0)
        if now - used > STALE_SECONDS:
            shutil.rmtree(other, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    args = argv if argv is not None else sys.argv[1:]
    if args != ["build"]:
        print("usage: python -m tests.engines build", file=sys.stderr)
        return 2
    try:
        print(build())
    except EnginesError as e:
        print(f"engines: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
