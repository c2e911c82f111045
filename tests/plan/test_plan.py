"""The pure planner, as tables of (desired, observed, context) -> state and actions, in the shape
of Flux helm-controller's TestReconcile: every service is first sorted into one `State`, and the
actions follow from that state alone. Each case names the situation; its `steps` are the plan's
actions in order, written `kind [service] [Reason]` (a step that names a reason checks it).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import pytest

from reconciler.desired.spec import HostSpec, ModelSpec, ServiceSpec, SSHSpec
from reconciler.plan.actions import plan_host
from reconciler.plan.facts import HostFacts, ServiceFacts
from reconciler.plan.files import mask_secrets, parse_env_file, render_env_dropin, render_env_file
from reconciler.plan.gpuhealth import GPU_FAULT, GpuFault, GpuHealth
from reconciler.plan.layout import env_path, envfile_path, unit_path
from reconciler.plan.model import (
    ORDER,
    Action,
    Block,
    Checks,
    Context,
    HostPlan,
    Kind,
    ModelFetch,
    Reason,
    State,
    Watch,
)
from reconciler.plan.records import (
    INCONCLUSIVE,
    START_LIMIT_HIT,
    Adopted,
    HostRecord,
    Pending,
    Quarantine,
    Result,
    ServiceRecord,
    Verdict,
    judge,
)
from reconciler.plan.state import fetch_refused
from reconciler.values import replace

REV = "a" * 40        # the revision being applied
OLD = "b" * 40        # what the host ran before
GOOD = "c" * 40       # the last good revision of a quarantined service
HOST = "gpu-1"
UNIT = "[Service]\nExecStart=/bin/server\n\n[Install]\nWantedBy=multi-user.target\n"


def svc(name: str = "m", unit: str = UNIT, env: Mapping[str, str] | None = None, **kw: object) -> ServiceSpec:
    return ServiceSpec(name=name, unit_text=unit, env=dict(env) if env is not None else {"A": "1"},
                       **kw)  # type: ignore[arg-type]


def host(*services: ServiceSpec) -> HostSpec:
    return HostSpec(name=HOST, ssh=SSHSpec(address="127.0.0.2"), services={s.name: s for s in services})


def verified(s: ServiceSpec, revision: str = REV, **kw: object) -> ServiceRecord:
    """The record of `s` applied and seen healthy at `revision`."""
    h = s.content_hash()
    return ServiceRecord(hash=h, revision=revision, last_good_hash=h, last_good_revision=revision,
                         **kw)  # type: ignore[arg-type]


_SAME = object()


def on_host(s: ServiceSpec, record: ServiceRecord | None, *, active: str = "active", enabled: str = "enabled",
            unit: object = _SAME, env: object = _SAME,
            dropins: Mapping[str, str] | None = None, **props: str) -> ServiceFacts:
    """Service `s` as observed on the host: its files (or the text, or None, given as `unit`/`env`:
    `env` is the env file's text), its record and its systemd state."""
    envfile = (render_env_file(s.env) if s.env else None) if env is _SAME else env
    env_text = render_env_dropin(s.name) if envfile is not None else None    # our drop-in names the env file
    return ServiceFacts(
        name=s.name, unit_text=s.unit_text if unit is _SAME else unit, env_text=env_text,  # type: ignore[arg-type]
        envfile_text=envfile, record=record,  # type: ignore[arg-type]
        props={"LoadState": "loaded", "FragmentPath": unit_path(s.name), "ActiveState": active,
               "UnitFileState": enabled, "NRestarts": "2", "InvocationID": "inv-0",
               "ActiveEnterTimestampMonotonic": "100", "NeedDaemonReload": "no", **props},
        dropins={**({env_path(s.name): env_text} if isinstance(env_text, str) else {}), **(dropins or {})})


# The desired service m, and other versions of it.
M = svc()
M_ENV0 = svc(env={"A": "0"})                                   # an older env
M_UNIT0 = svc(unit=UNIT.replace("/bin/server", "/bin/server --old"))   # an older unit
N = svc("n", unit="[Service]\nExecStart=/bin/n\n", env={})    # a second service, no [Install], no env
BAD = svc(env={"A": "bad"})                                    # a desired version that failed here
LAST = svc(env={"A": "good"})                                  # ... and the last good version before it
H = M.content_hash()

QBAD = Quarantine(hash=BAD.content_hash(), revision=REV, reason="CrashLoop", quote="CUDA error: out of memory", at=7)
FLEET = Quarantine(hash=BAD.content_hash(), revision=REV, reason="RolloutHalted", halted_at="gpu-9", wave=2,
                   cause="CrashLoop")
HELD_GOOD = verified(LAST, GOOD, quarantine=QBAD)              # rolled back: LAST runs, BAD quarantined
FAILED_BAD = replace(verified(LAST, GOOD), hash=BAD.content_hash(), revision=REV, quarantine=QBAD)  # BAD on disk
FIRST_FAILED = ServiceRecord(hash=BAD.content_hash(), revision=REV, quarantine=QBAD)  # never had a good one
INTENT_M = Pending(hash=H, revision=REV, replaces_hash=M_ENV0.content_hash(), replaces_revision=OLD, at=1234)
# M was started from that intent, and the controller died before the verdict.
STARTED_M = replace(verified(M_ENV0, OLD), hash=H, revision=REV, pending=replace(INTENT_M, started=True))
# ... and its watch came to no verdict: systemd could not start its process (issue 32)
NO_VERDICT = "Inconclusive: no verdict: systemd could not start its process (exit status 219/CGROUP)"
UNJUDGED_M = replace(STARTED_M, pending=replace(STARTED_M.pending, unjudged=NO_VERDICT, attempts=1))  # type: ignore[arg-type]
TRIED_OUT_M = replace(STARTED_M, pending=replace(STARTED_M.pending, unjudged=NO_VERDICT, attempts=3))  # type: ignore[arg-type]
TEMP = "/etc/systemd/system/.reconciler-tmp.4242.1"
# Sick GPUs (gpuhealth.py): a reading with a fault, a healthy one, one that could not be made;
# the host marked GpuFault after a start of M failed with them, M's deploy left pending
ECC = "GPU 00000000:18:00.0: ECC Errors / Volatile / DRAM Uncorrectable: 2"
SICK = Checks(gpu_gate=True, gpu_health=GpuHealth(read=True, faults=(ECC,), now=500))
HEALTHY = Checks(gpu_gate=True, gpu_health=GpuHealth(read=True, now=600))
UNREAD = Checks(gpu_gate=True, gpu_health=GpuHealth(read=False, notes=("nvidia-smi -q exited 9",)))
MARKED = GpuFault(quote=ECC, at=400, lines=(ECC,), service="m", revision=REV)
GPU_FAILED_M = replace(STARTED_M, pending=replace(STARTED_M.pending, attempts=1,  # type: ignore[arg-type]
                                                  unjudged=f"{GPU_FAULT}: the start failed while the GPUs were sick"))

# A model pre-flight found missing, with model.fetch: room for it, no room, room unknown
MODEL = ModelSpec(id="org/model", path="/models/m", fetch="hf download org/model --local-dir .", size_gb=16)
FETCH_OK = Checks(fetch={"m": ModelFetch(MODEL, free_bytes=100 * 10**9)})
FETCH_FULL = Checks(fetch={"m": ModelFetch(MODEL, free_bytes=10 * 10**9)})
# The GPU gate's answer earlier in this run: m's GPUs stayed busy after its stop
BUSY = "GPUs still busy 120s after stopping m: 1 GPU, 21090 MiB used (stray-process policy report)"
GATE = Checks(gate={"m": BUSY})
STOPPED_BY_GATE = verified(M_ENV0, OLD, pending=INTENT_M)           # the intent written, the unit stopped
BLOCKED_M = verified(M_ENV0, OLD, pending=replace(INTENT_M, blocked=BUSY))   # ... and recorded as not started
KILL = svc(gpu_policy="kill")

OVERRIDE = "/etc/systemd/system/m.service.d/override.conf"
RUNTIME = "/run/systemd/system/m.service.d/x.conf"
PACKAGE = "/lib/systemd/system/m.service"
HAND_MADE = "[Service]\nExecStart=/usr/local/bin/by-hand\n\n[Install]\nWantedBy=multi-user.target\n"


def foreign_unit(**props: str) -> ServiceFacts:
    """A unit file at our path that the reconciler did not install (no record)."""
    return ServiceFacts("m", unit_text=HAND_MADE, props={"LoadState": "loaded", "FragmentPath": unit_path("m"),
                                                         "ActiveState": "active", "UnitFileState": "enabled",
                                                         **props})


def package_unit(**props: str) -> ServiceFacts:
    """A package's unit, loaded from /lib; our file at /etc would shadow it."""
    return ServiceFacts("m", props={"LoadState": "loaded", "FragmentPath": PACKAGE, "ActiveState": "inactive",
                                    "UnitFileState": "disabled", **props})


def masked_unit() -> ServiceFacts:
    return ServiceFacts("m", props={"LoadState": "masked", "FragmentPath": "", "ActiveState": "inactive",
                                    "UnitFileState": "masked"})


@dataclass(frozen=True)
class Case:
    id: str
    desired: tuple[ServiceSpec, ...]
    observed: tuple[ServiceFacts, ...]
    states: Mapping[str, State]
    steps: tuple[str, ...]
    host_rev: str | None = REV                 # the host record's applied revision (None: no record)
    ctx: Mapping[str, object] = field(default_factory=dict)
    dropped: tuple[str, ...] = ()
    temps: tuple[str, ...] = ()                # temp files a killed run left (facts.stale_temps)
    gpu: GpuFault | None = None                # the host marked GpuFault (gpu-fault.json)

    def plan(self) -> HostPlan:
        facts = HostFacts(services={f.name: f for f in self.observed},
                          record=HostRecord(self.host_rev) if self.host_rev else None, stale_temps=self.temps,
                          gpu_fault=self.gpu)
        # The dead-man's switch is its own concern (tests at the end of this file): off in the table.
        ctx = {"confirm_margin": None, **self.ctx}
        return plan_host(host(*self.desired), facts, Context(REV, **ctx))  # type: ignore[arg-type]


# A new service with env: the unit, the env drop-in (it names the env file) and the env file.
NEW = ("intent m", "write m NewService", "write m NewService", "write m NewService", "daemon-reload", "enable m",
       "start m NewService", "record m", "record", "watch m HealthCheck")
# The last good differs from what is there in env only: no daemon-reload (systemd reads the env file at start).
SUBSTITUTE = ("hold m HoldLastGood", "intent m", "write m", "restart m SubstituteLastGood",
              "record m", "record", "watch m SubstituteLastGood")

CASES = [
    # ---- the desired version, from the file comparison --------------------------------------
    Case("new service", (M,), (), {"m": State.NEW}, NEW, host_rev=None),
    Case("new service: systemd knows no such unit", (M,),
         (ServiceFacts("m", props={"LoadState": "not-found", "ActiveState": "inactive"}),), {"m": State.NEW}, NEW),
    Case("in-sync host triggers no action", (M,), (on_host(M, verified(M)),), {"m": State.IN_SYNC}, ()),
    Case("in sync at a new revision: only the host record", (M,), (on_host(M, verified(M, OLD)),),
         {"m": State.IN_SYNC}, ("record",), host_rev=OLD),
    Case("in sync but disabled: enable", (M,), (on_host(M, verified(M), enabled="disabled"),),
         {"m": State.IN_SYNC}, ("enable m StartAtBoot", "record")),
    Case("in sync, no [Install]: never enabled", (N,), (on_host(N, verified(N), enabled="static"),),
         {"n": State.IN_SYNC}, ()),
    Case("changed unit", (M,), (on_host(M_UNIT0, verified(M_UNIT0, OLD)),), {"m": State.CHANGED},
         ("intent m", "write m UnitChanged", "daemon-reload", "restart m UnitChanged", "record m", "record",
          "watch m HealthCheck")),
    Case("changed env", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.CHANGED},
         ("intent m", "write m EnvChanged", "restart m UnitChanged", "record m", "record", "watch m")),
    Case("env removed: the drop-in is removed", (svc(env={}),), (on_host(M, verified(M, OLD)),),
         {"m": State.CHANGED}, ("intent m", "remove m EnvChanged", "remove m EnvChanged", "daemon-reload",
                                "restart m", "record m", "record", "watch m")),
    Case("drifted unit: hand edit reverted", (M,),
         (on_host(M, verified(M), unit=UNIT.replace("/bin/server", "/bin/server --bad")),), {"m": State.DRIFTED},
         ("intent m", "write m Drift", "daemon-reload", "restart m", "record m", "record", "watch m")),
    Case("drifted env", (M,), (on_host(M, verified(M), env=render_env_file({"A": "by hand"})),), {"m": State.DRIFTED},
         ("intent m", "write m Drift", "restart m", "record m", "record", "watch m")),
    Case("stopped: start, nothing written", (M,), (on_host(M, verified(M), active="inactive"),),
         {"m": State.STOPPED}, ("start m NotRunning", "record m", "record", "watch m")),
    Case("failed unit: start", (M,), (on_host(M, verified(M), active="failed"),), {"m": State.STOPPED},
         ("start m NotRunning", "record m", "record", "watch m")),
    Case("stopped, systemd has not reloaded: reload first", (M,),
         (on_host(M, verified(M), active="inactive", NeedDaemonReload="yes"),), {"m": State.STOPPED},
         ("daemon-reload", "start m NotRunning", "record m", "record", "watch m")),
    Case("files match, record differs: the process predates the files", (M,),
         (on_host(M, verified(M_ENV0, OLD)),), {"m": State.CHANGED},
         ("intent m", "restart m ProcessPredatesFiles", "record m", "record", "watch m")),
    Case("files match, no record hash (corrupt record): restart", (M,),
         (on_host(M, ServiceRecord(corrupt=True)),), {"m": State.CHANGED},
         ("intent m", "restart m ProcessPredatesFiles", "record m", "record", "watch m")),
    Case("schema 1 record, applied but never judged: re-verify, no restart", (M,),
         (on_host(M, ServiceRecord(hash=H, revision=REV, schema=1)),), {"m": State.PENDING},
         ("watch m Reverify",)),
    Case("schema 1 record with an older last good: re-verify", (M,),
         (on_host(M, replace(verified(M_ENV0, OLD), hash=H, revision=REV, schema=1)),), {"m": State.PENDING},
         ("watch m Reverify",)),
    # ---- the durable intent of a deploy that was cut short --------------------------------------
    Case("pending, not started (files all written): restart and watch", (M,),
         (on_host(M, verified(M_ENV0, OLD, pending=INTENT_M)),), {"m": State.PENDING},
         ("intent m", "restart m InterruptedDeploy", "record m", "record", "watch m HealthCheck"), host_rev=OLD),
    Case("pending, not started, cut before the env was written", (M,),
         (on_host(M, verified(M_ENV0, OLD, pending=INTENT_M), env=render_env_file(M_ENV0.env)),), {"m": State.PENDING},
         ("intent m", "write m EnvChanged", "restart m InterruptedDeploy", "record m", "record", "watch m"),
         host_rev=OLD),
    Case("pending, new service cut before any file: write and start", (M,),
         (ServiceFacts("m", record=ServiceRecord(pending=replace(INTENT_M, replaces_hash=None,
                                                                 replaces_revision=None)),
                       props={"LoadState": "not-found", "ActiveState": "inactive"}),), {"m": State.PENDING},
         ("intent m", "write m NewService", "write m NewService", "write m NewService", "daemon-reload", "enable m",
          "start m InterruptedDeploy", "record m", "record", "watch m"), host_rev=None),
    Case("pending, started, files match: only re-verify", (M,),
         (on_host(M, STARTED_M),),
         {"m": State.PENDING}, ("watch m Reverify",)),
    Case("pending, started, files differ: write again", (M,),
         (on_host(M_ENV0, STARTED_M),),
         {"m": State.PENDING},
         ("intent m", "write m", "restart m InterruptedDeploy", "record m", "record", "watch m HealthCheck")),
    # ---- failures: quarantine, substitution, hold ----------------------------------------------
    Case("quarantined, last good in place and running: hold marker only", (BAD,), (on_host(LAST, HELD_GOOD),),
         {"m": State.QUARANTINED}, ("hold m HoldLastGood",), ctx={"last_good": {"m": LAST}}),
    Case("quarantined, bad files in place: substitute the last good", (BAD,), (on_host(BAD, FAILED_BAD),),
         {"m": State.QUARANTINED}, SUBSTITUTE, ctx={"last_good": {"m": LAST}}, host_rev=OLD),
    Case("quarantined, bad version stopped by its verdict: start the last good", (BAD,),
         (on_host(BAD, FAILED_BAD, active="inactive"),), {"m": State.QUARANTINED},
         ("hold m HoldLastGood", "intent m", "write m", "start m SubstituteLastGood", "record m",
          "record", "watch m SubstituteLastGood"), ctx={"last_good": {"m": LAST}}),
    Case("quarantined, last good in place but stopped: start it", (BAD,),
         (on_host(LAST, HELD_GOOD, active="inactive"),), {"m": State.QUARANTINED},
         ("hold m HoldLastGood", "start m SubstituteLastGood", "record m", "record", "watch m"),
         ctx={"last_good": {"m": LAST}}),
    Case("quarantined, substitution cut short after its start: re-verify it", (BAD,),
         (on_host(LAST, replace(HELD_GOOD, pending=Pending(LAST.content_hash(), GOOD, rollback=True, at=9,
                                                           started=True))),),
         {"m": State.QUARANTINED}, ("hold m HoldLastGood", "watch m Reverify"), ctx={"last_good": {"m": LAST}}),
    Case("quarantined, no last good, running: stop and hold", (BAD,), (on_host(BAD, FIRST_FAILED),),
         {"m": State.QUARANTINED_NO_GOOD}, ("hold m HoldStopped", "stop m HoldStopped", "record")),
    Case("quarantined, no last good, already stopped: hold only", (BAD,),
         (on_host(BAD, FIRST_FAILED, active="inactive"),), {"m": State.QUARANTINED_NO_GOOD}, ("hold m HoldStopped",)),
    Case("quarantined, last good does not render: stop and hold", (BAD,), (on_host(BAD, FAILED_BAD),),
         {"m": State.QUARANTINED_NO_GOOD}, ("hold m HoldStopped", "stop m HoldStopped", "record"),
         ctx={"last_good": {"m": None}}),
    Case("rollback failed too: held stopped", (BAD,),
         (on_host(LAST, replace(HELD_GOOD, quarantine=replace(QBAD, rollback_failed=True)), active="inactive"),),
         {"m": State.ROLLBACK_FAILED}, ("hold m HoldStopped",), ctx={"last_good": {"m": LAST}}),
    Case("rollback failed, but someone started it: stop it", (BAD,),
         (on_host(LAST, replace(HELD_GOOD, quarantine=replace(QBAD, rollback_failed=True))),),
         {"m": State.ROLLBACK_FAILED}, ("hold m HoldStopped", "stop m HoldStopped", "record"),
         ctx={"last_good": {"m": LAST}}),
    Case("fleet quarantine (halted elsewhere), no last good: hold, record the halt", (BAD,),
         (on_host(LAST, ServiceRecord(hash=LAST.content_hash(), revision=GOOD)),), {"m": State.HALTED},
         ("hold m HoldHalted", "record m RecordQuarantine", "record"), ctx={"fleet_quarantine": {"m": FLEET}},
         host_rev=OLD),
    Case("fleet quarantine of a service new on this host: hold, nothing to record into", (BAD,), (),
         {"m": State.HALTED}, ("hold m HoldHalted",), ctx={"fleet_quarantine": {"m": FLEET}}),
    Case("fleet quarantine, last good in place: record the merged quarantine", (BAD,),
         (on_host(LAST, verified(LAST, GOOD)),), {"m": State.QUARANTINED},
         ("hold m HoldLastGood", "record m RecordQuarantine", "record"),
         ctx={"fleet_quarantine": {"m": FLEET}, "last_good": {"m": LAST}}, host_rev=OLD),
    Case("fleet quarantine already recorded: hold marker only", (BAD,),
         (on_host(LAST, verified(LAST, GOOD, quarantine=FLEET)),), {"m": State.QUARANTINED},
         ("hold m HoldLastGood",), ctx={"fleet_quarantine": {"m": FLEET}, "last_good": {"m": LAST}}),
    Case("--retry ignores the quarantine", (BAD,), (on_host(BAD, FAILED_BAD, active="inactive"),),
         {"m": State.STOPPED}, ("start m NotRunning", "record m", "record", "watch m HealthCheck"),
         ctx={"retry": True, "last_good": {"m": LAST}}),
    Case("--retry ignores a fleet quarantine", (BAD,), (on_host(LAST, verified(LAST, GOOD)),),
         {"m": State.CHANGED}, ("intent m", "write m", "restart m", "record m", "record", "watch m"),
         ctx={"retry": True, "fleet_quarantine": {"m": FLEET}}),
    Case("a new commit changes the quarantined service: deployed as usual", (M,), (on_host(LAST, HELD_GOOD),),
         {"m": State.CHANGED}, ("intent m", "write m EnvChanged", "restart m", "record m", "record", "watch m"),
         ctx={"last_good": {"m": LAST}}),
    # ---- units the reconciler did not install ----------------------------------------------------
    Case("foreign unit file at our path: left alone, n still converges", (M, N), (foreign_unit(),),
         {"m": State.FOREIGN, "n": State.NEW},
         ("hold m Foreign", "intent n", "write n NewService", "daemon-reload", "start n NewService", "record n",
          "record", "watch n")),
    Case("foreign package unit in /lib: left alone", (M,), (package_unit(),), {"m": State.FOREIGN},
         ("hold m Foreign",)),
    Case("foreign masked unit: left alone", (M,), (masked_unit(),), {"m": State.FOREIGN}, ("hold m Foreign",)),
    Case("adopt a hand-made unit: keep the original, then converge", (replace(M, adopt=True),), (foreign_unit(),),
         {"m": State.ADOPT},
         ("intent m", "adopt m Adopt", "write m UnitChanged", "write m NewService", "write m NewService",
          "daemon-reload", "restart m Adopt", "record m", "record", "watch m HealthCheck"), host_rev=None),
    Case("adopt a package unit: nothing to copy, ours shadows it", (replace(M, adopt=True),), (package_unit(),),
         {"m": State.ADOPT},
         ("intent m", "write m NewService", "write m NewService", "write m NewService", "daemon-reload", "enable m",
          "start m Adopt", "record m", "record", "watch m")),
    # ---- orphans: in the inventory, no longer desired ------------------------------------------
    Case("orphan: stop, disable, remove", (), (on_host(M, verified(M, OLD)),), {"m": State.ORPHAN},
         ("stop m RemovedFromGit", "disable m RemovedFromGit", "remove m RemovedFromGit", "remove m RemovedFromGit",
          "remove m RemovedFromGit", "daemon-reload", "record"), dropped=("m",)),
    Case("orphan already stopped and disabled: remove", (),
         (on_host(svc(env={}), verified(M, OLD), active="inactive", enabled="disabled"),), {"m": State.ORPHAN},
         ("remove m", "daemon-reload", "record"), dropped=("m",)),
    Case("adopted orphan: put the original back, enable and start it", (),
         (on_host(M, verified(M, adopted=Adopted((unit_path("m"),), was_enabled=True, was_active=True))),),
         {"m": State.ORPHAN},
         ("stop m", "disable m", "remove m", "remove m", "remove m", "restore m RestoreAdopted", "daemon-reload",
          "enable m RestoreAdopted", "start m RestoreAdopted", "record"), dropped=("m",)),
    Case("adopted orphan that was stopped and disabled: put back only", (),
         (on_host(M, verified(M, adopted=Adopted((unit_path("m"),))), active="inactive", enabled="disabled"),),
         {"m": State.ORPHAN}, ("remove m", "remove m", "remove m", "restore m", "daemon-reload", "record"),
         dropped=("m",)),
    Case("orphan of a deferred pass: not touched", (), (on_host(M, verified(M, OLD)),), {},
         (), ctx={"deferred": frozenset({"m"})}),
    Case("a unit outside the inventory is never touched", (), (foreign_unit(),), {}, ()),
    # ---- drop-ins the reconciler did not write ----------------------------------------------------
    Case("foreign drop-ins: removed, then restart", (M,),
         (on_host(M, verified(M), dropins={OVERRIDE: "[Service]\nNice=5\n", RUNTIME: "[Service]\nUser=x\n"}),),
         {"m": State.DRIFTED},
         ("intent m", "remove m ForeignDropIn", "remove m ForeignDropIn", "daemon-reload", "restart m", "record m",
          "record", "watch m")),
    Case("foreign drop-in on a changed service", (M,),
         (on_host(M_ENV0, verified(M_ENV0, OLD), dropins={OVERRIDE: "[Service]\nNice=5\n"}),), {"m": State.CHANGED},
         ("intent m", "write m EnvChanged", "remove m ForeignDropIn", "daemon-reload", "restart m", "record m",
          "record", "watch m")),
    Case("allowed drop-ins stay", (replace(M, allow_dropins=("override.conf", RUNTIME)),),
         (on_host(M, verified(M), dropins={OVERRIDE: "[Service]\nNice=5\n", RUNTIME: "[Service]\nUser=x\n"}),),
         {"m": State.IN_SYNC}, ()),
    # ---- pre-flight checks -----------------------------------------------------------------------
    Case("blocked new service: nothing written, no host record", (M,), (), {"m": State.BLOCKED},
         ("hold m Blocked",), host_rev=OLD,
         ctx={"checks": Checks(blocked={"m": (Block("PreflightFailed", "model config.json missing"),)})}),
    Case("blocked change: the running version is left as it is", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.BLOCKED}, ("hold m Blocked",), host_rev=OLD,
         ctx={"checks": Checks(blocked={"m": (Block("UnitInvalid", "line 2: bad"),)})}),
    Case("a block on an in-sync service changes nothing", (M,), (on_host(M, verified(M)),), {"m": State.IN_SYNC},
         (), ctx={"checks": Checks(blocked={"m": (Block("GpuBusy", "busy"),)})}),
    Case("one blocked, one converging: the other still converges", (M, N), (on_host(N, verified(N, OLD),
                                                                                     active="inactive"),),
         {"m": State.BLOCKED, "n": State.STOPPED}, ("hold m Blocked", "start n", "record n", "record", "watch n"),
         host_rev=OLD, ctx={"checks": Checks(blocked={"m": (Block("PreflightFailed", "no"),)})}),
    Case("model to fetch, room for it: fetch first", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.CHANGED},
         ("fetch-model m FetchModel", "intent m", "write m", "restart m", "record m", "record", "watch m"),
         ctx={"checks": FETCH_OK}),
    Case("model to fetch, no room for it: blocked, nothing fetched or written", (M,),
         (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.BLOCKED}, ("hold m Blocked",),
         ctx={"checks": FETCH_FULL}, host_rev=OLD),
    Case("model to fetch for an in-sync service: nothing", (M,), (on_host(M, verified(M)),), {"m": State.IN_SYNC},
         (), ctx={"checks": FETCH_FULL}),
    Case("GPU gate on a change: stop, wait for the GPUs, start", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.CHANGED},
         ("intent m", "stop m GpuGate", "write m", "wait-gpus m GpuGate", "start m UnitChanged",
          "record m", "record", "watch m"), ctx={"checks": Checks(gpu_gate=True)}),
    Case("GPU gate on a new service: wait, then start", (M,), (), {"m": State.NEW},
         ("intent m", "write m", "write m", "write m", "daemon-reload", "wait-gpus m GpuGate", "enable m",
          "start m NewService", "record m", "record", "watch m"), ctx={"checks": Checks(gpu_gate=True)}),
    Case("GPU gate on a stopped service: no stop", (M,), (on_host(M, verified(M), active="inactive"),),
         {"m": State.STOPPED}, ("wait-gpus m", "start m NotRunning", "record m", "record", "watch m"),
         ctx={"checks": Checks(gpu_gate=True)}),
    Case("GPU gate, gpu_policy kill: kill the strays after the stop, then wait", (KILL,),
         (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.CHANGED},
         ("intent m", "stop m GpuGate", "write m", "kill-strays m GpuGate", "wait-gpus m GpuGate",
          "start m UnitChanged", "record m", "record", "watch m"), ctx={"checks": Checks(gpu_gate=True)}),
    Case("gpu_policy kill on a host without GPUs: no gate, nothing killed", (KILL,),
         (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.CHANGED},
         ("intent m", "write m", "restart m UnitChanged", "record m", "record", "watch m")),
    Case("the GPUs stayed busy after the stop: record it not started, and why", (M,),
         (on_host(M, STOPPED_BY_GATE, active="inactive"),), {"m": State.BLOCKED},
         ("hold m Blocked", "record m GpuBusy", "record"), ctx={"checks": GATE}, host_rev=OLD),
    Case("... recorded already: nothing more", (M,), (on_host(M, BLOCKED_M, active="inactive"),),
         {"m": State.BLOCKED}, ("hold m Blocked", "record"), ctx={"checks": GATE}, host_rev=OLD),
    Case("a start the gate kept from happening, in a later run: through the gate again", (M,),
         (on_host(M, BLOCKED_M, active="inactive"),), {"m": State.PENDING},
         ("intent m", "wait-gpus m GpuGate", "start m InterruptedDeploy", "record m", "record", "watch m"),
         ctx={"checks": Checks(gpu_gate=True)}, host_rev=OLD),
    Case("GPU gate with the last good in place: nothing to gate", (BAD,), (on_host(LAST, HELD_GOOD),),
         {"m": State.QUARANTINED}, ("hold m HoldLastGood",),
         ctx={"last_good": {"m": LAST}, "checks": Checks(gpu_gate=True)}),
    # ---- a watch that came to no verdict (issue 32) ----------------------------------------------
    Case("no verdict, the unit failed: start it again", (M,), (on_host(M, UNJUDGED_M, active="failed"),),
         {"m": State.PENDING}, ("intent m", "start m StartAgain", "record m", "record", "watch m HealthCheck")),
    Case("no verdict, waiting out its restart: start it again now", (M,),
         (on_host(M, UNJUDGED_M, active="activating", SubState="auto-restart"),), {"m": State.PENDING},
         ("intent m", "restart m StartAgain", "record m", "record", "watch m HealthCheck")),
    Case("no verdict, systemd brought it up by itself: watch it again", (M,), (on_host(M, UNJUDGED_M),),
         {"m": State.PENDING}, ("watch m Reverify",)),
    Case("no verdict after three tries: left as it is, not quarantined", (M,),
         (on_host(M, TRIED_OUT_M, active="failed"),), {"m": State.INCONCLUSIVE}, ("hold m HoldUnjudged",)),
    Case("no verdict after three tries, --retry: start it again", (M,),
         (on_host(M, TRIED_OUT_M, active="failed"),), {"m": State.PENDING},
         ("intent m", "start m StartAgain", "record m", "record", "watch m"), ctx={"retry": True}),
    # ---- sick GPUs: the host's fault, not the revision's ---------------------------------------------
    Case("GPU fault seen before a start: blocked, nothing written, the revision not judged", (M,),
         (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.BLOCKED}, ("hold m Blocked",),
         ctx={"checks": SICK}, host_rev=OLD),
    Case("GPU fault recorded, the GPUs read healthy again: cleared, the deploy goes on", (M,),
         (on_host(M_ENV0, verified(M_ENV0, OLD)),), {"m": State.CHANGED},
         ("intent m", "stop m GpuGate", "write m", "wait-gpus m", "start m UnitChanged", "record m", "record",
          "watch m"), ctx={"checks": HEALTHY}, gpu=MARKED),
    Case("GPU fault recorded, no usable reading: still blocked", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.BLOCKED}, ("hold m Blocked",), ctx={"checks": UNREAD}, gpu=MARKED),
    Case("a start failed with sick GPUs, still sick: blocked, pending, not quarantined", (M,),
         (on_host(M, GPU_FAILED_M, active="failed"),), {"m": State.BLOCKED}, ("hold m Blocked",),
         ctx={"checks": SICK}, gpu=MARKED),
    Case("a start failed with sick GPUs, healthy again: start it again", (M,),
         (on_host(M, GPU_FAILED_M, active="failed"),), {"m": State.PENDING},
         ("intent m", "wait-gpus m", "start m StartAgain", "record m", "record", "watch m HealthCheck"),
         ctx={"checks": HEALTHY}, gpu=MARKED),
    Case("GPU fault, --retry: passed over once", (M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.CHANGED}, ("intent m", "stop m", "write m", "wait-gpus m", "start m", "record m", "record",
                                "watch m"), ctx={"checks": SICK, "retry": True}, gpu=MARKED),
    Case("GPU fault: a service in sync keeps running, nothing is stopped", (M,), (on_host(M, verified(M)),),
         {"m": State.IN_SYNC}, (), ctx={"checks": SICK}, gpu=MARKED),
    # ---- a killed run's temp files -----------------------------------------------------------------
    Case("a temp file a killed run left is removed, and the drift names it", (M,), (on_host(M, verified(M)),),
         {"m": State.IN_SYNC}, ("remove StaleTempFile", "record"), temps=(TEMP,)),
    # ---- other passes ----------------------------------------------------------------------------
    Case("deferred: a rollout wave converges it", (M, N), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.DEFERRED, "n": State.DEFERRED}, (), ctx={"deferred": frozenset({"m", "n"})}),
    Case("deferred beside a converging service", (M, N), (on_host(M_ENV0, verified(M_ENV0, OLD)),),
         {"m": State.DEFERRED, "n": State.NEW},
         ("intent n", "write n", "daemon-reload", "start n", "record n", "record", "watch n"),
         ctx={"deferred": frozenset({"m"})}),
]


