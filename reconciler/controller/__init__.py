"""The long-running side: the daemon (`reconcile watch`), the git hooks, the state store, metrics,
the fleet page, git notes and forge statuses."""
