"""What a preview runs on the hosts (PURE): whether a run's pre-flight may run the engine check
(host/engine.py). Which runs do, and what else a dry run reads: docs/engine-check.md (when it runs).
"""

from __future__ import annotations

import msgspec


class EngineCheck(msgspec.Struct, frozen=True):
    """Whether a run's pre-flight runs the engine check (host/engine.py), and why (`engine_check`)."""

    run: bool
    why: str

    def line(self) -> str:
        """What a dry run says about it."""
        return f"engine check {'ran' if self.run else 'skipped'}: {self.why}"


REAL_RUN = EngineCheck(True, "a real run")


def engine_check(dry_run: bool, asked: bool, signer: str | None) -> EngineCheck:
    """PURE: whether this run's pre-flight may run the engine check. The check starts the
    revision's interpreter with the revision's environment on the hosts, so a preview (a dry
    run), which promises to run nothing of the revision, runs it only for a revision that the
    run's trust policy verified (`signer`: require_signed, and a signature by an allowed key) or
    when the operator asks for it (`asked`: --engine-check). A real run deploys the revision,
    which runs its ExecStart= anyway: it keeps the check."""
    if not dry_run:
        return REAL_RUN
    if signer is not None:
        return EngineCheck(True, f"signed by {signer}")
    if asked:
        return EngineCheck(True, "--engine-check")
    return EngineCheck(False, "the revision is not signed; --engine-check runs it")
