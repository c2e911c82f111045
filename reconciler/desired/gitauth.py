"""How a fetch (or pull mode's push of its notes) of a repo URL authenticates, and whom it trusts:
the pygit2 RemoteCallbacks every network operation of the reconciler passes (review N9a). For
users: docs/pull.md ("Over SSH", "Over https") and docs/usage.md.

- **The server.** Over SSH its host key must be in GitAuth.known_hosts, else the running user's
  ~/.ssh/known_hosts (libssh2 checks it), before any credential is offered (pygit2's default
  callback lets every SSH host key through; this one never does). Over https the TLS
  certificate must verify.
- **The client.** Over SSH: GitAuth.ssh_key (this user's alone, as ssh requires; its `.pub`
  beside it when present), else ssh-agent's keys, else ~/.ssh/id_ed25519, id_ecdsa, id_rsa (what
  `ssh` would offer). Over http(s): git's credential helpers (`git credential fill`), asked only
  when the server asks, approved after a fetch that worked, rejected when the server refuses
  them; never a prompt. Each is offered once: a refusal is one clear error, never a loop of
  retries. The values never appear in a message.
"""

from __future__ import annotations

import getpass
import os
import pwd
import stat
import subprocess
from pathlib import Path
from urllib.parse import urlsplit

import msgspec
import pygit2
from pygit2.enums import CredentialType

from ..errors import SourceError

HELPER_TIMEOUT = 30             # seconds for `git credential`
HOW_HELPER = ("configure one for this user (git config --global credential.helper 'store --file FILE'; as root for "
              "pull mode, --system), FILE holding a line https://USER:TOKEN@HOST, mode 0600")


IDENTITIES = ("id_ed25519", "id_ecdsa", "id_rsa")     # ssh's default identity files, in its order


def default_identity() -> str | None:
    """This user's first default identity file (~/.ssh of its passwd entry, as ssh reads it)."""
    try:
        home = pwd.getpwuid(os.geteuid()).pw_dir
    except KeyError:
        return None
    return next((str(p) for name in IDENTITIES if (p := Path(home, ".ssh", name)).is_file()), None)


class GitAuth(msgspec.Struct, frozen=True):
    """What a fetch of a URL authenticates with: an SSH key file and the known_hosts file its
    server's key must be in (None: ssh-agent, and ~/.ssh/known_hosts)."""

    ssh_key: str | None = None
    known_hosts: str | None = None

    def check(self) -> None:
        """SourceError when the key file or the known_hosts file may not be used (see the module
        docstring): before anything is fetched."""
        if self.ssh_key is not None:
            check_key(Path(self.ssh_key))
        if self.known_hosts is not None:
            check_known_hosts(Path(self.known_hosts))


def _regular_file(path: Path, what: str) -> os.stat_result:
    """`path`'s stat, where it is a regular file (followed through a link); SourceError else."""
    try:
        st = path.stat()
    except OSError as e:
        raise SourceError(f"{what} {path}: {e.strerror or e}") from None
    if not stat.S_ISREG(st.st_mode):
        raise SourceError(f"{what} {path} is not a regular file")
    return st


def check_key(path: Path) -> None:
    """A private key of this user's alone: a regular file it owns, no permission for anyone else."""
    st = _regular_file(path, "SSH key")
    if st.st_uid != os.geteuid() or st.st_mode & 0o077:
        raise SourceError(f"SSH key {path} must be uid {os.geteuid()}'s alone (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): chown {os.geteuid()} {path} && chmod 600 {path}")


def check_known_hosts(path: Path) -> None:
    """A known_hosts file that only root or this user could have written: whoever writes it
    chooses which server is trusted."""
    st = _regular_file(path, "known_hosts file")
    if st.st_uid not in (0, os.geteuid()) or st.st_mode & 0o022:
        raise SourceError(f"known_hosts file {path} may be rewritten by others (owner uid {st.st_uid}, mode "
                          f"{stat.S_IMODE(st.st_mode):04o}): make it root's, not group- or world-writable")


def is_ssh(url: str) -> bool:
    """An SSH URL: ssh:// (and git+ssh, ssh+git), or git's scp-like user@host:path."""
    return "://" not in url or url.split("://", 1)[0].lower() in ("ssh", "git+ssh", "ssh+git")


