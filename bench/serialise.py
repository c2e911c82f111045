"""Benchmark: reading JSON back into the project's dataclasses, msgspec (the one serialiser) next
to cattrs (the alternative the choice was between) and json.loads alone (the floor: parsing, no
dataclasses). Two real inputs:

  cache entry    the example repo (desired-state/) loaded, as desired/cache.py keeps it
  record         a service record as plan/records.py writes it on a host

Each figure is the median of --rounds timings of --count reads in this process, after one read
untimed (msgspec reads a type's annotations once; cattrs generates its structuring code once per
class: in a new `reconcile` process that first read is paid every run, so it is printed too).
cattrs is not a dependency: install it to see its column (`pip install cattrs`).

    .venv/bin/python -m bench.serialise
    .venv/bin/python -m bench.serialise --count 200 --rounds 9
"""

from __future__ import annotations

import argparse
import base64
import json
import statistics
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import msgspec

from reconciler.desired import cache, load, source
from reconciler.plan.records import Pending, Quarantine, ServiceRecord

ROOT = Path(__file__).resolve().parent.parent


def inputs() -> dict[str, tuple[bytes, type, Callable[[bytes], Any]]]:
    """name -> (JSON bytes, the dataclass, how the code reads it with msgspec)."""
    snap = source.snapshot(source.open_repo(str(ROOT)), None, "desired-state")
    state = load.load_desired(snap)
    entry = cache.encode(cache.CacheEntry(cache.FORMAT, "t" * 40, "f" * 32, state))
    record = ServiceRecord(hash="a" * 64, revision="b" * 40, last_good_hash="c" * 64, last_good_revision="d" * 40,
                           quarantine=Quarantine("e" * 64, "f" * 40, "CrashLoop", quote="x" * 200, at=1_700_000_000),
                           pending=Pending("a" * 64, "b" * 40, at=1_700_000_001, started=True),
                           secrets={"HF_TOKEN": "age:" + "0" * 64}).dumps().encode()
    return {"cache entry": (entry, cache.CacheEntry, cache.decode),
            "record": (record, ServiceRecord, lambda raw: ServiceRecord.parse(raw.decode()))}


def timed(fn: Callable[[], object], count: int, rounds: int) -> tuple[float, float]:
    """(the first call, the median per call over rounds x count), in microseconds."""
    t0 = time.perf_counter()
    fn()
    first = (time.perf_counter() - t0) * 1e6
    per = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        for _ in range(count):
            fn()
        per.append((time.perf_counter() - t0) * 1e6 / count)
    return first, statistics.median(per)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--count", type=int, default=100)
    ap.add_argument("--rounds", type=int, default=7)
    args = ap.parse_args()
    try:
        import cattrs
        from cattrs.strategies import configure_union_passthrough
        converter: Any = cattrs.Converter()
        configure_union_passthrough(int | str | float | bool | None, converter)     # max_unavailable: int | str
        converter.register_structure_hook(bytes, lambda v, _t: base64.b64decode(v))     # msgspec writes base64
    except ImportError:
        converter = None
    print(f"reading JSON into dataclasses: first read, then median per read ({args.rounds} x {args.count})")
    print(f"{'input':14s} {'bytes':>8s}  {'json.loads':>18s}  {'msgspec':>20s}  {'cattrs (json + structure)':>26s}")
    for name, (raw, cls, ours) in inputs().items():
        floor = timed(lambda raw=raw: json.loads(raw), args.count, args.rounds)
        mine = timed(lambda raw=raw, ours=ours: ours(raw), args.count, args.rounds)
        cells = [f"{floor[1]:8.1f} us", f"{mine[0]:7.0f} / {mine[1]:7.1f} us"]
        if converter is not None:
            try:
                other = timed(lambda raw=raw, cls=cls: converter.structure(json.loads(raw), cls), args.count,
                              args.rounds)
                cells.append(f"{other[0]:9.0f} / {other[1]:8.1f} us")
            except Exception as e:      # a type cattrs cannot structure as it is configured here
                cells.append(f"({type(e).__name__})")
        else:
            cells.append("(not installed)")
        print(f"{name:14s} {len(raw):8d}  {cells[0]:>18s}  {cells[1]:>20s}  {cells[2]:>26s}")
    assert msgspec.json.decode(inputs()["cache entry"][0], type=cache.CacheEntry) is not None


if __name__ == "__main__":
    main()
