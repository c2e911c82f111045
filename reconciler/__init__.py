"""reconciler: GitOps for bare-metal GPU hosts.

Desired state (TOML in git) -> observe each host over SSH -> pure plan -> apply -> verify.
"""

import warnings

__version__ = "0.1.0"

# cryptography 51 deprecates DSA, and asyncssh, which still offers DSA keys, says so five times as
# it is imported: on the stderr of every run that connects. The reconciler uses no DSA key.
warnings.filterwarnings("ignore", message="DSA is deprecated", module=r"asyncssh\.")
