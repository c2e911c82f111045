"""One service on one host -> a ServiceSpec: its layers merged, its unit and model resolved, its
placeholders rendered, its health check and secrets checked.

Runs for every [services.<name>] table of every host file, in steps that each report their own
problems. A problem names the file and key the value was written in (the host's file, or the
shared definition or unit file it came from); one found in a shared file also names the service
and host it was found for, so a definition used by many hosts gives one line. A service with any
problem yields no spec: the load fails, listing them all.
"""

from __future__ import annotations

import functools
import re
from typing import Any

import msgspec

from ..values import replace
from . import schema
from .collect import Problems, Use
from .drain import drain_spec, smoke_spec
from .health import read_ca_bundle, url_problem
from .merge import At, Merged
from .placeholders import Values, render
from .problems import dotted
from .repo import FLEET_FILE, SERVICES_DIR, SnapshotLike
from .rollout import RolloutGroups
from .spec import DrainSpec, HealthSpec, ModelSpec, RolloutPolicy, SecretSpec, ServiceSpec, SmokeSpec
from .units import UnitFiles, managed_unit

_CONTROL = re.compile(r"[\x00-\x08\x0a-\x1f\x7f]")
_AGE_MAGIC = (b"age-encryption.org/v1\n", b"-----BEGIN AGE ENCRYPTED FILE-----")


class _Site(msgspec.Struct, frozen=True):
    """The service being loaded: its name, and the host and host file it is declared in."""

    host_name: str
    host_file: str
    address: str
    name: str

    @property
    def prefix(self) -> tuple[str, ...]:
        """Its table's key path in the host file."""
        return ("services", self.name)


class _Layers(msgspec.Struct, frozen=True):
    """The merged service and what the merge learned on the way."""

    merged: Merged
    sources: list[str]             # the host file, then the definition's file if it uses one
    def_file: str | None           # services/<def>.toml, for "not set here nor in ..." messages
    base_policy: RolloutPolicy     # the rollout policy without the host's own layer
    own_rollout: At | None         # the host's own `rollout` table, if it has one


class _Unit(msgspec.Struct, frozen=True):
    """The service's unit before rendering: its text (None: unusable, already reported), where
    problems in it are reported, and the source named in the header."""

    text: str | None
    at: At
    source: str


