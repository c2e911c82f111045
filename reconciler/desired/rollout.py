"""The fleet's rollout schedule, checked as a whole once every host is loaded.

Two checks that no single file can make: fleet.toml's [pull] waves against the hosts' labels
(a wave whose labels no host carries is a typo that would quietly move the canaries to the last
wave), and one rollout policy per group of hosts sharing a definition (they roll out together,
so a host's own `rollout` that makes its policy differ is an error, not a silent pick).
"""

from __future__ import annotations

from collections.abc import Mapping

import msgspec

from . import schema
from .collect import Problems
from .merge import At
from .repo import FLEET_FILE
from .spec import HostSpec, PullWave, RolloutPolicy


def pull_waves(table: schema.PullTable, hosts: Mapping[str, HostSpec], problems: Problems) -> tuple[PullWave, ...]:
    """fleet.toml [pull] waves, checked as a schedule: names unique, no wave sooner than the
    one before it, a wave without labels (every remaining host) only last, and every wave's
    labels carried by some host (a typo would quietly move the canaries to the last wave)."""
    waves: list[PullWave] = []
    for i, w in enumerate(table.waves):
        wave = PullWave(name=w.name or f"wave-{i + 1}", labels=dict(w.labels), after=w.after)
        _check_wave(i, wave, waves, hosts, problems)
        waves.append(wave)
    return tuple(waves)


def _check_wave(i: int, wave: PullWave, waves: list[PullWave], hosts: Mapping[str, HostSpec],
                problems: Problems) -> None:
    """Problems with wave number i+1 after the `waves` before it."""
    key = f"pull.waves[#{i + 1}]"
    earlier = next((j for j, x in enumerate(waves) if x.name == wave.name), None)
    if earlier is not None:
        problems.add(FLEET_FILE, f"{key}.name", f"wave {wave.name!r} is named twice (also "
                                                f"pull.waves[#{earlier + 1}]); names must be unique")
    if waves and wave.after < waves[-1].after:
        problems.add(FLEET_FILE, f"{key}.after",
                     f"{wave.after:g}s is sooner than the wave before it ({waves[-1].after:g}s): a "
                     f"later wave deploys a commit only when it is at least as old")
    if waves and not waves[-1].labels:
        problems.add(FLEET_FILE, key, f"comes after pull.waves[#{i}], which has no labels and so "
                                      f"takes every remaining host: this wave would never get one")
    if wave.labels and hosts and not any(wave.matches(h.labels) for h in hosts.values()):
        have = sorted({f"{k}={v}" for h in hosts.values() for k, v in h.labels.items()})
        want = ", ".join(f"{k}={v}" for k, v in wave.labels.items())
        problems.add(FLEET_FILE, f"{key}.labels", f"no host carries {want} (labels in use: "
                                                  f"{', '.join(have) or 'none'})")


class _Member(msgspec.Struct, frozen=True):
    """One host's service in a rollout group."""

    host_file: str
    own_rollout: At | None   # the host's own `rollout` table, if it has one
    policy: RolloutPolicy    # the merged policy
    base: RolloutPolicy      # the policy without the host's layer
    floor_at: At | None = None   # where min_available was set, if it was


class RolloutGroups:
    """The services that use a shared definition, grouped by (service, definition)."""

    def __init__(self) -> None:
        self._groups: dict[tuple[str, str], list[_Member]] = {}
        self._hosts: dict[tuple[str, str], set[str]] = {}    # every host file that uses it, loaded or not

    def declare(self, service: str, definition: str, host_file: str) -> None:
        """A host's service uses the definition (counted even when it fails to load: the group's
        size is what the repo says, not what survived this load's problems)."""
        self._hosts.setdefault((service, definition), set()).add(host_file)

    def add(self, service: str, definition: str, host_file: str, own_rollout: At | None, policy: RolloutPolicy,
            base: RolloutPolicy, floor_at: At | None = None) -> None:
        member = _Member(host_file, own_rollout, policy, base, floor_at)
        self._groups.setdefault((service, definition), []).append(member)

    def check(self, problems: Problems) -> None:
        """The hosts that share a definition roll out as one group, so under one policy: a host
        whose own `rollout` makes its policy differ from the others' is an error (the fleet would
        otherwise have to pick one silently). A min_available that the group can never keep
        while one of its hosts restarts is an error too: the rollout could never take a host."""
        for (service, definition), members in self._groups.items():
            _check_floor(service, definition, members, self._hosts.get((service, definition), set()), problems)
            if len({m.policy for m in members}) < 2:
                continue
            for m in members:
                if m.own_rollout is not None and m.policy != m.base:
                    problems.add(m.own_rollout.file, m.own_rollout.key,
                        f"this host's policy ({m.policy.describe()}) differs from the other hosts using "
                        f"services/{definition}.toml ({m.base.describe()}): the hosts that share a definition "
                        f"roll out {service} as one group under one policy; set rollout in "
                        f"services/{definition}.toml")


def _check_floor(service: str, definition: str, members: list[_Member], host_files: set[str],
                 problems: Problems) -> None:
    """min_available >= the hosts that serve the group: no host could ever restart."""
    files = host_files | {m.host_file for m in members}
    for m in members:
        floor = m.policy.min_available
        if floor is None or m.floor_at is None or floor < len(files):
            continue
        names = sorted(f.rsplit("/", 1)[-1].removesuffix(".toml") for f in files)
        shown = ", ".join(names[:5]) + (f" and {len(names) - 5} more" if len(names) > 5 else "")
        problems.add(m.floor_at.file, m.floor_at.key,
                     f"min_available = {floor} can never be met: {service} (services/{definition}.toml) runs on "
                     f"{len(files)} host{'s' * (len(files) != 1)} ({shown}), and a restart takes one of them "
                     f"out of service, so a rollout could never restart any; at most {len(files) - 1}"
                     + (" (or add hosts)" if len(files) > 1 else " (a single host has no budget to keep)"))
