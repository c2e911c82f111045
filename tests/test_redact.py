"""reconciler/redact.py on its own: the token formats, URL passwords, secret settings, registered
values in their variants (normal forms, case, re-spaced), the values never masked (short, plain
words, small numbers: an oracle otherwise), JSON keys kept, env names judged secret, and control
characters made visible (security review M3, L5)."""

from __future__ import annotations

import secrets as pysecrets
import unicodedata

import pytest

from reconciler import redact


def fresh(prefix: str = "v") -> str:
    """A value that matches no pattern and was never registered. Its 20 random characters are
    capitals that are neither hex digits nor vowels: leaked() looks for any 4 of them in a row, and
    hex made that find a token, a hash or a date in the text (1 run in about 300: CI, stop 52)."""
    return prefix + "-" + "".join(pysecrets.choice("GJKMNQRVXZ") for _ in range(20))


def leaked(secret: str, text: str, n: int = 4) -> list[str]:
    """The pieces of `n` characters of a secret that a text still holds (review N6: none may)."""
    return sorted({secret[i:i + n] for i in range(len(secret) - n + 1) if secret[i:i + n] in text})


def straddling(secret: str, at: int, before: str = "x", after: str = " after") -> str:
    """A line whose registered secret straddles character `at` (review E5): a word of its own."""
    head = (before * at)[: at - len(secret) // 2 - 1] + " "
    return head + secret + after


# ---- token formats ------------------------------------------------------------------------------

AWS_SECRET = "wJalrXUtnFEMI/K7MDENG/bPxRfiCYEXAMPLEKEY"
JWT = "eyJhbGciOiJIUzI1NiIsInR5cCI6IkpXVCJ9.eyJzdWIiOiIxMjM0NTY3ODkwIn0.SflKxwRJSMeKKF2QT4fwpMeJf36POk6yJV_adQssw5c"


@pytest.mark.parametrize(("text", "expected", "kind"), [
    ("hf_" + "AbCdEf12", "***", "a Hugging Face token"),                          # 8 characters are enough
    ("github_pat_11ABCDEFG0" + "123456789_abcdefghijklmnopqrstuvwxyz", "***", "a GitHub token"),
    ("git clone https://oauth2:glpat-" + "aB3dEf6hIj9kLm2nOp5q@gitlab.example/x.git",
     "git clone https://oauth2:***@gitlab.example/x.git", "a GitLab token"),
    ("glpat-" + "aB3dEf6hIj9kLm2nOp5q", "***", "a GitLab token"),
    ("slack xoxb-" + "1234567890-0987654321-AbCdEfGhIjKl", "slack ***", "a Slack token"),
    ("xoxp-" + "1234567890-0987654321", "***", "a Slack token"),
    ("xoxa-" + "2-1234567890-abcdef", "***", "a Slack token"),
    ("key AKIA" + "IOSFODNN7EXAMPLE used", "key *** used", "an AWS access key id"),
    (f"aws_secret_access_key = {AWS_SECRET}", "aws_secret_access_key = ***", "an AWS secret key"),
    (f'AWS_SECRET_ACCESS_KEY="{AWS_SECRET}"', 'AWS_SECRET_ACCESS_KEY="***"', "an AWS secret key"),
    (f"token {JWT} expired", "token *** expired", "a JWT"),
    ("curl -H 'Authorization: Bearer " + "abc123.DEF-456_ghi'", "curl -H 'Authorization: Bearer ***'",
     "a bearer token"),
    ("Authorization: Basic " + "dXNlcjpwYXNzd29yZA==", "Authorization: Basic ***", "an Authorization header"),
    ("postgres://app:" + "ab/cd+ef==@db:5432/app", "postgres://app:***@db:5432/app", "a URL with a password"),
    ("postgres://app:" + "p@ss@db/app", "postgres://app:***@db/app", "a URL with a password"),
    ("redis://:" + "S3cret@cache:6379", "redis://:***@cache:6379", "a URL with a password"),
    ("login failed: password=" + "hunter2", "login failed: password=***", "a password or token setting"),
    ('{"db_password": "' + 'x9-Yz8!", "n": 1}', '{"db_password": "***", "n": 1}', "a password or token setting"),
    ("server --api-key " + "k3y-value --port 1", "server --api-key *** --port 1", "a password or token setting"),
    ("OPENAI_KEY=" + "abc12345 SENTRY_DSN=https://k3y@o.example/1", "OPENAI_KEY=*** SENTRY_DSN=***",
     "a password or token setting"),
    ("DATABASE_URL=" + "postgres://u:pw@db/x auth=" + "let-me-in bearer: x",
     "DATABASE_URL=postgres://u:***@db/x auth=*** bearer: x", "a URL with a password"),
])
def test_token_formats_are_masked_and_named(text: str, expected: str, kind: str) -> None:
    assert redact.redact(text) == expected
    assert redact.looks_secret(text) == kind


@pytest.mark.parametrize("text", [
    "pip install hf_transfer",              # a module, not a token
    "hf_hub_download(repo_id)",
    "Bearer credentials are required",      # English
    "max_num_batched_tokens=8192 num_tokens=16",
    "--api-key $VLLM_API_KEY --token {vars.token}",   # a variable and a placeholder, not a value
    "https://127.0.0.1:30000/health",
    "ssh://git@host:22/fleet.git",
    "Invalid token: please log in again",
    "seconds=3 second=4",
    "tokenizer_mode=auto",
    "monkey=banana keyring=default",
])
def test_ordinary_text_is_left_alone(text: str) -> None:
    assert redact.redact(text) == text
    assert redact.looks_secret(text) is None


def test_a_url_password_is_everything_up_to_the_last_at() -> None:
    """A password holding '/' (one base64 character in 32) or '@' is masked whole, never its tail."""
    for password in ("Zm9v/YmFy+cXV4", "p@ss@word", "a/b@c/d"):
        out = redact.redact(f"connecting to postgres://app:{password}@db:5432/app now")
        assert out == "connecting to postgres://app:***@db:5432/app now"


# ---- registered values --------------------------------------------------------------------------


def test_a_registered_value_is_masked_in_any_case_and_normal_form() -> None:
    value = "Pässwörd-" + pysecrets.token_hex(6)
    redact.register(unicodedata.normalize("NFC", value))
    for shown in (value, value.upper(), value.lower(), unicodedata.normalize("NFD", value),
                  unicodedata.normalize("NFD", value.upper())):
        assert redact.redact(f"x {shown} y") == "x *** y", shown


def test_a_text_redacted_before_a_value_was_registered_is_masked_after():
    """Short texts are kept redacted while the registered values stay the same (a run redacts
    the same names many times); a value registered since is masked in them all the same."""
    value = "late-" + pysecrets.token_hex(8)
    short, long_ = f"host {value}", f"line {value} " + "x" * 300
    assert (redact.redact(short), redact.redact(long_)) == (short, long_)
    redact.register(value)
    try:
        assert redact.redact(short) == "host ***"
        assert redact.redact(long_) == "line *** " + "x" * 300
    finally:
        redact._values.discard(value)
    assert redact.redact(short) == short


def test_a_registered_value_is_masked_when_its_spaces_were_flattened_or_rewrapped() -> None:
    value = f"pa  ss\tword-{pysecrets.token_hex(4)}"
    redact.register(value)
    tail = value.split()[-1]
    assert redact.redact(f"said {' '.join(value.split())}!") == "said ***!"
    assert redact.redact(f"said pa\nss {tail}") == "said ***"


@pytest.mark.parametrize("value", ["abc", "second", "Admin", "Zürich", "12345", "  x1  "])
def test_short_values_plain_words_and_small_numbers_are_never_masked(value: str) -> None:
    """Masking them would turn ordinary text into *** and tell whoever writes text that it equals
    a secret (seconds=3 -> ***s=3)."""
    redact.register(value)
    text = f"seconds=3 {value.strip()} admins 123456 abcd Zürichsee"
    assert redact.redact(text) == text


def test_a_word_of_eight_letters_and_a_number_of_six_digits_are_masked() -> None:
    redact.register("Kxqzvbwj")
    redact.register("904417")
    assert redact.redact("a kxqzvbwj b 904417 c") == "a *** b *** c"


def test_maskable_says_which_values_are_masked() -> None:
    assert [redact.maskable(v) for v in ("abc", "abcd1", "second", "Passwort", "12345", "123456", "sëcond")] == [
        False, True, False, True, False, True, False]


def test_redact_data_masks_values_and_never_rewrites_keys() -> None:
    value = fresh("key")
    redact.register(value)
    data = {"true": 1, value: [value, {"quote": f"a {value}"}], "n": ("x", 2)}
    assert redact.redact_data(data) == {"true": 1, value: ["***", {"quote": "a ***"}], "n": ["x", 2]}


# ---- secret env names ---------------------------------------------------------------------------


def test_json_text_redacted_again_stays_json() -> None:
    """--json redacts each string, then the serialized text once more: a masked value inside an
    escaped quote (LoadCredential=\\"id:/path\\" in a diff) keeps the backslash of the quote that
    closes it, so the document still parses (CI failure of 2026-12-02: `\\"***"` broke it)."""
    import json
    data = {"diff": '+LoadCredential="db_url:/etc/credstore/db"\n+X=1\n',
            "env": 'DB_PASSWORD="a\\b\\"', "header": 'Authorization: "Basic QWxhZGRpbjpvcGVu"'}
    text = redact.redact(json.dumps(redact.redact_data(data)))
    assert json.loads(text) == {"diff": '+LoadCredential="***"\n+X=1\n', "env": 'DB_PASSWORD="***"',
                                "header": 'Authorization: "Basic ***"'}
    assert redact.redact('token=abc\\def; next') == "token=***; next"


@pytest.mark.parametrize(("name", "secret"), [
    ("HF_TOKEN", True), ("DB_PASSWORD", True), ("OPENAI_KEY", True), ("OPENAI_API_KEY", True),
    ("SENTRY_DSN", True), ("DATABASE_URL", True), ("REDIS_URL", True), ("AUTH", True), ("BEARER", True),
    ("MY_SECRET_THING", True), ("KEY", True), ("GCP_PRIVATE_KEY_ID", True), ("AWS_SECRET_ACCESS_KEY", True),
    ("LOG", False), ("HEALTH_URL", False), ("CUDA_VISIBLE_DEVICES", False), ("MONKEY", False), ("PWD", True),
    ("KEYCLOAK_REALM", False), ("MODEL", False),
])
def test_secret_names(name: str, secret: bool) -> None:
    assert redact.secret_name(name) is secret


# ---- control characters -------------------------------------------------------------------------


def test_control_characters_are_shown_as_escapes_but_newline_and_tab() -> None:
    raw = "a\x1b]0;pwned\x07b\x1b[2Jc\td\ne\rf\x7fg\x9bh\x00i"
    assert redact.escape_controls(raw) == "a\\x1b]0;pwned\\x07b\\x1b[2Jc\td\ne\\x0df\\x7fg\\x9bh\\x00i"
    assert redact.escape_controls("plain ü text\n") == "plain ü text\n"


def test_with_hundreds_of_values_registered_each_is_still_found() -> None:
    """Past a few dozen values the registry looks hints up by their first characters (a daemon
    registers every secret it ever decrypted): the same values are masked either way."""
    many = [f"Many-{i:03d}-{pysecrets.token_hex(6)}" for i in range(150)]
    for v in many:
        redact.register(v)
    longer = many[7] + "-and-more"
    redact.register(longer)
    assert not redact._registry().direct
    assert redact.redact(f"a {many[42].upper()} b {longer} c {many[7]} d") == "a *** b *** c *** d"
    assert redact.redact(f"x {unicodedata.normalize('NFD', 'é')} {many[0][:-1]}") == (
        f"x {unicodedata.normalize('NFD', 'é')} {many[0][:-1]}")


def test_a_long_command_error_is_cut_at_a_boundary_so_a_token_is_never_cut_in_half() -> None:
    """CommandError keeps the end of stderr; a cut inside a token would leave a tail no pattern
    matches when the message is redacted at the edge."""
    from reconciler.errors import CommandError
    token = "hf_" + "Zq7" * 400                               # one word longer than the cut
    e = CommandError("gpu-1", "apply", 1, f"error: bad token {token} was refused\nretry later")
    assert e.stderr == "... retry later" and token[-50:] not in redact.redact(str(e))
    e = CommandError("gpu-1", "apply", 1, f"{'x ' * 600}hf_{'Zq7' * 10} refused")
    assert e.stderr.startswith("... ") and redact.redact(str(e)).endswith("*** refused")
    e = CommandError("gpu-1", "apply", 1, token)
    assert e.stderr == "... (the rest of the output is one word, not shown)"


# ---- clip: redact whole, then cut (review N6) ----------------------------------------------------

@pytest.mark.parametrize("at", [80, 200, 240, 1000, 2000])
def test_a_clip_redacts_the_whole_text_before_it_cuts_at_either_end(at: int) -> None:
    secret = fresh("Zq9-vT3")
    redact.register(secret)
    line = straddling(secret, at, after=" word" * 500)
    keep = len(line) - at
    assert leaked(secret, line[:at]) and leaked(secret, line[-keep:])   # a cut there goes through it
    head, tail = redact.clip(line, at), redact.clip(line, keep, tail=True)
    assert not leaked(secret, head) and not leaked(secret, tail)
    assert len(head) == at and head.endswith("\u2026") and "***" in head
    whole = redact.redact(line)
    assert 0 < len(tail) <= keep and whole.endswith(tail) and whole[-len(tail) - 1] == " "   # from a whole word
    assert redact.clip(line, len(line)) == whole     # uncut: only redacted


def test_a_tail_cut_drops_the_word_it_went_through_even_unregistered() -> None:
    """What the host cut (progress.sh) the controller never saw whole: the cut word goes."""
    assert redact.clip("alpha beta gamma", 8, tail=True) == "gamma"           # 'a gamma': 'a' is cut
    assert redact.clip("alpha beta gamma", 6, tail=True) == "gamma"           # ' gamma': a whole word
    assert redact.clip("alpha beta\rgamma", 7, tail=True) == "gamma"        # a redraw's carriage return
    assert redact.clip("x" * 50, 10, tail=True) == ""                         # one word: nothing of it
    assert redact.clip("abc", 0) == "" and redact.clip("abc", 0, tail=True) == ""
