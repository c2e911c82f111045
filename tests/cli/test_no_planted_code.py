"""H1 of the 2026-12-02 review, kept as a break-in test: root's `reconcile` with its cache
directory in another user's hands (XDG_CACHE_HOME, RECONCILER_CACHE_DIR, HOME all pointing at a
0777 tree that user owns, as `sudo -E` would leave them) runs nothing planted there.

Planted: `reconciler/find_library.json` naming a shared library whose constructor writes a
marker (what libcache once handed to asyncssh's dlopen), a `code/*.marshal` whose code writes
the marker (dccache), and a `desired/*.pickle` that writes it when unpickled (loadcache). A dry
run against a real local repo, of a host nothing answers on, imports asyncssh to connect; an
audit hook in that process records every file it opens and every library it dlopens: none is
in the planted tree, and the marker never appears.
"""

from __future__ import annotations

import json
import marshal
import os
import pickle
import re
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest

from tests.conftest import ROOT, DesiredRepo, write_fleet

NOBODY = 65534

# Runs `python -m reconciler ...` with an audit hook that writes each open path and dlopen name
# to $AUDIT_LOG, opened before the hook (os.write raises no audit event of its own, and every
# line is out before process.leave's _exit).
AUDITED = textwrap.dedent("""
    import os, runpy, sys
    LOG = os.open(os.environ.pop("AUDIT_LOG"), os.O_WRONLY | os.O_APPEND)
    def hook(event, args):
        if event == "open" and isinstance(args[0], (str, bytes)):
            os.write(LOG, b"open " + os.fsencode(args[0]) + b"\\n")
        elif event == "ctypes.dlopen":
            os.write(LOG, b"dlopen " + os.fsencode(str(args[0])) + b"\\n")
        elif event == "import" and args[0] == "asyncssh":
            os.write(LOG, b"import asyncssh\\n")
    sys.addaudithook(hook)
    sys.argv = ["reconcile", *sys.argv[1:]]
    runpy.run_module("reconciler", run_name="__main__", alter_sys=True)
""")


class Unreachable:
    """A host in the desired state that nothing answers for (no test host is booted there)."""

    name, address = "gpu-9", "127.0.0.254"

    def __init__(self, key: str):
        self.key = key

    def known_hosts_line(self) -> str:
        return f"{self.address} {self.key}"


class Plant:
    """What a marker-writing payload does, unpickled: os.system of a shell line."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (f"echo pickle >> {self.marker}",))


def attacker_tree(tmp: Path, marker: Path) -> Path:
    """The other user's 0777 cache tree, with every kind of file the old caches executed."""
    src = tmp / "evil.c"
    src.write_text(f'#include <stdio.h>\n__attribute__((constructor)) static void pwn(void) {{\n'
                   f'  FILE *f = fopen("{marker}", "a"); if (f) {{ fputs("dlopen\\n", f); fclose(f); }}\n}}\n')
    lib = tmp / "evil" / "libevil.so"
    lib.parent.mkdir()
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(lib), str(src)], check=True, capture_output=True)
    cache = tmp / "evil" / "reconciler"
    for sub in ("code", "desired", "repos"):
        (cache / sub).mkdir(parents=True)
    (cache / "find_library.json").write_text(json.dumps(
        {"key": "any", "libs": {"nettle": str(lib), "oqs": str(lib), "crypto": str(lib), "sodium": str(lib)}}))
    payload = compile(f"open({str(marker)!r}, 'a').write('marshal\\n')", "planted", "exec")
    (cache / "code" / f"dataclasses-{sys.version_info[0]}{sys.version_info[1]}.marshal").write_bytes(
        marshal.dumps(payload))
    (cache / "desired" / "0123456789abcdef.pickle").write_bytes(pickle.dumps(Plant(marker)))
    for d, dirs, files in os.walk(tmp / "evil"):
        for name in [*dirs, *files]:
            os.chown(Path(d) / name, NOBODY, NOBODY)
            os.chmod(Path(d) / name, 0o777)
    os.chown(tmp / "evil", NOBODY, NOBODY)
    os.chmod(tmp / "evil", 0o777)
    return tmp / "evil"


