"""The cluster analyzer's HTTP client (agent/service/pull.py) against servers that send exactly the bytes a
test chooses: a kept-alive connection is reused, and every answer it does not understand is that agent's
error, never a hang or a wrong body."""
from __future__ import annotations

import asyncio
from collections.abc import Callable

import pytest

from rankscope.agent.service.pull import Puller, PullError

OK = b"HTTP/1.1 200 OK\r\nContent-Type: application/msgpack\r\nContent-Length: 5\r\n\r\nhello"


async def _serve(answer: Callable[[bytes], bytes | None],
                 hang_up: bool) -> tuple[asyncio.AbstractServer, list[int]]:
    """A server that answers each request head with answer(head) (None: say nothing), and closes the
    connection after it if `hang_up`; counts connections."""
    connections: list[int] = []

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        connections.append(1)
        try:
            while head := await reader.readuntil(b"\r\n\r\n"):
                reply = answer(head)
                if reply is None:
                    await asyncio.Event().wait()
                writer.write(reply)
                await writer.drain()
                if hang_up:
                    break
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            writer.close()

    server = await asyncio.start_server(handle, "127.0.0.1", 0)
    return server, connections


def _get(answer: Callable[[bytes], bytes | None], times: int = 1, timeout_s: float = 5.0, hang_up: bool = False):
    async def go():
        server, connections = await _serve(answer, hang_up)
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        puller = Puller({"Accept": "application/msgpack", "Authorization": "Bearer t"}, timeout_s, 4, 1 << 20)
        try:
            return [await puller.get(url, "/v1/patterns", {"replica": "1"}) for _ in range(times)], connections
        finally:
            puller.close()
            server.close()
    return asyncio.run(go())


def test_answers_come_over_one_kept_alive_connection_with_the_headers():
    heads = []
    answers, connections = _get(lambda head: heads.append(head) or OK, times=3)
    assert [(a.status, a.body) for a in answers] == [(200, b"hello")] * 3
    assert len(connections) == 1
    assert heads[0].startswith(b"GET /v1/patterns?replica=1 HTTP/1.1\r\nHost: 127.0.0.1:")
    assert b"Authorization: Bearer t\r\n" in heads[0] and b"Accept: application/msgpack\r\n" in heads[0]


def test_a_server_that_closes_after_each_answer_is_reconnected():
    answers, connections = _get(lambda _: OK.replace(b"\r\n\r\n", b"\r\nConnection: close\r\n\r\n"), times=2,
                                hang_up=True)
    assert [a.body for a in answers] == [b"hello"] * 2 and len(connections) == 2


def test_an_error_status_is_an_answer_with_its_body():
    answers, _ = _get(lambda _: b"HTTP/1.1 401 Unauthorized\r\nContent-Length: 3\r\n\r\nno!")
    assert (answers[0].status, answers[0].body) == (401, b"no!")


@pytest.mark.parametrize("reply, says", [
    (b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n5\r\nhello\r\n0\r\n\r\n", "Content-Length"),
    (b"HTTP/1.1 200 OK\r\n\r\nhello", "Content-Length"),
    (b"SSH-2.0-OpenSSH\r\n\r\n", "not an HTTP/1 answer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 99999999\r\n\r\n", "larger than"),
    (b"HTTP/1.1 200 OK\r\nX: " + b"a" * 20000, "headers longer"),
    (b"HTTP/1.1 200 OK\r\nContent-Length: 50\r\n\r\nshort", "connection closed"),
])
def test_answers_it_does_not_understand_are_errors(reply, says):
    with pytest.raises(PullError, match=says):
        _get(lambda _: reply, hang_up=True)


def test_a_silent_agent_times_out():
    with pytest.raises(PullError, match="no answer within 0.2 s"):
        _get(lambda _: None, timeout_s=0.2)


def test_a_refused_connection_is_an_error():
    async def go():
        puller = Puller({}, 2.0, 1, 100)
        with pytest.raises(PullError, match="cannot connect"):
            await puller.get("http://127.0.0.1:1", "/v1/patterns", {})
    asyncio.run(go())


def test_a_kept_connection_the_agent_closed_is_asked_again_on_a_new_one():
    async def go():
        server, connections = await _serve(lambda _: OK, hang_up=True)  # closes after each answer, silently
        url = f"http://127.0.0.1:{server.sockets[0].getsockname()[1]}"
        puller = Puller({}, 5.0, 1, 100)
        try:
            first = await puller.get(url, "/", {})
            second = await puller.get(url, "/", {})
        finally:
            puller.close()
            server.close()
        return first.body, second.body, len(connections)
    assert asyncio.run(go()) == (b"hello", b"hello", 2)
