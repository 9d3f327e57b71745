"""The page in a real headless browser (Debian's chromium): a live agent watching a faulty simulated job, and
an agent behind a token serving a link matrix and a hang. Each test saves a screenshot and prints its path
(in $RANKSCOPE_SCREENSHOTS when set, else pytest's temporary directory): look at it."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from html.parser import HTMLParser
from pathlib import Path
from urllib.parse import urlencode

import pytest
from conftest import wait_until

from rankscope.agent.service.history import StepHistory
from rankscope.agent.service.http import make_app, start_site
from rankscope.agent.service.snapshot import Snapshot
from rankscope.sim.harness import free_port

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
pytestmark = pytest.mark.skipif(CHROMIUM is None, reason="chromium is not installed (scripts/install installs it)")
WINDOW_S = 3.0  # long enough that the page usually loads within one window
BUDGET_MS = 4000  # virtual time for the page's first fetches and render (not wall time: no sleep)


class Elements(HTMLParser):
    """Every element's tag, attributes and text of its own, from a DOM the browser dumped."""

    def __init__(self, html: str):
        super().__init__()
        self.found: list[tuple[str, dict[str, str], list[str]]] = []
        self._open: list[int] = []
        self.feed(html)

    def handle_starttag(self, tag, attrs):
        self.found.append((tag, dict((k, v or "") for k, v in attrs), []))
        self._open.append(len(self.found) - 1)

    def handle_endtag(self, tag):
        while self._open and self.found[self._open.pop()][0] != tag:
            pass

    def handle_data(self, data):
        for i in self._open:
            self.found[i][2].append(data)

    def where(self, **attrs: str) -> list[tuple[str, dict[str, str], str]]:
        return [(t, a, "".join(text)) for t, a, text in self.found
                if all(a.get(k.replace("_", "-")) == v for k, v in attrs.items())]


def browse(url: str, screenshot: Path, profile: Path) -> Elements:
    """The page's DOM once its scripts ran for BUDGET_MS of virtual time, and a screenshot of that same load."""
    dom = subprocess.run([CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                          f"--user-data-dir={profile}", f"--virtual-time-budget={BUDGET_MS}", "--window-size=1280,1100",
                          "--dump-dom", f"--screenshot={screenshot}", url],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    assert screenshot.stat().st_size > 10_000
    print(f"\nscreenshot: {screenshot}", file=sys.stderr)
    return Elements(dom)


def loaded(page: Elements) -> bool:
    """The page's script rendered an answer of the API (it marks the body)."""
    return any(t == "body" and a.get("data-state") == "loaded" for t, a, _ in page.found)


@pytest.fixture
def shots(tmp_path: Path) -> Path:
    where = Path(os.environ.get("RANKSCOPE_SCREENSHOTS", tmp_path))
    where.mkdir(parents=True, exist_ok=True)
    return where


def test_live_agent_page_names_the_straggler(sim_job, agent, shots, tmp_path):
    job = sim_job(4, faults=("slow-gpu:2:2.5",))
    a = agent("--pid", ",".join(map(str, job.pids)), "--window", str(WINDOW_S))

    def straggling() -> list[float]:
        """Ends of the windows the agent reported rank 2's straggling in."""
        return [p["end"] for p in a.get("/v1/history")["jobs"].get(job.job_id, []) if "compute_straggler" in p["findings"]]

    wait_until(lambda: len(straggling()) >= 2, 60, "the finding in two windows (the chart has points to draw)")
    # The page shows the window current when it loads; on a busy machine that one may lack the finding (the
    # browser's own start takes CPU from the ranks). The window it showed tells which answer is right.
    for attempt in range(3):
        page = browse(a.url + "/", shots / "page-live-agent.png", tmp_path / f"profile{attempt}")
        assert loaded(page)
        (_, card, _), = page.where(data_job=job.job_id)
        if float(card["data-window-end"]) in straggling():
            break
    else:
        pytest.fail("three page loads each showed a window without the finding")
    (_, _, headline), = page.where(data_kind="compute_straggler", data_ranks="2")
    assert "rank 2: compute straggler" in headline and "costs" in headline
    (_, row, text), = [e for e in page.where(data_rank="2") if e[0] == "tr"]
    assert "bad" in row["class"] and "compute straggler" in text
    assert not [e for e in page.where(data_rank="0") if "bad" in e[1].get("class", "")]
    assert any(t == "svg" and a.get("aria-label") == "step time over recent windows" for t, a, _ in page.found)


def _fixture_docs() -> dict[str, dict]:
    """A link-matrix finding (an 8-rank ring whose link 3 -> 4 runs at a fifth of its peers' pace) and a hang."""
    here = Path(__file__).resolve().parent.parent / "data" / "page_documents.json"
    return json.loads(here.read_text())


@pytest.fixture
def served_snapshot() -> Iterator[tuple[str, str]]:
    """An agent's app serving fixed documents behind a token, on a loopback port, from a thread of its own."""
    token, port, docs = "page-test-token", free_port(), _fixture_docs()
    now = time.time()  # the page charts the last hours: the documents' windows closed just now
    docs = {job: {**doc, "window": {"start": now - 2, "end": now}} for job, doc in docs.items()}
    history = StepHistory()
    for ago in range(10, 0, -1):  # ten windows of each job before it, the last ones with its findings
        history.record({job: {**doc, "window": {"end": doc["window"]["end"] - 5 * ago},
                              "step_time_s": doc["step_time_s"] and doc["step_time_s"] * (1 if ago < 4 else 0.8),
                              "findings": doc["findings"] if ago < 4 else []} for job, doc in docs.items()})
    snapshot = Snapshot(diagnoses=docs, history=history.record(docs))
    loop = asyncio.new_event_loop()
    runner = loop.run_until_complete(start_site(make_app(lambda: snapshot, token), "127.0.0.1", port))
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", token
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_page_behind_a_token_shows_the_link_matrix_and_the_hang(served_snapshot, shots, tmp_path):
    url, token = served_snapshot
    page = browse(f"{url}/?{urlencode({'token': token})}", shots / "page-links-and-hang.png", tmp_path / "profile")
    assert loaded(page)  # the cookie let its scripts fetch
    assert page.where(data_kind="slow_link", data_ranks="3,4")
    (_, _, because), = page.where(data_criterion="link_matrix_slow")  # why, and what it outranked, under the summary
    assert because == "because link_matrix_slow: role_links 8 >= 3 (judged links of its role); link_slowdown 5 > 1.5 " \
                      "(times slower than its peers' links: 3 -> 4)"
    (_, _, outranked), = page.where(**{"class": "why outranked"})
    assert outranked.startswith("outranked: slow_link (late_finish_low_bandwidth) of rank 4 (the link matrix")
    cells = [a for t, a, _ in page.found if t == "rect" and "data-link" in a]
    assert len(cells) == 64 and [a["data-link"] for a in cells if a.get("stroke") == "#000"] == ["3>4"]
    (_, _, headline), = page.where(data_kind="noncomm_hang", data_ranks="2")
    assert "rank 2: noncomm hang" in headline
    assert len(page.where(**{"class": "why"})) == 1  # the hang's document says no why (an older agent's): none shown
    stuck = [text for t, a, text in page.where(data_rank="2") if t == "tr" and "bad" in a.get("class", "")]
    assert stuck and "never reached the collective" in stuck[0] and "rank.py:wait_forever" in stuck[0]
