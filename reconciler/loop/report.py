"""Human output: per-host diffs and actions, one-line summaries, the result table.

Printing only; all content comes from the plan and the results. Plain text when not a TTY.

Every text that comes from a run (diffs, messages, notes, journal quotes, store rows) is
redacted here, before rich lays it out: a table cell cut to its width or a wrapped line would
otherwise hide a secret from the redacting writer under the console (cli.py, daemon.py), which
masks whatever is left. Its control characters are shown as escapes (`\x1b`), never written raw:
a journal line, a host record or a commit subject must not drive the operator's terminal (and the
daemon's run log, written from here, is what `git push -o reconcile.wait` streams).
"""

from __future__ import annotations

import os
import re
from collections import Counter
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, TextIO

if TYPE_CHECKING:
    from rich.console import Console
    from rich.progress import TaskID

from ..errors import ConfigError
from ..plan.gpuhealth import GPU_FAULT
from ..plan.records import Result
from ..plan.rollout import RolloutResult
from ..reasons import Reason
from ..redact import escape_controls, redact
from .forecasts import host_lines, rollout_line
from .results import FleetResult, HostResult


def _t(text: object, plain: bool = False) -> str:
    """Text from a run, redacted, its control characters made visible (a journal line's ESC
    must not drive the terminal it is shown on), and escaped for rich markup unless `plain`."""
    safe = escape_controls(redact(str(text)))
    return safe if plain else escape_markup(safe)


# rich's markup tags, with the backslashes before them (rich.markup's own pattern)
_TAGS = re.compile(r"(\\*)\[([a-z#/@][^[]*?)]")


def escape_markup(text: str) -> str:
    """rich.markup.escape, without importing rich: every tag-like "[...]" escaped (and the
    backslashes before it doubled), and a lone trailing backslash doubled."""
    text = _TAGS.sub(lambda m: f"{m.group(1)}{m.group(1)}\\[{m.group(2)}]", text)
    return text + "\\" if text.endswith("\\") and not text.endswith("\\\\") else text


def strip_markup(text: str) -> str:
    """rich markup as the text rich writes without style: tags dropped, escaped ones (an odd
    number of backslashes before them) kept as text with half the backslashes, and a "\\["
    outside a tag written as "[" (rich.markup.render's rules, emoji codes left as they are)."""
    out, position = [], 0
    for m in _TAGS.finditer(text):
        out.append(text[position:m.start()].replace("\\[", "["))
        slashes, escaped = divmod(len(m.group(1)), 2)
        out.append("\\" * slashes + (f"[{m.group(2)}]" if escaped else ""))
        position = m.end()
    out.append(text[position:].replace("\\[", "["))
    return "".join(out)


def writes_plain(file: Any) -> bool:
    """Whether rich would write plain text to `file`: not a terminal, and neither FORCE_COLOR nor
    TTY_COMPATIBLE=1 makes it act as one (rich.console.Console's own test)."""
    if os.environ.get("FORCE_COLOR") or os.environ.get("TTY_COMPATIBLE") == "1":
        return False
    try:
        return not file.isatty()
    except (AttributeError, ValueError, OSError):
        return True


class PlainConsole:
    """The part of a rich Console the CLI's output uses, for a log, a pipe or CI, where rich
    would write plain text anyway: markup is stripped, nothing is wrapped, and rich (its import
    and its layout, tens of milliseconds of every run) is not needed. Anything but text (a rich
    renderable) is handed to a rich Console on the same file."""

    is_terminal = False
    color_system = None

    def __init__(self, file: TextIO, width: int):
        self.file, self.width = file, width

    def print(self, *objects: Any, sep: str = " ", end: str = "\n", markup: bool | None = None,
              highlight: bool | None = None, soft_wrap: bool | None = None) -> None:
        if all(isinstance(o, str) for o in objects):
            text = escape_controls(sep.join(objects))     # a log or a pipe may end on a terminal
            self.file.write((text if markup is False else strip_markup(text)) + end)
            return
        from rich.console import Console
        Console(file=self.file, width=self.width, highlight=False).print(
            *objects, sep=sep, end=end, markup=markup, highlight=highlight, soft_wrap=soft_wrap)


def _plain(console: Console) -> bool:
    """Whether rich would lay this console's output out as plain text anyway (a log, a pipe, CI:
    not a terminal, no colour): it is then written as it is, without rich's layout per call
    (about 5 ms a line; 0.25 s of a 10-host converge's controller CPU was printing)."""
    return not console.is_terminal and console.color_system is None


def _say(console: Console, lines: list[str], plain: bool, soft_wrap: bool = False) -> None:
    """Lines built for `plain` (text) or not (markup), in one write or one print."""
    if plain:
        console.file.write("\n".join(lines) + "\n")
    else:
        console.print("\n".join(lines), highlight=False, soft_wrap=soft_wrap)