def steps(plan: HostPlan, expected: tuple[str, ...]) -> tuple[str, ...]:
    """The plan's actions as `kind [service] [Reason]`, with the reason where the case names one."""
    out = []
    for i, a in enumerate(plan.actions):
        want = expected[i].split() if i < len(expected) else []
        step = a.kind.value + (f" {a.service}" if a.service else "")
        if want and want[-1][0].isupper():
            step += f" {a.reason.value}"
        out.append(step)
    return tuple(out)


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_reconcile(case: Case) -> None:
    plan = case.plan()
    assert plan.states == dict(case.states)
    assert steps(plan, case.steps) == case.steps
    assert plan.dropped_records == case.dropped


def test_the_table_covers_every_state() -> None:
    seen = {s for c in CASES for s in c.states.values()}
    assert seen == set(State), f"no case for {set(State) - seen}"


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_plan_invariants(case: Case) -> None:
    """What holds for every plan: the executor's order; the intent is durable before any file of
    the service changes; the started record comes after the start; a service without a target is
    never written, started or watched; a watch follows the start it judges (or re-verifies)."""
    plan = case.plan()
    acts = plan.actions
    assert [ORDER[a.kind] for a in acts] == sorted(ORDER[a.kind] for a in acts)
    for name, sp in plan.services.items():
        mine = [(i, a) for i, a in enumerate(acts) if a.service == name]
        at = {k: [i for i, a in mine if a.kind is k] for k in Kind}
        if sp.target is None:
            allowed = {Kind.HOLD, Kind.RECORD} | ({Kind.STOP} if sp.state in (
                State.QUARANTINED_NO_GOOD, State.ROLLBACK_FAILED) else set())
            if sp.state is State.ORPHAN:
                allowed = {Kind.STOP, Kind.DISABLE, Kind.REMOVE, Kind.RESTORE, Kind.ENABLE, Kind.START}
            assert {a.kind for _, a in mine} <= allowed, sp.state
            # a record without a target: a quarantine made durable, or a start the GPU gate stopped
            assert all(a.reason is Reason.QUARANTINE or (a.reason is Reason.GPU_BUSY and a.record is not None
                                                         and a.record.pending is not None
                                                         and not a.record.pending.started and a.record.pending.blocked)
                       for _, a in mine if a.kind is Kind.RECORD)
            continue
        files = at[Kind.WRITE] + at[Kind.REMOVE] + at[Kind.ADOPT]
        if files:
            assert at[Kind.INTENT] and at[Kind.INTENT][0] < min(files), "files change before the intent"
        for i in at[Kind.START] + at[Kind.RESTART]:
            started = [j for j in at[Kind.RECORD] if (r := acts[j].record) is not None and r.pending is not None
                       and r.pending.started]
            assert any(j > i for j in started), "no started record after the start"
        for i in at[Kind.WATCH]:
            w = acts[i].watch
            assert w is not None and w.hash == sp.target.hash and w.rollback == sp.target.rollback
            assert w.reverify or any(j < i for j in at[Kind.START] + at[Kind.RESTART])
        assert len(at[Kind.WATCH]) <= 1
    if plan.changes or plan.dropped_records:
        assert acts[-1].kind is Kind.WATCH or (acts[-1].kind is Kind.RECORD and acts[-1].service is None) \
            or any(a.kind is Kind.RECORD and a.service is None for a in acts)


