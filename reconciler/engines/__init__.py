"""The engine probe, a host program (package data; standard library and the engine only).

``probe.py`` is the part both engines share (arguments, stages, verdicts) and ``retired.py`` its
view of dead configuration; ``sglang.py`` and ``vllm.py`` are the calls each engine's launcher
makes. They travel as one text, ``probe_text(server)``: probe.py, retired.py, then the engine's
adapter, then the line that runs it, which the host writes as one file and runs with
the unit's own interpreter (``python -I probe.py [--facts JSON] [--path DIR]... [--] ARGS...``).
Nothing here imports the rest of reconciler (an import-linter contract in pyproject.toml):
this code runs on the host, not in the controller.
"""

from __future__ import annotations

from pathlib import Path

ADAPTERS = {"sglang": "SGLang", "vllm": "VLLM"}


def probe_text(server: str) -> str:
    """The probe program for `server` ("sglang" or "vllm"), as one text."""
    here = Path(__file__).parent         # no importlib.resources: 3 ms to import
    parts = [(here / name).read_text() for name in ("probe.py", "retired.py", f"{server}.py")]
    return (f"{parts[0]}\n\n# --- reconciler/engines/retired.py ---\n\n{parts[1]}\n\n"
            f"# --- the {server} adapter (reconciler/engines/{server}.py) ---\n\n{parts[2]}\n\n"
            f'if __name__ == "__main__":\n    run({ADAPTERS[server]}())\n')
