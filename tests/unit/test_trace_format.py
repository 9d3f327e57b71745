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

from rankscope.agent.interpreters import Frame
from rankscope.agent.loader.trace_stream import (TRACE_CALL, TRACE_COLLECTIVE, TRACE_GPU, TRACE_INSTANT, TRACE_NCCL,
                                                 TRACE_PY_CALL, TRACE_PY_SAMPLE, TRACE_RECORD, TRACE_SCHED, CaptureBusy,
                                                 Labels)
from rankscope.agent.service.http import make_app
from rankscope.agent.service.snapshot import Snapshot
from rankscope.agent.trace_capture import Captured
from rankscope.agent.views.trace import (COLLECTIVE_TID, COMM_STREAM, NCCL_TID, SCHED_TID, Function, RankInfo,
                                         chrome_trace, encode, zipped)

PID, WORKER = 4242, 4250
US = 1000  # ns
START = 10_000_000 * US
FUNCTIONS = {1: Function("gloo_allreduce", "gloo"), 2: Function("cuLaunchKernel", "cuda_driver"),
             3: Function("cudaStreamSynchronize", "cuda_runtime")}
INFO = RankInfo(job="j", rank=1, world_size=2, pid=PID, host="h")
UNIX_OFFSET = 1_700_000_000 * 10**9  # monotonic -> unix ns


def records(*rows: tuple) -> np.ndarray:
    """(kind, tid, fn, start_us, end_us, bytes, seq) rows, times from the capture's start."""
    return np.array([(kind, PID, tid, fn, START + s * US, START + e * US, b, seq) for kind, tid, fn, s, e, b, seq in rows],
                    TRACE_RECORD)


def captured(recs: np.ndarray, dropped: int = 0, truncated: int = 0, labels: Labels | None = None) -> Captured:
    return Captured(start_ns=START, end_ns=START + 1000 * US, mono_to_unix_ns=UNIX_OFFSET,
                    events={PID: recs}, threads={PID: {PID: "python", WORKER: "pt_gloo_runloop"}},
                    labels={PID: labels or {}}, dropped=dropped, truncated=truncated)


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


MAIN = Frame("main", "/srv/train.py", 1)
STEP = Frame("Trainer.step", "/srv/train.py", 10)
FORWARD = Frame("Net.forward", "/srv/model.py", 5)
PYTHON = records(
    (TRACE_PY_CALL, PID, 0, 100, 180, 0, 0xC0DE),  # a timed forward
    (TRACE_PY_CALL, PID, 0, 190, 195, 0, 0xBAD),  # a `forward` the timer does not want: no label
    (TRACE_PY_CALL, PID, 0, 200, 210, 0, 0),  # a collection
    (TRACE_PY_SAMPLE, PID, 0, 150, 150, 0, 1),
    (TRACE_PY_SAMPLE, PID, 0, 160, 160, 0, 2),
    (TRACE_PY_SAMPLE, WORKER, 0, 170, 170, 0, 1),
)
PYTHON_LABELS = {(TRACE_PY_CALL, 0xC0DE): FORWARD, (TRACE_PY_CALL, 0): "gc (collection)",
                 (TRACE_PY_SAMPLE, 1): (MAIN, STEP, FORWARD), (TRACE_PY_SAMPLE, 2): (MAIN, STEP)}


def test_python_functions_are_slices_and_samples_share_their_stack_frames():
    doc = chrome_trace(INFO, captured(PYTHON, labels=PYTHON_LABELS), FUNCTIONS)
    calls = [(e["name"], e["ts"], e["dur"], e["tid"]) for e in doc["traceEvents"] if e.get("cat") == "python_function"]
    assert calls == [("model.py:Net.forward", 100.0, 80.0, PID), ("gc (collection)", 200.0, 10.0, PID)]
    samples = [e for e in doc["traceEvents"] if e.get("cat") == "python_sample"]
    assert [(e["name"], e["ts"], e["tid"]) for e in samples] == [
        ("model.py:Net.forward", 150.0, PID), ("train.py:Trainer.step", 160.0, PID),
        ("model.py:Net.forward", 170.0, WORKER)]
    assert samples[0]["args"]["stack"] == "train.py:main;train.py:Trainer.step;model.py:Net.forward"
    frames = doc["stackFrames"]
    assert len(frames) == 3  # each (parent, function) once: the second stack is the first one's parent
    assert frames[samples[0]["sf"]]["parent"] == samples[1]["sf"] and samples[2]["sf"] == samples[0]["sf"]
    assert "parent" not in frames[frames[samples[1]["sf"]]["parent"]]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[WORKER] == "pt_gloo_runloop"


