"""Value types: a copy of one with some fields changed, whichever kind it is (base: pure).

The project's value types are msgspec Structs: a class is made in about 0.01 ms at import, where a
frozen dataclass takes about 0.5 ms (it compiles its methods), and a run imports over a hundred
of them; the host programs too (frames.HostProgram is a generic Struct). A few stay dataclasses:
the records kept on hosts (plan/records.py: their JSON is read leniently, field by field,
plan/lenient.py), and the types with fields left out of equality or repr (a secret's ciphertext,
a result's facts).
`replace` serves both, so a caller need not know which one it holds.
"""

from __future__ import annotations

import dataclasses
from typing import Any, TypeVar

import msgspec

T = TypeVar("T")


def replace(obj: T, /, **changes: Any) -> T:
    """A copy of the value `obj` with `changes` (field name -> value); TypeError for a name it
    has no field of."""
    if isinstance(obj, msgspec.Struct):
        return msgspec.structs.replace(obj, **changes)
    return dataclasses.replace(obj, **changes)  # type: ignore[type-var]
