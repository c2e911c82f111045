"""The engine probe, a host program (package data; standard library and the engine only).

``probe.py`` is the part both engines share, ``sglang.py`` and ``vllm.py`` the calls each
engine's launcher makes. They travel as one text, ``probe_text(server)``: probe.py, then the
engine's adapter, then the line that runs it, which the host writes as one file and runs with
the unit's own interpreter (``python -I probe.py [--facts JSON] [--path DIR]... [--] ARGS...``).
Nothing here imports the rest of reconciler (an import-linter contract in pyproject.toml):
this code runs on the host, not in the controller.
"""

from __future__ import annotations

from importlib import resources

ADAPTERS = {"sglang": "SGLang", "vllm": "VLLM"}


def probe_text(server: str) -> str:
    """The probe program for `server` ("sglang" or "vllm"), as one text."""
    here = resources.files(__name__)
    common = here.joinpath("probe.py").read_text()
    adapter = here.joinpath(f"{server}.py").read_text()
    return (f"{common}\n\n# --- the {server} adapter (reconciler/engines/{server}.py) ---\n\n{adapter}\n\n"
            f'if __name__ == "__main__":\n    run({ADAPTERS[server]}())\n')