GPU = records(
    (TRACE_GPU, 17, 10 | 3 << 8, -50, -10, 4242, 0xA),  # ended before the capture: not drawn
    (TRACE_GPU, 17, 10 | 3 << 8, 100, 350, 4243, 0xA),  # a kernel: correlation where copies carry bytes
    (TRACE_GPU, 18, 1 | 3 << 8, 360, 400, 1 << 20, 0),  # a copy
    (TRACE_NCCL, WORKER, 0, 500, 700, 4096, 0xF),
    (TRACE_NCCL, WORKER, 0, -100, 50, 8192, 0xF),  # begun before the capture
    (TRACE_COLLECTIVE, PID, 1, 450, 720, 4096, 9),
)


def test_gpu_records_on_their_stream_in_cuptis_clock_and_ncclspans_on_their_track():
    gpu = GPU.copy()
    is_gpu = gpu["kind"] == TRACE_GPU
    gpu["start_ns"][is_gpu] += UNIX_OFFSET  # CUPTI's clock: unix ns
    gpu["end_ns"][is_gpu] += UNIX_OFFSET
    doc = chrome_trace(INFO, captured(gpu, labels={(TRACE_GPU, 0xA): "gemm", (TRACE_NCCL, 0xF): "AllReduce"}),
                       FUNCTIONS)
    slices = {e["cat"]: e for e in doc["traceEvents"] if e["ph"] == "X"}  # the last of each category
    kernel, copy, nccl = slices["kernel"], slices["gpu_memcpy"], slices["gpu_user_annotation"]
    (clipped,) = [e for e in doc["traceEvents"] if e.get("cat") == "gpu_user_annotation" and e["ts"] == 0]
    assert (clipped["dur"], clipped["args"]) == (50.0, {"clipped": True, "bytes": 8192})
    assert [e["cat"] for e in doc["traceEvents"] if e["ph"] == "X"].count("kernel") == 1
    assert (kernel["name"], kernel["ts"], kernel["dur"]) == ("gemm", 100.0, 250.0)
    assert kernel["args"] == {"device": 3, "stream": 17, "correlation": 4243}
    assert (copy["name"], copy["args"]) == ("Memcpy", {"device": 3, "stream": 18, "bytes": 1 << 20})
    assert (nccl["name"], nccl["ts"], nccl["dur"], nccl["tid"]) == ("ncclAllReduce", 500.0, 200.0, NCCL_TID)
    # With the GPU's own kernels in the trace, the host's collective span is no kernel to HTA.
    coll = slices["collective"]
    assert coll["name"] == "ncclKernel gloo_allreduce" and "stream" not in coll["args"]
    names = {e["tid"]: e["args"]["name"] for e in doc["traceEvents"] if e["name"] == "thread_name"}
    assert names[kernel["tid"]] == "GPU 3 stream 17" and names[NCCL_TID] == "NCCL: GPU spans (profiler plugin)"
    assert max(kernel["tid"], NCCL_TID) < SCHED_TID  # below the tracks tests and tools read as collectives' lanes


def test_hta_finds_the_rank_and_the_job():
    doc = chrome_trace(INFO, captured(EVENTS), FUNCTIONS, summary={"rank": 1, "step_time_s": 0.01})
    text = encode(doc).decode()
    assert int(re.search(r'"rank":\s+(\d+)', text).group(1)) == 1  # HTA's own pattern, first match
    assert doc["distributedInfo"] == {"rank": 1, "world_size": 2, "backend": "gloo"}
    assert doc["baseTimeNanoseconds"] == START + UNIX_OFFSET
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
