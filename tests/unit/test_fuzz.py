"""Hypothesis fuzzing of what the network can reach: the pattern decoder and the HTTP handlers.

Bounded example counts keep this to seconds in CI; a failure prints the shrunk input.
"""
from __future__ import annotations

import asyncio
from collections.abc import Iterator

import msgpack
import pytest
from aiohttp.test_utils import TestServer
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from test_analyzer import simulate
from test_patterns import typical
from test_server import SNAP

from rankscope.agent.service.cluster_analyzer import AgentStatus, ClusterSnapshot, make_cluster_app
from rankscope.agent.service.http import make_app
from rankscope.analyzer.cluster import diagnose_cluster
from rankscope.schema.wire import PatternDecodeError, decode_patterns, encode_patterns

FAST = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
TOKEN = "s3cret-token"

values = st.recursive(
    st.none() | st.booleans() | st.integers(-2**64, 2**64 - 1) | st.floats() | st.text(max_size=8)
    | st.binary(max_size=8),
    lambda inner: st.lists(inner, max_size=5) | st.dictionaries(st.text(max_size=6), inner, max_size=5),
    max_leaves=20,
)


def _decodes_or_refuses(data: bytes) -> None:
    try:
        decode_patterns(data)
    except PatternDecodeError:
        pass  # the only exception allowed


@FAST
@given(st.binary(max_size=512))
def test_decoder_on_random_bytes(data):
    _decodes_or_refuses(data)


@FAST
@given(values)
def test_decoder_on_random_msgpack(obj):
    try:
        data = msgpack.packb(obj)
    except (OverflowError, ValueError):  # ints msgpack cannot carry
        return
    _decodes_or_refuses(data)


WIRE = msgpack.unpackb(encode_patterns([typical()]))[0]


@FAST
@given(st.sampled_from(sorted(WIRE)), values, st.integers(0, 3))
def test_decoder_on_a_real_pattern_with_one_field_replaced(key, value, depth):
    """Deep mutations: a well-formed pattern with one field (or one cell of its rows) of the wrong shape."""
    wire = msgpack.unpackb(msgpack.packb(WIRE))
    target, k = wire, key
    for _ in range(depth):  # descend into rows so that a single cell gets replaced
        inner = target[k]
        if isinstance(inner, dict) and inner:
            target, k = inner, next(iter(inner))
        elif isinstance(inner, list) and inner:
            target, k = inner, 0
    target[k] = value
    try:
        data = msgpack.packb([wire])
    except (OverflowError, ValueError):
        return
    _decodes_or_refuses(data)


@FAST
@given(st.binary(min_size=1, max_size=64), st.integers(0, 2000))
def test_decoder_on_truncated_and_corrupted_payloads(noise, at):
    good = encode_patterns([typical(0), typical(1)])
    at %= len(good)
    _decodes_or_refuses(good[:at])
    _decodes_or_refuses(good[:at] + noise + good[at + len(noise):])


# --- HTTP ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def servers() -> Iterator[tuple[asyncio.AbstractEventLoop, dict[str, TestServer]]]:
    """Two real listening servers (without and with a token) on one loop shared by every example."""
    loop = asyncio.new_event_loop()
    cluster = ClusterSnapshot(agents=[AgentStatus("http://10.0.0.1:9464", "down", "refused")],
                              diagnoses=diagnose_cluster(simulate(4), {}))
    servers = {"open": TestServer(make_app(lambda: SNAP)), "token": TestServer(make_app(lambda: SNAP, TOKEN)),
               "cluster": TestServer(make_cluster_app(lambda: cluster, TOKEN))}
    for s in servers.values():
        loop.run_until_complete(s.start_server())
    yield loop, servers
    for s in servers.values():
        loop.run_until_complete(s.close())
    loop.close()


async def _status(server: TestServer, request: bytes) -> int:
    """Send raw bytes (so the server's own HTTP parser is fuzzed too) and read the status code."""
    reader, writer = await asyncio.open_connection(server.host, server.port)
    try:
        writer.write(request)
        await writer.drain()
        line = await asyncio.wait_for(reader.readline(), 10)
    finally:
        writer.close()
    assert line.startswith(b"HTTP/1."), line  # the parser answers errors as HTTP/1.0
    return int(line.split()[1])


URL_BYTES = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b"").replace(b" ", b"%20"))
HEADER_VALUE = st.binary(max_size=80).map(lambda b: b.replace(b"\r", b"").replace(b"\n", b""))
PATHS = st.sampled_from([b"/healthz", b"/v1/targets", b"/v1/patterns", b"/v1/diagnosis", b"/v1/jobs", b"/metrics",
                         b"/v1/diagnosis?job=job-a", b"/"]) | URL_BYTES
HEADERS = st.lists(st.tuples(st.sampled_from([b"Accept", b"Authorization", b"Content-Length", b"Range", b"X-A"]),
                             HEADER_VALUE | st.sampled_from([b"application/msgpack", b"Bearer " + TOKEN.encode()])),
                   max_size=4)


@FAST
@given(st.sampled_from(["open", "token", "cluster"]), st.sampled_from([b"GET", b"HEAD", b"POST", b"PUT", b"OPTIONS"]), PATHS,
       URL_BYTES, HEADERS)
def test_http_never_5xx(servers, which, method, path, query, headers):
    loop, by_name = servers
    head = [method + b" " + (path if path.startswith(b"/") else b"/" + path) + b"?" + query + b" HTTP/1.1",
            b"Host: x", b"Connection: close", *(k + b": " + v for k, v in headers)]
    request = b"\r\n".join(head) + b"\r\n\r\n"
    status = loop.run_until_complete(_status(by_name[which], request))
    assert 200 <= status < 500, (status, request)
