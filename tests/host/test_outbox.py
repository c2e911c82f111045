"""The outbox (host/outbox.py) that webhooks and forge statuses go out through: in order, one at
a time, bounded, a newer request under the same key replacing a queued one, every failure a
warning, never an exception into the caller. httpx.MockTransport stands in for the far end."""

from __future__ import annotations

import asyncio

import httpx

from reconciler.host.outbox import Outbox


class Poster(Outbox[str]):
    """A sender as notify.py and forge.py are: how to send one item, and the words of a failure."""

    def __init__(self, seen: list[str], status: int = 204, max_pending: int = 3):
        def handle(request: httpx.Request) -> httpx.Response:
            seen.append(request.content.decode())
            return httpx.Response(status)
        super().__init__(lambda: httpx.AsyncClient(transport=httpx.MockTransport(handle)), max_pending=max_pending)
        self.said: list[str] = []

    async def _deliver(self, client: httpx.AsyncClient, item: str) -> None:
        (await client.post("http://127.0.0.1:9/x", content=item)).raise_for_status()

    def _failed(self, item: str, e: Exception) -> str:
        return f"{item}: {type(e).__name__}"

    def _say(self, msg: str) -> None:
        self.said.append(msg)


def outbox(seen: list[str], status: int = 204, max_pending: int = 3) -> tuple[Outbox[str], list[str]]:
    box = Poster(seen, status, max_pending)
    return box, box.said


def test_requests_go_out_in_order_and_a_newer_one_replaces_a_queued_one_under_its_key() -> None:
    seen: list[str] = []

    async def run() -> tuple[int, list[str]]:
        box, warnings = outbox(seen)
        box.put("a", "a1")
        box.put("b", "b1")
        box.put("a", "a2")                 # a1 was still queued: a2 replaces it, behind b1
        assert box.pending == 2 and seen == []     # put never waits
        assert await box.drain(5)
        await box.close()
        return box.sent, warnings
    assert asyncio.run(run()) == (2, [])
    assert seen == ["b1", "a2"]


def test_the_queue_is_bounded_and_what_it_drops_is_said() -> None:
    seen: list[str] = []

    async def run() -> list[str]:
        box, warnings = outbox(seen, max_pending=2)
        for i in range(4):
            box.put(i, f"e{i}")
        assert await box.drain(5)
        await box.close()
        return warnings
    assert asyncio.run(run()) == ["dropped 'e0'", "dropped 'e1'"]
    assert seen == ["e2", "e3"]


def test_a_failure_is_handed_to_the_owner_and_the_next_request_still_goes() -> None:
    seen: list[str] = []

    async def run() -> tuple[int, list[str]]:
        box, warnings = outbox(seen, status=500)
        box.put(1, "one")
        box.put(2, "two")
        assert await box.drain(5)
        await box.close()
        return box.sent, warnings
    assert asyncio.run(run()) == (0, ["one: HTTPStatusError", "two: HTTPStatusError"])
    assert seen == ["one", "two"]


def test_warnings_are_redacted_and_only_the_newest_are_kept() -> None:
    from reconciler import redact
    from reconciler.host import outbox as module
    redact.register("hunter2-secret-value")
    box = Poster([])
    for i in range(module.KEEP + 5):
        box.warn(f"w{i} token hunter2-secret-value")
    assert len(box.failures) == module.KEEP and box.failures[0].startswith("w5 ")
    assert all("hunter2-secret-value" not in w for w in box.failures + box.said)


def test_close_drops_what_is_queued_and_a_drain_is_bounded() -> None:
    release = asyncio.Event()
    seen: list[str] = []

    async def run() -> tuple[bool, int]:
        class Slow(Outbox[str]):
            async def _deliver(self, client: httpx.AsyncClient, item: str) -> None:
                seen.append(item)
                await release.wait()
        box = Slow(lambda: httpx.AsyncClient(), max_pending=5)
        box.put(1, "held")
        box.put(2, "queued")
        drained = await box.drain(0)       # the first is held at the far end
        left = box.pending
        await box.close()
        return drained, left
    assert asyncio.run(run()) == (False, 1)
    assert seen == ["held"]
