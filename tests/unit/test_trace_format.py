"""Trace captures without processes: the Chrome trace document of hand-made kernel events (tracks, lanes,
clipping, lost events, what HTA reads) and GET /v1/trace's answers over a stand-in capturer."""
import asyncio
import io
import json
import re
import zipfile

import numpy as np
import pytest
from aiohttp.test_utils import TestClient, TestServer

from rankscope.agent.loader.trace_stream import (TRACE_CALL, TRACE_COLLECTIVE, TRACE_GPU, TRACE_INSTANT, TRACE_NCCL,
                                                 TRACE_PY_CALL, TRACE_PY_SAMPLE, TRACE_RECORD, TRACE_SCHED, CaptureBusy)
from rankscope.agent.service.http import make_app
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.trace_capture import Captured
from rankscope.agent.views.trace import (COLLECTIVE_TID, COMM_STREAM, SCHED_TID, Function, RankInfo, chrome_trace,
                                         encode, zipped)

PID, WORKER = 4242, 4250
US = 1000  # ns
START = 10_000_000 * US
FUNCTIONS = {1: Function("gloo_allreduce", "gloo"), 2: Function("cuLaunchKernel", "cuda_driver"),
             3: Function("cudaStreamSynchronize", "cuda_runtime")}
INFO = RankInfo(job="j", rank=1, world_size=2, pid=PID, host="h")


def records(*rows: tuple) -> np.ndarray:
    """(kind, tid, fn, start_us, end_us, bytes, seq) rows, times from the capture's start."""
    return np.array([(kind, PID, tid, fn, START + s * US, START + e * US, b, seq) for kind, tid, fn, s, e, b, seq in rows],
                    TRACE_RECORD)


def captured(recs: np.ndarray, dropped: int = 0, truncated: int = 0) -> Captured:
    return Captured(start_ns=START, end_ns=START + 1000 * US, mono_to_unix_ns=1_700_000_000 * 10**9,
                    events={PID: recs}, threads={PID: {PID: "python", WORKER: "pt_gloo_runloop"}},
                    dropped=dropped, truncated=truncated)


EVENTS = records(
    (TRACE_SCHED, PID, 2, -500, 100, 0, 0),  # asleep since before the capture
    (TRACE_SCHED, PID, 1, 100, 110, 0, 0),
    (TRACE_SCHED, PID, 0, 110, 400, 0, 0),
    (TRACE_CALL, WORKER, 1, 200, 300, 4096, 7),  # gloo's blocking collective: its call and its completion
    (TRACE_COLLECTIVE, WORKER, 1, 200, 300, 4096, 7),
    (TRACE_COLLECTIVE, PID, 1, 250, 350, 4096, 8),  # overlaps the first: a second lane
    (TRACE_COLLECTIVE, PID, 1, 400, 450, 4096, 9),  # after both: back on the first lane
    (TRACE_INSTANT, PID, 2, 120, 120, 0, 0),
    (TRACE_CALL, PID, 3, -20, 30, 0, 0),  # entered before the capture
)


def test_every_event_is_well_formed_and_on_its_track():
    doc = chrome_trace(INFO, captured(EVENTS), FUNCTIONS)
    events = doc["traceEvents"]
    assert all({"ph", "ts", "pid", "tid", "name"} <= e.keys() for e in events)
    assert all(e["dur"] >= 0 and e["ts"] >= 0 for e in events if e["ph"] == "X")
    slices = [e for e in events if e["ph"] == "X"]
    states = [(e["name"], e["ts"], e["dur"]) for e in slices if e["tid"] == SCHED_TID]
    assert states == [("asleep", 0.0, 100.0), ("runnable", 100.0, 10.0), ("running", 110.0, 290.0)]
    (call,) = [e for e in slices if e["tid"] == WORKER]
    assert (call["cat"], call["name"], call["args"]) == ("gloo", "gloo_allreduce", {"bytes": 4096, "correlation": 7})
    colls = sorted((e["ts"], e["tid"] - COLLECTIVE_TID, e["args"]["stream"] - COMM_STREAM, e["args"]["correlation"])
                   for e in slices if e["cat"] == "kernel")
    assert colls == [(200.0, 0, 0, 7), (250.0, 1, 1, 8), (400.0, 0, 0, 9)]
    assert {e["name"] for e in slices if e["cat"] == "kernel"} == {"ncclKernel gloo_allreduce"}
    (sync,) = [e for e in slices if e["name"] == "cudaStreamSynchronize"]
    assert (sync["ts"], sync["dur"], sync["args"]) == (0.0, 30.0, {"clipped": True})
    (launch,) = [e for e in events if e["ph"] == "i"]
    assert (launch["name"], launch["ts"], launch["tid"]) == ("cuLaunchKernel", 120.0, PID)
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    assert names == {SCHED_TID: "main thread: scheduler state", COLLECTIVE_TID: "collectives",
                     COLLECTIVE_TID + 1: "collectives (2)", PID: "python", WORKER: "pt_gloo_runloop"}
    assert doc["rankscope"]["dropped_events"] == 0 and not any(e["cat"] == "rankscope" for e in slices)