@pytest.mark.skipif(os.geteuid() != 0, reason="the attack is on root's run (the suite runs as root: .ci/test)")
def test_a_root_dry_run_loads_nothing_from_another_users_cache(tmp_path):
    marker = tmp_path / "PWNED"
    evil = attacker_tree(tmp_path, marker)
    subprocess.run(["ssh-keygen", "-q", "-t", "ed25519", "-N", "", "-f", str(tmp_path / "hostkey")], check=True)
    repo = DesiredRepo(tmp_path / "fleet")
    write_fleet(repo, [Unreachable(" ".join((tmp_path / "hostkey.pub").read_text().split()[:2]))])  # type: ignore[list-item]
    repo.commit("a fleet of one unreachable host")
    env = {**os.environ, "XDG_CACHE_HOME": str(evil), "RECONCILER_CACHE_DIR": str(evil / "reconciler"),
           "HOME": str(evil), "RECONCILER_IDENTITY": str(tmp_path / "hostkey"), "NO_COLOR": "1"}
    log = tmp_path / "audit.log"
    log.write_text("")
    res = subprocess.run([sys.executable, "-c", AUDITED, "--repo", str(repo.path), "--dry-run"],
                         env={**env, "AUDIT_LOG": str(log)}, cwd=ROOT, capture_output=True, text=True, timeout=120)
    events = log.read_text(errors="replace").splitlines()
    assert "import asyncssh" in events, (events[:20], res.stdout, res.stderr)   # the path H1 was on
    assert res.returncode == 4, res.stdout + res.stderr                           # 4: a host unreachable
    assert "gpu-9: Unreachable: root@127.0.0.254:22: cannot connect" in res.stdout, res.stdout
    assert not marker.exists(), marker.read_text()
    assert [e for e in events if str(evil) in e or "find_library" in e] == []
    # asyncssh's libraries come from ctypes.util.find_library itself: bare sonames that the
    # dynamic loader resolves through root's own ld.so.cache, never a path from a file
    loaded = [e.removeprefix("dlopen ") for e in events if e.startswith("dlopen ")]
    assert loaded and all(name == "None" or "/" not in name for name in loaded), loaded
    # every file the run opened: Python and the checkout, the repo and key it was given, the
    # system's own files, and find_library's fresh temp files (it runs gcc); nothing in a cache or a home
    given = (sys.prefix, sys.base_prefix, str(ROOT), str(repo.path), str(tmp_path / "hostkey"))
    system = ("/etc/", "/usr/", "/lib", "/proc/", "/sys/", "/dev/")
    fresh = re.compile(rf"{re.escape(tempfile.gettempdir())}(/\w+)?")     # tempfile's probe, gcc's output
    # a relative path is the run's working directory, the checkout (`python -m` puts it on
    # sys.path; pydantic's plugin loader reads the entry points of every distribution there,
    # the checkout's own reconciler.egg-info where `pip install -e` made one)
    opened = [os.path.join(ROOT, e.removeprefix("open ")) for e in events if e.startswith("open ")]
    elsewhere = [p for p in opened if not p.startswith(given + system) and not fresh.fullmatch(p)
                 and not p.endswith(".__path_hook__")]
    assert elsewhere == [], elsewhere
    # the control: each planted payload does write the marker when it is loaded
    (code,) = (evil / "reconciler" / "code").glob("*.marshal")
    (pickled,) = (evil / "reconciler" / "desired").glob("*.pickle")
    subprocess.run([sys.executable, "-c", f"import ctypes, marshal, pickle; ctypes.CDLL({str(evil / 'libevil.so')!r}); "
                    f"exec(marshal.loads(open({str(code)!r}, 'rb').read())); "
                    f"pickle.loads(open({str(pickled)!r}, 'rb').read())"], check=True, timeout=30)
    assert marker.read_text().split() == ["dlopen", "marshal", "pickle"]
