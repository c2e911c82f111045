"""`python -m reconciler` and the `reconcile` command (its console script starts at `console`):
the command tree is imported with the collector off and then frozen out of its collections
(process.starting: all of it lives as long as the process), then the command runs."""

from .process import starting


def console() -> None:
    with starting():
        from .cli import console as run
    run()


if __name__ == "__main__":
    console()