def _style(style: str, text: str, plain: bool) -> str:
    return text if plain or not style else f"[{style}]{text}[/]"


_STYLE = {"in-sync": "green", "converged": "green", "would-change": "yellow", "failed": "bold red",
          "rolled-back": "bold yellow", "quarantined": "yellow"}


def print_host(console: Console, r: HostResult, dry_run: bool) -> None:
    """Diffs and actions with reasons for one host that has changes (or failed): one print of
    all its lines (rich's cost is per call; a fleet of hosts printed line by line adds up)."""
    if r.plan is None or not r.plan.visible:
        return
    verb = ("would change" if dry_run else "changes") if r.plan.changes else "holds"
    plain = _plain(console)
    lines = [_style("bold", f"── {_t(r.host, plain)} ({_t(r.address, plain)}) {verb} at {r.plan.revision[:7]}", plain)]
    for a in r.plan.actions:        # each diff coloured by kind of line
        for line in (a.diff or "").rstrip("\n").splitlines():
            style = ("bold" if line.startswith(("---", "+++")) else "green" if line.startswith("+")
                     else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "")
            lines.append("    " + _style(style, _t(line, plain), plain))
    lines += [f"  • {_t(a.describe(), plain)}" for a in r.plan.visible]
    if dry_run:
        lines += [_t(line, plain) for line in host_lines(r)]
    _say(console, [*lines, ""], plain)


def print_result(console: Console, res: FleetResult, shown: set[str] | frozenset[str] = frozenset(),
                 in_sync_rows: bool = True) -> None:
    """Everything a person needs after a run: per-host detail (but for the hosts in `shown`,
    whose plan was printed as it was applied), then the table and a total. Without
    `in_sync_rows` (the daemon, every interval), the table lists only the hosts that are not in
    sync, and the total counts the rest: a no-change round of 1,000 hosts is one line."""
    for r in res.hosts:
        if r.host not in shown:
            print_host(console, r, res.dry_run)
    print_events(console, res)
    print_rollouts(console, res)
    listed = [r for r in res.hosts if in_sync_rows or r.status != Result.IN_SYNC]
    if listed:
        _table(console, res, listed)
    parts = ", ".join(f"{n} {s}" for s, n in sorted(Counter(r.status for r in res.hosts).items()))
    _say(console, [f"{len(res.hosts)} host{'s' * (len(res.hosts) != 1)}: {parts}; exit {res.exit_code()}"],
         _plain(console))


def plain_table(title: str, columns: tuple[str, ...], rows: Sequence[tuple[str, ...]],
                width: dict[str, int] | None = None) -> list[str]:
    """A table as aligned plain-text lines (what a log or a pipe gets): the title, the header,
    a rule and one line per row; a column in `width` is cut to it with an ellipsis."""
    cut = width or {}
    rows = [tuple(v if len(v) <= cut.get(c, len(v)) else v[:max(0, cut[c] - 1)] + "…"
                  for c, v in zip(columns, row, strict=True)) for row in rows]
    sizes = [max([len(c)] + [len(row[i]) for row in rows]) for i, c in enumerate(columns)]

    def line(cells: tuple[str, ...]) -> str:
        return "  ".join(v.ljust(n) for v, n in zip(cells, sizes, strict=True)).rstrip()
    return [title, line(columns), "  ".join("-" * n for n in sizes), *(line(row) for row in rows)]


def _table(console: Console, res: FleetResult, hosts: list[HostResult]) -> None:
    plain = _plain(console)
    title = f"revision {res.revision[:7]}{' (dry run: nothing changed)' if res.dry_run else ''}"
    # A long detail must not squeeze the other columns to nothing: cap it at what they leave.
    others = sum(max([len(col)] + [len(v) for v in values]) for col, values in (
        ("host", [r.host for r in hosts]), ("address", [r.address for r in hosts]),
        ("result", [r.status for r in hosts]), ("time", ["000.00s"])))
    rows = [(_t(r.host, plain), _t(r.address, plain), _style(_STYLE.get(r.status, ""), str(r.status), plain),
             _t(f"{r.reason}: {r.message}" if r.reason else r.plan.summary() if r.plan else "", plain),
             f"{r.seconds:.2f}s") for r in hosts]
    _print_table(console, title, ("host", "address", "result", "detail", "time"), rows,
                 cut={"detail": max(20, console.width - others - 16)})
    reasons = [f"{_t(r.host, plain)}: {_t(r.reason, plain)}: {_t(r.message or '', plain)}" for r in hosts if r.reason]
    if reasons:
        _say(console, reasons, plain, soft_wrap=True)


