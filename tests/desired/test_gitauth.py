"""How a fetch of a repo URL authenticates (desired/gitauth.py, review N9a): the key and known_hosts
files' checks, and git's credential helpers over http, against a real git server on loopback
(`git http-backend` behind Basic authentication). The SSH path (a deploy key, a pinned host key)
runs on real test hosts: tests/e2e/test_e2e_pull_ssh.py."""

from __future__ import annotations

import base64
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from reconciler.desired import gitauth, source
from reconciler.desired.gitauth import GitAuth
from reconciler.errors import SourceError
from tests.conftest import DesiredRepo

NOBODY = 65534
USER, TOKEN = "deploy", "glpat-Zq9vT3sX4wPe7"


# ---- the files -------------------------------------------------------------------------------------


def test_a_key_must_be_this_users_alone(tmp_path):
    key = tmp_path / "deploy"
    key.write_text("-----BEGIN OPENSSH PRIVATE KEY-----\n")
    key.chmod(0o600)
    GitAuth(str(key)).check()
    key.chmod(0o640)
    with pytest.raises(SourceError) as e:
        GitAuth(str(key)).check()
    assert str(e.value) == (f"SSH key {key} must be uid 0's alone (owner uid 0, mode 0640): chown 0 {key} && "
                            f"chmod 600 {key}")
    key.chmod(0o600)
    os.chown(key, NOBODY, NOBODY)
    with pytest.raises(SourceError, match=f"owner uid {NOBODY}, mode 0600"):
        GitAuth(str(key)).check()
    with pytest.raises(SourceError, match="No such file"):
        GitAuth(str(tmp_path / "absent")).check()


def test_a_known_hosts_file_only_root_or_this_user_could_write(tmp_path):
    kh = tmp_path / "known_hosts"
    kh.write_text("127.0.0.5 ssh-ed25519 AAAA\n")
    kh.chmod(0o644)
    GitAuth(None, str(kh)).check()
    kh.chmod(0o664)
    with pytest.raises(SourceError) as e:
        GitAuth(None, str(kh)).check()
    assert str(e.value) == (f"known_hosts file {kh} may be rewritten by others (owner uid 0, mode 0664): make it "
                            f"root's, not group- or world-writable")


def test_what_git_credential_is_asked_and_answers():
    assert gitauth.request("https://git.example:8443/fleet/repo.git") == \
        {"protocol": "https", "host": "git.example:8443", "path": "fleet/repo.git"}
    assert gitauth.parse_helper("protocol=https\nhost=h\nusername=u\npassword=a=b\n\n") == \
        {"protocol": "https", "host": "h", "username": "u", "password": "a=b"}
    assert gitauth.is_ssh("git@host:fleet.git") and gitauth.is_ssh("ssh://git@host/x")
    assert not gitauth.is_ssh("https://host/x")


# ---- git's credential helpers, against a real server ----------------------------------------------


class _Backend(BaseHTTPRequestHandler):
    """git http-backend behind Basic authentication (one user, one token)."""

    root: str
    seen: list[str]

    def log_message(self, *args: object) -> None:
        pass

    def _serve(self) -> None:
        auth = self.headers.get("Authorization", "")
        self.seen.append(auth)
        if auth != "Basic " + base64.b64encode(f"{USER}:{TOKEN}".encode()).decode():
            self.send_response(401)
            self.send_header("WWW-Authenticate", 'Basic realm="git"')
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        path, _, query = self.path.partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"GIT_PROJECT_ROOT": self.root, "GIT_HTTP_EXPORT_ALL": "1", "PATH_INFO": path, "QUERY_STRING": query,
               "REQUEST_METHOD": self.command, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_USER": USER, "PATH": os.environ["PATH"]}
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, check=True).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        status = 200
        headers = []
        for line in head.decode().split("\r\n"):
            name, _, value = line.partition(": ")
            if name.lower() == "status":
                status = int(value.split()[0])
            else:
                headers.append((name, value))
        self.send_response(status)
        for name, value in headers:
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    do_GET = do_POST = _serve


@pytest.fixture
def served(tmp_path) -> Iterator[tuple[str, list[str]]]:
    """A bare repo with one commit, served over http on 127.0.0.1 to one user with a token."""
    work = DesiredRepo(tmp_path / "work")
    work.write("fleet.toml", "")
    work.commit("one")
    subprocess.run(["git", "clone", "-q", "--bare", str(work.path), str(tmp_path / "srv" / "fleet.git")], check=True)
    seen: list[str] = []
    handler = type("Backend", (_Backend,), {"root": str(tmp_path / "srv"), "seen": seen})
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/fleet.git", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def helper(tmp_path, monkeypatch) -> Path:
    """This user's git config names a `store` credential helper (its file returned, empty)."""
    store = tmp_path / "git-credentials"
    store.write_text("")
    store.chmod(0o600)
    config = tmp_path / "gitconfig"
    config.write_text(f"[credential]\n\thelper = store --file {store}\n")
    monkeypatch.setenv("GIT_CONFIG_GLOBAL", str(config))
    monkeypatch.setenv("GIT_CONFIG_NOSYSTEM", "1")
    return store


def test_the_credential_helper_answers_the_server(served, helper, tmp_path):
    url, seen = served
    helper.write_text(f"http://{USER}:{TOKEN}@{url.split('//')[1].split('/')[0]}\n")
    r = source.open_repo(url, tmp_path / "cache")
    assert r.revparse_single("main").message == "one"
    basic = "Basic " + base64.b64encode(f"{USER}:{TOKEN}".encode()).decode()
    # the clone (refs: asked, answered; the pack) and the fetch (refs: asked, answered; up to date)
    assert seen == ["", basic, basic, "", basic]
    assert TOKEN in helper.read_text()                             # approved: the helper keeps them


def test_credentials_the_server_refuses_are_one_clear_error_and_forgotten(served, helper, tmp_path):
    url, seen = served
    host = url.split("//")[1].split("/")[0]
    helper.write_text(f"http://{USER}:wrong-{TOKEN}@{host}\n")
    with pytest.raises(SourceError) as e:
        source.open_repo(url, tmp_path / "cache")
    assert str(e.value) == (f"cannot fetch {url}: the server refused the user name and password git's credential "
                            f"helper gave (told to forget them): correct them in the helper")
    assert TOKEN not in str(e.value)
    assert helper.read_text() == ""                                # rejected: the helper dropped them
    assert len(seen) == 2                                          # asked once, answered once: no loop


def test_no_helper_with_credentials_is_an_error_saying_how_to_give_some(served, helper, tmp_path):
    url, _ = served
    with pytest.raises(SourceError) as e:
        source.open_repo(url, tmp_path / "cache")
    assert str(e.value) == (f"cannot fetch {url}: the server asks for a user name and password, and git's "
                            f"credential helpers have none for it: {gitauth.HOW_HELPER}")
