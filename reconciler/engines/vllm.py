"""The engine probe's vLLM adapter: the calls ``vllm serve`` makes before it starts an engine
process, and where this vLLM keeps its hooks (found by what it has, not by its version).

    make_arg_parser(FlexibleArgumentParser(prog="vllm serve")).parse_args(argv)
    validate_parsed_serve_args(args)
    AsyncEngineArgs.from_cli_args(args).create_engine_config(usage_context=OPENAI_API_SERVER)

vLLM has no override point for the hardware: a subclass of its ``CudaPlatform`` that answers
from the host's facts becomes ``vllm.platforms.current_platform`` before anything else of vLLM
is imported (its modules bind the platform at import); the probe reads back the device count
and capability vLLM then reports. A release without ``vllm.platforms.cuda.CudaPlatform`` or
``vllm.platforms.interface.DeviceCapability`` is inconclusive, naming them. Importing vLLM's
CUDA platform needs ``libcuda.so.1`` (the NVIDIA driver), even with the GPUs hidden.

Its variables: ``vllm.envs.environment_variables`` (the registry), and where the release has
them ``removed_environment_variables`` and the platform's ``validate_environ`` (0.34: it refuses
to start on a removed variable), which the probe calls itself so that the refusal is reported
even when the flags are refused first.

vLLM inspects a model's architecture in a subprocess once and caches the answer under
``VLLM_CACHE_ROOT``; when that is unset the probe points it at a directory of its own under the
system's temporary directory, kept between runs (the first run of an architecture is slower).

Sent to the host after probe.py, in one text (``probe_text``): it uses probe.py's names and
must not import anything itself that probe.py does not (no ``from __future__`` here).
"""

import argparse
import importlib
import importlib.util
import os
import stat
import tempfile
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .probe import Inconclusive, MissingHook, Registry, installed_version, plain

# Where vLLM raises its own configuration errors (review 2026-12-02 section 7.5), and the
# serve command's own argument checks (validate_parsed_serve_args).
VLLM_CONFIG_SOURCES = ("vllm/config/", "vllm/engine/arg_utils.py", "vllm/entrypoints/common/cli_args.py")
PLATFORM_HOOK = ("vllm.platforms.current_platform", "vllm.platforms.cuda.CudaPlatform",
                 "vllm.platforms.interface.DeviceCapability")


