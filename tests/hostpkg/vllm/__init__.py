"""STAND-IN for the `vllm` package on the test hosts: not vLLM.

tests/fleet.py binds it at /opt/standin/vllm, off python's path (the engine tests expect system
python to have no vllm), so a unit runs the project's stand-in server (tests/standin.py) playing
vLLM with a command line the reconciler reads as vLLM's:
`python3 /opt/standin/vllm/entrypoints/openai/api_server.py --model ...` (fleet.VLLM_STANDIN).
"""

__version__ = "0.33.0"
