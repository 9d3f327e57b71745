"""Scoped access to the HTTP API: a read token and a capture token, a session cookie that is not the token and
starts no capture, captures one at a time with a cool-down off the windows' executor, bounded query
parameters, and a capped, timed, optionally TLS connection layer before any of it."""
from __future__ import annotations

import asyncio
import ssl
import subprocess
import threading
import time
from urllib.parse import urlencode

import pytest
from aiohttp import ClientSession, TCPConnector
from aiohttp.test_utils import TestClient, TestServer
from conftest import free_port, one_line_error, run
from test_server import SNAP

from rankscope.agent.service.auth import SESSION_COOKIE, SESSION_S, Access, TokenError, session_valid, session_value
from rankscope.agent.service.http import CaptureGate, make_app, start_site, tls_context
from rankscope.agent.service.shard import MAX_REPLICAS

READ, CAPTURE = "read-token-0123456789", "capture-token-9876543210"
STACKS = {"groups": [], "errors": []}


def _trace(seconds: float, job: str | None, rank: int | None) -> list[dict]:
    return [{"traceEvents": [], "distributedInfo": {"rank": rank or 0}}]


def _app(access: Access | str | None, gate: CaptureGate | None = None, stacks=lambda: STACKS):
    # A clock that stands still: no cool-down between the captures of one test.
    return make_app(lambda: SNAP, access, stacks, _trace, gate or CaptureGate(min_cooldown_s=0, clock=lambda: 0.0))


def _statuses(app, requests: list[tuple[str, str, dict]]) -> list[int]:
    async def go() -> list[int]:
        async with TestClient(TestServer(app)) as c:
            return [(await c.request(method, path, headers=headers, allow_redirects=False)).status
                    for method, path, headers in requests]

    return asyncio.run(go())


def _bearer(token: str) -> dict:
    return {"Authorization": f"Bearer {token}"}


READS = ["/v1/targets", "/v1/patterns", "/v1/diagnosis", "/v1/history", "/metrics", "/"]
CAPTURES = [("GET", "/v1/stacks"), ("POST", "/v1/stacks"), ("GET", "/v1/trace?seconds=1"),
            ("POST", "/v1/trace?seconds=1")]


def _everything(token: str) -> list[tuple[str, str, dict]]:
    return [("GET", p, _bearer(token)) for p in READS] + [(m, p, _bearer(token)) for m, p in CAPTURES]


def test_the_read_token_reads_and_cannot_capture():
    app = _app(Access(READ, CAPTURE))
    reads = _statuses(app, [("GET", p, _bearer(READ)) for p in READS])
    captures = _statuses(_app(Access(READ, CAPTURE)), [(m, p, _bearer(READ)) for m, p in CAPTURES])
    assert set(reads) == {200} and set(captures) == {403}


def test_the_capture_token_captures_and_reads():
    assert set(_statuses(_app(Access(READ, CAPTURE)), _everything(CAPTURE))) == {200}


@pytest.mark.parametrize("headers", [{}, _bearer("nope"), _bearer(CAPTURE + "x")])
def test_a_capture_without_a_token_is_401(headers):
    assert set(_statuses(_app(Access(READ, CAPTURE)), [(m, p, headers) for m, p in CAPTURES])) == {401}


def test_a_single_token_keeps_its_former_scope():
    """A deployment that sets only --token-file: its token reads and captures, as it always did."""
    assert set(_statuses(_app(READ), _everything(READ))) == {200}


def test_the_capture_token_must_differ_from_the_read_token():
    with pytest.raises(TokenError, match="must differ"):
        Access(READ, READ)


@pytest.mark.parametrize("access", [READ, Access(READ, CAPTURE)])
def test_the_page_cookie_reads_but_starts_no_capture(access):
    """Cookies ignore ports and ride along with same-site requests: whatever method, the cookie alone never
    starts a capture, whether or not a separate capture token is configured."""
    async def go():
        async with TestClient(TestServer(_app(access))) as c:
            r = await c.get("/?" + urlencode({"token": READ}), allow_redirects=False)
            assert r.status == 303
            reads = [(await c.get(p)).status for p in READS]
            same_origin = {"Origin": str(c.make_url("")).rstrip("/"), "Sec-Fetch-Site": "same-origin"}
            captures = [(await c.request(m, p, headers=same_origin)).status for m, p in CAPTURES]
            return reads, captures

    reads, captures = asyncio.run(go())
    assert set(reads) == {200} and set(captures) == {403}


