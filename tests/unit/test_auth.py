"""Bearer token on the HTTP API: loopback by default, a token required beyond it, checked on every path but
/healthz."""
from __future__ import annotations

import asyncio
import os

import pytest
from aiohttp.test_utils import TestClient, TestServer
from conftest import one_line_error, run
from test_server import SNAP

from rankscope.agent.service.auth import TOKEN_ENV, Access, TokenError, check_bind, is_loopback, load_token
from rankscope.agent.service.http import make_app

TOKEN = "0123456789abcdef-token"


def _statuses(token: str | None, authorization: str | None) -> dict[str, int]:
    headers = {} if authorization is None else {"Authorization": authorization}

    async def go() -> dict[str, int]:
        async with TestClient(TestServer(make_app(lambda: SNAP, token))) as c:
            return {path: (await c.get(path, headers=headers)).status
                    for path in ("/healthz", "/v1/targets", "/v1/patterns", "/v1/diagnosis", "/metrics")}

    return asyncio.run(go())


def test_right_token_opens_every_path():
    assert set(_statuses(TOKEN, f"Bearer {TOKEN}").values()) == {200}


@pytest.mark.parametrize("authorization", [None, "", f"Bearer {TOKEN}x", f"bearer {TOKEN}", TOKEN, "Bearer ",
                                           f"Basic {TOKEN}", f"Bearer {TOKEN[:-1]}"])
def test_missing_or_wrong_token_is_401_except_healthz(authorization):
    statuses = _statuses(TOKEN, authorization)
    assert statuses.pop("/healthz") == 200
    assert set(statuses.values()) == {401}


def test_without_a_configured_token_nothing_is_asked():
    assert set(_statuses(None, None).values()) == {200}


def test_401_says_why_and_how():
    async def go():
        async with TestClient(TestServer(make_app(lambda: SNAP, TOKEN))) as c:
            r = await c.get("/v1/diagnosis")
            return r.status, r.headers.get("WWW-Authenticate"), await r.text()

    status, challenge, text = asyncio.run(go())
    assert status == 401 and challenge.startswith("Bearer") and "token" in text


@pytest.mark.parametrize("host,loopback", [("127.0.0.1", True), ("127.9.9.9", True), ("::1", True),
                                           ("localhost", True), ("0.0.0.0", False), ("::", False),
                                           ("10.77.1.2", False), ("node-1.example", False)])
def test_loopback(host, loopback):
    assert is_loopback(host) is loopback
    if loopback:
        check_bind(host, Access())
    else:
        with pytest.raises(TokenError, match="without a token"):
            check_bind(host, Access())
    check_bind(host, Access(TOKEN))
    with pytest.raises(TokenError, match="--require-token"):
        check_bind(host, Access(), require_token=True)
    check_bind(host, Access(capture=TOKEN), require_token=True)


def test_token_sources(tmp_path, monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    assert load_token(None) is None
    monkeypatch.setenv(TOKEN_ENV, f"  {TOKEN}\n")
    assert load_token(None) == TOKEN
    f = tmp_path / "token"
    f.write_text("from-file\n")
    assert load_token(str(f)) == "from-file"  # the file wins over the environment
    for bad in ("", " \n", "two words", "tab\tinside"):
        f.write_text(bad)
        with pytest.raises(TokenError, match="empty or contains"):
            load_token(str(f))
    f.write_bytes(b"\xff\xfe")
    with pytest.raises(TokenError, match="not ASCII"):
        load_token(str(f))
    with pytest.raises(TokenError, match="cannot read"):
        load_token(str(tmp_path / "missing"))


def test_agent_refuses_non_loopback_without_token(monkeypatch):
    monkeypatch.delenv(TOKEN_ENV, raising=False)
    line = one_line_error(run("agent", "--listen", "0.0.0.0:9", "--pid", str(os.getpid())))
    assert "refusing to serve on 0.0.0.0 without a token" in line


def test_agent_refuses_an_unreadable_token_file(tmp_path):
    line = one_line_error(run("agent", "--listen", "0.0.0.0:9", "--pid", "1", "--token-file", str(tmp_path / "no")))
    assert "cannot read the token file" in line
