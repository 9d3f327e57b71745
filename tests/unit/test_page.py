"""The page's routes (`/`, `/v1/history`), its step-time history, and a browser's way in: `/?token=` once."""
from __future__ import annotations

import asyncio
import json
import re
import time
from urllib.parse import urlencode

import pytest
from aiohttp.test_utils import TestClient, TestServer
from test_server import SNAP, _doc

from rankscope.agent.service.auth import LEGACY_COOKIE, SESSION_COOKIE
from rankscope.agent.service.cluster_analyzer import ClusterSnapshot, make_cluster_app
from rankscope.agent.service.history import StepHistory, StepPoint
from rankscope.agent.service.http import make_app
from rankscope.agent.service.page import PAGE

TOKEN = "s3cret;token,with=odd\"chars"


def _window(doc: dict, end: float, step: float | None, baseline: float | None = None) -> dict:
    return {**doc, "window": {"start": end - 5, "end": end}, "step_time_s": step,
            "baseline": {"step_time_s": baseline} if baseline else None}


def test_history_keeps_each_window_once_bounded_and_forgets_ended_jobs():
    h = StepHistory(keep=3)
    a = _doc("a")
    for end in (10.0, 15.0, 15.0, 20.0, 25.0):  # 15 twice: a window served again is one point
        h.record({"a": _window(a, end, 0.05, 0.04)})
    got = h.points()
    assert [p.end for p in got["a"]] == [15.0, 20.0, 25.0]
    assert got["a"][-1] == StepPoint(end=25.0, step_time_s=0.05, baseline_s=0.04, findings=("compute_straggler",))
    got = h.record({"b": _window(_doc("b"), 30.0, None)}).points()
    assert list(got) == ["b"] and got["b"][0].step_time_s is None
    assert h.record({"b": {**_doc("b"), "window": {"start": None, "end": None}}}).points()["b"] == got["b"]


def test_page_is_self_contained():
    html = PAGE.read_text()
    # No resource from elsewhere: no external script, style, font or image (clusters are often air-gapped).
    assert not re.search(r"(src|href)\s*=|@import|url\(|@font-face", html, re.I)
    assert re.findall(r"(?:https?:)?//[\w.-]+\.\w+[^\"' ]*", html) == ["http://www.w3.org/2000/svg"]  # a name, not fetched
    assert 'fetch(path' in html and '"v1/history?since="' in html and '"v1/diagnosis?job="' in html  # relative: proxies


def _get(app, *requests: tuple[str, dict]) -> list[tuple[int, dict, str]]:
    async def go():
        async with TestClient(TestServer(app)) as c:
            out = []
            for path, headers in requests:
                r = await c.get(path, headers=headers, allow_redirects=False)
                out.append((r.status, dict(r.headers), await r.text()))
            return out

    return asyncio.run(go())


def test_page_and_history_on_the_agent_and_the_cluster_analyzer():
    history = StepHistory()
    now = time.time()
    history.record({"job-a": {**_window(_doc("job-a"), now - 10, 0.05), "findings": []}})
    history.record({"job-a": _window(_doc("job-a"), now - 5, 0.08, 0.05)})
    agent = make_app(lambda: SNAP.__class__(diagnoses=SNAP.diagnoses, history=history))
    cluster = make_cluster_app(lambda: ClusterSnapshot(diagnoses=SNAP.diagnoses, history=history), None)
    for app in (agent, cluster):
        (status, headers, body), (h_status, _, h_body) = _get(app, ("/", {}), ("/v1/history?job=job-a&since=1h", {}))
        assert status == 200 and headers["Content-Type"].startswith("text/html")
        assert "default-src 'none'" in headers["Content-Security-Policy"] and "<title>rankscope</title>" in body
        answer = json.loads(h_body)
        assert h_status == 200 and [p["baseline_s"] for p in answer["jobs"]["job-a"]] == [None, 0.05]
        assert answer["jobs"]["job-a"][-1]["findings"] == ["compute_straggler"]
        (onset,) = answer["findings"]["job-a"]
        assert (onset["kind"], onset["ranks"], onset["start"], onset["windows"]) == ("compute_straggler", [0], now - 5, 1)
        assert onset["finding"]["cost"] == 0.25


@pytest.mark.parametrize("query", ["since=yesterday", "since=nan", "since=-3h", "until=1e300", "since=400d",
                                   "since=1h&until=2h", "job=" + "j" * 300, "job="])
def test_a_history_parameter_out_of_bounds_is_a_400(query):
    ((status, _, body),) = _get(make_app(lambda: SNAP), ("/v1/history?" + query, {}))
    assert status == 400 and body.strip(), (query, body)


def test_a_browser_passes_the_token_once_and_keeps_a_session_cookie():
    async def go():
        async with TestClient(TestServer(make_app(lambda: SNAP, TOKEN))) as c:
            async def status(path: str) -> int:
                return (await c.get(path, allow_redirects=False)).status

            before = [await status(p) for p in ("/", "/?" + urlencode({"token": TOKEN + "x"}),
                                                 "/v1/diagnosis?" + urlencode({"token": TOKEN}))]
            why = await (await c.get("/")).text()
            r = await c.get("/?" + urlencode({"token": TOKEN}), allow_redirects=False)
            after = [await status(p) for p in ("/", "/v1/diagnosis", "/v1/history", "/metrics")]
            c.session.cookie_jar.clear()
            wrong = [(await c.get("/", headers={"Cookie": f"{name}={value}"})).status
                     for name, value in ((SESSION_COOKIE, "nope"), (SESSION_COOKIE, "1.00"), (LEGACY_COOKIE, TOKEN))]
            return before, why, r.status, r.headers["Location"], r.headers.getall("Set-Cookie"), after, wrong

    before, why, given, location, cookies, after, wrong = asyncio.run(go())
    assert before == [401, 401, 401] and "/?token=" in why  # only the page takes it; the 401 says how
    assert given == 303 and location == "./"  # relative: keeps a proxy's path prefix; drops the token from the URL
    session = next(c for c in cookies if c.startswith(f"{SESSION_COOKIE}="))
    value = session.split(";")[0].split("=", 1)[1]
    assert TOKEN not in session and value.strip('"') != TOKEN  # derived, never the token
    assert all(attr in session for attr in ("HttpOnly", "SameSite=Strict", "Path=/", "Max-Age="))
    assert "Secure" not in session  # plain HTTP: a Secure cookie would never come back
    assert any(c.startswith(f"{LEGACY_COOKIE}=") and "Max-Age=0" in c for c in cookies)  # the old raw-token cookie cleared
    assert after == [200, 200, 200, 200] and wrong == [401, 401, 401]  # the raw token as a cookie opens nothing
