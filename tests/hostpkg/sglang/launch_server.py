"""STAND-IN for `python3 -m sglang.launch_server` on the test hosts: runs tests/standin.py
(bound at /usr/local/bin/sglang-standin), the project's stand-in for an SGLang server."""

import runpy

runpy.run_path("/usr/local/bin/sglang-standin", run_name="__main__")