def test_a_session_expires_and_names_its_token():
    now = 1_000_000.0
    value = session_value(READ, int(now))
    assert session_valid(value, (READ,), now + 60) and READ not in value
    assert not session_valid(value, (READ,), now + SESSION_S + 1)
    assert not session_valid(value, (CAPTURE,), now + 60)  # another token's
    assert not session_valid(value.replace(".", ".0", 1), (READ,), now + 60)
    assert not session_valid(session_value(READ, int(now) + 100), (READ,), now)  # issued in the future


def test_without_a_token_no_other_site_starts_a_capture():
    """Loopback serves without a token; a page elsewhere (another site, another port of this host) or a name
    rebound to 127.0.0.1 must not start a capture through the user's browser. curl sends none of these."""
    def origin(c: TestClient) -> str:
        return str(c.make_url("")).rstrip("/")

    async def go():
        async with TestClient(TestServer(_app(None))) as c:
            plain = [(await c.request(m, p)).status for m, p in CAPTURES]
            typed = (await c.get("/v1/stacks", headers={"Sec-Fetch-Site": "none"})).status
            own = (await c.post("/v1/stacks", headers={"Sec-Fetch-Site": "same-origin", "Origin": origin(c)})).status
            others = [(await c.request(m, p, headers=h)).status for m, p in CAPTURES for h in (
                {"Sec-Fetch-Site": "cross-site"}, {"Sec-Fetch-Site": "same-site"},
                {"Origin": origin(c).replace("127.0.0.1", "localhost")})]
            rebound = (await c.get("/v1/diagnosis", headers={"Host": "evil.example"})).status
            return plain, typed, own, others, rebound

    plain, typed, own, others, rebound = asyncio.run(go())
    assert set(plain) == {200} and typed == 200 and own == 200
    assert set(others) == {403} and rebound == 403


@pytest.mark.parametrize("query", [
    "replicas=1000000000000&replica=0", f"replicas={MAX_REPLICAS + 1}&replica=0", "replicas=3&replica=3",
    "replicas=2&replica=-1", "replicas=2", "replica=0", "replicas=1e3&replica=0",
    "replicas=" + "9" * 5000 + "&replica=0",
])
def test_a_pull_with_a_replica_out_of_range_is_400_at_once(query):
    async def go():
        async with TestClient(TestServer(_app(None))) as c:
            started = time.perf_counter()
            r = await c.get("/v1/patterns?" + query)
            return r.status, time.perf_counter() - started

    status, took = asyncio.run(go())
    assert status == 400 and took < 5  # hashing 10**12 replicas would take hours


@pytest.mark.parametrize("path", [
    "/v1/profile?rank=" + "1" * 40, "/v1/profile?rank=-5", "/v1/profile?rank=0&format=svg", "/v1/profile?what=heap",
    "/v1/profile?rank=0&against=everyone", "/v1/profile?job=" + "j" * 300,
    "/v1/trace?seconds=61", "/v1/trace?seconds=nan", "/v1/trace?seconds=0", "/v1/trace?rank=99999999999",
    "/v1/trace?seconds=" + "1" * 40, "/v1/diagnosis?job=" + "j" * 300,
])
def test_every_parameter_is_bounded(path):
    assert _statuses(_app(None), [("GET", path, {})]) == [400]


def test_a_bad_trace_request_takes_no_capture_slot():
    gate = CaptureGate(min_cooldown_s=3600)
    statuses = _statuses(_app(None, gate), [("GET", "/v1/trace?seconds=999", {}), ("GET", "/v1/trace?seconds=1", {})])
    assert statuses == [400, 200]


def test_captures_run_one_at_a_time_on_their_own_thread_then_cool_down():
    entered, release = threading.Event(), threading.Event()
    threads: list[str] = []
    now = [100.0]

    def stacks() -> dict:
        threads.append(threading.current_thread().name)
        entered.set()
        release.wait(10)
        return STACKS

    gate = CaptureGate(min_cooldown_s=5.0, clock=lambda: now[0])

    async def go():
        async with TestClient(TestServer(_app(None, gate, stacks))) as c:
            first = asyncio.create_task(c.get("/v1/stacks"))
            await asyncio.get_running_loop().run_in_executor(None, entered.wait, 10)
            # The windows' executor is free while a capture runs.
            window = await asyncio.wait_for(asyncio.get_running_loop().run_in_executor(None, lambda: "window"), 5)
            busy = (await c.get("/v1/trace?seconds=1")).status
            now[0] = 107.0  # the capture took 7 s: the next one waits 7 s more
            release.set()
            assert (await first).status == 200
            cooling = await c.get("/v1/stacks")
            now[0] = 113.9
            still = (await c.get("/v1/stacks")).status
            now[0] = 114.0
            again = (await c.get("/v1/stacks")).status
            return window, busy, cooling.status, cooling.headers["Retry-After"], still, again

    window, busy, cooling, retry_after, still, again = asyncio.run(go())
    assert window == "window" and busy == 409
    assert cooling == 429 and retry_after == "8" and still == 429 and again == 200
    assert threads and all(t.startswith("rankscope-capture") for t in threads)