def print_config_error(console: Console, err: ConfigError, where: str) -> None:
    console.print(f"[bold red]error:[/] invalid desired state at {_t(where)} "
                  f"({len(err.problems)} problem{'s' * (len(err.problems) != 1)}); nothing was applied",
                  highlight=False)
    for p in err.problems:
        console.print(f"  {_t(p)}", highlight=False, soft_wrap=True)


class PhaseView:
    """Per host and service: the phase and elapsed/timeout while health waits run.

    A rich progress display on a terminal; plain lines on phase changes otherwise. With `plans`
    (the console the report goes to), each host's diff and actions are printed the moment it is
    about to apply them (`planned`), so they come before its health progress, not after.
    """

    def __init__(self, console: Console, plans: Console | None = None):
        self.console = console
        self.plans = plans
        self.shown: set[str] = set()
        self.live = console.is_terminal
        self.plain = _plain(console)
        self.last: dict[tuple[str, str], str] = {}
        self.progress = None
        self.tasks: dict[tuple[str, str], TaskID] = {}
        if self.live:
            from rich.progress import BarColumn, Progress, TextColumn
            self.progress = Progress(TextColumn("{task.description}"), BarColumn(),
                                     TextColumn("{task.fields[clock]}"), console=console, transient=True)

    def __enter__(self) -> PhaseView:
        if self.progress:
            self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        if self.progress:
            self.progress.stop()

    def planned(self, r: HostResult) -> None:
        """A host's plan, just before it is applied: its diffs and actions, printed once."""
        if self.plans is None or r.plan is None or not r.plan.changes or r.host in self.shown:
            return
        self.shown.add(r.host)
        # On a terminal the progress display owns the screen: print through it (above the bars).
        out = self.progress.console if self.progress is not None else self.plans
        print_host(out, r, dry_run=False)

    def __call__(self, host: str, service: str, phase: str, elapsed: float, timeout: float) -> None:
        key = (host, service)
        clock = f"{elapsed:5.1f}s / {timeout:.0f}s"
        if self.progress is not None:
            desc = f"{_t(host)} {_t(service)}: {_t(phase)}"
            if key not in self.tasks:
                self.tasks[key] = self.progress.add_task(desc, total=timeout, clock=clock)
            self.progress.update(self.tasks[key], description=desc, completed=min(elapsed, timeout), clock=clock)
        elif self.last.get(key) != phase:
            self.last[key] = phase
            p = self.plain
            _say(self.console, [f"[{elapsed:6.1f}s] {_t(host, p)} {_t(service, p)}: {_t(phase, p)}"], p)


def print_events(console: Console, res: FleetResult) -> None:
    """Health outcomes, rollbacks and quarantines, with the journal line that explains each failure."""
    plain = _plain(console)
    lines: list[str] = []
    for r in res.hosts:
        lines += [_style("dim", f"{_t(r.host, plain)}: {_t(n, plain)}", plain) for n in r.notes]
        for e in r.events:
            if e.outcome is None:
                lines.append(f"{_t(r.host, plain)} {_t(e.service, plain)}: {_t(e.note, plain)}")
                continue
            o = e.outcome
            head = f"{r.host} {e.service} ({e.action} {e.revision[:7]}): {o.reason}"
            style = "green" if o.healthy else "bold red"
            lines.append(f"{_style(style, _t(head, plain), plain)} {_t(o.message, plain)}")
            if not o.healthy and o.quote:
                lines.append(f"    journal: {_t(o.quote, plain)}")
    if lines:      # one print; notes and quotes are never wrapped mid-line
        _say(console, lines, plain, soft_wrap=True)


def print_status(console: Console, rows: list[dict], live: str | None = None) -> None:
    """The status table: from the local store, or (live = the revision's short SHA) from the
    hosts' records, with systemd's ActiveState/SubState as one more column."""
    title = (f"fleet status at {live} (live, from the hosts' records)" if live
             else "fleet status (from the local state store)")
    cols = ("host", "service", "desired", "running", "health", *(("systemd",) if live else ()), "last event")
    plain = _plain(console)
    lines = []
    for r in rows:
        event = r["last_event"] + (f" — {r['quote']}" if r.get("quote") else "")
        systemd = "/".join(x for x in (r.get("active_state"), r.get("sub_state")) if x) or "-"
        lines.append((_t(r["host"], plain), _t(r["service"], plain), (r["desired_rev"] or "")[:7],
                      (r["running_rev"] or "-")[:7], _t(r["health"] or "-", plain),
                      *((_t(systemd, plain),) if live else ()), _t(event, plain)))
    _print_table(console, title, cols, lines)


