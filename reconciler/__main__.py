"""`python -m reconciler` runs the `reconcile` command."""

from .entry import console

console()
