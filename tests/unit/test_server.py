"""The agent's HTTP API over a fixed snapshot: status codes, content types, JSON and msgpack bodies."""
import asyncio

import msgpack
from aiohttp.test_utils import TestClient, TestServer
from conftest import free_port
from prometheus_client.parser import text_string_to_metric_families

from rankscope.agent.service.http import MAX_LINE_BYTES, make_app, start_site
from rankscope.agent.service.snapshot import Snapshot, TargetView
from rankscope.schema.patterns import FunctionStats, RankPattern, Role
from rankscope.schema.wire import decode_patterns


def _pattern(rank: int) -> RankPattern:
    return RankPattern(
        job="job-a", rank=rank, world_size=2, pid=100 + rank, host="node1", window_start=1000.0, window_end=1005.0,
        functions={"cuStreamSynchronize": FunctionStats("cuStreamSynchronize", Role.SYNC, 10, 0.2, 0.03, 0.02, 0.03)},
    )


def _doc(job: str) -> dict:
    return {"job": job, "window": {"start": 1000.0, "end": 1005.0},
            "ranks": [{"rank": 0, "pid": 100, "step_time_s": 0.05}],
            "findings": [{"kind": "compute_straggler", "ranks": [0], "function": None, "component": "gpu",
                          "score": 9.0, "cost": 0.25, "summary": "s", "evidence": {}}]}


SNAP = Snapshot(
    window_end=1005.0,
    targets=[TargetView(pid=100, rank=0, world_size=2, job="job-a", libraries=["cuda"], state="running")],
    patterns=[_pattern(0), _pattern(1)],
    diagnoses={"job-a": _doc("job-a")},
)


def _run(snapshot: Snapshot, check) -> None:
    async def go():
        async with TestClient(TestServer(make_app(lambda: snapshot))) as client:
            await check(client)

    asyncio.run(go())


def test_healthz_and_targets():
    async def check(c):
        r = await c.get("/healthz")
        assert r.status == 200
        r = await c.get("/v1/targets")
        assert r.status == 200 and r.content_type == "application/json"
        body = await r.json()
        assert body["targets"][0]["pid"] == 100 and body["targets"][0]["state"] == "running"

    _run(SNAP, check)


def test_patterns_json_and_msgpack():
    async def check(c):
        r = await c.get("/v1/patterns")
        assert r.content_type == "application/json"
        assert [p["rank"] for p in (await r.json())["patterns"]] == [0, 1]
        r = await c.get("/v1/patterns", headers={"Accept": "application/msgpack"})
        assert r.status == 200 and r.content_type == "application/msgpack"
        body = await r.read()
        decoded = decode_patterns(body)
        assert [p.rank for p in decoded] == [0, 1]
        assert decoded[0].functions["cuStreamSynchronize"].role is Role.SYNC
        assert isinstance(msgpack.unpackb(body), list)

    _run(SNAP, check)


def test_diagnosis_single_job_and_selection():
    async def check(c):
        r = await c.get("/v1/diagnosis")
        assert r.status == 200 and r.content_type == "application/json"
        assert (await r.json())["findings"][0]["kind"] == "compute_straggler"
        assert (await c.get("/v1/diagnosis?job=job-a")).status == 200
        r = await c.get("/v1/diagnosis?job=nope")
        assert r.status == 404 and "job-a" in await r.text()

    _run(SNAP, check)


def test_diagnosis_needs_job_when_several_and_is_empty_when_none():
    two = Snapshot(diagnoses={"a": _doc("a"), "b": _doc("b")})

    async def several(c):
        r = await c.get("/v1/diagnosis")
        assert r.status == 400 and "?job=" in await r.text()

    _run(two, several)

    async def none(c):
        body = await (await c.get("/v1/diagnosis")).json()
        assert body["findings"] == [] and body["ranks"] == []

    _run(Snapshot(), none)


def test_metrics_low_cardinality():
    async def check(c):
        r = await c.get("/metrics")
        assert r.status == 200 and r.content_type == "text/plain"
        text = await r.text()
        samples = {s.name + str(sorted(s.labels.items())): s.value
                   for family in text_string_to_metric_families(text) for s in family.samples}
        assert {k: v for k, v in samples.items() if not k.startswith(("rankscope_build_info", "rankscope_windows",
                                                                      "rankscope_attach", "rankscope_collective"))} == {
            "rankscope_targets[]": 1.0,
            "rankscope_step_time_seconds[('job', 'job-a'), ('rank', '0')]": 0.05,
            "rankscope_finding_cost[('job', 'job-a'), ('kind', 'compute_straggler')]": 0.25,
            "rankscope_finding_cost_ratio[('job', 'job-a'), ('kind', 'compute_straggler')]": 0.25,
            "rankscope_finding_held_windows[('job', 'job-a'), ('kind', 'compute_straggler'), ('node', ''), ('rank', '0')]": 1.0,
        }  # tests/unit/test_metrics.py checks the rest
        assert "cuStreamSynchronize" not in text  # function names never become labels

    _run(SNAP, check)


def test_unknown_path_and_method():
    async def check(c):
        assert (await c.get("/v1/nothing")).status == 404
        assert (await c.post("/v1/diagnosis", data=b"x")).status == 405

    _run(SNAP, check)


def test_served_site_refuses_header_lines_over_the_limit():
    """start_site is what the agent and the cluster serve with: its request limits, not aiohttp's defaults."""
    async def go() -> list[int]:
        port = free_port()
        runner = await start_site(make_app(lambda: SNAP), "127.0.0.1", port)
        statuses = []
        try:
            for size in (MAX_LINE_BYTES // 2, MAX_LINE_BYTES + 100):
                reader, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.write(b"GET /healthz HTTP/1.1\r\nHost: x\r\nConnection: close\r\nX-A: "
                             + b"a" * size + b"\r\n\r\n")
                await writer.drain()
                statuses.append(int((await asyncio.wait_for(reader.readline(), 10)).split()[1]))
                writer.close()
        finally:
            await runner.cleanup()
        return statuses

    ok, too_long = asyncio.run(go())
    assert ok == 200 and too_long in (400, 431), (ok, too_long)
