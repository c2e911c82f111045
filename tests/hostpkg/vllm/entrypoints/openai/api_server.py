"""STAND-IN for vLLM's `vllm/entrypoints/openai/api_server.py` on the test hosts: runs
tests/standin.py (bound at /usr/local/bin/sglang-standin) playing vLLM (STANDIN_ENGINE=vllm):
vLLM's flags, its /metrics names, and its stop (--shutdown-timeout 0 aborts what is in flight)."""

import os
import runpy

os.environ["STANDIN_ENGINE"] = "vllm"
runpy.run_path("/usr/local/bin/sglang-standin", run_name="__main__")
