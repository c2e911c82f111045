"""PURE: what the programs run on a host answer, each program beside its parser and typed result
(frames.HostProgram; pyinfra's facts/<area>.py): observe.py (what the planner reads), and the
pre-flight's, the health watch's and the executor's programs beside it. The executors that run
them are in host/.

The observation's types are the planner's vocabulary, so they are named here; so are the
layout's paths, for the modules that have always imported them from here (plan/layout.py is
where they live)."""

from ..layout import (
    HOST_RECORD,
    STATE_DIR,
    UNIT_DIR,
    adopted_copy,
    cred_env_path,
    cred_path,
    env_path,
    envfile_path,
    record_path,
    secrets_path,
    unit_path,
)
from .observe import SHOW_PROPS, HostFacts, Observe, ServiceFacts, parse_observation
from .show import parse_show

__all__ = ["HOST_RECORD", "SHOW_PROPS", "STATE_DIR", "UNIT_DIR", "HostFacts", "Observe", "ServiceFacts",
           "adopted_copy", "cred_env_path", "cred_path", "env_path", "envfile_path", "parse_observation",
           "parse_show", "record_path", "secrets_path", "unit_path"]
