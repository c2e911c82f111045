"""STAND-IN for the `vllm` package on the test hosts: not vLLM.

The test hosts have it on python3's path beside the stand-in `sglang` (tests/fleet.py binds it
into dist-packages), so a unit runs the project's stand-in server (tests/standin.py) playing vLLM
with vLLM's own command line, `python3 -m vllm.entrypoints.openai.api_server --model ...`, and
the reconciler's version read finds `vllm.__version__` as it would in a real install.
"""

__version__ = "0.33.0"
