"""Load progress from the engine's own journal lines (reconciler/host/progress.py): the pure
parser on the real engines' line formats (SGLang 0.5.12 and 0.5.23, vLLM 0.33.0, as journald
stores them), the journal read's program (reconciler/sh/progress.sh, run here with a stand-in
journalctl) and its parser, and the follower that the health watch's tick feeds."""

from __future__ import annotations

import itertools
import os
import shlex
from pathlib import Path

import pytest

from reconciler.host.progress import PROGRESS_EVERY, LoadFollower
from reconciler.plan.facts import progress
from reconciler.plan.facts.progress import GRAPHS, READY, WEIGHTS, LoadProgress, advance, parse_tail
from tests.host.programs import headers, run_here

ROOT = Path(__file__).resolve().parents[2]
P = LoadProgress


def bar(desc: str, total: int, upto: int, *, completed: bool = True) -> str:
    """A tqdm bar as one journal record: every redraw after a carriage return (SGLang's
    BAR_FORMAT, and tqdm's default, end no redraw with a newline: journald stores the bar whole
    when it ends)."""
    out = []
    for n in range(upto + 1):
        pct = f"{round(100 * n / total):3d}%"
        mid = f" Completed | {n}/{total}" if completed else f"|{'█' * (n * 10 // total):10s}| {n}/{total}"
        out.append(f"\r{desc}: {pct}{mid} [00:0{n}<00:0{total - n}, 1.31s/it]")
    return "".join(out)


# SGLang 0.5.12 (utils/common.py configure_logger: "[%(asctime)s TP0] %(message)s"), a whole start.
SGLANG_0_5_12 = [
    ("[2026-12-02 10:00:00 TP0] Init torch distributed ends. mem usage=0.00 GB", None),
    ("[2026-12-02 10:00:01 TP0] Load weight begin. avail mem=78.50 GB", P(WEIGHTS)),
    (bar("Loading safetensors checkpoint shards", 4, 4), P(WEIGHTS, 4, 4)),
    ("[2026-12-02 10:00:07 TP0] Load weight end. elapsed=6.12 s, type=Qwen3ForCausalLM, avail mem=62.10 GB, "
     "mem usage=16.40 GB.", P(WEIGHTS, 4, 4, True)),
    ("[2026-12-02 10:00:08 TP0] KV Cache is allocated. #tokens: 400000, K size: 27.47 GB", P(WEIGHTS, 4, 4, True)),
    ("[2026-12-02 10:00:08 TP0] Capture cuda graph begin. This can take up to several minutes. avail mem=6.41 GB",
     P(GRAPHS)),
    ("[2026-12-02 10:00:08 TP0] Capture cuda graph bs [1, 2, 4, 8, 12, 16, 24, 32]", P(GRAPHS, None, 8)),
    (bar("Capturing batches (bs=32 avail_mem=6.38 GB)", 8, 3, completed=False), P(GRAPHS, 3, 8)),
    ("[2026-12-02 10:00:12 TP0] Capture cuda graph end. Time elapsed: 4.01 s. mem usage=0.49 GB. avail mem=5.89 GB.",
     P(GRAPHS, 3, 8, True)),
    ("[2026-12-02 10:00:14] INFO:     Uvicorn running on http://127.0.0.1:30000 (Press CTRL+C to quit)",
     P(GRAPHS, 3, 8, True)),
    ("[2026-12-02 10:00:16] The server is fired up and ready to roll!", P(READY)),
]

# vLLM 0.33.0 (logger.py _FORMAT; the engine core's lines carry its process prefix). Its shard
# bar ends every redraw with a newline (_BAR_FORMAT): one record each, the next one's padding
# and carriage return first.
VLLM_0_33_0 = [
    ("(EngineCore_DP0 pid=4242) INFO 12-02 10:00:01 [gpu_model_runner.py:4979] Starting to load model "
     "/models/Qwen3-8B...", P(WEIGHTS)),
    ("(EngineCore_DP0 pid=4242) Loading safetensors checkpoint shards:   0% Completed | 0/5 [00:00<?, ?it/s]",
     P(WEIGHTS, 0, 5)),
    ("   \rLoading safetensors checkpoint shards:  40% Completed | 2/5 [00:02<00:03,  1.30s/it]", P(WEIGHTS, 2, 5)),
    ("(EngineCore_DP0 pid=4242) INFO 12-02 10:00:09 [default_loader.py:507] Loading weights took 7.91 seconds",
     P(WEIGHTS, 2, 5, True)),
    ("(EngineCore_DP0 pid=4242) INFO 12-02 10:00:10 [gpu_model_runner.py:5089] Model loading took 15.27 GiB memory "
     "and 8.612 seconds", P(WEIGHTS, 2, 5, True)),
    (bar("Capturing CUDA graphs (mixed prefill-decode, PIECEWISE)", 67, 33, completed=False), P(GRAPHS, 33, 67)),
    ("(EngineCore_DP0 pid=4242) INFO 12-02 10:00:21 [gpu_model_runner.py:6517] Graph capturing finished in 9 secs, "
     "took 0.52 GiB", P(GRAPHS, 33, 67, True)),
    ("(APIServer pid=4201) INFO:     Application startup complete.", P(READY)),
]

