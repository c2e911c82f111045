"""Human output: per-host diffs and actions, one-line summaries, the result table.

Printing only; all content comes from the plan and the results. Plain text when not a TTY.
"""

from __future__ import annotations

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .errors import ConfigError
from .reconcile import FleetResult, HostResult

_STYLE = {"in-sync": "green", "converged": "green", "would-change": "yellow", "failed": "bold red"}


def print_diff(console: Console, diff: str) -> None:
    for line in diff.rstrip("\n").splitlines():
        style = ("bold" if line.startswith(("---", "+++")) else "green" if line.startswith("+")
                 else "red" if line.startswith("-") else "cyan" if line.startswith("@@") else "")
        console.print(f"    [{style}]{escape(line)}[/]" if style else f"    {escape(line)}", highlight=False)


def print_host(console: Console, r: HostResult, dry_run: bool) -> None:
    """Diffs and actions with reasons for one host that has changes (or failed)."""
    if r.plan is None or not r.plan.changes:
        return
    verb = "would change" if dry_run else "changes"
    console.print(f"[bold]── {escape(r.host)} ({escape(r.address)}) {verb} at {r.plan.revision[:7]}[/]", highlight=False)
    for a in r.plan.actions:
        if a.diff:
            print_diff(console, a.diff)
    for a in r.plan.actions:
        console.print(f"  • {escape(a.describe())}", highlight=False)
    console.print()


def print_result(console: Console, res: FleetResult) -> None:
    """Everything a person needs after a run: per-host detail, then the table and a total."""
    for r in res.hosts:
        print_host(console, r, res.dry_run)
    table = Table(title=f"revision {res.revision[:7]}{' (dry run: nothing changed)' if res.dry_run else ''}",
                  title_justify="left")
    for col in ("host", "address", "result", "detail", "time"):
        table.add_column(col)
    for r in res.hosts:
        detail = (f"{r.reason}: {r.message}" if r.status == "failed"
                  else r.plan.summary() if r.plan else "")
        table.add_row(r.host, r.address, f"[{_STYLE.get(r.status, '')}]{r.status}[/]", escape(detail),
                      f"{r.seconds:.2f}s")
    console.print(table)
    counts: dict[str, int] = {}
    for r in res.hosts:
        counts[r.status] = counts.get(r.status, 0) + 1
    parts = ", ".join(f"{n} {s}" for s, n in sorted(counts.items()))
    console.print(f"{len(res.hosts)} host{'s' * (len(res.hosts) != 1)}: {parts}; exit {res.exit_code()}", highlight=False)


def print_config_error(console: Console, err: ConfigError, where: str) -> None:
    console.print(f"[bold red]error:[/] invalid desired state at {escape(where)} "
                  f"({len(err.problems)} problem{'s' * (len(err.problems) != 1)}); nothing was applied", highlight=False)
    for p in err.problems:
        console.print(f"  {escape(str(p))}", highlight=False)