class ServiceLoader(msgspec.Struct):
    """Loads the services of every host of one revision, against its fleet.toml and definitions."""

    snap: SnapshotLike
    problems: Problems
    units: UnitFiles
    fleet: schema.FleetFile
    definitions: dict[str, schema.ServiceDefinition | None]
    groups: RolloutGroups

    def load(self, host_name: str, host_file: str, host: schema.HostFile, name: str,
             table: schema.ServiceTable) -> ServiceSpec | None:
        """Merge one service's layers, render it, and check everything that needs the host."""
        site = _Site(host_name, host_file, host.address, name)
        problems_before = self.problems.count
        layers = self._layers(site, table)
        if layers is None:
            return None
        unit = self._unit(site, layers)
        model = self._model(site, layers)
        # Placeholders: vars first (they may name host/service/model), then everything else.
        ctx = self._context(site, layers.merged, model)
        env = {k: self._render_value(site, v, at, ctx) for k, (v, at) in layers.merged.env.items()}
        model = self._fetch(site, layers.merged, model, ctx)
        health = self._health(site, layers.merged, ctx)
        drain, smoke = self._drain(site, layers.merged, ctx, health.get("http"))
        unit_text = self._render_unit(site, unit, ctx)
        if unit_text is None or self.problems.count != problems_before:
            return None
        return replace(self._spec(site, table, layers, unit_text, env, health, model), drain=drain, smoke=smoke)

    # -- the steps, in order --

    def _layers(self, site: _Site, table: schema.ServiceTable) -> _Layers | None:
        """fleet.toml < the definition it uses < the host's table; None when it cannot merge."""
        merged = Merged()
        merged.add_table("health", self.fleet.health, FLEET_FILE, ())
        merged.add_table("rollout", self.fleet.rollout, FLEET_FILE, ())
        sources = [site.host_file]
        def_file = None
        if table.use is not None:
            definition = self._definition(site, table.use)
            if definition is None:
                return None
            def_file = f"{SERVICES_DIR}/{table.use}.toml"
            sources.append(def_file)
            merged.add_layer(definition, def_file, ())
        if table.unit is not None and table.unit_file is not None:
            self.problems.add(site.host_file, dotted(*site.prefix, "unit"), "set either unit or unit_file, not both")
            return None
        base_policy = merged.policy()
        merged.add_layer(table, site.host_file, site.prefix)
        own_rollout = At(site.host_file, dotted(*site.prefix, "rollout")) if table.rollout is not None else None
        if own_rollout is not None and table.use is None:
            self.problems.add(own_rollout.file, own_rollout.key,
                "has no effect here: only a service that uses a shared definition (`use`) rolls out in "
                "waves over the hosts that share it; set rollout in services/<definition>.toml")
        return _Layers(merged, sources, def_file, base_policy, own_rollout)

    def _definition(self, site: _Site, use: str) -> schema.ServiceDefinition | None:
        """The definition a service uses; None when there is no such file (a problem) or it is
        invalid (its own problems are already reported)."""
        if use not in self.definitions:
            available = ", ".join(self.definitions) or "none"
            self.problems.add(site.host_file, dotted(*site.prefix, "use"),
                              f"unknown definition {use!r}: no services/{use}.toml (available: {available})")
            return None
        return self.definitions[use]

    def _unit(self, site: _Site, layers: _Layers) -> _Unit | None:
        """The unit file's text or the inline unit; None (with a problem) when neither is set."""
        merged = layers.merged
        if merged.unit_file is not None:
            path, at = merged.unit_file
            return _Unit(self.units.read(path, at), At(path, ""), path)
        if merged.unit is not None:
            text, at = merged.unit
            if at.file == site.host_file:  # a definition's inline unit was checked with the definition
                self.units.check_text(text, at)
            return _Unit(text, at, at.file)
        where = f" (here or in {layers.def_file})" if layers.def_file else ""
        self.problems.add(site.host_file, dotted(*site.prefix), f"no unit: set unit_file or unit{where}")
        return None

    def _model(self, site: _Site, layers: _Layers) -> ModelSpec | None:
        """The model: id and path are required once any model key is set, in any layer."""
        model = layers.merged.model
        if not model:
            return None
        missing = [k for k in ("id", "path") if k not in model]
        for k in missing:
            where = f" (not set here nor in {layers.def_file})" if layers.def_file else ""
            self.problems.add(site.host_file, dotted(*site.prefix, "model", k),
                              f"required key missing: a model needs id and path{where}")
        if missing:
            return None
        values: dict[str, Any] = {k: v for k, (v, _) in model.items() if k != "fetch"}  # each typed by the schema
        return ModelSpec(**values)

    def _context(self, site: _Site, merged: Merged, model: ModelSpec | None) -> Values:
        """What placeholders may name, with the service's vars rendered (vars may not name vars)."""
        ctx = Values(
            host={"name": site.host_name, "address": site.address},
            service={"name": site.name},
            model={"id": model.id, "path": model.path} if model else None,
            vars=None,
        )
        rendered_vars = {k: self._render_value(site, v, at, ctx) for k, (v, at) in merged.vars.items()}
        return Values(ctx.host, ctx.service, ctx.model, rendered_vars)

    def _fetch(self, site: _Site, merged: Merged, model: ModelSpec | None, ctx: Values) -> ModelSpec | None:
        """The model with its fetch command rendered, when it has one."""
        if model is None or "fetch" not in merged.model:
            return model
        template, at = merged.model["fetch"]
        return replace(model, fetch=self._render_value(site, str(template), at, ctx))

    def _health(self, site: _Site, merged: Merged, ctx: Values) -> dict[str, Any]:
        """The HealthSpec's fields: the CA bundle read from the repo, the URL rendered and checked."""
        values = {k: v for k, (v, _) in merged.health.items()}
        if "ca" in merged.health:
            ca_path, at = merged.health["ca"]
            values.pop("ca")
            values["ca_pem"] = read_ca_bundle(self.snap, self.problems, ca_path, at)
        if "http" in merged.health:
            template, at = merged.health["http"]
            url = self._render_value(site, template, at, ctx)
            if problem := url_problem(url):
                self._report(site, at, problem)
            values["http"] = url
        return values

    def _drain(self, site: _Site, merged: Merged, ctx: Values,
               health_url: str | None) -> tuple[DrainSpec | None, SmokeSpec | None]:
        """The drain and smoke test, rendered and checked across their layers (drain.py)."""
        # Not _render_value: a controller's stdin may span lines (every value here was checked
        # by the schema, and a placeholder renders no control character).
        render_at = functools.partial(self._render, site, ctx)
        report = functools.partial(self._report, site)
        return (drain_spec(merged.drain, merged.tables.get("drain"), health_url, render_at, report),
                smoke_spec(merged.smoke, merged.tables.get("smoke"), health_url, render_at, report))

    def _render_unit(self, site: _Site, unit: _Unit | None, ctx: Values) -> str | None:
        """The unit text as written on the host; None when there is no usable unit."""
        if unit is None or unit.text is None:
            return None
        rendered, unknown = render(unit.text, ctx)
        for line, why in unknown:
            where = f"line {line}: " if unit.at.key == "" else f"line {line} of the unit: "
            self._report(site, unit.at, where + why)
        return managed_unit(rendered, unit.source)

    def _spec(self, site: _Site, table: schema.ServiceTable, layers: _Layers, unit_text: str, env: dict[str, str],
              health: dict[str, Any], model: ModelSpec | None) -> ServiceSpec:
        """The finished service; it joins its definition's rollout group."""
        merged = layers.merged
        policy = merged.policy()
        if table.use is not None:
            floor = merged.rollout.get("min_available")
            self.groups.add(site.name, table.use, site.host_file, layers.own_rollout, policy, layers.base_policy,
                            floor[1] if floor is not None else None)
        return ServiceSpec(
            name=site.name,
            unit_text=unit_text,
            env=env,
            health=HealthSpec(**health),
            model=model,
            source=" + ".join(layers.sources),
            definition=table.use,
            rollout=policy,
            gpu_policy=merged.gpu_policy,
            engine_check=merged.engine_check,
            adopt=merged.adopt,
            allow_dropins=merged.allow_dropins,
            secrets=self._secrets(merged, env),
        )

    # -- helpers --

    def _report(self, site: _Site, at: At, message: str) -> None:
        """A problem at a value's file and key; one in a shared file also names this service and host."""
        use = Use(site.name, site.host_name) if at.file != site.host_file else None
        self.problems.add(at.file, at.key, message, use)

    def _render(self, site: _Site, ctx: Values, value: str, at: At) -> str:
        """Render placeholders in a value; each unknown one is a problem naming the key and the
        placeholder, never the value: env values may be secrets."""
        rendered, unknown = render(value, ctx)
        for _, why in unknown:
            self._report(site, at, why)
        return rendered

    def _render_value(self, site: _Site, value: str, at: At, ctx: Values) -> str:
        """Render placeholders in a one-line value (env, vars, health.http)."""
        rendered = self._render(site, ctx, value, at)
        if _CONTROL.search(rendered):  # impossible by validation; kept as the last line of defence
            self.problems.add(at.file, at.key, "renders to a value with a control character")
        return rendered

    def _secrets(self, merged: Merged, env: dict[str, str]) -> tuple[SecretSpec, ...]:
        """The service's secrets, checked: exactly one source each, an age file that exists and
        is an age file, no name that env sets too. Problems name file and key, never a value."""
        out = (self._secret(name, ref, at, env) for name, (ref, at) in sorted(merged.secrets.items()))
        return tuple(s for s in out if s is not None)

    def _secret(self, name: str, ref: schema.SecretRef, at: At, env: dict[str, str]) -> SecretSpec | None:
        if (ref.file is None) == (ref.age is None):
            self.problems.add(at.file, at.key, "set exactly one of file (a path on the host) and age "
                                               "(an encrypted file in this repo)")
            return None
        if name in env:
            self.problems.add(at.file, at.key, f"{name} is also set in env: a secret belongs in one place")
            return None
        if ref.file is not None:
            return SecretSpec(name, "file", ref.file, ref.env)
        assert ref.age is not None
        data = self.snap.read(ref.age)
        if data is None:
            self.problems.add(at.file, f"{at.key}.age", f"file {ref.age!r} not found in the repository")
            return None
        if not data.startswith(_AGE_MAGIC):
            self.problems.add(at.file, f"{at.key}.age", f"{ref.age!r} is not an age-encrypted file "
                              f"(make it with `reconcile secrets encrypt {name}`)")
            return None
        return SecretSpec(name, "age", ref.age, ref.env, ciphertext=data)