# SGLang 0.5.23 (model_runner_components/cuda_graph_setup.py) names what it captures.
SGLANG_0_5_23 = [
    ("[2026-12-02 10:00:08 TP0] Capture target decode CUDA graph begin. backend=full, num_tokens_per_req=1, "
     "avail mem=6.41 GB", P(GRAPHS)),
    ("[2026-12-02 10:00:12 TP0] Capture target decode CUDA graph end. bs=[1, 2, 4, 8], elapsed=3.80 s, "
     "mem usage=0.49 GB, avail mem=5.89 GB.", P(GRAPHS, finished=True)),
    ("[2026-12-02 10:00:12 TP0] Capture draft extend CUDA graph begin. step=1, backend=full", P(GRAPHS)),
]


def _strip(p: LoadProgress | None) -> LoadProgress | None:
    """The progress without its quote (compared on its own)."""
    return None if p is None else LoadProgress(p.stage, p.done, p.total, p.finished)


@pytest.mark.parametrize("engine", [SGLANG_0_5_12, VLLM_0_33_0, SGLANG_0_5_23],
                         ids=["sglang-0.5.12", "vllm-0.33.0", "sglang-0.5.23"])
def test_each_line_of_a_real_start_moves_the_progress_as_the_engine_says(engine):
    now = None
    for line, want in engine:
        now = advance(now, [line])
        assert _strip(now) == want, line
    # read all at once (a first look at a journal that already has them): the same end
    assert _strip(advance(None, [line for line, _ in engine])) == engine[-1][1]


def test_a_bar_quotes_its_latest_redraw_and_a_log_line_itself():
    p = advance(None, [bar("Loading safetensors checkpoint shards", 4, 2)])
    assert p is not None
    assert p.line == "Loading safetensors checkpoint shards:  50% Completed | 2/4 [00:02<00:02, 1.31s/it]"
    line = "[2026-12-02 10:00:07 TP0] Load weight end. elapsed=6.12 s, type=Qwen3ForCausalLM"
    assert advance(p, [line]) == LoadProgress(WEIGHTS, 2, 4, True, line)


def test_a_bar_cut_short_by_another_process_line_counts_and_so_does_that_line():
    # A redraw without a newline, then another rank's line on the same stream: one record.
    record = bar("Loading safetensors checkpoint shards", 8, 3) + "[2026-12-02 10:00:03 TP1] Load weight end. x"
    p = advance(None, [record])
    assert _strip(p) == LoadProgress(WEIGHTS, 3, 8, True)
    assert p is not None
    assert p.line == ("Loading safetensors checkpoint shards:  38% Completed | 3/8 [00:03<00:05, 1.31s/it]"
                      "[2026-12-02 10:00:03 TP1] Load weight end. x")
    only_bar = advance(None, [bar("Loading safetensors checkpoint shards", 8, 3) + "[TP1] unrelated"])
    assert only_bar is not None and only_bar.line.endswith("| 3/8 [00:03<00:05, 1.31s/it]")


def test_lines_that_say_nothing_of_the_load_change_nothing():
    before = LoadProgress(WEIGHTS, 1, 4, line="x")
    quiet = ["", "[2026-12-02 10:00:00 TP0] server_args=ServerArgs(model_path='/m', tp_size=4)",
             "Capture cuda graph failed: CUDA error: out of memory", "RuntimeError: boom",
             "  0%|          | 0/8 [00:00<?, ?it/s]"]
    assert advance(before, quiet) is before
    assert advance(None, quiet) is None