# ---- details of single decisions ---------------------------------------------------------------


def plan_of(desired: tuple[ServiceSpec, ...], observed: tuple[ServiceFacts, ...], host_rev: str | None = REV,
            gpu: GpuFault | None = None, **ctx: object) -> HostPlan:
    return Case("", desired, observed, {}, (), host_rev=host_rev, ctx=ctx, gpu=gpu).plan()


def only(plan: HostPlan, kind: Kind, service: str | None = "m") -> Action:
    found = [a for a in plan.actions if a.kind is kind and a.service == service]
    assert len(found) == 1, f"{len(found)} {kind.value} actions for {service}"
    return found[0]


def record_of(plan: HostPlan, kind: Kind = Kind.RECORD) -> ServiceRecord:
    """The record m's one INTENT or RECORD action writes."""
    rec = only(plan, kind).record
    assert rec is not None
    return rec


def pending_of(rec: ServiceRecord) -> Pending:
    assert rec.pending is not None
    return rec.pending


def watch_of(plan: HostPlan) -> Watch:
    w = only(plan, Kind.WATCH).watch
    assert w is not None
    return w


def diff_of(plan: HostPlan, kind: Kind = Kind.WRITE) -> str:
    diff = only(plan, kind).diff
    assert diff is not None
    return diff


