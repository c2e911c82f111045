"""PURE: what the programs run on a host answer, each program beside its parser and typed result
(frames.HostProgram; pyinfra's facts/<area>.py): observe.py (what the planner reads), and the
pre-flight's, the health watch's and the executor's programs beside it. The executors that run
them are in host/.

The observation's types are the planner's vocabulary, so they are named here."""

from .observe import SHOW_PROPS, HostFacts, Observe, ServiceFacts, parse_observation
from .show import parse_show

__all__ = ["SHOW_PROPS", "HostFacts", "Observe", "ServiceFacts", "parse_observation", "parse_show"]
