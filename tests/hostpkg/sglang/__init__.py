"""STAND-IN for the `sglang` package on the test hosts: not SGLang.

The test hosts have it on python3's path (tests/fleet.py binds it into dist-packages), so a unit
runs the project's stand-in server (tests/standin.py) with SGLang's own command line,
`python3 -m sglang.launch_server --model-path ...`, and the reconciler's version probe reads
`sglang.__version__` as it would from a real install. A test that needs another version puts a
copy with another __version__ first on PYTHONPATH (see tests/fleet.py, `standin_package`).
"""

__version__ = "0.5.12"