def test_in_sync_summary() -> None:
    plan = plan_of((M,), (on_host(M, verified(M)),))
    assert plan.actions == () and plan.changes == () and plan.summary() == "in sync"
    assert plan.services["m"].result is Result.IN_SYNC


def test_new_service_writes_its_files_and_records_what_it_starts() -> None:
    plan = plan_of((M,), (), host_rev=None)
    assert {a.path: a.content for a in plan.actions if a.kind is Kind.WRITE} == {
        unit_path("m"): UNIT, env_path("m"): render_env_dropin("m"), envfile_path("m"): render_env_file({"A": "1"})}
    intent, started = record_of(plan, Kind.INTENT), record_of(plan)
    assert intent.pending == Pending(hash=H, revision=REV)
    assert (started.hash, started.revision, pending_of(started).started) == (H, REV, True)
    assert started.last_good_hash is None          # only a healthy verdict makes it the last good
    assert plan.summary() == "write 3 files, daemon-reload, enable m, start m"
    w = watch_of(plan)
    assert (w.hash, w.rollback, w.reverify, w.baseline_restarts) == (H, False, False, 0)


def test_env_change_restarts_with_a_reason_naming_the_key() -> None:
    old, new = svc(env={"A": "1", "B": "x", "C": "y"}), svc(env={"A": "2", "B": "x"})
    plan = plan_of((new,), (on_host(old, verified(old, OLD)),))
    write = only(plan, Kind.WRITE)
    assert (write.reason, write.path, write.detail) == (Reason.ENV_CHANGED, envfile_path("m"), "env changed: A, C")
    assert plan.restarts == ["m"] and plan.states == {"m": State.CHANGED}
    # systemd reads the env file at every start: no unit file changed, so no daemon-reload
    assert not [a for a in plan.actions if a.kind is Kind.DAEMON_RELOAD]
    # A restart keeps counting NRestarts: the watch starts from the count before it.
    assert watch_of(plan).baseline_restarts == 2
    assert watch_of(plan).baseline_invocation == "inv-0"


