"""The trust policy's environment variables and what they may do (pure), and where the
controller's config is (config_path): no pydantic, so that a `reconcile` run reads them without
the config's schema.

    RECONCILER_REQUIRE_SIGNED          only signed revisions deploy
    RECONCILER_ALLOWED_SIGNERS         by a key in this ssh allowed_signers file
    RECONCILER_ALLOW_INSECURE_TRANSPORT   fetch over http:// or git://

Every other RECONCILER_<KEY> simply overrides its key of the controller's config. These three
decide who is root on the fleet, and root's environment can be a user's (`sudo -E`), so at every
door they may make the policy stricter, never looser, and a setting that would not take effect
is an error, never dropped in silence: docs/push.md ("the environment") says what that refuses.
RECONCILER_ALLOWED_SIGNERS may not differ from `--allowed-signers` either.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from pathlib import Path

import msgspec

from ..desired.trust import DEFAULT_SIGNERS
from ..errors import Problem

REQUIRE = "RECONCILER_REQUIRE_SIGNED"
SIGNERS = "RECONCILER_ALLOWED_SIGNERS"
INSECURE = "RECONCILER_ALLOW_INSECURE_TRANSPORT"
NAMES = (REQUIRE, SIGNERS, INSECURE)
# The words the config's schema (pydantic) takes for a boolean, so both read a variable alike.
TRUE = frozenset({"1", "on", "t", "true", "y", "yes"})
FALSE = frozenset({"0", "off", "f", "false", "n", "no"})
NEVER_LOOSER = "an environment variable may make the trust policy stricter, never looser"
DEFAULT_CONFIG = Path("/etc/reconciler/config.toml")


def config_path() -> Path:
    """The controller's config: $RECONCILER_CONFIG, else /etc/reconciler/config.toml."""
    return Path(os.environ.get("RECONCILER_CONFIG") or DEFAULT_CONFIG)


class TrustVars(msgspec.Struct, frozen=True):
    """One source's trust settings; None: that source does not say."""

    require_signed: bool | None = None
    allowed_signers: str | None = None
    insecure_transport: bool | None = None


def read(env: Mapping[str, str]) -> tuple[TrustVars, list[Problem]]:
    """The three variables from `env` (an empty value is unset), and the problems of those that
    are not a boolean (the value is not repeated: it is the environment's)."""
    problems: list[Problem] = []

    def flag(name: str) -> bool | None:
        raw = env.get(name, "").strip().lower()
        if not raw:
            return None
        if raw in TRUE or raw in FALSE:
            return raw in TRUE
        problems.append(Problem("environment", name, "expected true or false"))
        return None

    signers = env.get(SIGNERS) or None
    return TrustVars(flag(REQUIRE), signers, flag(INSECURE)), problems


NONE_GIVEN = TrustVars()      # no flag given


def _same_file(a: str, b: str) -> bool:
    return Path(a).absolute() == Path(b).absolute()


def problems(env: TrustVars, *, flags: TrustVars = NONE_GIVEN, file: TrustVars | None = None,
             file_name: str = "the controller's config") -> list[Problem]:
    """Why the variables `env` may not stand beside the command line's `flags` and the config
    file's settings `file` (None: no config file applies; its values otherwise, defaults
    included: a key the file leaves out says what its default says). [] when they may."""
    file_requires = bool(file and file.require_signed)
    flag_requires = bool(flags.require_signed or flags.allowed_signers)
    out: list[Problem] = []
    if env.require_signed is False and (file_requires or flag_requires):
        out.append(_unsigned_problem(flags, file_requires, file_name))
    if env.insecure_transport and file is not None and not file.insecure_transport:
        out.append(Problem("environment", INSECURE, f"allows fetching over http:// and git://, but {file_name} does "
                                                    f"not: {NEVER_LOOSER} (set allow_insecure_transport = true in the "
                                                    f"file if that is meant, or unset it)"))
    if env.allowed_signers is not None:
        out += _signers_problems(env.allowed_signers, flags, file, file_name,
                                 requires=file_requires or flag_requires or bool(env.require_signed))
    return out


def _unsigned_problem(flags: TrustVars, file_requires: bool, file_name: str) -> Problem:
    """RECONCILER_REQUIRE_SIGNED=false where the file or the command line requires signing,
    naming which one does (the file first)."""
    where = file_name if file_requires else "--allowed-signers" if flags.allowed_signers else "--require-signed"
    return Problem("environment", REQUIRE, f"asks for unsigned revisions, but {where} requires signed ones: "
                                          f"{NEVER_LOOSER} (unset it)")


def _signers_problems(signers: str, flags: TrustVars, file: TrustVars | None, file_name: str, *,
                      requires: bool) -> list[Problem]:
    """Why RECONCILER_ALLOWED_SIGNERS (`signers`) may not stand: nothing requires signing (so it
    would verify nothing), it names another file than the one the config file requires, or
    another than --allowed-signers."""
    out: list[Problem] = []
    if not requires:
        out.append(Problem("environment", SIGNERS, "names a signers file, but nothing requires signed revisions, "
                                                   f"so it would verify nothing: set {REQUIRE}=true (or pass "
                                                   "--require-signed), or unset it"))
    elif file is not None and file.require_signed and \
            not _same_file(signers, file.allowed_signers or DEFAULT_SIGNERS):
        out.append(Problem("environment", SIGNERS, f"names another signers file than the "
                                                   f"{file.allowed_signers or DEFAULT_SIGNERS} that {file_name} "
                                                   f"requires: the environment may not change who may deploy "
                                                   f"(unset it, or change allowed_signers in the file)"))
    if flags.allowed_signers is not None and not _same_file(signers, flags.allowed_signers):
        out.append(Problem("environment", SIGNERS, "names another signers file than --allowed-signers: choose one"))
    return out


def of_file(data: Mapping[str, object]) -> TrustVars:
    """What a config file's TOML says of the three keys, defaults filled in (a value of the wrong
    type counts as its default here; the schema reports it)."""
    signers = data.get("allowed_signers")
    return TrustVars(_truthy(data.get("require_signed")), signers if isinstance(signers, str) and signers else None,
                     _truthy(data.get("allow_insecure_transport")))


def _truthy(value: object) -> bool:
    """True as the schema reads it: true, or a string it takes for true ("yes", "1", ...)."""
    return value is True or (isinstance(value, str) and value.strip().lower() in TRUE) or value == 1