def test_hta_finds_the_rank_and_the_job():
    doc = chrome_trace(INFO, captured(EVENTS), FUNCTIONS, summary={"rank": 1, "step_time_s": 0.01})
    text = encode(doc).decode()
    assert int(re.search(r'"rank":\s+(\d+)', text).group(1)) == 1  # HTA's own pattern, first match
    assert doc["distributedInfo"] == {"rank": 1, "world_size": 2, "backend": "gloo"}
    assert doc["baseTimeNanoseconds"] == START + 1_700_000_000 * 10**9
    assert doc["rankscope"]["summary"]["step_time_s"] == 0.01


def test_lost_events_are_shown_not_silent():
    doc = chrome_trace(INFO, captured(EVENTS, dropped=3, truncated=2), FUNCTIONS)
    (lost,) = [e for e in doc["traceEvents"] if e.get("cat") == "rankscope"]
    assert lost["name"] == "rankscope: 5 events lost" and lost["args"] == {"dropped": 3, "truncated": 2}
    assert lost["ts"] == 1000.0
    assert (doc["rankscope"]["dropped_events"], doc["rankscope"]["truncated_events"]) == (3, 2)


def test_a_rank_without_events_is_an_empty_timeline():
    doc = chrome_trace(INFO, captured(np.zeros(0, TRACE_RECORD)), FUNCTIONS)
    assert all(e["ph"] == "M" for e in doc["traceEvents"]) and "backend" not in doc["distributedInfo"]


DOCS = [chrome_trace(RankInfo("j", r, 2, PID + r, "h"), captured(EVENTS), FUNCTIONS) for r in (0, 1)]


def fake_capturer(seconds: float, job: str | None, rank: int | None) -> list[dict]:
    if seconds == 7:
        raise CaptureBusy("a trace capture is already running")
    if rank == 9:
        raise LookupError("no watched rank 9")
    return [d for d in DOCS if rank is None or d["distributedInfo"]["rank"] == rank]


def _get(path: str, trace=fake_capturer) -> tuple[int, str, bytes]:
    async def go():
        async with TestClient(TestServer(make_app(lambda: Snapshot(), trace=trace))) as client:
            r = await client.get(path)
            return r.status, r.headers.get("Content-Type", ""), await r.read()

    return asyncio.run(go())


def test_http_trace_zips_every_rank_or_serves_one():
    status, ctype, body = _get("/v1/trace?seconds=2")
    assert status == 200 and ctype == "application/zip"
    with zipfile.ZipFile(io.BytesIO(body)) as z:
        assert sorted(z.namelist()) == ["rank0.trace.json", "rank1.trace.json"]
        assert json.loads(z.read("rank1.trace.json")) == json.loads(encode(DOCS[1]))
    status, ctype, body = _get("/v1/trace?seconds=2&rank=1")
    assert status == 200 and ctype == "application/json" and json.loads(body)["distributedInfo"]["rank"] == 1
    assert zipped(DOCS)[:2] == b"PK"


@pytest.mark.parametrize("query,status", [("seconds=0", 400), ("seconds=61", 400), ("seconds=x", 400),
                                          ("seconds=1&rank=x", 400), ("seconds=7", 409), ("seconds=1&rank=9", 404)])
def test_http_trace_bad_requests(query, status):
    assert _get(f"/v1/trace?{query}")[0] == status


def test_http_trace_is_served_when_the_agent_gives_a_capturer():
    assert _get("/v1/trace?seconds=1", trace=None)[0] == 404
