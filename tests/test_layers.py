"""The architecture's contracts (pyproject.toml [tool.importlinter]) hold, and they bite: the
same check on a copy of the package with one import that crosses a layer upwards fails, naming it."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
LINT = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command as c; sys.exit(c())"]


def lint(package_parent: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([*LINT, str(ROOT / "pyproject.toml"), "--no-cache"], capture_output=True,
                          text=True, cwd=package_parent, env={"PYTHONPATH": str(package_parent), "PATH": "/usr/bin"},
                          timeout=120)


def test_the_package_keeps_every_contract():
    res = lint(ROOT)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "Contracts: 6 kept, 0 broken." in res.stdout, res.stdout


def test_an_import_that_crosses_a_layer_upwards_breaks_the_contract(tmp_path):
    shutil.copytree(ROOT / "reconciler", tmp_path / "reconciler", ignore=shutil.ignore_patterns("__pycache__"))
    records = tmp_path / "reconciler" / "plan" / "records.py"
    records.write_text(records.read_text() + "\nfrom ..host import apply  # the planner reaching for the executor\n")
    res = lint(tmp_path)
    assert res.returncode != 0
    assert "reconciler.plan.records -> reconciler.host.apply" in res.stdout, res.stdout


def test_the_engine_probe_importing_the_rest_of_reconciler_breaks_its_contract(tmp_path):
    shutil.copytree(ROOT / "reconciler", tmp_path / "reconciler", ignore=shutil.ignore_patterns("__pycache__"))
    probe = tmp_path / "reconciler" / "engines" / "probe.py"
    probe.write_text(probe.read_text() + "\nfrom ..redact import redact  # a host program reaching into reconciler\n")
    res = lint(tmp_path)
    assert res.returncode != 0
    assert "reconciler.engines.probe -> reconciler.redact" in res.stdout, res.stdout