async def _closed(reader: asyncio.StreamReader) -> bytes:
    """What the server sent before closing (raises TimeoutError if it keeps the connection open)."""
    return await asyncio.wait_for(reader.read(), 10)


def test_connections_beyond_the_cap_are_refused_before_they_are_read():
    async def go():
        port = free_port()
        runner = await start_site(_app(READ), "127.0.0.1", port, max_connections=2, head_timeout_s=30)
        try:
            held = [await asyncio.open_connection("127.0.0.1", port) for _ in range(2)]
            reader, _ = await asyncio.open_connection("127.0.0.1", port)
            refused = await _closed(reader)
            for _, writer in held:
                writer.close()
            await asyncio.gather(*(r.read() for r, _ in held))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nConnection: close\r\n\r\n")
            after = await _closed(reader)
            return refused, after
        finally:
            await runner.cleanup()

    refused, after = asyncio.run(go())
    assert refused.startswith(b"HTTP/1.1 503") and after.startswith(b"HTTP/1.1 200")


def test_a_request_head_that_never_ends_is_cut_off():
    async def go():
        port = free_port()
        runner = await start_site(_app(READ), "127.0.0.1", port, head_timeout_s=0.5)
        try:
            reader, writer = await asyncio.open_connection("127.0.0.1", port)
            writer.write(b"GET /metrics HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: a")  # no end of the head
            started = time.perf_counter()
            sent = await _closed(reader)
            return sent, time.perf_counter() - started
        finally:
            await runner.cleanup()

    sent, took = asyncio.run(go())
    assert sent == b"" and took < 5


@pytest.fixture(scope="module")
def certificate(tmp_path_factory) -> tuple[str, str]:
    d = tmp_path_factory.mktemp("tls")
    cert, key = str(d / "cert.pem"), str(d / "key.pem")
    subprocess.run(["openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1", "-subj", "/CN=127.0.0.1",
                    "-addext", "subjectAltName=IP:127.0.0.1", "-keyout", key, "-out", cert],
                   check=True, capture_output=True, timeout=60)
    return cert, key


def test_tls_serves_https_and_marks_the_cookie_secure(certificate):
    cert, key = certificate

    async def go():
        port = free_port()
        runner = await start_site(_app(Access(READ, CAPTURE)), "127.0.0.1", port, tls_context(cert, key))
        try:
            client_tls = ssl.create_default_context(cafile=cert)
            async with ClientSession(connector=TCPConnector(ssl=client_tls)) as s:
                base = f"https://127.0.0.1:{port}"
                async with s.get(f"{base}/v1/stacks", headers=_bearer(CAPTURE)) as r:
                    stacks = r.status
                async with s.get(f"{base}/?{urlencode({'token': READ})}", allow_redirects=False) as r:
                    cookie = next(c for c in r.headers.getall("Set-Cookie") if c.startswith(SESSION_COOKIE))
            reader, writer = await asyncio.open_connection("127.0.0.1", port)  # plain HTTP to the TLS port
            writer.write(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
            plain = await _closed(reader)
            return stacks, cookie, plain
        finally:
            await runner.cleanup()

    stacks, cookie, plain = asyncio.run(go())
    assert stacks == 200 and "Secure" in cookie and b"200" not in plain


@pytest.mark.parametrize("args,says", [
    (["--tls-cert", "/nonexistent.pem"], "--tls-cert and --tls-key go together"),
    (["--tls-cert", "/nonexistent.pem", "--tls-key", "/nonexistent.key"], "cannot load the TLS certificate"),
])
def test_cluster_refuses_unusable_tls_files(args, says):
    listen = f"127.0.0.1:{free_port()}"
    line = one_line_error(run("cluster", "--agents", "http://127.0.0.1:1", "--listen", listen, *args))
    assert says in line


def test_agent_refuses_the_same_token_for_both_scopes(tmp_path):
    f = tmp_path / "token"
    f.write_text(READ)
    line = one_line_error(run("agent", "--pid", "1", "--token-file", str(f), "--capture-token-file", str(f)))
    assert "must differ" in line


def test_require_token_refuses_loopback_without_one(monkeypatch):
    monkeypatch.delenv("RANKSCOPE_TOKEN", raising=False)
    line = one_line_error(run("cluster", "--agents", "http://127.0.0.1:1", "--require-token"))
    assert "--require-token" in line
