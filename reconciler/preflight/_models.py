"""Model knowledge: what a service's model is (ModelInfo), from its config.json or the [[model]] tables.

With the model's config.json (read from the host): its architectures, model_type and traits
(a layer list with linear-attention / SSM layers means "hybrid"), plus the checkpoint's
quantization method. Without it (validate: no host access): the [[model]] tables of the rule
files, matched by model id and by the architecture the repo declares.
"""

from __future__ import annotations

import fnmatch
from collections.abc import Iterable, Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from ..desired.spec import ServiceSpec

if TYPE_CHECKING:
    from ._schema import ModelEntry

# Layer kinds that carry recurrent state (Gated DeltaNet / linear attention, Mamba SSM) in the
# layer lists of hybrid configs: Qwen3.5 / Qwen3-Next `layer_types`, Granite-4.0-H `layer_types`,
# Jamba `layers_block_type`, Nemotron-H `hybrid_override_pattern` ("M" = Mamba layer).
_RECURRENT_LAYER_KINDS = frozenset({"linear_attention", "mamba", "mamba2"})


class ModelInfo(msgspec.Struct, frozen=True):
    """What the checks know about a service's model, and how they know it."""

    id: str | None = None
    architectures: tuple[str, ...] = ()
    model_type: str | None = None
    traits: frozenset[str] = frozenset()
    why: dict[str, str] = msgspec.field(default_factory=dict)      # trait -> evidence, for messages
    known: bool = False              # False: no config.json and nothing in the table
    config: Mapping[str, Any] | None = None

    @property
    def label(self) -> str:
        """How messages name the model: its id, else its first architecture."""
        return self.id or (self.architectures[0] if self.architectures else "the model")


def _sections(config: Mapping[str, Any]) -> list[tuple[str, Mapping[str, Any]]]:
    out: list[tuple[str, Mapping[str, Any]]] = [("", config)]
    text = config.get("text_config")
    if isinstance(text, Mapping):
        out.append(("text_config.", text))
    return out


def text_config(config: Mapping[str, Any]) -> Mapping[str, Any]:
    """The language model's part of a config (text_config for multimodal wrappers)."""
    text = config.get("text_config")
    return text if isinstance(text, Mapping) else config


def _recurrent_layers(config: Mapping[str, Any]) -> str | None:
    """Evidence that a config.json describes a model with recurrent (linear/SSM) layers."""
    for prefix, section in _sections(config):
        for key in ("layer_types", "layers_block_type"):
            kinds = section.get(key)
            if isinstance(kinds, list):
                found = [k for k in kinds if isinstance(k, str) and k.lower() in _RECURRENT_LAYER_KINDS]
                if found:
                    names = "/".join(sorted(set(found)))
                    return f"config.json {prefix}{key} has {len(found)} of {len(kinds)} {names} layers"
        pattern = section.get("hybrid_override_pattern")
        if isinstance(pattern, str) and "M" in pattern:
            return f"config.json {prefix}hybrid_override_pattern has {pattern.count('M')} Mamba layers"
    return None


_WILDCARDS = frozenset("*?[")      # what makes an fnmatch pattern more than a name


def glob_any(value: str, patterns: Iterable[str]) -> str | None:
    """The first pattern (fnmatch, any case) the value matches. A pattern with no wildcard is
    compared as it is: most of the rule pack's names are plain, and fnmatch compiles each
    pattern to a regex the first time a process meets it."""
    low = value.lower()
    for p in patterns:
        pat = p.lower()
        if (low == pat) if _WILDCARDS.isdisjoint(pat) else fnmatch.fnmatchcase(low, pat):
            return p
    return None


def model_info(svc: ServiceSpec, config: Mapping[str, Any] | None, table: Iterable[ModelEntry]) -> ModelInfo:
    """What is known about the model of a service (pure).

    With the model's config.json (read from the host): its architectures and model_type, and
    its traits from the layer lists (an unknown architecture with linear_attention layers is
    still hybrid) and from the table. Without it: the table, by model id and by the
    architecture declared in the repo (model.architecture).
    """
    model_id = svc.model.id if svc.model else None
    why: dict[str, str] = {}      # trait -> its first evidence; the traits are its keys
    if config is not None:
        archs, model_type = _config_names(config)
        evidence = _recurrent_layers(config)
        if evidence:
            why["hybrid"] = evidence
        _table_traits(table, None, archs, model_type, why)
        return ModelInfo(id=model_id, architectures=tuple(archs), model_type=model_type,
                         traits=frozenset(why), why=why, known=True, config=config)
    declared = svc.model.architecture if svc.model else None
    archs_declared = [declared] if declared else []
    known = _table_traits(table, model_id, archs_declared, None, why)
    return ModelInfo(id=model_id, architectures=tuple(archs_declared), traits=frozenset(why),
                     why=why, known=known)


def _config_names(config: Mapping[str, Any]) -> tuple[list[str], str | None]:
    """A config.json's architectures (its own, then text_config's, each once) and its model_type
    (its own, else text_config's)."""
    archs: list[str] = []
    model_type = None
    for _, section in _sections(config):
        a = section.get("architectures")
        if isinstance(a, list):
            archs.extend(x for x in a if isinstance(x, str) and x not in archs)
        if model_type is None and isinstance(section.get("model_type"), str):
            model_type = section["model_type"]
    return archs, model_type


def _table_traits(table: Iterable[ModelEntry], model_id: str | None, archs: list[str], model_type: str | None,
                  why: dict[str, str]) -> bool:
    """Adds to `why` the traits of every [[model]] entry the model matches, each with the first
    evidence found for it; whether any entry matched."""
    known = False
    for entry in table:
        hit = _entry_match(entry, model_id, archs, model_type)
        if hit:
            known = True
            for t in entry.traits:
                why.setdefault(t, hit)
    return known


def _entry_match(entry: ModelEntry, model_id: str | None, archs: list[str], model_type: str | None) -> str | None:
    if model_id and (p := glob_any(model_id, entry.ids)):
        return f"model id matches {p}"
    for a in archs:
        if glob_any(a, entry.architectures):
            return f"architecture {a}"
    if model_type and glob_any(model_type, entry.model_types):
        return f"model_type {model_type}"
    return None


def checkpoint_quantization(config: Mapping[str, Any]) -> str | None:
    """quant_method of a checkpoint's quantization_config (or compression_config), if any."""
    for _, section in _sections(config):
        for key in ("quantization_config", "compression_config"):
            q = section.get(key)
            method = q.get("quant_method") if isinstance(q, Mapping) else None
            if isinstance(method, str) and method:
                return method.lower().replace("compressed_tensors", "compressed-tensors")
    return None