class VLLM:
    engine = "vllm"
    prefixes = ("VLLM_",)
    packages = ("vllm",)
    config_sources = VLLM_CONFIG_SOURCES

    def setup(self) -> None:
        if not os.environ.get("VLLM_CACHE_ROOT"):
            os.environ["VLLM_CACHE_ROOT"] = cache_root()

    def normalize(self, args: list[str]) -> list[str]:
        return args

    def install_facts(self, facts: dict[str, Any]) -> dict[str, Any]:
        """Make vLLM's current platform a CUDA platform that answers from the host's facts."""
        platforms: Any = importlib.import_module("vllm.platforms")   # not installed: the import says why
        try:
            from vllm.platforms.cuda import CudaPlatform
            from vllm.platforms.interface import DeviceCapability
        except ImportError as e:
            if not (e.name or "").startswith("vllm."):
                raise                 # a module of the environment (the driver's library), not a hook
            raise MissingHook(f"vllm {installed_version('vllm') or ''} has no platform hook: {e} (the probe needs "
                              f"{', '.join(PLATFORM_HOOK)})") from e
        count, name = int(facts["count"]), str(facts["name"])
        major, minor = (int(x) for x in facts["capability"])
        memory = int(facts["memory_mib"]) * 1024 * 1024

        class HostCuda(CudaPlatform):  # type: ignore[misc,valid-type]
            """The host's GPUs as its nvidia-smi reported them (the probe runs with them hidden)."""

            @classmethod
            def device_count(cls) -> int:
                return count

            @classmethod
            def get_device_capability(cls, device_id: int = 0) -> Any:
                return DeviceCapability(major=major, minor=minor)

            @classmethod
            def get_device_name(cls, device_id: int = 0) -> str:
                return name

            @classmethod
            def get_device_uuid(cls, device_id: int = 0) -> str:
                return f"GPU-reconciler-probe-{device_id}"

            @classmethod
            def get_device_total_memory(cls, device_id: int = 0) -> int:
                return memory

            @classmethod
            def is_fully_connected(cls, physical_device_ids: list[int]) -> bool:
                return True

            @classmethod
            def log_warnings(cls) -> None:
                return None

        platforms.current_platform = HostCuda()
        seen = platforms.current_platform           # as every vLLM module reads it
        capability = tuple(seen.get_device_capability())[:2]
        if seen.device_count() != count or capability != (major, minor):
            raise Inconclusive(f"vllm.platforms.current_platform did not take the host's facts: it reports "
                               f"{seen.device_count()} devices, capability {capability}")
        return {"hook": PLATFORM_HOOK[0], "capability": list(capability), "count": seen.device_count()}

    def registry(self) -> "Registry | None":
        if importlib.util.find_spec("vllm.envs") is None:
            return None          # a build without the registry: its variables are not judged
        envs = importlib.import_module("vllm.envs")
        known = getattr(envs, "environment_variables", None)
        if not isinstance(known, dict):
            return None
        removed = getattr(envs, "removed_environment_variables", None) or {}
        return Registry(known=set(known), removed={k: f"{k} has been removed. {v}" for k, v in removed.items()})

    def environ_refusal(self) -> BaseException | None:
        """What vLLM's own ``validate_environ`` raises on this environment (0.34: a removed
        variable, ``VLLM_USE_V2_MODEL_RUNNER`` other than 1), or None."""
        if importlib.util.find_spec("vllm.platforms") is None \
                or importlib.util.find_spec("vllm.platforms.interface") is None:
            return None
        interface = importlib.import_module("vllm.platforms.interface")
        validate = getattr(getattr(interface, "Platform", None), "validate_environ", None)
        if validate is None:
            return None
        try:
            validate(False)
        except ValueError as e:
            return e
        return None

    def parser(self) -> argparse.ArgumentParser | None:
        from vllm.entrypoints.common.cli_args import make_arg_parser
        from vllm.utils.argparse_utils import FlexibleArgumentParser
        return make_arg_parser(FlexibleArgumentParser(prog="vllm serve"))  # type: ignore[no-any-return]

    def check(self, args: list[str], parsed: argparse.Namespace | None, at: Callable[[str], None]) -> dict[str, Any]:
        import vllm
        from vllm.entrypoints.common.cli_args import validate_parsed_serve_args
        from vllm.usage.usage_lib import UsageContext
        at("parse")
        if parsed is None:
            raise Inconclusive("vllm's argument parser could not be built")
        if getattr(parsed, "model_tag", None) is not None:
            parsed.model = parsed.model_tag       # as `vllm serve MODEL` does
        validate_parsed_serve_args(parsed)
        at("config")
        engine_args = vllm.AsyncEngineArgs.from_cli_args(parsed)
        config = engine_args.create_engine_config(usage_context=UsageContext.OPENAI_API_SERVER)
        return resolved(config)


def cache_root() -> str:
    """A writable cache directory of this user's own, kept between runs: the system temporary
    directory's ``reconciler-vllm-cache-UID``, or a fresh one when that name is not ours."""
    path = os.path.join(tempfile.gettempdir(), f"reconciler-vllm-cache-{os.getuid()}")
    try:
        os.mkdir(path, 0o700)
    except FileExistsError:
        pass
    except OSError:
        return tempfile.mkdtemp(prefix="reconciler-vllm-cache-")
    st = os.lstat(path)
    if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid() or st.st_mode & 0o022:
        return tempfile.mkdtemp(prefix="reconciler-vllm-cache-")
    return path


def resolved(config: Any) -> dict[str, Any]:
    """What the dry run shows: the values vLLM resolved that change how the server runs."""
    spec = config.speculative_config
    values = {"max_model_len": config.model_config.max_model_len,
              "tensor_parallel_size": config.parallel_config.tensor_parallel_size,
              "speculative_method": getattr(spec, "method", None) if spec is not None else None,
              "mamba_cache_mode": getattr(config.cache_config, "mamba_cache_mode", None),
              "architecture": getattr(config.model_config, "architecture", None)}
    return {k: plain(v) for k, v in values.items()}