def test_hand_edit_is_drift_with_a_diff() -> None:
    edited = UNIT.replace("/bin/server", "/bin/server --bad")
    plan = plan_of((M,), (on_host(M, verified(M), unit=edited),))
    write = only(plan, Kind.WRITE)
    assert plan.states["m"] is State.DRIFTED and write.reason is Reason.DRIFT and "drift" in write.detail
    diff = diff_of(plan)
    assert "-ExecStart=/bin/server --bad" in diff and "+ExecStart=/bin/server\n" in diff
    assert diff.startswith(f"--- {HOST}:{unit_path('m')}")


def test_env_removed_removes_the_drop_in() -> None:
    plan = plan_of((svc(env={}),), (on_host(M, verified(M, OLD)),))
    assert [(a.kind, a.path) for a in plan.actions if a.path] == [(Kind.REMOVE, env_path("m")),
                                                                  (Kind.REMOVE, envfile_path("m"))]


def test_secrets_never_show_in_a_plan() -> None:
    old, new = svc(env={"HF_TOKEN": "hf_old_secret"}), svc(env={"HF_TOKEN": "hf_new_secret"})
    plan = plan_of((new,), (on_host(old, verified(old, OLD)),))
    shown = repr(plan.actions) + "".join(str(a.to_json()) + a.describe() for a in plan.actions)
    assert "hf_old_secret" not in shown and "hf_new_secret" not in shown
    assert '-HF_TOKEN="***"' in diff_of(plan) and '+HF_TOKEN="***"' in diff_of(plan)
    assert only(plan, Kind.WRITE).content == render_env_file(new.env)     # the file itself has it


@pytest.mark.parametrize("observed", [
    on_host(M, verified(M_ENV0, OLD, pending=INTENT_M)),             # cut before the restart
    on_host(M_ENV0, STARTED_M),                                      # started, then its files changed
], ids=["not started", "started, files differ"])
def test_interrupted_deploy_keeps_what_the_intent_replaces(observed: ServiceFacts) -> None:
    """What a deploy replaces is what ran before it, even once the record already names the new
    version (a rollback goes back to the version before the interrupted deploy)."""
    plan = plan_of((M,), (observed,), host_rev=OLD)
    for rec in (record_of(plan, Kind.INTENT), record_of(plan)):
        assert (pending_of(rec).replaces_hash, pending_of(rec).replaces_revision) == (M_ENV0.content_hash(), OLD)
    assert pending_of(record_of(plan)).started
    assert only(plan, Kind.RESTART).reason is Reason.INTERRUPTED


