"""PURE: a leave of rotation that no rejoin followed (issue 42), and what the next run does with
it, decided from the plan it has already made (docs/drain.md, "A run that dies between the
leave and the rejoin"). loop/cutover.py records the leave on the host (layout.ROTATION_DIR/
NAME.left) and removes it after the rejoin; the observation reads it (ServiceFacts.left_rotation).

A service the plan stops, starts, restarts or watches (its own cutover decides), one another
pass converges (a rollout wave), and an orphan get nothing here. One that runs the version its
record says passed health here, with no deploy pending, and declares how it rejoins, gets a
REJOIN (not restarted); anything else a HOLD that says why, the record kept for a later run.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping

from ..values import replace
from .facts import ServiceFacts
from .model import Action, Kind, Reason, ServicePlan, State
from .records import Result

# The plan's own steps that end with the service's cutover (or keep it stopped).
_OWN_CUTOVER = frozenset({Kind.STOP, Kind.START, Kind.RESTART, Kind.WATCH})
WHY = "left by a run that did not finish"


def not_healthy(sp: ServicePlan, f: ServiceFacts) -> str | None:
    """PURE: why a service whose leave is recorded must stay out of rotation; None: it may rejoin
    (it runs, active, the version it converges to, which passed health here, no deploy pending)."""
    rec = f.record
    if sp.target is None:
        return f"nothing to run ({sp.state.value})"
    if sp.target.spec.drain is None:
        return "it declares no drain, so no rejoin: put it back by hand"
    if f.active_state != "active":
        return f"its unit is {f.active_state or 'not loaded'}, not active"
    if rec is None or rec.corrupt or rec.hash != sp.target.hash:
        return f"its record does not say it runs {sp.target.revision[:7]}"
    if rec.pending is not None:
        return f"the deploy of {rec.pending.revision[:7]} has no verdict yet"
    if rec.last_good_hash != rec.hash:
        return f"{sp.target.revision[:7]} never passed its health check here"
    return None


def rejoins(services: dict[str, ServicePlan], facts: Mapping[str, ServiceFacts], actions: Iterable[Action],
            deferred: Iterable[str] = ()) -> list[Action]:
    """PURE: the REJOIN (or HOLD) step of each service whose leave of rotation is recorded and
    whose plan has no cutover of its own. A service that rejoins converges in this run: its
    plan's result says so (updated in `services`)."""
    own = {a.service for a in actions if a.kind in _OWN_CUTOVER}
    out: list[Action] = []
    for name, sp in sorted(services.items()):
        f = facts.get(name)
        if f is None or not f.left_rotation or name in own or name in deferred \
                or sp.state in (State.DEFERRED, State.ORPHAN):
            continue
        why = not_healthy(sp, f)
        if why is not None:
            out.append(Action(Kind.HOLD, Reason.HOLD_OUT, name, detail=f"stays out of rotation ({WHY}): {why}"))
            continue
        assert sp.target is not None
        out.append(Action(Kind.REJOIN, Reason.LEFT_ROTATION, name, detail=f"rejoin rotation ({WHY})"))
        if sp.result is Result.IN_SYNC:
            services[name] = replace(sp, result=Result.CONVERGED)
    return out
