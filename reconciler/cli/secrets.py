"""`reconcile secrets`: make the controller's age key, and encrypt a value to it as a file to
commit (secrets in git with age, never in clear)."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import click

from .. import redact
from .output import fail, say
from .run import PATH


@click.group()
def secrets() -> None:
    """Secrets encrypted in git with age: make the controller's key, encrypt a value."""


DEFAULT_AGE_IDENTITY = Path("/etc/reconciler/age.key")
RECIPIENTS = "secrets/recipients.txt"


@secrets.command("keygen")
@click.option("--out", "-o", type=PATH, default=DEFAULT_AGE_IDENTITY, show_default=True,
              help="Where to write the new identity (mode 0600; never overwritten).")
def secrets_keygen(out: Path) -> None:
    """Make the controller's age identity (run on the controller); print its public key.

    The public key (age1...) goes on stdout alone, what to do next on stderr."""
    from ..desired import secrets as age
    try:
        public = age.keygen(out)
    except FileExistsError:
        fail(f"{out} exists: not overwriting an identity (every secret encrypted to it would become "
              f"unreadable). Remove it first, or choose another --out")
    except OSError as e:
        fail(f"cannot write {out}: {e.strerror}")
    print(public)
    say(f"wrote the controller's age identity to {out} (mode 0600). Keep it out of git and back it up: "
         f"without it the secrets encrypted to it cannot be decrypted.")
    say("next:")
    say(f'  1. controller: set age_identity = "{out.resolve()}" in /etc/reconciler/config.toml '
         f"(reconcile watch), or pass --age-identity / $RECONCILER_AGE_IDENTITY to reconcile")
    if os.geteuid() == 0 and _user_exists("reconciler"):
        say(f"     the daemon runs as user reconciler: chown reconciler:reconciler {out}")
    say(f"  2. desired-state repo: add the public key to {RECIPIENTS} and commit it:")
    say(f"       mkdir -p secrets && echo {public} >> {RECIPIENTS} && git add {RECIPIENTS} && "
         f"git commit -m 'secrets: the controller key'")
    say('  3. encrypt a secret: printf %s "$HF_TOKEN" | reconcile secrets encrypt HF_TOKEN')


def _user_exists(name: str) -> bool:
    import pwd
    try:
        pwd.getpwnam(name)
    except KeyError:
        return False
    return True


def _recipients(path: Path) -> list[tuple[str, str]]:
    """The age public keys in a recipients file, each with its comment: one a line, # comments
    and blank lines allowed; a key's comment is the one on its line, else the comment line right
    above it ("" when none)."""
    try:
        text = path.read_text()
    except FileNotFoundError:
        fail(f"no recipients: {path} does not exist. On the controller, `reconcile secrets keygen` prints its "
              f"public key (age1...): put it in {RECIPIENTS} and commit it, or pass --recipient age1...")
    except OSError as e:
        fail(f"cannot read {path}: {e.strerror}")
    keys = []
    above = ""
    for n, raw in enumerate(text.splitlines(), 1):
        line, _, comment = raw.partition("#")
        line = line.strip()
        if not line:
            above = comment.strip() if raw.strip() else ""
            continue
        if not _is_recipient(line):
            fail(f"{path}: line {n}: expected an age public key (age1...), one a line")
        keys.append((line, comment.strip() or above))
        above = ""
    if not keys:
        fail(f"no recipients: {path} holds no age public key (age1...)")
    return keys


def _is_recipient(key: str) -> bool:
    from pyrage import x25519
    try:
        x25519.Recipient.from_str(key)
    except Exception:             # pyrage.RecipientError
        return False
    return True


def _read_value(name: str) -> bytes:
    """The secret from stdin (one trailing newline removed), or asked for without echo on a terminal."""
    if sys.stdin.isatty():
        import getpass
        return getpass.getpass(f"{name} (not echoed): ").encode()
    data = sys.stdin.buffer.read()
    if data.endswith(b"\n"):
        data = data[:-2] if data.endswith(b"\r\n") else data[:-1]
    return data


@secrets.command("encrypt")
@click.argument("name")
@click.option("--repo", type=PATH, default=Path("."), help="The desired-state repo (its working tree).")
@click.option("--out", "-o", type=PATH, help="Where to write it (default: <repo>/secrets/<name>.age, e.g. "
                                             "hf-token.age).")
@click.option("--recipient", "-r", multiple=True, metavar="AGE1...",
              help=f"Encrypt to this age public key (repeatable; default: the keys in <repo>/{RECIPIENTS}).")
def secrets_encrypt(name: str, repo: Path, out: Path | None, recipient: tuple[str, ...]) -> None:
    """Encrypt a secret read from stdin to the controller's key, as a file to commit.

    printf %s "$HF_TOKEN" | reconcile secrets encrypt HF_TOKEN"""
    import re

    from ..desired import secrets as age
    from ..desired.fields import ENV_KEY
    from ..preflight import secret_file
    if not re.match(ENV_KEY, name):
        fail(f"{name!r} is not a valid name: letters, digits and '_', not starting with a digit (the server "
              f"sees it as an environment variable or a credential of that name)")
    if recipient:
        keys = [(r.strip(), "--recipient") for r in recipient]
        for k, _ in keys:
            if not _is_recipient(k):
                fail(f"--recipient {k!r}: not an age public key (age1...)")
    else:
        keys = _recipients(repo / RECIPIENTS)
    value = _read_value(name)
    if not value.strip():
        fail(f"{name}: the value is empty (nothing on stdin, or only whitespace); pipe it in: "
              f"printf %s \"$VALUE\" | reconcile secrets encrypt {name}")
    redact.register(value)
    armored = age.encrypt(value, [k for k, _ in keys])
    target = out if out is not None else repo / secret_file(name)
    replaced = target.exists()
    try:
        target.parent.mkdir(parents=True, exist_ok=True)
        tmp = target.with_name(f".{target.name}.tmp")
        tmp.write_bytes(armored)
        tmp.replace(target)
    except OSError as e:
        fail(f"cannot write {target}: {e.strerror}")
    try:
        rel = target.resolve().relative_to(repo.resolve()).as_posix()
    except ValueError:
        rel = str(target)
    keys_text = f"{len(keys)} key{'s' * (len(keys) != 1)}"
    # Every key, by name: whoever holds one's identity can decrypt the value, and the recipients
    # file is the repo's (a pusher can add a key to it).
    say(f"{name} is encrypted to {keys_text}; whoever holds one of their identities can decrypt it:")
    for key, comment in keys:
        say(f"  {key}" + (f"  ({comment})" if comment else "  (no comment: whose is it?)"))
    if replaced:
        say(f"replaced {target}: {name}, encrypted to {keys_text}. Commit and push it: the services that use "
             f"{name} restart with the new value.")
    else:
        say(f"wrote {target}: {name}, encrypted to {keys_text}. Add this line to the service's secrets table "
             f"([services.<service>.secrets] in hosts/<host>.toml, or [secrets] in services/<definition>.toml; "
             f"add env = true for a server that reads it from its environment), then commit both:")
    print(f'{name} = {{ age = "{rel}" }}')
    say(f"  git add {rel} && git commit")