def test_reverify_of_a_started_deploy_watches_from_its_intent() -> None:
    rec = STARTED_M
    plan = plan_of((M,), (on_host(M, rec),))
    w = watch_of(plan)
    assert (w.reverify, w.since, w.baseline_invocation, w.rollback) == (True, 1234, "", False)
    assert plan.changes == () and plan.summary() == "in sync; re-verify m"


def test_schema_1_record_is_reverified_without_restart() -> None:
    rec = ServiceRecord.from_json({"hash": H, "revision": REV})      # written before `pending` existed
    assert rec.schema == 1 and rec.pending is None and not rec.verified
    plan = plan_of((M,), (on_host(M, rec),))
    assert [a.kind for a in plan.actions] == [Kind.WATCH] and watch_of(plan).reverify
    assert plan.restarts == []


def test_substitution_converges_to_the_last_good_version() -> None:
    plan = plan_of((BAD,), (on_host(BAD, FAILED_BAD),), last_good={"m": LAST})
    sp = plan.services["m"]
    assert sp.target is not None and sp.target.spec == LAST and sp.target.revision == GOOD and sp.target.rollback
    assert sp.result is Result.QUARANTINED and sp.quote == QBAD.quote
    write = only(plan, Kind.WRITE)
    assert write.content == render_env_file(LAST.env) and "substitute last good ccccccc" in write.detail
    assert record_of(plan, Kind.INTENT).pending == Pending(
        hash=LAST.content_hash(), revision=GOOD, rollback=True, replaces_hash=BAD.content_hash(), replaces_revision=REV)
    started = record_of(plan)
    assert started.quarantine == QBAD and started.hash == LAST.content_hash() and pending_of(started).rollback
    w = watch_of(plan)
    assert (w.hash, w.revision, w.rollback) == (LAST.content_hash(), GOOD, True)


def test_quarantine_without_last_good_writes_nothing() -> None:
    plan = plan_of((BAD,), (on_host(BAD, FIRST_FAILED),))
    sp = plan.services["m"]
    assert (sp.result, sp.reason, sp.target) == (Result.FAILED, "QuarantinedNoRollback", None)
    assert "first deploy failed" in sp.note
    assert not [a for a in plan.actions if a.kind in (Kind.WRITE, Kind.REMOVE, Kind.INTENT, Kind.START,
                                                       Kind.RESTART, Kind.WATCH)]


def test_halted_rollout_is_recorded_into_the_existing_record() -> None:
    rec = ServiceRecord(hash=LAST.content_hash(), revision=GOOD)
    plan = plan_of((BAD,), (on_host(LAST, rec),), fleet_quarantine={"m": FLEET})
    assert record_of(plan) == replace(rec, quarantine=FLEET)
    sp = plan.services["m"]
    assert sp.result is Result.QUARANTINED and "rollout halted at gpu-9 (wave 2): CrashLoop" in sp.note


def test_fleet_quarantine_merges_into_the_recorded_one() -> None:
    """The host's own failure wins; the fleet adds where the rollout halted."""
    plan = plan_of((BAD,), (on_host(LAST, HELD_GOOD),), fleet_quarantine={"m": FLEET}, last_good={"m": LAST})
    assert plan.states == {"m": State.QUARANTINED}
    q = record_of(plan).quarantine
    assert q is not None
    assert (q.reason, q.quote, q.halted_at, q.wave, q.cause) == ("CrashLoop", QBAD.quote, "gpu-9", 2, "CrashLoop")


def test_a_recorded_fleet_quarantine_survives_the_substitution_that_follows() -> None:
    # The last good is in place but stopped (a reboot), and the rollout halted on another host.
    plan = plan_of((BAD,), (on_host(LAST, verified(LAST, GOOD), active="inactive"),),
                   fleet_quarantine={"m": FLEET}, last_good={"m": LAST})
    assert plan.states == {"m": State.QUARANTINED} and plan.restarts == ["m"]
    records = [a.record for a in plan.actions if a.kind in (Kind.INTENT, Kind.RECORD) and a.service == "m"]
    # Until the watch's verdict, the last record written is what another controller reads.
    assert records[-1] is not None and records[-1].quarantine == FLEET


def test_foreign_unit_is_reported_with_its_path() -> None:
    for facts, where in ((foreign_unit(), unit_path("m")), (package_unit(), PACKAGE), (masked_unit(), unit_path("m"))):
        plan = plan_of((M,), (facts,))
        sp = plan.services["m"]
        assert (sp.state, sp.result, sp.reason) == (State.FOREIGN, Result.FAILED, "Foreign")
        assert sp.note.startswith(f"{where} was not installed by the reconciler") and plan.changes == ()


def test_adoption_records_the_original_before_replacing_it() -> None:
    plan = plan_of((replace(M, adopt=True),), (foreign_unit(),), host_rev=None)
    intent = record_of(plan, Kind.INTENT)
    assert intent.adopted == Adopted(files=(unit_path("m"),), was_enabled=True, was_active=True,
                                            fragment=unit_path("m"))
    assert only(plan, Kind.ADOPT).path == unit_path("m")
    assert record_of(plan).adopted == intent.adopted
    kinds = [a.kind for a in plan.actions]
    assert kinds.index(Kind.INTENT) < kinds.index(Kind.ADOPT) < kinds.index(Kind.WRITE)


def test_adopting_a_package_unit_keeps_where_it_came_from() -> None:
    plan = plan_of((replace(M, adopt=True),), (package_unit(),))
    assert record_of(plan, Kind.INTENT).adopted == Adopted(files=(), was_enabled=False, was_active=False,
                                                             fragment=PACKAGE)


def test_an_adopted_masked_unit_is_masked_again_when_it_leaves() -> None:
    adopt = plan_of((replace(M, adopt=True),), (masked_unit(),))
    assert adopt.states == {"m": State.ADOPT}
    adopted = record_of(adopt)          # what the host keeps once the adoption ran
    leave = plan_of((), (on_host(M, replace(adopted, pending=None)),))
    assert [a.path for a in leave.actions if a.kind is Kind.RESTORE] == [unit_path("m")], \
        [a.describe() for a in leave.actions]


def test_orphan_removal_drops_its_record_and_shows_the_removed_files() -> None:
    plan = plan_of((), (on_host(M, verified(M, OLD)),))
    assert plan.dropped_records == ("m",) and plan.states == {"m": State.ORPHAN}
    assert {a.path for a in plan.actions if a.kind is Kind.REMOVE} == {unit_path("m"), env_path("m"), envfile_path("m")}
    assert all("+++ /dev/null" in (a.diff or "") for a in plan.actions if a.kind is Kind.REMOVE)
    assert plan.services["m"].result is Result.CONVERGED


def test_blocked_service_says_why() -> None:
    blocks = (Block("PreflightFailed", "model config.json missing"), Block("GpuBusy", "GPU 0 held by pid 7"))
    plan = plan_of((M,), (), host_rev=OLD, checks=Checks(blocked={"m": blocks}))
    sp = plan.services["m"]
    assert (sp.result, sp.reason, sp.target) == (Result.FAILED, "PreflightFailed", None)
    assert sp.note == "model config.json missing | GPU 0 held by pid 7"
    assert [a.kind for a in plan.actions] == [Kind.HOLD]


def test_gpu_gated_start_counts_restarts_from_zero() -> None:
    plan = plan_of((M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), checks=Checks(gpu_gate=True))
    assert watch_of(plan).baseline_restarts == 0
    assert plan.restarts == ["m"] and plan.summary().endswith("stop m, wait-gpus m, start m")


# ---- files -------------------------------------------------------------------------------------


@pytest.mark.parametrize(("value", "expected"), [
    ('a"b', 'K="a\\"b"'), ("50%", 'K="50%"'), ("c:\\x", 'K="c:\\\\x"'), ("$HOME `x`", 'K="\\$HOME \\`x\\`"'),
    ("", 'K=""'), ("x y", 'K="x y"')])
def test_env_values_are_escaped_for_systemd(value: str, expected: str) -> None:
    assert f"{expected}\n" in render_env_file({"K": value})
    assert parse_env_file(render_env_file({"K": value})) == {"K": value}


def test_env_is_rendered_sorted_under_a_header_in_a_file_the_drop_in_names() -> None:
    assert render_env_file({"B": "2", "A": "1"}).splitlines()[1:] == ['A="1"', 'B="2"']
    assert render_env_dropin("m").splitlines()[1:] == ["[Service]", f"EnvironmentFile={envfile_path('m')}"]