def test_a_long_line_is_quoted_in_part():
    p = advance(None, ["Load weight begin. " + "x" * 1000])
    assert p is not None and len(p.line) == progress.QUOTE_MAX


@pytest.mark.parametrize("p,text", [
    (P(WEIGHTS), "loading weights"),
    (P(WEIGHTS, 2, 4), "loading weights: 2/4 checkpoint shards (50%)"),
    (P(WEIGHTS, 0, 4), "loading weights: 0/4 checkpoint shards (0%)"),
    (P(WEIGHTS, 4, 4, True), "weights loaded (4 checkpoint shards)"),
    (P(WEIGHTS, finished=True), "weights loaded"),
    (P(GRAPHS), "capturing CUDA graphs"),
    (P(GRAPHS, None, 8), "capturing CUDA graphs (8 batch sizes)"),
    (P(GRAPHS, 3, 8), "capturing CUDA graphs: 3/8 (38%)"),
    (P(GRAPHS, 3, 8, True), "CUDA graphs captured"),
    (P(READY), "engine ready"),
])
def test_the_words_each_progress_is_shown_in(p, text):
    assert p.text() == text
    assert p.to_json()["text"] == text


def test_the_json_of_a_progress():
    assert P(WEIGHTS, 1, 3, line="L").to_json() == {
        "stage": "weights", "done": 1, "total": 3, "finished": False, "percent": 33,
        "text": "loading weights: 1/3 checkpoint shards (33%)", "line": "L"}


# -- the journal read: its program and its parser -----------------------------------------------

TOKEN = "t0k3n"
INV_A, INV_B = "a" * 32, "b" * 32
CURSOR = "s=1a;i=2b;b=3c;m=4d;t=5e;x=6f"


def fed(f: LoadFollower, stdout: str) -> None:
    """The follower given progress.sh's answer (as the tick hands it over, parsed)."""
    f.take(parse_tail(stdout, TOKEN))


