"""The loaded-state cache (desired/cache.py): plain data that gives back exactly what the loader
gave, used only when it is this user's and nobody else's, a miss in every other case."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import pytest

from reconciler.desired import cache, load, source
from reconciler.desired.spec import (
    DesiredState,
    FleetSettings,
    HealthSpec,
    HostSpec,
    ModelSpec,
    NotifySpec,
    PullWave,
    RolloutPolicy,
    SecretSpec,
    ServiceSpec,
    SSHSpec,
)
from reconciler.errors import ConfigError
from reconciler.values import replace
from tests.conftest import ROOT, DesiredRepo

NOBODY = 65534


def rich_state() -> DesiredState:
    """Every kind of field the spec has: optional dataclasses, int | str, bytes, tuples, floats."""
    svc = ServiceSpec(
        name="sglang", unit_text="[Service]\nExecStart=/bin/true\n", env={"A": "1", "B": "two words"},
        health=HealthSpec(http="https://127.0.0.1:30000/health", startup_timeout=1800.0, interval=2.5,
                          stable_for=30.0, expect_status=204, body_contains="ok", ca_pem="-----BEGIN CERT-----\n"),
        model=ModelSpec(id="Qwen/Qwen3-8B", path="/models/q", architecture="Qwen3ForCausalLM", fetch=None,
                        fetch_timeout=60.0, size_gb=16.5),
        source="services/sglang.toml", definition="sglang", gpu_policy="kill",
        rollout=RolloutPolicy(canary=0, max_unavailable=2), adopt=True, allow_dropins=("10-numa.conf",),
        secrets=(SecretSpec("HF_TOKEN", "age", "secrets/hf.age", env=True, ciphertext=b"\x00age\xffbytes",
                            problem=None),
                 SecretSpec("db", "file", "/etc/credstore/db", problem="missing")))
    other = ServiceSpec(name="vllm", unit_text="[Service]\n", rollout=RolloutPolicy(max_unavailable="50%"))
    host = HostSpec("gpu-1", SSHSpec("127.0.0.5", port=2222, host_key="ssh-ed25519 AAAA", known_hosts=None),
                    {"sglang": svc, "vllm": other}, {"rack": "a"}, "hosts/gpu-1.toml")
    return DesiredState("a" * 40, {"gpu-1": host},
                        FleetSettings(concurrency=7, notify=NotifySpec("https://hooks.example.invalid/x", "slack", 2.0),
                                      pull_waves=(PullWave("canary", {"rack": "a"}, 0.0), PullWave("rest", {}, 600.0))))


def test_every_field_comes_back_as_it_was() -> None:
    state = rich_state()
    entry = cache.decode(cache.encode(cache.CacheEntry(cache.FORMAT, "t", "f", state)))
    assert entry is not None
    back = entry.state
    assert back == state
    got = back.hosts["gpu-1"].services["sglang"]
    assert got.secrets[0].ciphertext == b"\x00age\xffbytes"          # compare=False: checked by hand
    assert got.content_hash() == state.hosts["gpu-1"].services["sglang"].content_hash()
    assert type(got.rollout.max_unavailable) is int and type(got.health.startup_timeout) is float
    assert back.hosts["gpu-1"].services["vllm"].rollout.max_unavailable == "50%"


def fleet_of(n: int, known_hosts: str) -> DesiredState:
    """n hosts that hold the same known_hosts text (as the loader gives every host the fleet's
    file), one that holds another and one that holds none."""
    host = rich_state().hosts["gpu-1"]
    hosts = {f"h{i}": replace(host, name=f"h{i}", ssh=SSHSpec(f"127.0.1.{i}", known_hosts=known_hosts,
                                                              known_hosts_file="known_hosts"))
             for i in range(n)}
    hosts["other"] = replace(host, name="other", ssh=SSHSpec("127.0.2.1", known_hosts="other-host ssh-ed25519 BBBB\n"))
    hosts["pinned"] = replace(host, name="pinned")
    return DesiredState("a" * 40, hosts, FleetSettings())


def test_a_known_hosts_text_every_host_holds_is_kept_once() -> None:
    # one line a host, as a fleet's known_hosts file grows with the fleet
    text = "".join(f"127.0.1.{i} ssh-ed25519 AAAAC3NzaC1lZDI1NTE5AAAAI{i:020d}\n" for i in range(300))
    state = fleet_of(300, text)
    raw = cache.encode(cache.CacheEntry(cache.FORMAT, "t", "f", state))
    assert raw.count(b"AAAAC3NzaC1lZDI1NTE5AAAAI00000000000000000299") == 1
    none = replace(state, hosts={n: replace(h, ssh=replace(h.ssh, known_hosts=None)) for n, h in state.hosts.items()})
    bare = cache.encode(cache.CacheEntry(cache.FORMAT, "t", "f", none))
    assert len(raw) - len(bare) < 2 * len(text)           # each text once, and an index a host (300 times: 6 MB)
    entry = cache.decode(raw)
    assert entry is not None
    assert entry.state == state
    back = entry.state.hosts
    assert back["h0"].ssh.known_hosts == text and back["h0"].ssh.known_hosts is back["h299"].ssh.known_hosts
    assert back["other"].ssh.known_hosts == "other-host ssh-ed25519 BBBB\n" and back["pinned"].ssh.known_hosts is None
    assert (entry.known_hosts, entry.known_by) == ([], {})      # as the loader gave it


@pytest.mark.parametrize("index", [-1, 2, "x"])
def test_an_entry_whose_host_names_no_kept_known_hosts_text_is_a_miss(index: object) -> None:
    doc = json.loads(cache.encode(cache.CacheEntry(cache.FORMAT, "t", "f", fleet_of(2, "k ssh-ed25519 A\n"))))
    assert sorted(doc["known_by"].values()) == [0, 0, 1]
    doc["known_by"]["h1"] = index
    assert cache.decode(json.dumps(doc).encode()) is None
    doc["known_by"] = {"h1": 0, "nobody": 0}                    # a host the state does not have
    assert cache.decode(json.dumps(doc).encode()) is None


def test_the_example_repo_comes_back_as_the_loader_made_it(tmp_path: Path) -> None:
    snap = source.snapshot(source.open_repo(str(ROOT)), None, "desired-state")
    state = load.load_desired(snap)
    assert cache.load_desired(snap, tmp_path) == state                  # a miss: loaded, then kept
    [entry] = (tmp_path / "desired").iterdir()
    assert entry.name == f"{snap.tree_id}.json"
    assert cache.load_desired(snap, tmp_path) == state                  # a hit


@pytest.fixture
def repo(tmp_path: Path) -> DesiredRepo:
    r = DesiredRepo(tmp_path / "repo")
    shutil.copytree(ROOT / "desired-state", r.path, dirs_exist_ok=True)
    r.commit("the example")
    return r


def snap_of(repo: DesiredRepo) -> source.Snapshot:
    return source.snapshot(repo.repo)


class Counting:
    """The loader, counted (a hit never calls it)."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch):
        self.calls = 0
        real = load.load_desired

        def counted(snap):  # type: ignore[no-untyped-def]
            self.calls += 1
            return real(snap)
        monkeypatch.setattr(load, "load_desired", counted)