@pytest.mark.parametrize(("line", "masked"), [
    ('+Environment="HF_TOKEN=hf_abcdef"', '+Environment="HF_TOKEN=***"'),
    ('-Environment="DB_PASSWORD=x"', '-Environment="DB_PASSWORD=***"'),
    (' Environment="OPENAI_API_KEY=sk-1"', ' Environment="OPENAI_API_KEY=***"'),
    ('+Environment="aws_secret_access=1"', '+Environment="aws_secret_access=***"'),
    ('+Environment="LOG=info"', '+Environment="LOG=info"'),
    ("+ExecStart=/bin/server --token=abc", "+ExecStart=/bin/server --token=abc"),
    # review M3: names the old rule missed, and every NAME= of an Environment= line judged
    ('+OPENAI_KEY="plain"', '+OPENAI_KEY="***"'),
    ('+SENTRY_DSN="https://k@o.example/1"', '+SENTRY_DSN="***"'),
    ('-DATABASE_URL="postgres://app:Zm9v/YmFy@db/app"', '-DATABASE_URL="***"'),
    (' AUTH="let-me-in"', ' AUTH="***"'),
    ('+BEARER="abc"', '+BEARER="***"'),
    ("+Environment=A=1 DB_PASSWORD=x C=3", "+Environment=A=1 DB_PASSWORD=***"),
    ('+Environment="A=1" "OPENAI_KEY=x"', '+Environment="A=1" "OPENAI_KEY=***"'),
    ('+Environment="OPTS=--v DB_PASSWORD=y"', '+Environment="OPTS=--v DB_PASSWORD=***"'),
    ('+Environment="A=1" "B=2"', '+Environment="A=1" "B=2"'),
    ('+LOG="info"', '+LOG="info"'),
])
def test_secrets_masked_in_diffs(line: str, masked: str) -> None:
    assert mask_secrets(line + "\n") == masked + "\n"


def test_a_diff_masks_token_formats_and_registered_values_whatever_the_name() -> None:
    """unified_diff is safe on its own: a value under an ordinary name (a URL password, a token, a
    decrypted secret) is masked too, not only the values of secret-looking names."""
    from reconciler import redact
    from reconciler.plan.files import unified_diff
    value = "reg1stered-" + "Q7w8e9r0"
    redact.register(value)
    new = render_env_file({"URL": "postgres://app:Zm9v/YmFy@db/app", "ARGS": "--hf hf_" + "Ab12Cd34Ef",
                           "MSG": f"x {value}"})
    diff = unified_diff("/etc/x.env", None, new, "gpu-1", "abcdef1")
    assert 'URL="postgres://app:***@db/app"' in diff and 'ARGS="--hf ***"' in diff and 'MSG="x ***"' in diff
    assert "Zm9v" not in diff and "Ab12Cd34Ef" not in diff and value not in diff


def test_an_orphan_is_kept_while_the_service_that_replaces_it_is_blocked() -> None:
    """A rename (m -> n) whose new service pre-flight refuses must not leave neither running."""
    blocked = Checks(blocked={"n": (Block("PreflightFailed", "no"),)})
    plan = plan_of((N,), (on_host(M, verified(M, OLD)),), host_rev=OLD, checks=blocked)
    assert plan.states == {"n": State.BLOCKED, "m": State.ORPHAN}
    assert sorted((a.kind, a.service) for a in plan.actions) == [(Kind.HOLD, "m"), (Kind.HOLD, "n")]
    assert "kept while n is blocked" in plan.services["m"].note and plan.dropped_records == ()
    # once n is let through, m goes
    plan = plan_of((N,), (on_host(M, verified(M, OLD)),), host_rev=OLD)
    assert plan.dropped_records == ("m",) and ("n", Kind.START) in [(a.service, a.kind) for a in plan.actions]


def test_an_adopted_units_drop_ins_are_kept_and_put_back() -> None:
    mine = "/etc/systemd/system/m.service.d/10-numa.conf"
    facts = replace(foreign_unit(), dropins={mine: "[Service]\nNice=5\n"})
    adopt = plan_of((replace(M, adopt=True),), (facts,))
    intent = record_of(adopt, Kind.INTENT)
    assert intent.adopted is not None and intent.adopted.files == (unit_path("m"), mine)
    assert [a.path for a in adopt.actions if a.kind is Kind.ADOPT] == [unit_path("m"), mine]
    kinds = [a.kind for a in adopt.actions]
    assert kinds.index(Kind.ADOPT) < kinds.index(Kind.REMOVE)      # copied before the drift removal
    leave = plan_of((), (on_host(M, replace(record_of(adopt), pending=None)),))
    assert [a.path for a in leave.actions if a.kind is Kind.RESTORE] == [unit_path("m"), mine]


# ---- the dead-man's switch ----------------------------------------------------------------------


def test_a_deploy_arms_a_switch_that_restores_the_verified_version() -> None:
    plan = plan_of((M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), confirm_margin=60.0)
    kinds = [a.kind for a in plan.actions]
    # an env-only change: no daemon-reload, not for the env file, not for the switch (transient)
    assert kinds.index(Kind.INTENT) < kinds.index(Kind.ARM) < kinds.index(Kind.ARM_TIMER) < kinds.index(Kind.RESTART)
    assert Kind.DAEMON_RELOAD not in kinds
    sw = only(plan, Kind.ARM).switch
    assert sw is not None and sw.restores == OLD
    h = M.health
    assert sw.window == int(h.startup_timeout + h.stable_for + 60)
    from reconciler.plan import confirm
    # a transient timer (no unit file, no daemon-reload for it), made only if the controller
    # goes, by the script that also arms it at boot: its window is the switch script's own
    rearm = confirm.rearm_text()
    assert '--on-active="${w:-600}s"' in rearm and 'flock -w 600 "$LOCK"' in rearm
    assert "\nLOCK=/var/lib/reconciler/.lock\n" in rearm
    assert f"# window={sw.window}\n" in sw.script         # what the re-arm reads
    # the script puts the verified files back, restarts, and records the new version quarantined
    # (sh/confirm.sh after its header: the service, what it does, the previous files, the record)
    head = dict(x.split("=", 1) for x in sw.script.splitlines() if x[:1].isupper() and "=" in x)
    assert (head["SERVICE"], head["ACTION"]) == ("m", "restore")
    assert '"NotConfirmed"' not in sw.script      # (base64 inside)
    assert 'systemctl restart "$svc_unit"' in sw.script
    assert head["ENVFILE"] != "-" and head["DROPIN"] != "-"                     # env file and drop-in
    assert 'put "$ENV_DIR/$SERVICE.env" "$ENVFILE" 0600' in sw.script and envfile_path("m").startswith(head["ENV_DIR"])
    assert env_path("m") == f"{head['UNIT_DIR']}/m.service.d/{head['ENV_DROPIN']}"
    import base64
    import json
    records = [json.loads(base64.b64decode(head["RECORD"]))]
    assert records and records[-1]["quarantine"]["reason"] == "NotConfirmed"
    assert records[-1]["hash"] == M_ENV0.content_hash() and records[-1]["pending"] is None


def test_without_a_verified_version_the_switch_stops_the_service() -> None:
    plan = plan_of((M,), (), confirm_margin=60.0)
    sw = only(plan, Kind.ARM).switch
    assert sw is not None and sw.restores is None and "\nACTION=stop\n" in sw.script
    assert 'systemctl stop "$svc_unit"' in sw.script


def test_no_switch_for_a_rollback_and_none_when_turned_off() -> None:
    plan = plan_of((BAD,), (on_host(BAD, FAILED_BAD),), last_good={"m": LAST}, confirm_margin=60.0)
    assert plan.states == {"m": State.QUARANTINED} and not [a for a in plan.actions if a.kind is Kind.ARM]
    plan = plan_of((M,), (), confirm_margin=None)
    assert not [a for a in plan.actions if a.kind in (Kind.ARM, Kind.ARM_TIMER)]


def test_an_orphan_with_a_deploy_in_flight_disarms_its_switch() -> None:
    rec = replace(verified(M, OLD), pending=Pending(M.content_hash(), REV, started=True))
    plan = plan_of((), (on_host(M, rec),), confirm_margin=60.0)
    kinds = [a.kind for a in plan.actions]
    assert Kind.DISARM in kinds and kinds.index(Kind.DISARM) < kinds.index(Kind.STOP)


