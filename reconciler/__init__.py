"""reconciler: GitOps for bare-metal GPU hosts.

Desired state (TOML in git) -> observe each host over SSH -> pure plan -> apply -> verify.
"""

__version__ = "0.1.0"
