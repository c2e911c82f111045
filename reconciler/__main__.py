"""`python -m reconciler` runs the `reconcile` command."""

from .cli import console

console()
