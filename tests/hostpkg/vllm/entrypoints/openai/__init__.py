"""STAND-IN: part of the stand-in `vllm` package (tests/hostpkg/vllm/__init__.py)."""