class Callbacks(pygit2.RemoteCallbacks):
    """The callbacks of one connection to `url` (see the module docstring). A refused credential
    raises SourceError (the operation stops there); a refused server key leaves `problem`, in
    words, for the error the caller raises. Messages name no URL: the caller's does."""

    def __init__(self, url: str, auth: GitAuth | None = None):
        super().__init__()
        self.url, self.auth = url, auth or GitAuth()
        self.problem: str | None = None
        self._asked: set[str] = set()
        self._helper: dict[str, str] | None = None    # what git's credential helper gave (to approve)

    def certificate_check(self, certificate: None, valid: bool, host: bytes) -> bool:
        """Only a key known_hosts lists (SSH) or a certificate that verifies (TLS). Called once
        per connection, before any credential: the key may be offered once on this one."""
        self._asked.discard("ssh")
        if not valid:
            name = host.decode(errors="replace") if isinstance(host, bytes) else str(host)
            if is_ssh(self.url):
                where = self.auth.known_hosts or "~/.ssh/known_hosts"
                self.problem = (f"the SSH host key of {name} is not in {where} (or differs from it): not connecting. "
                                f"Get the key from the server's administrator, or `ssh-keyscan {name}` and compare "
                                f"its fingerprint with theirs, then add that line to {where}")
            else:
                self.problem = f"the TLS certificate of {name} does not verify"
        return bool(valid)

    def credentials(self, url: str, username_from_url: str | None,
                    allowed_types: CredentialType) -> pygit2.Username | pygit2.UserPass | pygit2.Keypair:
        """The key (SSH) or the helper's user name and password (http): once each; asked again, the
        server refused them."""
        if is_ssh(self.url):
            user = username_from_url or getpass.getuser()
            if allowed_types & CredentialType.SSH_KEY:
                return self._key(user)
            if allowed_types & CredentialType.USERNAME:
                return pygit2.Username(user)
        elif allowed_types & CredentialType.USERPASS_PLAINTEXT:
            return self._from_helper(url)
        raise SourceError(f"the server asks for credentials the reconciler does not give ({allowed_types!s})")

    def _key(self, user: str) -> pygit2.Keypair:
        """The key given, else ssh-agent's, else this user's default identity file (as ssh)."""
        agent = bool(os.environ.get("SSH_AUTH_SOCK"))
        key = self.auth.ssh_key or (None if agent else default_identity())
        which = f"the SSH key {key}" if key else "the keys of ssh-agent"
        if "ssh" in self._asked:
            raise SourceError(f"the server refused {which} for user {user}: add its public key to {user}'s "
                              f"authorized_keys there (a read-only deploy key), or give the key it knows "
                              f"(reconcile pull --ssh-identity)")
        self._asked.add("ssh")
        if key:
            check_key(Path(key))
            pub = f"{key}.pub"
            return pygit2.Keypair(user, pub if os.path.isfile(pub) else None, key, "")
        if agent:
            return pygit2.KeypairFromAgent(user)
        raise SourceError(f"the server asks for an SSH key and none was given: none of {', '.join(IDENTITIES)} in "
                          f"~/.ssh, no ssh-agent; give the host a deploy key of its own (reconcile pull "
                          f"--ssh-identity)")

    def _from_helper(self, url: str) -> pygit2.UserPass:
        if self._helper is not None:
            helper_call("reject", self._helper)
            self._helper = None
            raise SourceError("the server refused the user name and password git's credential "
                              "helper gave (told to forget them): correct them in the helper")
        if "helper" in self._asked:
            raise SourceError("the server asks for a user name and password again")
        self._asked.add("helper")
        given = helper_call("fill", request(url))
        if not given or not given.get("username") or "password" not in given:
            raise SourceError(f"the server asks for a user name and password, and git's "
                              f"credential helpers have none for it: {HOW_HELPER}")
        self._helper = given
        return pygit2.UserPass(given["username"], given["password"])

    def succeeded(self) -> None:
        """The operation worked: a helper's credentials are approved (it may store them)."""
        if self._helper is not None:
            helper_call("approve", self._helper)
            self._helper = None


def request(url: str) -> dict[str, str]:
    """What `git credential` is asked about an http(s) URL: its protocol, host (and port), path."""
    u = urlsplit(url)
    host = u.hostname or ""
    if u.port:
        host = f"{host}:{u.port}"
    return {"protocol": u.scheme, "host": host, "path": u.path.lstrip("/")}


def parse_helper(text: str) -> dict[str, str]:
    """PURE: git credential's `key=value` lines."""
    return {key: value for key, sep, value in (line.partition("=") for line in text.splitlines()) if sep and key}


def helper_call(action: str, fields: dict[str, str]) -> dict[str, str] | None:
    """`git credential ACTION` (fill, approve, reject) with `fields`; fill's answer, or None when
    git is missing or fails. Never prompts (no terminal, no askpass program)."""
    text = "".join(f"{k}={v}\n" for k, v in fields.items() if "\n" not in v and "\0" not in v) + "\n"
    env = {**os.environ, "GIT_TERMINAL_PROMPT": "0", "GIT_ASKPASS": "", "SSH_ASKPASS": ""}
    try:
        res = subprocess.run(["git", "credential", action], input=text, capture_output=True, text=True,
                             timeout=HELPER_TIMEOUT, env=env)
    except (OSError, subprocess.TimeoutExpired):
        return None
    if res.returncode != 0:
        return None
    return parse_helper(res.stdout) if action == "fill" else {}