def _print_table(console: Console, title: str, columns: tuple[str, ...], rows: Sequence[tuple[str, ...]],
                 cut: dict[str, int] | None = None) -> None:
    """Rows built for `_plain(console)`: aligned text, or a rich table. `cut`: columns kept to
    one line of at most that width, ending in an ellipsis."""
    if _plain(console):
        _say(console, plain_table(title, columns, rows, cut), True)
        return
    from rich.table import Table
    cut = cut or {}
    table = Table(title=title, title_justify="left")
    for col in columns:
        table.add_column(col, overflow="ellipsis", no_wrap=col in cut, max_width=cut.get(col))
    for row in rows:
        table.add_row(*row)
    console.print(table)


def print_history(console: Console, host: str, rows: list[dict]) -> None:
    import datetime as _dt
    plain = _plain(console)
    lines = []
    for r in rows:
        when = _dt.datetime.fromtimestamp(r["at"]).strftime("%Y-%m-%d %H:%M:%S")
        detail = r["quote"] or r["message"] or ""
        lines.append((when, _t(r["service"], plain), _t(r["action"], plain), r["revision"][:7],
                      _t(r["result"], plain), _t(detail, plain), f"{r['seconds']:.1f}s"))
    _print_table(console, f"history of {_t(host, plain)}", ("when", "service", "action", "revision", "result",
                                                             "detail", "time"), lines)


def print_rollouts(console: Console, res: FleetResult) -> None:
    """Per rollout group: the waves and their hosts (dry run), or how far it got and where it
    halted, with the journal line that explains the halt. Then any warnings (webhook)."""
    for ro in res.rollouts:
        p = ro.plan
        head = (f"rollout of {p.group.service} (services/{p.group.definition}.toml) at {res.revision[:7]}: "
                f"{len(p.pending)} of {len(p.members)} hosts restart, {p.policy.describe()} "
                f"(at most {p.bound} at once)")
        console.print(f"[bold]{_t(head)}[/]", highlight=False)
        for w in p.waves:
            mark = "" if res.dry_run else _wave_mark(ro, w.number)
            console.print(f"  wave {w.number}{' (canary)' if w.canary else ''}: {_t(', '.join(w.hosts))}{mark}",
                          highlight=False)
        for said in ro.budget:
            console.print(f"  budget: {_t(said)}", highlight=False)
        if res.dry_run and (line := rollout_line(ro, res.hosts)) is not None:
            console.print(f"  {_t(line)}", highlight=False)
        _print_rollout_end(console, ro, res.revision)
        if ro.skipped:
            console.print(f"  skipped (could not be observed): {_t(', '.join(ro.skipped))}", highlight=False)
        if ro.excused:
            console.print(f"  not counted against it (GpuFault: the host's GPUs, not the change): "
                          f"{_t(', '.join(ro.excused))}", highlight=False)
    if res.rollouts:
        console.print()
    for warning in res.warnings:
        console.print(f"[yellow]warning:[/] {_t(warning)}", highlight=False)


def _wave_mark(ro: RolloutResult, number: int) -> str:
    """Where a run's rollout left this wave: halted here, not started, done, or nothing."""
    if ro.halted_wave == number:
        return "  halted here"
    if ro.halted_wave is not None and number > ro.halted_wave:
        return "  not started"
    return "  done" if number <= ro.waves_done else ""


def _print_rollout_end(console: Console, ro: RolloutResult, revision: str) -> None:
    """How the rollout ended: blocked by its budget, halted (where, why, the journal line, the
    hosts left quarantined), or done."""
    p = ro.plan
    if ro.reason == Reason.BUDGET_BLOCKED:
        console.print(f"  [bold red]{_t(ro.reason)}: {_t(ro.message or '')}[/]", highlight=False)
    elif ro.status == "halted":
        console.print(f"  [bold red]halted at {_t(ro.halted_at or '?')} (wave {ro.halted_wave}"
                      f"{', canary' if p.waves[(ro.halted_wave or 1) - 1].canary else ''}): "
                      f"{_t(ro.reason or '')}[/]", highlight=False)
        if ro.quote:
            console.print(f"    journal: {_t(ro.quote)}", highlight=False)
        if ro.reason == GPU_FAULT and ro.message:     # why a GPU fault counted this time
            console.print(f"    {_t(ro.message)}", highlight=False)
        if ro.untouched:
            console.print(f"  not restarted, quarantined at {revision[:7]}: {_t(', '.join(ro.untouched))}",
                          highlight=False)
    elif ro.status == "done":
        console.print(f"  [green]done: {len(p.pending)} hosts in {len(p.waves)} waves, {ro.seconds:.1f}s[/]",
                      highlight=False)
