"""PURE: load progress, what the engine says in its journal while it starts (checkpoint shards,
CUDA graphs, its ready line), and the bounded read of its new lines (reconciler/sh/progress.sh).

`advance`: journal lines in, a `LoadProgress` out (the stage, done/total, the line it was read
from). `JournalTail` reads, per invocation of a service being started, its own processes' lines
after a cursor: at most LINES lines and MAX_BYTES bytes per service and read. The follower that
keeps the cursors and rides on the health watch's tick is host/progress.py's.

The formats are the engines' own, copied from their sources:

- SGLang 0.5.12 and 0.5.23 (sglang/srt/model_executor/model_runner.py: "Load weight begin.
  avail mem=...", "Load weight end. elapsed=..."; 0.5.12 model_runner.py "Capture cuda graph
  begin. This can take up to several minutes. ...", "Capture cuda graph end. Time elapsed: ...";
  0.5.12 cuda_graph_runner.py "Capture cuda graph bs [...]" and its tqdm bar "Capturing batches
  (bs=... avail_mem=... GB)"; 0.5.23 model_runner_components/cuda_graph_setup.py "Capture target
  decode CUDA graph begin. ..." / "... end. ..."; model_loader/weight_utils.py the tqdm bar
  "Loading safetensors checkpoint shards:  50% Completed | 2/4 [...]" with utils/common.py's
  BAR_FORMAT; entrypoints/http_server.py "The server is fired up and ready to roll!").
- vLLM 0.33.0 (model_executor/model_loader/weight_utils.py: the same shard bar, its _BAR_FORMAT
  ending in a newline; default_loader.py "Loading weights took ... seconds";
  v1/worker/gpu_model_runner.py "Starting to load model ...", "Model loading took ...",
  "Capturing CUDA graphs (decode, FULL): ...%|...| n/N" and "Graph capturing finished in ...";
  uvicorn's "Application startup complete.").

What journald makes of a tqdm bar (measured on a test host, systemd 252): it splits records at
newlines only, so a bar redrawn with carriage returns (SGLang's BAR_FORMAT and tqdm's default
have no newline) is stored as one record when the bar ends, or when another line of the same
stream follows; vLLM's shard bar ends each redraw with a newline, one record each. A record
is read as its carriage-return segments, in order.

Its lines are data (review N5, N6): every count is at most COUNT_DIGITS ASCII digits (a
400-digit shard count is no count: the line says nothing), a bar whose count is past its total
says nothing either, and the percentage is integer arithmetic; a line is redacted whole before
anything cuts it (host/progress.py `take`; progress.sh drops the word its own cut went through).
`advance` never raises.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Iterable, Mapping
from typing import ClassVar

import msgspec

from ...frames import HostProgram, Param, Records

WEIGHTS, GRAPHS, READY = "weights", "graphs", "ready"
LINES = 200               # progress.sh: lines per service and read
LINE_MAX = 2000           # progress.sh: bytes kept of a line (its end)
MAX_BYTES = 32768         # progress.sh: bytes per service and read
QUOTE_MAX = 240           # characters of the line a progress quotes
COUNT_DIGITS = 6          # the most digits of a count taken (done, total): a longer one is no count


class LoadProgress(msgspec.Struct, frozen=True):
    """Where the engine's start-up is, by its own lines: the stage, how far (done of total, where
    the engine counts), whether the stage's end line was seen, and the line it was read from."""

    stage: str                     # WEIGHTS | GRAPHS | READY
    done: int | None = None
    total: int | None = None
    finished: bool = False
    line: str = ""

    def percent(self) -> int | None:
        """done of total in percent, rounded as round() does (half to even), in integers: no
        float, so no count can overflow it."""
        if self.done is None or self.total is None or self.total <= 0 or self.done < 0:
            return None
        q, r = divmod(100 * self.done, self.total)
        if 2 * r > self.total or (2 * r == self.total and q % 2):
            q += 1
        return min(100, q)

    def text(self) -> str:
        """In words, as the progress views show it (the health phase while the engine loads)."""
        if self.stage == READY:
            return "engine ready"
        if self.stage == WEIGHTS:
            if self.finished:
                return "weights loaded" + (f" ({self.total} checkpoint shards)" if self.total else "")
            if self.done is not None and self.total:
                return f"loading weights: {self.done}/{self.total} checkpoint shards ({self.percent()}%)"
            return "loading weights"
        if self.finished:
            return "CUDA graphs captured"
        if self.done is not None and self.total:
            return f"capturing CUDA graphs: {self.done}/{self.total} ({self.percent()}%)"
        return "capturing CUDA graphs" + (f" ({self.total} batch sizes)" if self.total else "")

    def to_json(self) -> dict[str, object]:
        return {"stage": self.stage, "done": self.done, "total": self.total, "finished": self.finished,
                "percent": self.percent(), "text": self.text(), "line": self.line}


Progressed = Callable[[str, "LoadProgress"], None]   # (service, its load progress): told of each change