def test_a_hit_skips_the_loader_and_a_new_commit_of_the_same_tree_hits_with_its_own_revision(
        repo: DesiredRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    loader = Counting(monkeypatch)
    first = cache.load_desired(snap_of(repo), tmp_path / "c")
    again = cache.load_desired(snap_of(repo), tmp_path / "c")
    assert (loader.calls, again) == (1, first)
    rev = repo.repo.create_commit("HEAD", repo.repo.default_signature, repo.repo.default_signature, "empty",
                                  repo.repo.head.peel().tree.id, [repo.repo.head.target])
    moved = cache.load_desired(snap_of(repo), tmp_path / "c")
    assert loader.calls == 1 and moved.revision == str(rev) != first.revision and moved.hosts == first.hosts


def test_a_bad_revision_is_an_error_every_time_and_nothing_is_kept(repo: DesiredRepo, tmp_path: Path) -> None:
    repo.write("fleet.toml", "concurrency = 'many'\n")
    repo.commit("bad")
    for _ in range(2):
        with pytest.raises(ConfigError):
            cache.load_desired(snap_of(repo), tmp_path / "c")
    assert not (tmp_path / "c").exists()


def entry_of(repo: DesiredRepo, where: Path) -> Path:
    return where / "desired" / f"{snap_of(repo).tree_id}.json"


@pytest.mark.parametrize("spoil", ["group-writable", "another owner", "a symlink", "two links", "old loader",
                                   "another tree", "not json", "wrong types", "directory group-writable",
                                   "directory of another owner"])
def test_an_entry_that_is_not_ours_alone_or_not_this_loaders_is_a_miss(
        repo: DesiredRepo, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, spoil: str) -> None:
    where = tmp_path / "c"
    good = cache.load_desired(snap_of(repo), where)
    entry = entry_of(repo, where)
    data = json.loads(entry.read_text())
    forged = json.loads(entry.read_text())
    service = next(iter(forged["state"]["hosts"]["h2"]["services"].values()))
    service["unit_text"] = "[Service]\nExecStart=/bin/evil\n"
    entry.write_text(json.dumps(forged))
    if spoil == "group-writable":
        entry.chmod(0o620)
    elif spoil == "another owner":
        os.chown(entry, NOBODY, NOBODY)
    elif spoil == "a symlink":
        entry.rename(tmp_path / "elsewhere.json")
        entry.symlink_to(tmp_path / "elsewhere.json")
    elif spoil == "two links":
        os.link(entry, tmp_path / "second-link.json")
    elif spoil == "old loader":
        entry.write_text(json.dumps({**forged, "fingerprint": "0" * 32}))
    elif spoil == "another tree":
        entry.write_text(json.dumps({**forged, "tree": "f" * 40}))
    elif spoil == "not json":
        entry.write_text("{not json")
    elif spoil == "wrong types":
        entry.write_text(json.dumps({**data, "state": {**data["state"], "hosts": ["a list"]}}))
    elif spoil == "directory group-writable":
        entry.parent.chmod(0o770)
    elif spoil == "directory of another owner":
        os.chown(entry.parent, NOBODY, NOBODY)
    loader = Counting(monkeypatch)
    assert cache.load_desired(snap_of(repo), where) == good
    assert loader.calls == 1


def test_only_the_newest_entries_are_kept(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(cache, "KEEP", 3)
    r = DesiredRepo(tmp_path / "repo")
    shutil.copytree(ROOT / "desired-state", r.path, dirs_exist_ok=True)
    trees = []
    for i in range(5):
        r.write("hosts/README.md", f"round {i}\n")
        r.commit(f"round {i}")
        cache.load_desired(snap_of(r), tmp_path / "c")
        trees.append(snap_of(r).tree_id)
    assert sorted(p.name for p in (tmp_path / "c" / "desired").iterdir()) == sorted(f"{t}.json" for t in trees[2:])


def test_another_users_cache_directory_is_never_opened_or_written(repo: DesiredRepo, tmp_path: Path) -> None:
    """sudo -E keeps XDG_CACHE_HOME: root's run must not take (or leave) anything there."""
    theirs = tmp_path / "theirs"
    theirs.mkdir(mode=0o777)
    theirs.chmod(0o777)
    os.chown(theirs, NOBODY, NOBODY)
    cache.load_desired(snap_of(repo), theirs)
    assert list(theirs.iterdir()) == []
