"""--notify-url against a local HTTP server: a finding's start and end are posted once each, in Alertmanager's
webhook shape with a chat `text`; a URL that hangs or fails never delays a window, and failures are retried."""
from __future__ import annotations

import asyncio
import time

import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from rankscope.agent.service.notify import Notifier, parse_notify_url

STRAGGLER = {"kind": "compute_straggler", "ranks": [1], "cost": 0.25, "summary": "rank 1's GPU is slow",
             "evidence": {"per_rank": [{"rank": 1, "z": 9.0}]}}
GC = {"kind": "python_gc", "ranks": [0, 2], "cost": 0.1, "summary": "collections", "evidence": {}}


def _docs(end: float, *findings: dict) -> dict:
    return {"job-a": {"job": "job-a", "window": {"start": end - 5, "end": end}, "findings": list(findings),
                      "ranks": [{"rank": r, "host": f"node{r}"} for r in range(3)]}}


class Receiver:
    """An HTTP server that records the JSON bodies posted to /ok, fails /fail with 500 and answers /hang only
    once released."""

    def __init__(self):
        self.bodies: list[dict] = []
        self.failed = 0
        self.changed = asyncio.Event()
        self.release = asyncio.Event()
        app = web.Application()
        app.router.add_post("/ok", self.ok)
        app.router.add_post("/fail", self.fail)
        app.router.add_post("/hang", self.hang)
        self.server = TestServer(app)

    async def ok(self, request: web.Request) -> web.Response:
        self.bodies.append(await request.json())
        self.changed.set()
        return web.Response(text="ok")

    async def fail(self, _: web.Request) -> web.Response:
        self.failed += 1
        self.changed.set()
        return web.Response(status=500)

    async def hang(self, _: web.Request) -> web.Response:
        await self.release.wait()
        return web.Response(text="late")

    def url(self, path: str) -> str:
        return str(self.server.make_url(path))

    async def until(self, done, timeout: float = 10.0) -> None:
        async def wait():
            while not done():
                self.changed.clear()
                await self.changed.wait()

        await asyncio.wait_for(wait(), timeout)


def test_a_finding_starts_and_ends_once_each_in_alertmanagers_shape():
    async def go():
        r = Receiver()
        await r.server.start_server()
        notifier = Notifier([r.url("/ok")], "agent")
        try:
            windows = [_docs(100.0), _docs(105.0, STRAGGLER), _docs(110.0, STRAGGLER), _docs(115.0, STRAGGLER),
                       _docs(120.0), _docs(125.0), _docs(130.0, GC)]
            for docs in windows:
                notifier.update(docs)
            await r.until(lambda: len(r.bodies) >= 3)
        finally:
            await asyncio.to_thread(notifier.close)  # joins the senders: the server must go on answering
            await r.server.close()
        return r.bodies

    start, end, gc = asyncio.run(go())
    assert [(b["event"], b["status"], b["finding"]["kind"]) for b in (start, end, gc)] == [
        ("start", "firing", "compute_straggler"), ("end", "resolved", "compute_straggler"), ("start", "firing", "python_gc")]
    (alert,) = start["alerts"]
    assert alert["labels"].items() >= {"job": "job-a", "kind": "compute_straggler", "ranks": "1", "node": "node1"}.items()
    assert alert["startsAt"].startswith("1970-01-01T00:01:45") and alert["endsAt"].startswith("0001-")
    assert end["alerts"][0]["endsAt"].startswith("1970-01-01T00:02:00")  # the first window without it
    assert "rank 1's GPU is slow" in start["text"] and "started" in start["text"] and "ended" in end["text"]
    assert start["finding"]["evidence"] == STRAGGLER["evidence"]
    assert gc["alerts"][0]["labels"]["node"] == "node0,node2"


def test_a_url_that_hangs_or_fails_never_delays_a_window_and_failures_are_retried():
    async def go():
        r = Receiver()
        await r.server.start_server()
        notifier = Notifier([r.url("/hang"), r.url("/fail"), r.url("/ok")], "agent", timeout_s=30.0, backoff_s=0.01)
        try:
            took = []
            for i, docs in enumerate([_docs(100.0, STRAGGLER), _docs(105.0), _docs(110.0, STRAGGLER)]):
                started = time.perf_counter()
                notifier.update(docs)
                took.append(time.perf_counter() - started)
            await r.until(lambda: len(r.bodies) == 3 and r.failed >= 4)  # the hanging URL holds nobody else up
            return took, r.failed, [b["event"] for b in r.bodies]
        finally:
            r.release.set()
            await asyncio.to_thread(notifier.close)  # joins the senders: the server must go on answering
            await r.server.close()

    took, failed, events = asyncio.run(go())
    assert max(took) < 0.05
    assert failed >= 4  # the first event's four attempts at least
    assert events == ["start", "end", "start"]


def test_events_beyond_the_rate_limit_are_dropped():
    async def go():
        r = Receiver()
        await r.server.start_server()
        notifier = Notifier([r.url("/ok")], "agent", per_minute=2)
        try:
            for i in range(6):  # a start and an end every two windows: 6 events
                notifier.update(_docs(100.0 + 5 * i, *([STRAGGLER] if i % 2 == 0 else [])))
            notifier.update(_docs(200.0))
            await r.until(lambda: len(r.bodies) >= 2)
        finally:
            await asyncio.to_thread(notifier.close)  # joins the senders: the server must go on answering
            await r.server.close()
        return r.bodies

    assert len(asyncio.run(go())) == 2


@pytest.mark.parametrize("url", ["ftp://host/x", "http://", "not a url", "http://host:99999/"])
def test_a_notify_url_must_be_http(url):
    with pytest.raises(ValueError):
        parse_notify_url(url)