# What each line says: (stage, what of it, pattern): a bar's count, the stage's beginning or end,
# the number of CUDA graph batch sizes. A record may hold several (carriage-return redraws, or
# a bar followed by another process's line): every match counts, in the order of the text.
_COUNT = rf"([0-9]{{1,{COUNT_DIGITS}}})"
_BAR_TAIL = rf":\s*[0-9]{{1,4}}%(?: Completed \||\|[^|\r\n]*\|)\s*{_COUNT}/{_COUNT}(?![0-9])"
_RULES: tuple[tuple[str, str, re.Pattern[str]], ...] = (
    (WEIGHTS, "bar", re.compile(r"[Ll]oading (?:safetensors|pt|np_cache)[^:\r\n]*" + _BAR_TAIL)),
    (GRAPHS, "bar", re.compile(r"(?:Capturing batches \([^)\r\n]*\)|Capturing CUDA graphs(?: \([^)\r\n]*\))?)"
                               + _BAR_TAIL)),
    (WEIGHTS, "begin", re.compile(r"\bLoad weight begin\b|\bStarting to load model\b")),
    (WEIGHTS, "end", re.compile(r"\bLoad weight end\b|\bLoading weights took [0-9.]{1,32} s|\bModel loading took\b")),
    (GRAPHS, "sizes", re.compile(r"\bCapture cuda graph bs \[([0-9, ]{0,1000})\]")),
    (GRAPHS, "begin", re.compile(r"\bCapture [\w -]{0,60}? begin\b")),
    (GRAPHS, "end", re.compile(r"\bCapture [\w -]{0,60}? end\. |\bGraph capturing finished in\b")),
    (READY, "begin", re.compile(r"The server is fired up and ready to roll!|\bApplication startup complete\.")),
)


def _quote(segment: str, start: int, what: str) -> str:
    """The words a progress quotes: a bar from its name to its closing bracket (not what another
    process appended), a log line whole; stripped and bounded (its start kept: what `take` hands
    `advance` was redacted whole before this cut)."""
    text = segment[start:] if what == "bar" else segment
    if what == "bar" and "]" in text:
        text = text[:text.index("]") + 1]
    return text.strip()[:QUOTE_MAX]


def _step(before: LoadProgress | None, stage: str, what: str, m: re.Match[str], quote: str) -> LoadProgress:
    """One recognised line on top of what was known: counts carry within a stage."""
    if what == "bar":
        return LoadProgress(stage, int(m.group(1)), int(m.group(2)), line=quote)
    if what == "sizes":
        sizes = [s for s in m.group(1).replace(" ", "").split(",") if s]
        return LoadProgress(stage, None, len(sizes) or None, line=quote)
    if what == "end" and before is not None and before.stage == stage:
        return LoadProgress(stage, before.done, before.total, True, quote)
    return LoadProgress(stage, finished=what == "end", line=quote)


def advance(before: LoadProgress | None, lines: Iterable[str]) -> LoadProgress | None:
    """PURE: the progress after these journal lines (oldest first), from `before` (None: nothing
    seen yet). The latest line the engine wrote decides the stage; lines that say nothing about
    the load leave it as it was."""
    now = before
    for record in lines:
        for segment in record.split("\r"):
            hits = sorted((m.start(), i, m) for i, (_, _, pat) in enumerate(_RULES) for m in pat.finditer(segment))
            for start, i, m in hits:
                stage, what, _ = _RULES[i]
                if what == "bar" and int(m.group(1)) > int(m.group(2)):
                    continue            # past its total: no count we take
                now = _step(now, stage, what, m, _quote(segment, start, what))
    return now


# -- the journal read: a host program and its parser -------------------------------------------

_CURSOR = re.compile(r"-- cursor: (s=[0-9a-f]{1,32};i=[0-9a-f]{1,32};b=[0-9a-f]{1,32};m=[0-9a-f]{1,32};"
                     r"t=[0-9a-f]{1,32};x=[0-9a-f]{1,32})")


Tail = dict[str, tuple[list[str], "str | None"]]     # invocation -> (its new lines, the cursor after them)


class JournalTail(HostProgram[Tail], frozen=True):
    """reconciler/sh/progress.sh for (invocation, cursor) pairs: each invocation's lines after
    its cursor (None: its last LINES lines)."""

    name: ClassVar[str] = "progress"
    constants: ClassVar[Mapping[str, str]] = {"LINES": str(LINES), "LINE_MAX": str(LINE_MAX),
                                              "MAX_BYTES": str(MAX_BYTES)}
    reads: tuple[tuple[str, str | None], ...]

    def params(self) -> Mapping[str, Param]:
        return {"read": [f"{invocation} {cursor or '-'}" for invocation, cursor in self.reads]}

    def parse(self, answer: Records) -> Tail:
        return parse_tail(answer.stdout, answer.token)


def parse_tail(stdout: str, token: str) -> Tail:
    """PURE: progress.sh's answer -> {invocation: (its new lines, the cursor after them)}.
    journalctl's own cursor line is the last line of an invocation's section; a line of the
    service that looks like one is only a line."""
    out: dict[str, tuple[list[str], str | None]] = {}
    current: list[str] | None = None
    for f in Records(stdout, token):
        if f.kind == "U":
            current = []
            out[f.payload] = (current, None)
        elif f.kind == "L" and current is not None:
            current.append(f.payload)
    for inv, (lines, _) in list(out.items()):
        m = _CURSOR.fullmatch(lines[-1]) if lines else None
        out[inv] = (lines[:-1], m.group(1)) if m else (lines, None)
    return out