def run_program(tmp_path: Path, output: bytes, reads: list[tuple[str, str | None]]) -> tuple[str, list[list[str]]]:
    """progress.sh run here, with a stand-in journalctl that prints `output` and records its
    arguments: (what the program printed, each journalctl's arguments)."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    (tmp_path / "out").write_bytes(output)
    fake = bin_dir / "journalctl"
    fake.write_text(f'#!/bin/sh\nprintf "%s\\n" "$*" >> {shlex.quote(str(tmp_path / "args"))}\n'
                    f'cat {shlex.quote(str(tmp_path / "out"))}\n')
    fake.chmod(0o755)
    res = run_here(progress.JournalTail(tuple(reads)), tokens=[TOKEN], path=f"{bin_dir}:{os.environ['PATH']}")
    args = [line.split(" ") for line in (tmp_path / "args").read_text().splitlines()]
    return res.stdout, args


def test_the_program_reads_each_invocation_after_its_cursor_framed_and_bounded(tmp_path):
    bar_record = "\r".join(f"Loading safetensors checkpoint shards: {i}/400" for i in range(400))   # > LINE_MAX
    out = f"Load weight begin.\n{bar_record}\n-- cursor: {CURSOR}\n".encode()
    stdout, args = run_program(tmp_path, out, [(INV_A, None), (INV_B, CURSOR)])
    assert args == [[f"_SYSTEMD_INVOCATION_ID={INV_A}", "-n", "200", "-o", "cat", "--show-cursor", "--no-pager"],
                    [f"_SYSTEMD_INVOCATION_ID={INV_B}", f"--after-cursor={CURSOR}", "-n", "200", "-o", "cat",
                     "--show-cursor", "--no-pager"]]
    sections = parse_tail(stdout + "Id=m.service\nActiveState=active\n", TOKEN)
    lines, cursor = sections[INV_A]
    assert cursor == CURSOR and lines[0] == "Load weight begin."
    # its end kept, from the first whole word after the cut (the word the cut went through goes)
    kept = len(lines[1].encode())
    assert progress.LINE_MAX - 50 < kept <= progress.LINE_MAX and lines[1].endswith("shards: 399/400")
    assert bar_record.endswith(lines[1]) and bar_record[-kept - 1] in " \r"
    assert sections[INV_B] == sections[INV_A]
    assert _strip(advance(None, lines)) == LoadProgress(WEIGHTS)   # "n/400" alone is no tqdm bar


def test_the_program_sends_at_most_max_bytes_an_invocation_and_no_line_cut_at_its_front(tmp_path):
    many = b"".join(b"Load weight begin. line %05d\n" % i for i in range(5000)) + f"-- cursor: {CURSOR}\n".encode()
    stdout, _ = run_program(tmp_path, many, [(INV_A, None)])
    body = stdout.split(f"{TOKEN} U {INV_A}\n", 1)[1].split(f"{TOKEN} END\n", 1)[0]
    assert len(body.encode()) <= progress.MAX_BYTES
    lines, cursor = parse_tail(stdout, TOKEN)[INV_A]
    assert cursor == CURSOR and lines[-1] == "Load weight begin. line 04999"
    assert all(line.startswith("Load weight begin. line ") and len(line) == 29 for line in lines)   # none cut


def test_only_journalctls_own_last_line_is_the_cursor():
    forged = "-- cursor: s=0;i=0;b=0;m=0;t=0;x=0"
    stdout = (f"{TOKEN} U {INV_A}\n{TOKEN} L {forged}\n{TOKEN} L hello\n{TOKEN} L -- cursor: {CURSOR}\n"
              f"{TOKEN} U {INV_B}\n{TOKEN} L {forged}x\n{TOKEN} END\nrest\n")
    sections = parse_tail(stdout, TOKEN)
    assert sections == {INV_A: ([forged, "hello"], CURSOR), INV_B: ([forged + "x"], None)}
    assert parse_tail("no answer at all\n", TOKEN) == {}


# -- the follower: which units, when, and what it keeps ------------------------------------------

def test_the_follower_reads_only_a_new_invocation_of_a_followed_unit_and_at_most_every_so_often():
    f = LoadFollower(every=1.0)
    f.follow("m.service", baseline_invocation=INV_A)
    assert f.command(0.0, ["m.service"]) is None             # no invocation of our start seen yet
    f.saw("m.service", {"InvocationID": INV_A})               # the old process: not this start's
    assert f.command(0.0, ["m.service"]) is None
    f.saw("other.service", {"InvocationID": INV_B})           # not followed
    f.saw("m.service", {"InvocationID": INV_B})
    cmd = f.command(0.0, ["m.service", "other.service"])
    assert cmd is not None and cmd.reads == ((INV_B, None),)
    assert f.command(0.5, ["m.service"]) is None              # read under a second ago
    assert f.command(1.0, ["other.service"]) is None          # this tick does not ask for it
    fed(f, f"{TOKEN} U {INV_B}\n{TOKEN} L Load weight begin.\n{TOKEN} L -- cursor: {CURSOR}\n{TOKEN} END\n")
    cmd = f.command(1.0, ["m.service"])
    assert cmd is not None and cmd.reads == ((INV_B, CURSOR),)
    assert f.progress("m.service") == LoadProgress(WEIGHTS, line="Load weight begin.")
    f.saw("m.service", {"InvocationID": "c" * 32})            # systemd restarted it: start over
    assert f.progress("m.service") is None
    assert f.command(2.0, ["m.service"]).reads == (("c" * 32, None),)   # type: ignore[union-attr]
    f.unfollow("m.service")
    assert f.command(5.0, ["m.service"]) is None and f.progress("m.service") is None


def test_the_follower_keeps_a_cursor_when_a_read_has_none_and_redacts_what_it_quotes():
    f = LoadFollower()
    f.follow("m.service")
    f.saw("m.service", {"InvocationID": INV_A})
    fed(f, f"{TOKEN} U {INV_A}\n{TOKEN} L -- cursor: {CURSOR}\n{TOKEN} END\n")
    assert f.units["m.service"].cursor == CURSOR and f.progress("m.service") is None
    fed(f, f"{TOKEN} U {INV_A}\n{TOKEN} END\n")                # nothing new: no cursor line
    assert f.units["m.service"].cursor == CURSOR
    token = "hf_" + "Ab3" * 8
    fed(f, f"{TOKEN} U {INV_A}\n{TOKEN} L Load weight begin. token={token} \x1b[31m\n{TOKEN} END\n")
    p = f.progress("m.service")
    assert p is not None and token not in p.line and "\x1b" not in p.line and "\\x1b[31m" in p.line
    assert p.line.startswith("Load weight begin. token=")


# -- the watch: the progress is its phase, read with the ticks it makes anyway -------------------

POLL = 1 / 16
RTT = 1 / 128
STARTING = {"LoadState": "loaded", "ActiveState": "activating", "SubState": "start", "NRestarts": "0",
            "InvocationID": INV_B, "ActiveEnterTimestampMonotonic": "0"}
RUNNING = {**STARTING, "ActiveState": "active", "SubState": "running", "ActiveEnterTimestampMonotonic": "5"}


class LoadingHost:
    """A fake transport: `systemctl show` answers `starting` readings for `loading` seconds of
    the virtual clock, then running ones; a journal read put before it (progress.sh, parsed from
    the command as the host's sh would) answers the next batch of `batches`, framed as the
    program frames it. Records each round trip's virtual time and whether it read the journal."""

    host = "h1"

    def __init__(self, batches: list[list[str]], loading: float):
        from tests.clock import FakeClock
        self.clock = FakeClock()
        self.batches, self.loading = list(batches), loading
        self.trips: list[tuple[float, bool]] = []

    async def run(self, cmd, *, input=None, check=False, timeout=60.0, what="command"):
        from reconciler.host.transport import Completed
        await self.clock.sleep(RTT)
        *journal, show = headers(input)          # progress.sh's parameters, then show.sh's
        assert (show["unit"] and not journal) or journal[0]["read"][0].startswith(INV_B + " "), input
        out = ""
        if journal:
            token, read = journal[0]["token"][0], journal[0]["read"][0].split()[0]
            lines = self.batches.pop(0) if self.batches else []
            out = f"{token} U {read}\n" + "".join(f"{token} L {x}\n" for x in lines)
            out += f"{token} L -- cursor: s=1;i={len(self.batches):x};b=1;m=1;t=1;x=1\n" if lines else ""
            out += f"{token} END\n"
        self.trips.append((self.clock.elapsed(), bool(journal)))
        props = STARTING if self.clock.elapsed() < self.loading else RUNNING
        out += f"{show['token'][0]} S -\n"
        return Completed(0, out + "\n".join([f"Id={show['unit'][0]}", *(f"{k}={v}" for k, v in props.items())])
                         + "\n", "")


def test_a_watch_shows_the_engines_progress_as_its_phase_without_a_round_trip_of_its_own():
    import asyncio

    from reconciler.desired.spec import HealthSpec
    from reconciler.host.health import SystemdWatch, watch_service
    batches = [["[TP0] Load weight begin. avail mem=78.50 GB"],
               ["Loading safetensors checkpoint shards:  50% Completed | 1/2 [00:01<00:01, 1.0s/it]"],
               ["\rLoading safetensors checkpoint shards: 100% Completed | 2/2 [00:02<00:00, 1.0s/it]",
                "[TP0] Load weight end. elapsed=2.00 s"],
               [],                                               # nothing new this time
               ["[TP0] Capture cuda graph begin. avail mem=6.41 GB", "[TP0] Capture cuda graph end. Time elapsed: 1 s.",
                "[TP0] The server is fired up and ready to roll!"]]
    t = LoadingHost(batches, loading=4.5)
    phases: list[str] = []
    told: list[LoadProgress] = []

    async def main():
        systemd = SystemdWatch(t, POLL, t.clock)
        return await watch_service(t, "m", HealthSpec(stable_for=0.5, startup_timeout=60), baseline_restarts=0,
                                   since_epoch=0, baseline_invocation="old", systemd=systemd,
                                   on_phase=lambda _s, p, _e, _t: phases.append(p),
                                   on_progress=lambda s, p: told.append(p))
    out = asyncio.run(main())
    assert out.reason == "Healthy"
    assert phases == ["starting", "loading weights", "loading weights: 1/2 checkpoint shards (50%)",
                      "weights loaded (2 checkpoint shards)", "engine ready",
                      "healthy, checking it stays stable for 0.5s", "healthy"]
    assert [p.text() for p in told] == phases[1:5]
    assert told[-1].line == "[TP0] The server is fired up and ready to roll!"
    reads = [at for at, journal in t.trips if journal]
    # every read rode on a tick's systemctl show, a second apart at least, none once it was healthy
    assert len(reads) == 5 and all(b - a >= PROGRESS_EVERY for a, b in itertools.pairwise(reads))
    assert reads[-1] < 4.5 and all(not journal for at, journal in t.trips if at > 4.5 + POLL)
