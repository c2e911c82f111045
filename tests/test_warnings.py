"""What a run prints on stderr besides its own lines: no dependency's deprecation it cannot act on."""

from __future__ import annotations

import subprocess
import sys

# A process that imports reconciler, as every run does, then sees each message issued from a module
# (as cryptography's CryptographyDeprecationWarning is issued: a UserWarning, shown by default).
SHOW = """
import sys, warnings
import reconciler
class Deprecated(UserWarning):
    pass
for module, message in zip(sys.argv[1::2], sys.argv[2::2]):
    warnings.warn_explicit(message, Deprecated, module.replace(".", "/") + ".py", 32, module=module)
"""
DSA = "DSA is deprecated and support will be removed in a future release. Use a more modern signature algorithm."


def _stderr(*pairs: str) -> str:
    return subprocess.run([sys.executable, "-c", SHOW, *pairs], capture_output=True, text=True, timeout=60,
                          check=True).stderr


def test_asyncssh_importing_dsa_under_cryptography_51_is_not_said_on_every_run():
    assert _stderr("asyncssh.crypto.misc", DSA, "asyncssh.crypto.dsa", DSA) == ""


def test_other_warnings_still_show():
    err = _stderr("asyncssh.connection", "something else is deprecated", "reconciler.host.transport", DSA)
    assert "Deprecated: something else is deprecated" in err
    assert f"Deprecated: {DSA}" in err