def test_a_host_with_the_env_as_environment_lines_moves_to_the_env_file_without_a_restart() -> None:
    """A host an older reconciler deployed has the env as Environment= lines in the drop-in and no
    env file. Where those lines are exactly the desired env, the running process has it already:
    the files move (write both, daemon-reload), nothing restarts. Where they differ, it is an
    env change as any other."""
    from reconciler.plan.files import legacy_env_dropin as _legacy_env_dropin
    legacy = replace(on_host(M, verified(M)), env_text=_legacy_env_dropin(M.env), envfile_text=None,
                     dropins={env_path("m"): _legacy_env_dropin(M.env)})
    plan = plan_of((M,), (legacy,))
    assert [(a.kind, a.path) for a in plan.actions if a.kind is not Kind.RECORD] == [
        (Kind.WRITE, env_path("m")), (Kind.WRITE, envfile_path("m")), (Kind.DAEMON_RELOAD, None)]
    assert all("same values: no restart" in a.detail for a in plan.actions if a.kind is Kind.WRITE)
    assert plan.states == {"m": State.IN_SYNC} and plan.services["m"].result is Result.CONVERGED
    old_env = _legacy_env_dropin({"A": "0"})
    other = replace(legacy, env_text=old_env, dropins={env_path("m"): old_env})
    plan = plan_of((M,), (other,))
    assert plan.states == {"m": State.DRIFTED} and plan.restarts == ["m"]


# ---- a watch with no verdict (issue 32) ----------------------------------------------------------


def test_starting_again_keeps_the_count_of_watches_without_a_verdict() -> None:
    plan = plan_of((M,), (on_host(M, UNJUDGED_M, active="failed"),))
    for kind in (Kind.INTENT, Kind.RECORD):
        p = pending_of(record_of(plan, kind))
        assert (p.attempts, p.unjudged) == (1, NO_VERDICT)
    assert "219/CGROUP" in only(plan, Kind.START).detail
    # --retry starts the count afresh
    retried = plan_of((M,), (on_host(M, TRIED_OUT_M, active="failed"),), retry=True)
    assert pending_of(record_of(retried, Kind.INTENT)).attempts == 0


def judged(rec: ServiceRecord, reason: str, healthy: bool = False) -> tuple[ServiceRecord, bool]:
    out = judge(rec, hash=H, revision=REV, rollback=False, now=99,
                verdict=Verdict(healthy, reason, "the quote", "the message"))
    return out.record, out.stop


@pytest.mark.parametrize("reason", [INCONCLUSIVE, START_LIMIT_HIT])
def test_a_watch_without_a_verdict_keeps_the_deploy_pending_and_counts_it(reason: str) -> None:
    rec, stop = judged(STARTED_M, reason)
    assert not stop and rec.quarantine is None and rec.last_good_hash == STARTED_M.last_good_hash
    p = pending_of(rec)
    assert p.started and p.attempts == 1 and p.unjudged == f"{reason}: the message"
    again, _ = judged(rec, INCONCLUSIVE)
    assert pending_of(again).attempts == 2


def test_a_start_refused_again_after_it_was_started_again_is_start_failed() -> None:
    once, _ = judged(STARTED_M, START_LIMIT_HIT)
    rec, stop = judged(once, START_LIMIT_HIT)
    assert stop and rec.pending is None and rec.quarantine is not None
    assert rec.quarantine.reason == "StartFailed"
    # ... but not after a start that failed for another reason (that one was no verdict either)
    other, _ = judged(UNJUDGED_M, START_LIMIT_HIT)
    assert other.quarantine is None and pending_of(other).attempts == 2


def test_a_healthy_verdict_after_no_verdict_makes_it_the_last_good() -> None:
    rec, stop = judged(UNJUDGED_M, "Healthy", healthy=True)
    assert not stop and rec.pending is None and rec.last_good_hash == H and rec.quarantine is None


# ---- sick GPUs (issue 35) --------------------------------------------------------------------------


def test_a_gpu_fault_block_quotes_the_line_and_names_the_failed_start() -> None:
    plan = plan_of((M,), (on_host(M, GPU_FAILED_M, active="failed"),), gpu=MARKED, checks=SICK)
    sp = plan.services["m"]
    assert (sp.result, sp.reason, sp.quote) == (Result.FAILED, GPU_FAULT, ECC)
    assert sp.note == (f"not started: the host's GPU fault (m {REV[:7]} failed to start): {ECC} (the revision "
                       f"is not judged; cleared by the next healthy GPU reading)")
    # seen before any start: said so
    before = plan_of((M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), checks=SICK).services["m"]
    assert before.note.startswith(f"not started: the host's GPU fault (seen before a start): {ECC}")
    # and the revision stays unjudged: no quarantine recorded, no last good moved
    assert not [a for a in plan.actions if a.kind in (Kind.RECORD, Kind.INTENT)]


def test_a_start_that_failed_with_sick_gpus_is_no_verdict_and_stops_the_unit() -> None:
    rec, stop = judged(STARTED_M, GPU_FAULT)
    assert stop and rec.quarantine is None and rec.last_good_hash == STARTED_M.last_good_hash
    p = pending_of(rec)
    assert p.started and p.attempts == 1 and p.unjudged == f"{GPU_FAULT}: the message"
    # the same failure without a GPU fault is the revision's: quarantined
    bad, _ = judged(STARTED_M, "CrashLoop")
    assert bad.quarantine is not None and bad.quarantine.reason == "CrashLoop" and bad.pending is None


# ---- the steps of this run as facts: the GPU gate's answer, the model fetch -------------------------


def test_a_closed_gate_is_recorded_as_a_start_that_did_not_happen() -> None:
    plan = plan_of((M,), (on_host(M, STOPPED_BY_GATE, active="inactive"),), checks=GATE, host_rev=OLD)
    rec = record_of(plan)
    assert rec.pending == replace(INTENT_M, started=False, blocked=BUSY)    # the intent kept, and why not started
    assert (rec.hash, rec.last_good_hash) == (M_ENV0.content_hash(), M_ENV0.content_hash())   # nothing judged
    sp = plan.services["m"]
    assert (sp.state, sp.result, sp.reason, sp.note) == (State.BLOCKED, Result.FAILED, Reason.GPU_BUSY, BUSY)
    assert only(plan, Kind.RECORD, None).detail.startswith("record revision")   # the files at REV are there


def test_a_closed_gate_without_an_intent_on_record_says_what_was_to_start() -> None:
    """A stopped service starts without an intent (nothing is written): its record says the start."""
    plan = plan_of((M,), (on_host(M, verified(M_ENV0, OLD), active="inactive"),), checks=GATE, host_rev=OLD)
    assert pending_of(record_of(plan)) == Pending(hash=H, revision=REV, replaces_hash=M_ENV0.content_hash(),
                                                  replaces_revision=OLD, blocked=BUSY)


def test_the_fetch_step_carries_its_model() -> None:
    fetch = only(plan_of((M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), checks=FETCH_OK), Kind.FETCH)
    assert fetch.model == MODEL
    assert fetch.detail == "fetch org/model into /models/m first (hf download org/model --local-dir .)"
    # a rollback's start never fetches (it ran here before)
    plan = plan_of((BAD,), (on_host(BAD, FAILED_BAD),), host_rev=OLD,
                   checks=Checks(fetch={"m": ModelFetch(MODEL, free_bytes=1)}), last_good={"m": LAST})
    assert not [a for a in plan.actions if a.kind is Kind.FETCH] and plan.services["m"].state is State.QUARANTINED


def test_no_room_for_a_fetch_blocks_with_why() -> None:
    sp = plan_of((M,), (on_host(M_ENV0, verified(M_ENV0, OLD)),), checks=FETCH_FULL).services["m"]
    assert (sp.reason, sp.note) == (Reason.MODEL_FETCH_FAILED, "model-fetch: not enough disk for org/model at "
                                                               "/models/m: needs 16.0 GB, 10.0 GB free")


@pytest.mark.parametrize("model, total, free, refused", [
    (MODEL, None, 100 * 10**9, None),                            # size_gb 16, 100 GB free
    (MODEL, None, 16 * 10**9, None),                             # exactly enough
    (MODEL, None, 16 * 10**9 - 1, "needs 16.0 GB, 16.0 GB free"),
    (MODEL, 99 * 10**9, 20 * 10**9, None),                       # the declared size wins over the index's
    (replace(MODEL, size_gb=None), 30 * 10**9, 20 * 10**9, "needs 30.0 GB, 20.0 GB free"),   # the index's size
    (replace(MODEL, size_gb=None), None, 1, None),               # size unknown: it runs
    (MODEL, None, None, None),                                   # free space unknown: it runs
])
def test_fetch_refused(model: ModelSpec, total: int | None, free: int | None, refused: str | None) -> None:
    why = fetch_refused(ModelFetch(model, total, free))
    assert why == (None if refused is None else f"model-fetch: not enough disk for org/model at /models/m: {refused}")
