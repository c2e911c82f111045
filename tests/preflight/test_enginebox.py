"""The engine probe's box (preflight/_enginebox.py), pure: which variables reach the probe and
which systemd properties it runs under, as tables. (The host program's copy of the lists is
checked with its other constants: tests/test_host_programs.py.)"""

from __future__ import annotations

import pytest

from reconciler.preflight import _enginebox as box
from reconciler.preflight import probe_env, probe_properties, unit_entries


@pytest.mark.parametrize(("name", "allowed"), [
    ("SGLANG_ENABLE_SPEC_V2", True), ("SGL_CHUNKED_PREFIX", True), ("VLLM_USE_V1", True),
    ("CUDA_VISIBLE_DEVICES", True), ("HF_HOME", True), ("HF_HUB_CACHE", True), ("HUGGING_FACE_HUB_CACHE", True),
    ("TRANSFORMERS_OFFLINE", True), ("TORCH_CUDA_ARCH_LIST", True), ("PYTORCH_CUDA_ALLOC_CONF", True),
    ("TORCHINDUCTOR_CACHE_DIR", True), ("TRITON_CACHE_DIR", True), ("NCCL_DEBUG", True),
    ("NVIDIA_VISIBLE_DEVICES", True), ("FLASHINFER_WORKSPACE_BASE", True), ("OMP_NUM_THREADS", True),
    ("MKL_NUM_THREADS", True),
    # code, search paths and loaders: never
    ("PYTHONWARNINGS", False), ("PYTHONPATH", False), ("PYTHONSTARTUP", False), ("PYTHONINSPECT", False),
    ("PYTHONHOME", False), ("BROWSER", False), ("LD_PRELOAD", False), ("LD_LIBRARY_PATH", False), ("PATH", False),
    ("CUDA_INJECTION64_PATH", False), ("VLLM_LOGGING_CONFIG_PATH", False), ("TRITON_PTXAS_PATH", False),
    ("NCCL_NET_PLUGIN", False), ("VLLM_PLUGINS", False), ("HF_MODULES_CACHE", False), ("HOME", False),
    ("PERL5LIB", False), ("NODE_OPTIONS", False),
    # secret-looking: the check needs no secret
    ("HF_TOKEN", False), ("HUGGING_FACE_HUB_TOKEN", False), ("VLLM_API_KEY", False), ("SGLANG_API_KEY", False),
    ("NCCL_SECRET", False), ("HF_PASSWORD", False), ("CUDA_CREDENTIALS", False),
    # not a name
    ("sglang_lower", False), ("SGLANG-X", False), ("", False), ("1SGLANG", False),
])
def test_which_variables_reach_the_probe(name: str, allowed: bool):
    assert box.allowed_name(name) is allowed
    assert (name in probe_env({name: "v"})) is allowed


OWN = [*box.OWN]
TAIL = ["SystemCallFilter=@system-service", "SystemCallErrorNumber=EPERM"]
LIMITS = [f"LimitFSIZE={box.LIMIT_FSIZE}", f"TasksMax={box.TASKS_MAX}"]


def props(service: str, mode: str = "hidden") -> list[str]:
    return probe_properties(box.unit_settings(unit_entries("[Service]\n" + service)), mode)


@pytest.mark.parametrize(("service", "mode", "expected"), [
    # no User=: the unit runs as root, its probe as a dynamic user
    ("ExecStart=/x\n", "hidden",
     ["DynamicUser=yes", *OWN, "ProtectHome=read-only", *TAIL, "PrivateDevices=yes", *LIMITS]),
    ("User=root\nGroup=root\nSupplementaryGroups=video root\n", "hidden",
     ["SupplementaryGroups=video", "DynamicUser=yes", *OWN, "ProtectHome=read-only", *TAIL, "PrivateDevices=yes",
      *LIMITS]),
    ("User=0\n", "visible", ["DynamicUser=yes", *OWN, "ProtectHome=read-only", *TAIL, *LIMITS]),
    # the unit's own identity
    ("User=llm\nGroup=llm\nSupplementaryGroups=render\n", "visible",
     ["User=llm", "Group=llm", "SupplementaryGroups=render", *OWN, "ProtectHome=read-only", *TAIL, *LIMITS]),
    ("DynamicUser=yes\n", "visible", ["DynamicUser=yes", *OWN, "ProtectHome=read-only", *TAIL, *LIMITS]),
    # the unit's sandbox, in its order, the probe's own after it; a stricter ProtectHome= stays
    ("User=llm\nProtectHome=tmpfs\nReadWritePaths=/srv/cache\nReadOnlyPaths=-/etc/x\nWorkingDirectory=/srv/llm\n"
     "AmbientCapabilities=CAP_NET_ADMIN\nEnvironment=A=1\nLoadCredential=k:/etc/k\n", "visible",
     ["User=llm", "ProtectHome=tmpfs", "ReadWritePaths=/srv/cache", "ReadOnlyPaths=-/etc/x",
      "WorkingDirectory=-/srv/llm", *OWN, "ProtectHome=tmpfs", *TAIL, *LIMITS]),
    ("User=llm\nProtectHome=no\nProtectSystem=full\nPrivateNetwork=no\n", "visible",
     ["User=llm", "ProtectHome=no", "ProtectSystem=full", "PrivateNetwork=no", *OWN, "ProtectHome=read-only", *TAIL,
      *LIMITS]),
    # a unit's own system-call filter is never widened by the probe's
    ("User=llm\nSystemCallFilter=@basic-io @file-system\n", "visible",
     ["User=llm", "SystemCallFilter=@basic-io @file-system", *OWN, "ProtectHome=read-only", *LIMITS]),
])
def test_the_probes_properties(service: str, mode: str, expected: list[str]):
    assert props(service, mode) == expected


def test_the_probes_own_settings_come_last_and_each_is_the_strictest():
    """systemd takes the last assignment of a setting: the probe's own are set after the unit's,
    so a unit's `PrivateNetwork=no` or `NoNewPrivileges=no` does not reach the probe."""
    out = props("User=llm\nPrivateNetwork=no\nNoNewPrivileges=no\nProtectSystem=false\nCapabilityBoundingSet=~\n")
    last = {p.split("=", 1)[0]: p for p in out}
    assert [last[k] for k in ("PrivateNetwork", "NoNewPrivileges", "ProtectSystem", "CapabilityBoundingSet",
                              "PrivateTmp", "PrivateDevices")] == [
        "PrivateNetwork=yes", "NoNewPrivileges=yes", "ProtectSystem=strict", "CapabilityBoundingSet=",
        "PrivateTmp=yes", "PrivateDevices=yes"]


@pytest.mark.parametrize(("service", "root"), [
    ("", True), ("User=root\n", True), ("User=0\n", True), ("User=\n", True), ("User=llm\n", False),
    ("DynamicUser=yes\n", False), ("User=llm\nUser=root\n", True),
])
def test_which_units_run_as_root(service: str, root: bool):
    assert box.runs_as_root(box.unit_settings(unit_entries("[Service]\n" + service))) is root
